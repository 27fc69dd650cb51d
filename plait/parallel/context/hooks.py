"""The hooks that shard a model's sequence over the cp ranks, and the loss that slices the targets to match.

- a forward pre-hook cuts the tokens [B, T, ...] to this rank's positions (zigzag for ring, contiguous for
  Ulysses) and passes those global positions to the model (``positions`` for plait's GPT, ``position_ids``
  for Hugging Face models: learned position embeddings and RoPE see the right positions);
- in training the model returns this rank's shard of the output; in eval (``model.training`` False) a
  forward hook all-gathers it over cp and restores sequence order, so metrics see full outputs;
- under pipeline parallelism the hooks go on this rank's stage modules instead: the first stage shards the
  tokens as above; a later stage receives hidden states [B, T/(cp s), d] that are already this rank's shard
  (s: Megatron-SP's split, else 1), so its pre-hook only recomputes their global positions from the cp index
  and T = local length x cp x s (nothing travels with the activations); only the last stage gathers in eval;
- packed documents (``plait.models.inputs``): the model is called with ``positions`` [B, T] (every stage, by the
  pipeline runtime), and every hook slices them to this rank's tokens exactly as it slices the tokens, so each
  rank's attention kernel gets its own queries' document positions [B, T/cp];
- ``ContextParallelMeanLoss`` slices the targets to match for a token-mean loss (``MeanLoss``): its ``total``
  is the inner loss's sum over this rank's positions and its ``count`` the inner count of the full targets, so
  the Engine's normalisation by the global batch's token count (``plait.parallel.loss_normalization``) covers cp
  like any other split of the batch. ``ContextParallelLoss`` does the same for any other loss: a mean over the
  local tokens is rescaled by cp * n_local / n_all (n = targets not equal to ``ignore_index``, counted from the
  full targets the Engine passes, so no communication), which makes the average over dp_cp the mean over all
  of a micro-batch's tokens. With no ignored targets the factor is 1.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from plait.comm import Comm, gather_from
from plait.errors import LayoutError
from plait.models.loss import IGNORE_INDEX, LossFn, MeanLoss
from plait.parallel.context.sharding import SequenceSharding

AXIS = "cp"


StageRole = tuple[nn.Module, bool, bool]
"""A pipeline stage's module on this rank, whether it is the first stage, whether it is the last."""


class ContextParallelModel:
    """The hooks that make ``model`` context parallel; kept on the model as ``model._plait_context_parallel``.

    ``stages`` (pipeline parallelism): this rank's stage modules with their roles; the hooks go on them (the
    first stage shards the tokens, later ones recompute their inputs' positions, the last gathers in eval).
    None: ``model`` is the whole model, both first and last."""

    def __init__(
        self,
        model: nn.Module,
        sharding: SequenceSharding,
        comm: Comm,
        axis: str = AXIS,
        sequence_parallel: int = 1,
        stages: list[StageRole] | None = None,
    ) -> None:
        self.model, self.sharding, self.comm, self.axis = model, sharding, comm, axis
        self.sequence_parallel = sequence_parallel
        """Megatron-SP's split of each rank's T/cp tokens (tp with ``sequence_parallel=True``, else 1)."""
        self.length: int | None = None
        """The full sequence length of the last forward (the loss wrapper slices targets to it)."""
        self._handles: list[Any] = []
        for module, first, last in [(model, True, True)] if stages is None else stages:
            entry = self._shard_inputs if first else self._position_hidden
            self._handles.append(module.register_forward_pre_hook(entry, with_kwargs=True))
            if last:
                self._handles.append(module.register_forward_hook(self._gather_in_eval))

    def local_positions(self, length: int, device: torch.device | None = None) -> Tensor:
        """The global positions this rank holds of a length-``length`` sequence."""
        return self.sharding.local_positions(length, device=device)

    def check_input(self, tokens: Tensor) -> None:
        """Raise LayoutError when the full input [B, T, ...] cannot be split (T over the cp chunks, then T/cp
        over Megatron-SP's tp): pure, so every rank can run it before any collective (the pipeline runner does,
        on ranks that never see the tokens' first stage)."""
        length = tokens.shape[1]
        self.sharding.check_length(length)
        if (length // self.sharding.size) % self.sequence_parallel:
            split = self.sharding.size * self.sequence_parallel
            raise LayoutError(
                f"context parallel (cp={self.sharding.size}) leaves {length // self.sharding.size} of the {length} "
                f"tokens on each rank, which Megatron-SP cannot split over tp={self.sequence_parallel}. Fix: use a "
                f"sequence length that is a multiple of {math.lcm(split, self.sharding.chunks)}, pad the batch, "
                f"or sequence_parallel=False."
            )

    def _shard_inputs(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        if not args:
            raise TypeError("a context-parallel model takes its tokens [B, T] (or hidden states [B, T, d]) first")
        tokens = args[0]
        self.check_input(tokens)  # before any collective, identically on every rank
        length = self.length = tokens.shape[1]
        index = self.local_positions(length, tokens.device)
        return self.local_call(tokens.index_select(1, index), index, args[1:], kwargs)

    def _position_hidden(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        """A pipeline stage after the first: its input [B, T/(cp s), d] is this rank's shard already; hand it
        on with the global positions of T = local length x cp x s (s: Megatron-SP's split)."""
        if not args:
            raise TypeError("a context-parallel pipeline stage takes the previous stage's hidden states first")
        hidden = args[0]
        length = self.length = hidden.shape[1] * self.sharding.size * self.sequence_parallel
        index = self.local_positions(length, hidden.device)
        given = args[1] if len(args) > 1 else kwargs.get("positions")
        if given is not None and given.shape[-1] != length:  # positions passed along that are this rank's already
            return args, kwargs
        return self.local_call(hidden, index, args[1:], kwargs)  # the micro-batch's documents are sliced there

    def local_call(
        self, local_tokens: Tensor, index: Tensor, rest: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The model's arguments for this rank's tokens at global positions ``index``: plait's GPT takes
        ``forward(x, positions)`` (given positions, if any, are sliced the same way)."""
        given = rest[0] if rest else kwargs.get("positions")
        positions = index if given is None else given.index_select(-1, index)
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


class ContextParallelMeanLoss(ContextParallelLoss, MeanLoss):
    """A token-mean ``loss_fn`` (``MeanLoss``) on this rank's shard of the sequence: ``total`` over this rank's
    positions, ``count`` of the full targets (module docstring); evaluation's full outputs pass through."""

    loss_fn: MeanLoss

    def total(self, output: Tensor, target: Tensor) -> Tensor:
        local = self.local_targets(output, target)
        return self.loss_fn.total(output, target if local is None else local)

    def count(self, target: Tensor) -> Tensor:
        return self.loss_fn.count(target)
