"""Context parallelism applied to a model: shard every batch's sequence over the cp ranks, swap each
Attention's core for the ring or Ulysses kernel, and slice the targets the same way in the loss.

The model object is kept (hooks, not a wrapping module), so parameter names, checkpoints and the
data-parallel strategies see exactly the single-device model:

- a forward pre-hook cuts the tokens [B, T, ...] to this rank's positions (zigzag for ring, contiguous for
  Ulysses) and passes those global ``positions`` to the model (learned position embeddings and RoPE see
  the right positions); the swapped cores hold the same ``SequenceSharding``, so nothing global is read;
- in training the model returns this rank's shard of the output; in eval (``model.training`` False) a
  forward hook all-gathers it over cp and restores sequence order, so metrics see full outputs;
- ``ContextParallelLoss`` slices the targets to match. A mean over the local tokens is rescaled by
  cp * n_local / n_all (n = targets not equal to ``ignore_index``, counted from the full targets the Engine
  passes, so no communication), which makes the average over dp_cp (what the Engine does with losses and
  gradients) the mean over all tokens: exactly single-device training. With no ignored targets the factor is 1.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from plait.comm import Comm, gather_from
from plait.config import Layout
from plait.errors import LayoutError
from plait.logging import get_logger
from plait.models.layers import Attention
from plait.parallel.context.ring import RingAttention
from plait.parallel.context.sharding import SequenceSharding
from plait.parallel.context.ulysses import UlyssesAttention

log = get_logger(__name__)
AXIS = "cp"
IGNORE_INDEX = -100
LossFn = Callable[[Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class ContextPlan:
    """What ``plan_context_parallel`` checked: the mode, the degree, and the Attention layers to swap."""

    mode: str
    size: int
    attention_paths: tuple[str, ...]
    kv_groups: tuple[int, ...]
    """Query heads per key/value head of each layer, read before tensor parallelism swaps the projections."""


def _attention_layers(model: nn.Module) -> list[tuple[str, Attention]]:
    return [(path, module) for path, module in model.named_modules() if isinstance(module, Attention)]


def plan_context_parallel(model: nn.Module, layout: Layout) -> ContextPlan | None:
    """Check (purely, before any collective) that ``model`` can run with ``layout.cp``; None when cp == 1."""
    cp, mode = layout.cp, layout.cp_mode
    if cp == 1:
        return None
    if layout.pp > 1:
        raise LayoutError(
            f"context parallelism (cp={cp}) together with pipeline parallelism (pp={layout.pp}) is not implemented. "
            f"Fix: use pp=1 with cp > 1, or cp=1 with pp > 1."
        )
    if getattr(model, "_plait_context_parallel", None) is not None:
        raise LayoutError("this model already has context parallelism applied. Fix: pass a fresh model to parallelize.")
    layers = _attention_layers(model)
    if not layers:
        raise LayoutError(
            f"context parallelism (cp={cp}) swaps the attention kernel of plait.models.layers.Attention layers, but "
            f"{type(model).__name__} has none. Fix: use plait's GPT (or its Attention layer), or cp=1."
        )
    if "positions" not in inspect.signature(model.forward).parameters:
        raise LayoutError(
            f"context parallelism passes each rank's token positions to the model, but "
            f"{type(model).__name__}.forward has no 'positions' argument. Fix: accept forward(x, positions=None) "
            f"and hand the positions to the blocks (as plait's GPT does), or use cp=1."
        )
    for path, attention in layers:
        dropout = getattr(attention.core, "dropout", 0.0)
        if dropout:
            raise LayoutError(
                f"{path}: attention dropout={dropout} cannot be reproduced by the context-parallel kernels. "
                f"Fix: set the model's dropout to 0, or use cp=1."
            )
        if mode == "ulysses":
            heads = attention.q.out_features // attention.head_dim
            kv_heads = attention.k.out_features // attention.head_dim
            split = layout.tp * cp
            if heads % split or kv_heads % split:
                raise LayoutError(
                    f"Ulysses (cp_mode='ulysses') gives each rank heads/(tp*cp) heads, but {path} has {heads} query "
                    f"and {kv_heads} key/value heads, not both divisible by tp*cp = {layout.tp}*{cp} = {split}. "
                    f"Fix: choose cp (and tp) so that tp*cp divides {kv_heads}, or use cp_mode='ring' (no constraint "
                    f"on heads)."
                )
    kv_groups = tuple(attention.q.out_features // attention.k.out_features for _, attention in layers)
    return ContextPlan(mode, cp, tuple(path for path, _ in layers), kv_groups)


class ContextParallelModel:
    """The hooks that make ``model`` context parallel; kept on the model as ``model._plait_context_parallel``."""

    def __init__(self, model: nn.Module, sharding: SequenceSharding, comm: Comm, axis: str = AXIS) -> None:
        self.model, self.sharding, self.comm, self.axis = model, sharding, comm, axis
        self.length: int | None = None
        """The full sequence length of the last forward (the loss wrapper slices targets to it)."""
        self._handles = [
            model.register_forward_pre_hook(self._shard_inputs, with_kwargs=True),
            model.register_forward_hook(self._gather_in_eval),
        ]

    def local_positions(self, length: int, device: torch.device | None = None) -> Tensor:
        """The global positions this rank holds of a length-``length`` sequence."""
        return self.sharding.local_positions(length, device=device)

    def _shard_inputs(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        if not args:
            raise TypeError("a context-parallel model takes its tokens [B, T] (or hidden states [B, T, d]) first")
        tokens, rest = args[0], args[1:]
        length = tokens.shape[1]
        self.sharding.check_length(length)  # before any collective, identically on every rank
        self.length = length
        index = self.local_positions(length, tokens.device)
        given = rest[0] if rest else kwargs.get("positions")
        positions = index if given is None else given.index_select(-1, index)
        local_tokens = tokens.index_select(1, index)
        if rest:
            return (local_tokens, positions, *rest[1:]), kwargs
        return (local_tokens,), {**kwargs, "positions": positions}

    def _gather_in_eval(self, module: nn.Module, args: tuple[Any, ...], output: Tensor) -> Tensor:
        if module.training or self.length is None:
            return output
        gathered = gather_from(output, self.comm, self.axis, dim=1)  # rank order: chunks of each rank in turn
        if self.sharding.mode == "ulysses":
            return gathered  # contiguous shards: rank order is sequence order
        order = self.sharding.gathered_order(self.length, device=output.device)
        return gathered.index_select(1, torch.argsort(order))

    def remove(self) -> None:
        """Take the hooks off (the swapped attention cores stay)."""
        for handle in self._handles:
            handle.remove()


class ContextParallelLoss:
    """``loss_fn`` on this rank's shard of the output against the matching targets, weighted so that the
    average over cp ranks is the mean over all non-ignored tokens (see the module docstring)."""

    def __init__(self, loss_fn: LossFn, model: ContextParallelModel, ignore_index: int = IGNORE_INDEX) -> None:
        self.loss_fn, self.model, self.ignore_index = loss_fn, model, ignore_index

    def local_targets(self, output: Tensor, target: Tensor) -> Tensor | None:
        """The targets of this rank's positions, or None when ``output`` covers the full sequence."""
        length, n = self.model.length, self.model.sharding.size
        if length is None:
            return None
        index = self.model.local_positions(length, target.device)
        if target.dim() == 1 and output.shape[0] * n == target.shape[0]:  # [B*T] flattened next to [B*T/cp, C]
            return target.view(-1, length).index_select(1, index).reshape(-1)
        if target.dim() >= 2 and target.shape[1] == length and output.dim() >= 2 and output.shape[1] * n == length:
            return target.index_select(1, index)
        return None

    def __call__(self, output: Tensor, target: Tensor) -> Tensor:
        local = self.local_targets(output, target)
        if local is None:
            return self.loss_fn(output, target)
        if target.is_floating_point():  # regression-style targets: equal token counts, plain mean
            return self.loss_fn(output, local)
        n = self.model.sharding.size
        counted_here = int((local != self.ignore_index).sum())
        counted_all = int((target != self.ignore_index).sum())
        if counted_here == 0 and counted_all > 0:  # nothing scored here: contribute 0 (and zero gradients)
            return output.sum() * 0.0
        loss = self.loss_fn(output, local)
        if counted_all == 0 or counted_here * n == counted_all:
            return loss
        return loss * (counted_here * n / counted_all)


def apply_context_parallel(model: nn.Module, plan: ContextPlan, comm: Comm, loss_fn: LossFn) -> ContextParallelLoss:
    """Swap the attention cores, install the sequence-sharding hooks; returns the loss the Engine must use."""
    sharding = SequenceSharding(plan.mode, comm.size(AXIS), comm.mesh.index(AXIS))
    core_class = RingAttention if plan.mode == "ring" else UlyssesAttention
    kv_groups = dict(zip(plan.attention_paths, plan.kv_groups))  # from the plan: under tp, q/k are parallel layers
    for path, attention in _attention_layers(model):
        attention.core = core_class(comm, sharding, kv_group=kv_groups[path], causal=True, axis=AXIS)
    handle = ContextParallelModel(model, sharding, comm)
    model._plait_context_parallel = handle  # type: ignore[assignment]
    log.info("context parallel: %s over cp=%d (rank %d of the cp group), %d attention layers",
             plan.mode, sharding.size, sharding.index, len(plan.attention_paths))
    return ContextParallelLoss(loss_fn, handle)
