"""Run records: one JSON object per line in ``metrics.jsonl`` (train steps and evaluations), and a PNG of the
loss and accuracy curves. Written by rank 0 only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from plait.engine import EvalStats, StepStats


def step_record(stats: StepStats, lr: float) -> dict[str, Any]:
    """The JSON record of one training step (bytes per mesh axis on rank 0, ring model). ``skipped``: fp16 loss
    scaling found inf/NaN gradients and the optimizer did not step; ``loss_scale``: the scale after this step's
    update (halved after a skip; null without fp16)."""
    return {
        "kind": "train",
        "step": stats.step,
        "loss": stats.loss,
        "tokens_per_s": stats.tokens_per_s,
        "seconds": stats.seconds,
        "grad_norm": stats.grad_norm,
        "lr": lr,
        "skipped": stats.skipped,
        "loss_scale": stats.loss_scale,
        "comm_bytes": {axis: int(b) for axis, b in stats.comm.wire_by_axis().items()},
    }


def eval_record(step: int, stats: EvalStats) -> dict[str, Any]:
    return {"kind": "eval", "step": step, "loss": stats.loss, "accuracy": stats.accuracy, "samples": stats.total}


class MetricsWriter:
    """Appends records to ``<folder>/metrics.jsonl`` (line-buffered, so a crash loses at most one line)."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / "metrics.jsonl"
        self._file = open(self.path, "a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_metrics(metrics_path: Path, out_path: Path, title: str = "") -> Path:
    """Draw training loss (and evaluation loss/accuracy when present) against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss", color="tab:blue", lw=1)
    if evals:
        ax.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", label="eval loss", color="tab:orange")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    if evals:
        acc = ax.twinx()
        acc.plot([r["step"] for r in evals], [100 * r["accuracy"] for r in evals], "s--", color="tab:green",
                 label="eval accuracy")
        acc.set_ylabel("accuracy (%)")
        acc.set_ylim(0, 100)
        acc.legend(loc="center right")
    ax.legend(loc="upper right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out_path)
    plt.close(fig)
    return out_path
