"""What ``plan_context_parallel`` checks before any collective, shared by plait's GPT and Hugging Face models:
the layout (pp only for plait's GPT and synchronous schedules), the model (not already converted), attention
dropout, and under Ulysses that tp*cp divides the query and key/value heads (each rank attends heads / (tp cp)
of them for the whole sequence)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn

from plait.errors import LayoutError
from plait.layout import CpMode, Layout, PipelineSchedule
from plait.models.hf import is_hf_model


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
    """The checks every model goes through: with pp > 1 plait's GPT (not a Hugging Face model) and a synchronous
    schedule, and context parallelism not applied already."""
    if layout.pp > 1 and is_hf_model(model):
        raise LayoutError(
            f"context parallelism (cp={layout.cp}) together with pipeline parallelism (pp={layout.pp}) is implemented "
            f"for plait's GPT, not for Hugging Face models: their pipeline stages (plait.models.hf_stages) compute "
            f"positions 0..T/cp-1 instead of this rank's global ones. Fix: use pp=1 with cp > 1 for this model, or "
            f"cp=1 with pp > 1."
        )
    if layout.pp > 1 and layout.schedule == PipelineSchedule.PIPEDREAM:
        raise LayoutError(
            f"context parallelism (cp={layout.cp}) with schedule='pipedream' is not implemented: PipeDream's "
            f"asynchronous updates are not parity-tested with a sharded sequence. Fix: use a synchronous schedule "
            f"(e.g. schedule='1f1b' or 'interleaved') with cp > 1, or cp=1 with PipeDream."
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
    if layout.cp_mode == CpMode.ULYSSES and (heads % split or kv_heads % split):
        raise LayoutError(
            f"Ulysses (cp_mode='ulysses') gives each rank heads/(tp*cp) heads, but {path} has {heads} query "
            f"and {kv_heads} key/value heads, not both divisible by tp*cp = {layout.tp}*{layout.cp} = {split}. "
            f"Fix: choose cp (and tp) so that tp*cp divides {kv_heads}, or use cp_mode='ring' (no constraint "
            f"on heads)."
        )
