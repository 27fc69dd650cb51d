"""TensorBoard event files beside ``metrics.jsonl``: the same records, as scalars people already know how to read.

``torch.utils.tensorboard.SummaryWriter`` (the optional ``tensorboard`` package, ``pip install 'plait[tensorboard]'``)
writes ``events.out.tfevents.*`` into the run folder, so ``tensorboard --logdir runs`` shows every run. Per training
step: ``train/loss``, ``train/perplexity`` (exp of the mean token cross-entropy), ``train/lr``, ``train/grad_norm``,
``train/tokens_per_s``, ``train/mfu`` (when known) and ``train/memory_bytes`` (the largest of the ranks' peaks);
per evaluation: ``eval/loss``, ``eval/perplexity`` and ``eval/accuracy``. A Mixture-of-Experts model adds per
step ``moe/aux_loss``, ``moe/imbalance`` (the worst layer's), ``moe/dropped_fraction`` and per MoE layer L
``moe/layerL/imbalance`` and ``moe/layerL/expertE`` (tokens routed to expert E). Every ``train.straggler_every``
steps: ``straggler/lag``, ``straggler/rank``, ``straggler/compute_s_max``, ``straggler/compute_s_median`` and
``straggler/wait_s_max`` (``plait.observe.stragglers``). On a resumed run the writer purges
events from the resumed step on, as metrics.jsonl drops its lines past the checkpoint.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

from plait.errors import ConfigError
from plait.logging import get_logger
from plait.observe.stragglers import straggler_scalars

log = get_logger(__name__)


def tensorboard_available() -> bool:
    """Whether the tensorboard package (which torch.utils.tensorboard needs) is installed."""
    return importlib.util.find_spec("tensorboard") is not None


def _perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 50 else float("inf")


class TensorBoardLog:
    """Writes run records (``plait.train.metrics``) as TensorBoard scalars into ``folder``."""

    def __init__(self, folder: Path, purge_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(folder), purge_step=purge_step or None)

    def write(self, record: dict[str, Any]) -> None:
        step, kind = int(record["step"]), record.get("kind")
        scalars: dict[str, Any] = {}
        if kind == "train":
            memory = record.get("max_allocated_bytes") or record.get("max_rss_bytes")
            scalars = {
                "train/loss": record.get("loss"),
                "train/perplexity": _perplexity(record["loss"]),
                "train/lr": record.get("lr"),
                "train/grad_norm": record.get("grad_norm"),
                "train/tokens_per_s": record.get("tokens_per_s"),
                "train/mfu": record.get("mfu"),
                "train/memory_bytes": max(memory) if memory else None,
            } | moe_scalars(record.get("moe"))
            scalars |= straggler_scalars(record)
        elif kind == "eval":
            scalars = {
                "eval/loss": record.get("loss"),
                "eval/perplexity": _perplexity(record["loss"]),
                "eval/accuracy": record.get("accuracy"),
            }
        for tag, value in scalars.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()


def moe_scalars(moe: dict[str, Any] | None) -> dict[str, Any]:
    """The TensorBoard scalars of a train record's ``moe`` object (module docstring); {} for a dense model."""
    if not moe:
        return {}
    scalars = {
        "moe/aux_loss": moe["aux_loss"],
        "moe/imbalance": max(moe["imbalance"], default=None),
        "moe/dropped_fraction": moe["dropped_fraction"],
    }
    for layer, imbalance, load in zip(moe["layers"], moe["imbalance"], moe["load"]):
        scalars[f"moe/layer{layer}/imbalance"] = imbalance
        scalars.update({f"moe/layer{layer}/expert{expert}": tokens for expert, tokens in enumerate(load)})
    return scalars


def open_tensorboard(folder: Path, wanted: bool | None, step: int = 0) -> TensorBoardLog | None:
    """The TensorBoard log of a run (rank 0): on when ``wanted``, off when False, and when None (the default)
    on if the package is installed. ``wanted=True`` without the package is a ConfigError with the fix."""
    if wanted is False:
        return None
    if not tensorboard_available():
        if wanted:
            raise ConfigError(
                "train.tensorboard=true needs the tensorboard package. Fix: pip install 'plait[tensorboard]' "
                "(or set train.tensorboard=false)."
            )
        return None
    folder.mkdir(parents=True, exist_ok=True)
    return TensorBoardLog(folder, purge_step=step)


__all__ = ["TensorBoardLog", "moe_scalars", "open_tensorboard", "tensorboard_available"]
