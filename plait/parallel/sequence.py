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
instead of s b h (10 + 24 / t + 5 a s / (h t)) (paper eqs. 3-4, 2-byte activations; ``plait.memory``).

Parameters replicated over tp (norm weights, row-parallel biases, position embeddings) then see only their
rank's sequence chunk, so their gradients are partial sums: after backward they are summed over tp
(``DataParallelStrategy.reduce_sequence_parallel_grads``, one flat all-reduce, called by the Engine). The
layers themselves take a ``sequence_parallel`` switch (``plait.parallel.tensor``); this module holds the
checks and the bookkeeping.
"""

from __future__ import annotations

import torch
from torch import Tensor

from plait.comm import Comm
from plait.config import Layout
from plait.errors import LayoutError
from plait.memory import saved_activation_bytes  # re-exported: measured SP activation memory

AXIS = "tp"


def check_sequence_parallel(layout: Layout) -> None:
    """Pure checks of a layout asking for sequence parallelism (the same LayoutError on every rank)."""
    if not layout.sequence_parallel:
        return
    if layout.tp == 1:
        raise LayoutError("sequence_parallel=True splits the sequence inside the tp group, but tp=1. Fix: set tp >= 2.")
    if layout.pp > 1:
        raise LayoutError(
            f"sequence_parallel=True with pp={layout.pp} is not implemented: stages after the first would see "
            f"sequence chunks without their global positions. Fix: use sequence_parallel=False with pp > 1."
        )
    # with cp > 1 the sequence is split twice: cp cuts it first (each rank keeps T/cp tokens at their global
    # positions), SP cuts those T/cp further over tp; the cp hook checks that T/cp splits (docs/context_parallel.md)


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


__all__ = ["check_sequence_parallel", "is_sequence_partial", "saved_activation_bytes", "sum_over_tp"]
