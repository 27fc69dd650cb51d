"""Data parallelism: replicas see different samples; gradients are averaged before each optimizer step.

With N replicas each computing the mean loss of B/N samples, the average of their gradients is the gradient
of the mean loss over all B samples:  (1/N) sum_r grad L_r = grad (1/B) sum_i l_i  (equal shares). So after the
average every replica takes the same step as single-device training on the whole batch.

``AllReduceGradSync`` is the plain, correct version: after backward, every gradient is packed into one flat
buffer per dtype and averaged with a single all-reduce over the ``dp_cp`` axis. The bucketed version that
overlaps the all-reduce with backward replaces it behind the same interface (``sync``, ``clip_grad_norm``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from plait.comm import Comm

GRAD_AXIS = "dp_cp"
"""Gradients are averaged over data- and context-parallel ranks: both see other tokens with the same weights."""


def broadcast_parameters(module: nn.Module, comm: Comm, axis: str = GRAD_AXIS) -> None:
    """Make every replica start from the weights of the replica at index 0 of ``axis`` (parameters and buffers)."""
    for tensor in list(module.parameters()) + list(module.buffers()):
        comm.broadcast(tensor.data, axis, src=0)


class AllReduceGradSync:
    """Average the gradients of ``params`` over ``axis`` after backward (one flat all-reduce per dtype)."""

    def __init__(self, params: Iterable[nn.Parameter], comm: Comm, axis: str = GRAD_AXIS) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.comm = comm
        self.axis = axis

    def sync(self) -> None:
        """All-reduce-average every gradient; a parameter without a gradient on this rank gets zeros, so that
        every rank takes part in the same collective with the same sizes."""
        if self.comm.size(self.axis) == 1:
            return
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for param in self.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            by_dtype.setdefault(param.grad.dtype, []).append(param)
        for params in by_dtype.values():
            grads = [p.grad for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.comm.all_reduce(flat, self.axis, op="avg")
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()

    def clip_grad_norm(self, max_norm: float) -> float:
        """Scale gradients so that their global L2 norm is at most ``max_norm``; return the norm before clipping.

        After ``sync`` every replica holds the full averaged gradient, so the local norm is the global norm."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return 0.0
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        return float(norm)

    def grad_norm(self) -> float:
        """The global L2 norm of the (synchronised) gradients."""
        total = sum(float(p.grad.detach().float().pow(2).sum()) for p in self.params if p.grad is not None)
        return math.sqrt(total)
