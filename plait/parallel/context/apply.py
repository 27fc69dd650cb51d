"""Context parallelism applied to a model: check it (``plan_context_parallel``, pure), then swap each
Attention's core for the ring or Ulysses kernel and install the sequence-sharding hooks (``hooks.py``).

The model object is kept (hooks, not a wrapping module), so parameter names, checkpoints and the
data-parallel strategies see exactly the single-device model. Under pipeline parallelism the hooks go on this
rank's stage modules (``stages``), whose Attention layers are the local model's own objects. The swapped cores
hold the cp group's ``SequenceSharding``, so nothing global is read. Hugging Face models take the route of
``context.hf``.
"""

from __future__ import annotations

from torch import nn

from plait.comm import Comm
from plait.errors import LayoutError
from plait.layout import Layout
from plait.logging import get_logger
from plait.models.hf import is_hf_model
from plait.models.layers import Attention
from plait.models.loss import MeanLoss
from plait.parallel.context.hf import apply_hf_context_parallel, plan_hf_context_parallel
from plait.parallel.context.hooks import (
    AXIS,
    ContextParallelLoss,
    ContextParallelMeanLoss,
    ContextParallelModel,
    LossFn,
    StageRole,
)
from plait.parallel.context.plan import (
    ContextPlan,
    check_dropout,
    check_layout_and_model,
    check_positions_argument,
    check_ulysses_heads,
)
from plait.parallel.context.ring import RingAttention
from plait.parallel.context.sharding import SequenceSharding
from plait.parallel.context.ulysses import UlyssesAttention

log = get_logger(__name__)


def _attention_layers(model: nn.Module) -> list[tuple[str, Attention]]:
    return [(path, module) for path, module in model.named_modules() if isinstance(module, Attention)]


def plan_context_parallel(model: nn.Module, layout: Layout) -> ContextPlan | None:
    """Check (purely, before any collective) that ``model`` can run with ``layout.cp``; None when cp == 1."""
    cp, mode = layout.cp, layout.cp_mode
    if cp == 1:
        return None
    check_layout_and_model(model, layout)
    if is_hf_model(model):
        return plan_hf_context_parallel(model, layout)
    layers = _attention_layers(model)
    if not layers:
        raise LayoutError(
            f"context parallelism (cp={cp}) swaps the attention kernel of plait.models.layers.Attention layers, but "
            f"{type(model).__name__} has none. Fix: use plait's GPT (or its Attention layer), a Hugging Face model "
            f"whose attention goes through transformers' AttentionInterface (Llama, GPT-2), or cp=1."
        )
    check_positions_argument(
        model,
        "positions",
        "accept forward(x, positions=None) and hand the positions to the blocks (as plait's GPT does)",
    )
    for path, attention in layers:
        check_dropout(path, getattr(attention.core, "dropout", 0.0))
        check_ulysses_heads(
            path, attention.q.out_features // attention.head_dim, attention.k.out_features // attention.head_dim, layout
        )
    kv_groups = tuple(attention.q.out_features // attention.k.out_features for _, attention in layers)
    sequence_split = layout.tp if layout.sequence_parallel else 1
    return ContextPlan(mode, cp, tuple(path for path, _ in layers), kv_groups, sequence_split=sequence_split)


def apply_context_parallel(
    model: nn.Module, plan: ContextPlan, comm: Comm, loss_fn: LossFn, stages: list[StageRole] | None = None
) -> ContextParallelLoss:
    """Swap the attention cores, install the sequence-sharding hooks (on ``model``, or with pp > 1 on this
    rank's pipeline ``stages`` as (module, is first, is last)); returns the loss the Engine must use."""
    sharding = SequenceSharding(plan.mode, comm.size(AXIS), comm.mesh.index(AXIS))
    handle: ContextParallelModel
    if plan.hugging_face:
        handle = apply_hf_context_parallel(model, plan, sharding, comm)
    else:
        core_class = RingAttention if plan.mode == "ring" else UlyssesAttention
        kv_groups = dict(zip(plan.attention_paths, plan.kv_groups))  # from the plan: under tp, q/k are parallel
        for path, attention in _attention_layers(model):  # a pipeline rank's local model: the layers it holds
            core = core_class(comm, sharding, kv_group=kv_groups[path], causal=True, axis=AXIS)
            # replaces the child module "core" (Attention types it as the ScaledDotProductAttention it starts with)
            attention.add_module("core", core)
        handle = ContextParallelModel(model, sharding, comm, sequence_parallel=plan.sequence_split, stages=stages)
    # torch's stubs type Module.__setattr__'s value as Tensor | Module; a plain attribute is fine at runtime
    model._plait_context_parallel = handle  # type: ignore[assignment]
    log.info(
        "context parallel: %s over cp=%d (rank %d of the cp group), %d attention layers",
        plan.mode,
        sharding.size,
        sharding.index,
        len(plan.attention_paths),
    )
    if isinstance(loss_fn, MeanLoss):
        return ContextParallelMeanLoss(loss_fn, handle)
    return ContextParallelLoss(loss_fn, handle)
