"""The certificate as files a user can act on: certificate.json (everything), summary.md (per layout the verdict,
the budget, per step loss and gradient norm against the reference, the worst parameters, and where a divergence
starts) and certificate.png (losses overlaid; per layout the worst difference per block over the budget)."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plait.certification.certificate import DIFFERS, LayoutCertificate
from plait.train.metrics import dumps

if TYPE_CHECKING:
    from plait.certification.api import Certificate

WORST = 5
"""Parameters listed per layout in the summary (the worst gradient and value differences)."""


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _diff(diff: Any) -> dict[str, Any] | None:
    if diff is None:
        return None
    return {
        "max_abs": _finite(diff.max_abs),
        "max_rel": _finite(diff.max_rel),
        "budget_ratio": _finite(diff.ratio),
        "bitwise": diff.bitwise,
    }


def layout_dict(result: LayoutCertificate) -> dict[str, Any]:
    steps = [
        {
            "step": r.step,
            "loss": r.loss,
            "reference_loss": r.reference_loss,
            "grad_norm": r.grad_norm,
            "reference_grad_norm": r.reference_grad_norm,
            "loss_diff": _diff(r.loss_diff),
            "grad_norm_diff": _diff(r.grad_norm_diff),
            "grads": {name: _diff(d) for name, d in r.grads.items()},
            "params": {name: _diff(d) for name, d in r.params.items()},
        }
        for r in result.steps
    ]
    out: dict[str, Any] = {
        "layout": result.layout,
        "resolved": result.short,
        "world_size": result.world,
        "verdict": result.verdict,
        "budget": result.budget.to_dict(),
        "determinism": result.determinism,
        "steps": steps,
    }
    if result.divergence is not None:
        d = result.divergence
        out["divergence"] = {
            "step": d.step,
            "what": d.what,
            "parameter": d.parameter,
            "module": d.module,
            "direction": d.direction,
            "module_diff": _diff(d.module_diff),
            "modules": [{"kind": m["kind"], "module": m["module"], "diff": _diff(m["diff"])} for m in d.modules],
            "text": d.describe(),
        }
    return out


def summary_markdown(certificate: Certificate) -> str:
    job = certificate.job
    lines = [
        "# plait certify",
        "",
        f"{len(certificate.layouts)} layout(s) against one process, {job.steps} steps on the same global batches "
        f"({job.config.train.global_batch} samples each), in {certificate.seconds:.0f} s: "
        + ("**every layout equal**." if certificate.equal else "**a layout DIFFERS**."),
        "",
        "| layout | resolved | verdict | first divergence |",
        "|---|---|---|---|",
    ]
    for result in certificate.layouts:
        where = result.divergence.describe() if result.divergence else ""
        lines.append(f"| `{result.layout}` | {result.short} | **{result.verdict}** | {where} |")
    for result in certificate.layouts:
        lines += ["", f"## `{result.layout}`: {result.verdict}", "", f"Budget: {result.budget.describe()}.", ""]
        lines += ["| step | loss | reference | grad norm | reference | worst grad / budget | worst param / budget |"]
        lines += ["|---|---|---|---|---|---|---|"]
        for r in result.steps:
            grad = max((d.ratio for d in r.grads.values()), default=0.0)
            param = max((d.ratio for d in r.params.values()), default=0.0)
            lines.append(
                f"| {r.step} | {r.loss:.9g} | {r.reference_loss:.9g} | {r.grad_norm:.9g} | "
                f"{r.reference_grad_norm:.9g} | {grad:.3g} | {param:.3g} |"
            )
        last = result.steps[-1]
        worst = sorted(last.grads.values(), key=lambda d: -d.ratio)[:WORST]
        lines += ["", f"Worst gradients at step {last.step} (largest |a-e|, largest relative, over the budget):", ""]
        lines += [f"- `{d.name}`: {d.max_abs:.3g}, {d.max_rel:.3g}, {d.ratio:.3g}" for d in worst]
        if result.divergence is not None:
            d = result.divergence
            lines += ["", f"**Divergence**: {d.describe()}."]
            if d.module_diff is not None:
                m = d.module_diff
                lines.append(
                    f"That module's output differs by up to {m.max_abs:.3g} ({m.max_rel:.3g} relative), "
                    f"{m.ratio:.3g} x its budget; every module before it is within the budget."
                )
            shown = [m for m in d.modules if m["diff"] is not None][:12]
            if shown:
                lines += ["", "| order | module | over budget |", "|---|---|---|"]
                lines += [f"| {m['kind']} | `{m['module']}` | {m['diff'].ratio:.3g} |" for m in shown]
    return "\n".join(lines) + "\n"


def _block(name: str) -> str:
    """The block a parameter belongs to (``blocks.3``, ``model.layers.3``), or its top module."""
    match = re.match(r"(.*?\.\d+)\.", name)
    return match.group(1) if match else name.split(".")[0]


def save_picture(certificate: Certificate, path: Path) -> None:
    """Losses overlaid (reference and every layout); per layout the worst gradient difference per block over its
    budget (log scale, 1 = the budget)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (losses, blocks) = plt.subplots(1, 2, figsize=(12, 4.5))
    steps = range(len(certificate.reference["losses"]))
    losses.plot(steps, certificate.reference["losses"], "k-", linewidth=3, alpha=0.4, label="one process")
    for result in certificate.layouts:
        losses.plot(steps, [r.loss for r in result.steps], "o--", label=f"{result.layout} ({result.verdict})")
    losses.set_xlabel("step")
    losses.set_ylabel("loss")
    losses.set_title("loss per step")
    losses.legend(fontsize=8)
    for result in certificate.layouts:
        worst: dict[str, float] = {}
        for record in result.steps:
            for name, diff in record.grads.items():
                block = _block(name)
                worst[block] = max(worst.get(block, 0.0), diff.ratio if math.isfinite(diff.ratio) else 1e6)
        names = list(worst)
        blocks.semilogy(range(len(names)), [max(worst[n], 1e-6) for n in names], "o-", label=result.layout)
        blocks.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=7)
    blocks.axhline(1.0, color="red", linestyle=":", label="budget")
    blocks.set_ylabel("worst gradient difference / budget")
    blocks.set_title("per layer, all steps")
    blocks.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(certificate: Certificate, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    job = certificate.job
    data = {
        "equal": certificate.equal,
        "steps": job.steps,
        "seconds": certificate.seconds,
        "config": job.config.to_dict(),
        "model_factory": job.model_factory or None,
        "layers": job.layers or None,
        "optimizer": job.optimizer_factory or None,
        "deterministic": job.config.train.deterministic,
        "reference": {
            "losses": certificate.reference["losses"],
            "determinism": certificate.reference.get("determinism"),
        },
        "layouts": [layout_dict(result) for result in certificate.layouts],
        "differs": [r.layout for r in certificate.layouts if r.verdict == DIFFERS],
    }
    paths = [out / "certificate.json", out / "summary.md", out / "certificate.png"]
    paths[0].write_text(dumps(data, indent=1))  # NaN as null: strict JSON
    paths[1].write_text(summary_markdown(certificate))
    save_picture(certificate, paths[2])
    return paths
