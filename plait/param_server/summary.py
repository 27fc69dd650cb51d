"""What a finished parameter-server job reports: held-out loss, updates, the staleness histogram, and a plot.

``job_summary`` merges the servers' reports (each server's staleness histogram counts the gradients applied to its
shard, so a step pushed to S servers counts S times; the merged histogram is over (step, shard) pairs).
``plot_job`` draws each worker's training loss by step beside that histogram (matplotlib, Agg: no display).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any


def job_summary(
    setup: dict[str, Any],
    reports: list[dict[str, Any]],
    losses: dict[int, list[float]],
    initial_loss: float,
    held_out_loss: float,
) -> dict[str, Any]:
    """A JSON-able record of the job (``setup``: mode, servers, workers, steps, ... as given)."""
    histogram: Counter[int] = Counter()
    for report in reports:
        histogram.update({int(tau): count for tau, count in report["staleness"]["histogram"].items()})
    total = sum(histogram.values())
    return {
        **setup,
        "initial_loss": initial_loss,
        "held_out_loss": held_out_loss,
        "updates": {str(r["index"]): r["version"] for r in reports},
        "pushes_applied": {str(r["index"]): r["pushes_applied"] for r in reports},
        "duplicates_ignored": sum(r["duplicates"] for r in reports),
        "stale_pushes_dropped": sum(r["dropped"] for r in reports),
        "staleness": {
            "histogram": {str(tau): histogram[tau] for tau in sorted(histogram)},
            "mean": sum(tau * count for tau, count in histogram.items()) / max(1, total),
            "max": max(histogram, default=0),
        },
        "final_train_loss": {str(w): values[-1] for w, values in sorted(losses.items()) if values},
    }


def summary_text(summary: dict[str, Any]) -> str:
    """The summary as a few lines for the terminal."""
    staleness = summary["staleness"]
    histogram = ", ".join(f"{tau}: {count}" for tau, count in staleness["histogram"].items())
    updates = ", ".join(f"server {index}: {count}" for index, count in summary["updates"].items())
    return "\n".join(
        [
            f"  held-out loss {summary['initial_loss']:.3f} -> {summary['held_out_loss']:.3f}",
            f"  updates {updates}; duplicates ignored {summary['duplicates_ignored']}, "
            f"stale pushes dropped {summary['stale_pushes_dropped']}",
            f"  staleness of applied gradients: mean {staleness['mean']:.2f}, max {staleness['max']}, "
            f"histogram {{{histogram}}}",
        ]
    )


def plot_job(summary: dict[str, Any], losses: dict[int, list[float]], path: str | Path) -> Path:
    """Training loss per worker by step, and the staleness histogram, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
    for worker, values in sorted(losses.items()):
        left.plot(range(1, len(values) + 1), values, linewidth=1, label=f"worker {worker}")
    left.axhline(summary["held_out_loss"], color="black", linestyle="--", linewidth=1, label="final held-out")
    left.set_xlabel("worker step")
    left.set_ylabel("training loss (own batch)")
    left.legend(fontsize=7)
    histogram = {int(tau): count for tau, count in summary["staleness"]["histogram"].items()}
    right.bar(list(histogram), list(histogram.values()), color="tab:orange")
    right.set_xticks(list(histogram))
    right.set_xlabel("staleness tau (versions between pull and apply)")
    right.set_ylabel("applied gradients (per shard)")
    fig.suptitle(
        f"plait ps: {str(summary.get('mode', '')).upper()}, {summary.get('servers')} servers, "
        f"{summary.get('workers')} workers; held-out {summary['initial_loss']:.3f} -> {summary['held_out_loss']:.3f}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


__all__ = ["job_summary", "plot_job", "summary_text"]
