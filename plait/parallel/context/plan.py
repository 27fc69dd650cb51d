"""What ``plan_context_parallel`` checks before any collective, shared by plait's GPT and Hugging Face models:
the layout (no pp), the model (not already converted), attention dropout, and under Ulysses that tp*cp divides
the query and key/value heads (each rank attends heads / (tp cp) of them for the whole sequence)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn

from plait.config import Layout
from plait.errors import LayoutError


@dataclass(frozen=True)
class ContextPlan:
    """What ``plan_context_parallel`` checked: the mode, the degree, and the attention layers to swap."""

    mode: str
    size: int
    attention_paths: tuple[str, ...]
    kv_groups: tuple[int, ...]
    """Query heads per key/value head of each layer, read before tensor parallelism swaps the projections."""
    hugging_face: bool = False
    """A transformers model: attention runs through its AttentionInterface (``context.hf``)."""
    sequence_split: int = 1
    """Megatron-SP's further split of each rank's T/cp tokens: tp under ``sequence_parallel=True``, else 1."""


def check_layout_and_model(model: nn.Module, layout: Layout) -> None:
    """The checks every model goes through: pp == 1, and context parallelism not applied already."""
    if layout.pp > 1:
        raise LayoutError(
            f"context parallelism (cp={layout.cp}) together with pipeline parallelism (pp={layout.pp}) is not "
            f"implemented. Fix: use pp=1 with cp > 1, or cp=1 with pp > 1."
        )
    if getattr(model, "_plait_context_parallel", None) is not None:
        raise LayoutError("this model already has context parallelism applied. Fix: pass a fresh model to parallelize.")


def check_positions_argument(model: nn.Module, argument: str, fix: str) -> None:
    """The sequence-sharding hook hands each rank's global token positions to ``model.forward(..., argument=)``."""
    if argument not in inspect.signature(model.forward).parameters:
        raise LayoutError(
            f"context parallelism passes each rank's global token positions to the model, but "
            f"{type(model).__name__}.forward has no {argument!r} argument. Fix: {fix}, or use cp=1."
        )


def check_dropout(path: str, dropout: float) -> None:
    """Attention dropout cannot be replayed by the blockwise kernels (nor matched across a head split)."""
    if dropout:
        raise LayoutError(
            f"{path}: attention dropout={dropout} cannot be reproduced by the context-parallel kernels. "
            f"Fix: set the model's dropout to 0, or use cp=1."
        )


def check_ulysses_heads(path: str, heads: int, kv_heads: int, layout: Layout) -> None:
    """Under Ulysses, tp first splits the heads and cp splits them again: tp*cp must divide both counts."""
    split = layout.tp * layout.cp
    if layout.cp_mode == "ulysses" and (heads % split or kv_heads % split):
        raise LayoutError(
            f"Ulysses (cp_mode='ulysses') gives each rank heads/(tp*cp) heads, but {path} has {heads} query "
            f"and {kv_heads} key/value heads, not both divisible by tp*cp = {layout.tp}*{layout.cp} = {split}. "
            f"Fix: choose cp (and tp) so that tp*cp divides {kv_heads}, or use cp_mode='ring' (no constraint "
            f"on heads)."
        )
