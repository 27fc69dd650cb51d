"""Megatron sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", sec. 4.2.2), on top of 1D tensor parallelism over the ``tp`` axis.

Tensor parallelism splits attention and the MLP, but the layer norms, dropouts and residual adds between them
run replicated: every tp rank holds the whole [B, T, d] activations there. Sequence parallelism splits those
regions along the sequence: each rank keeps [B, T/t, d]. The conjugate f/g pair becomes

    entering a tensor-parallel region (before q/k/v, before MLP up/gate, before the LM head):
        all-gather along the sequence forward, reduce-scatter backward       (instead of identity / all-reduce)
    leaving it (after attn.o, after MLP down, after the vocab-parallel embedding):
        reduce-scatter along the sequence forward, all-gather backward       (instead of all-reduce / identity)

An all-reduce is a reduce-scatter plus an all-gather, so the bytes are the same as plain tensor parallelism,
while the activations of the replicated regions shrink by t: per layer s b h (34 + 5 a s / h) / t bytes
instead of s b h (10 + 24 / t + 5 a s / (h t)) (paper eqs. 3-4, 2-byte activations; ``plait.observe.memory``).

Parameters replicated over tp (norm weights, row-parallel biases, position embeddings) then see only their
rank's sequence chunk, so their gradients are partial sums: after backward they are summed over tp
(``DataParallelStrategy.reduce_sequence_parallel_grads``, one flat all-reduce, called by the Engine). The
layers themselves take a ``sequence_parallel`` switch (``plait.parallel.tensor``); this module holds the
checks and the bookkeeping.

With pipeline parallelism the hidden states crossing a stage boundary are SP's chunks [B, T/t, d]. A stage after
the first never sees the tokens, and its attention gathers the chunks back to T before RoPE, so it needs the
positions 0..T-1 with T = t x its input's length: ``hand_stage_positions`` passes them to each such stage's
``forward(x, positions)`` (under cp > 1 the context-parallel hooks do it, with cp's global positions).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import Tensor, nn

from plait.comm import Comm
from plait.errors import LayoutError
from plait.layout import Layout, PipelineSchedule
from plait.observe.memory import saved_activation_bytes  # re-exported: measured SP activation memory

AXIS = "tp"


def check_sequence_parallel(layout: Layout) -> None:
    """Pure checks of a layout asking for sequence parallelism (the same LayoutError on every rank)."""
    if not layout.sequence_parallel:
        return
    if layout.tp == 1:
        raise LayoutError("sequence_parallel=True splits the sequence inside the tp group, but tp=1. Fix: set tp >= 2.")
    if layout.pp > 1 and layout.schedule == PipelineSchedule.PIPEDREAM:
        raise LayoutError(
            "sequence_parallel=True with schedule='pipedream' is not implemented: PipeDream's asynchronous updates "
            "are not parity-tested with sequence-split activations. Fix: use a synchronous schedule (e.g. "
            "schedule='1f1b') with sequence_parallel=True, or sequence_parallel=False with PipeDream."
        )
    # with cp > 1 the sequence is split twice: cp cuts it first (each rank keeps T/cp tokens at their global
    # positions), SP cuts those T/cp further over tp; the cp hook checks that T/cp splits (docs/context_parallel.md)


def hand_stage_positions(stages: list[tuple[nn.Module, bool]], tp: int) -> Callable[[Tensor], None]:
    """Megatron-SP x pp (cp = 1): on each (stage module, is first stage) after the first whose ``forward`` takes
    ``positions``, a forward pre-hook passes ``arange(tp x local length)`` when none are given (see the module
    doc). Returns the input check the pipeline runner calls on every rank before a step: T must split over tp
    (otherwise only the first stage would notice, and the others would wait for it)."""

    def positions_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if len(args) != 1 or kwargs.get("positions") is not None:
            return None  # positions given by the caller
        length = args[0].shape[1] * tp
        return args, {**kwargs, "positions": torch.arange(length, device=args[0].device)}

    for module, first in stages:
        if not first and "positions" in inspect.signature(module.forward).parameters:
            module.register_forward_pre_hook(positions_hook, with_kwargs=True)
        # the first stage has the tokens; a stage without ``positions`` uses none (learned embeddings)

    def check_length(tokens: Tensor) -> None:
        if tokens.dim() >= 2 and tokens.shape[1] % tp:
            raise LayoutError(
                f"sequence_parallel=True splits the sequence over tp={tp}, but the batch has {tokens.shape[1]} tokens "
                f"per sample. Fix: use a sequence length that is a multiple of {tp}, pad the batch, or "
                f"sequence_parallel=False."
            )

    return check_length


def is_sequence_partial(param: Tensor) -> bool:
    """Whether ``param``'s gradient is a partial sum over tp (tagged by ``plan.mark_sequence_partial``)."""
    return bool(getattr(param, "sequence_partial", False))


@torch.no_grad()
def sum_over_tp(grads: list[Tensor], comm: Comm, axis: str = AXIS) -> None:
    """Sum ``grads`` over ``axis`` in place with one flat all-reduce (per dtype)."""
    if comm.size(axis) == 1 or not grads:
        return
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for group in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in group]).to(comm.device)
        comm.all_reduce(flat, axis)
        offset = 0
        for grad in group:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


__all__ = [
    "check_sequence_parallel",
    "hand_stage_positions",
    "is_sequence_partial",
    "saved_activation_bytes",
    "sum_over_tp",
]
