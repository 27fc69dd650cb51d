"""Data parallelism: replicas see different samples; gradients are averaged before each optimizer step.

With N replicas each computing the mean loss of B/N samples, the average of their gradients is the gradient
of the mean loss over all B samples:  (1/N) sum_r grad L_r = grad (1/B) sum_i l_i  (equal shares). So after the
average every replica takes the same step as single-device training on the whole batch.

The plain version (one flat all-reduce after backward) is ``DataParallelStrategy`` itself
(plait/parallel/strategy.py); the bucketed DDP that overlaps all-reduces with backward lives here.
"""

from __future__ import annotations

from torch import nn

from plait.comm import Comm
from plait.parallel.strategy import GRAD_AXIS


def broadcast_parameters(module: nn.Module, comm: Comm, axis: str = GRAD_AXIS) -> None:
    """Make every replica start from the weights of the replica at index 0 of ``axis`` (parameters and buffers)."""
    for tensor in list(module.parameters()) + list(module.buffers()):
        comm.broadcast(tensor.data, axis, src=0)
