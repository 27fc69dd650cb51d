"""One loss normalisation for every layout: what each micro-batch differentiates so that a step's gradients are
those of the loss one device computes on the whole global batch.

**Token means** (``plait.models.loss.MeanLoss``: ``lm_loss``, torch's cross-entropy, the vocab-parallel and
context-parallel losses built on them, a user's own). One device computes L = S / N over the global batch, with
S = sum of per-token losses and N = scored tokens. A step with m micro-batches on each of D data-parallel ranks
(D = dp; context- and tensor-parallel ranks of one replica see the same targets) counts before any forward:

    n_k  = count(targets of micro-batch k)            on each dp rank, k = 1..m
    N_k  = sum over dp of n_k                         one all-reduce of m integers over "dp", per step

Each micro-batch k then backpropagates its local total s_k (the sum of its per-token losses on this rank: a cp
rank's share of the sequence, the whole micro-batch on a tp rank) scaled by G / N_w, where G = dp x cp is the
size of the gradient axis (data parallelism *averages* gradients over it) and N_w the scored tokens of the update
window holding k (all m micro-batches, or PipeDream's ``update_interval`` of them). The average over the G ranks
of sum_k G s_k / N_w is then sum(s) / N_w = dL/dtheta, whatever the masks. The reported loss is
sum over dp_cp of sum_k s_k, divided by N = sum_k N_k: the same number on every rank.

**Semi-synchronous training** (``plait.parallel.semisync``: gradients reduced inside one HSDP replica group, the
mesh axis ``shard`` of G_g = dp/R x cp ranks): N_k is counted over the group's data ranks only (an all-reduce of m
integers over ``shard``, divided by cp: the cp ranks of a data rank count the same targets) and G is G_g, so each
group's gradient is that of its own token mean S_g / N_g. The step reports sum over every group of S_g divided by
sum of N_g (one all-reduce of (S, n) over dp_cp): the token mean of the global batch, each group's tokens scored
by its own parameters, the same number on every rank.

A window without a scored token contributes zero gradients (N_w is clamped to 1) and the step reports NaN, as
0/0 is; ``scored`` (0 then) says so, so that the NaN is not taken for a divergence (``plait.train.metrics``).

**Other losses** (any ``loss_fn`` that is not a ``MeanLoss``): each micro-batch's loss l_k is taken as a mean
of equal weight, so micro-batch k backpropagates l_k / w (w: the window's micro-batch count), the data axis
averages, and the step reports the mean of the l_k averaged over dp_cp: exact when every piece holds the same
number of items, which is what such a loss can promise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from plait.comm import Comm
from plait.models.loss import LossFn, MeanLoss, apply_loss, apply_total
from plait.parallel.strategy import GRAD_AXIS

COUNT_AXIS = "dp"
"""Targets differ between dp ranks only: cp ranks slice the same targets, tp and pp ranks hold the same batch."""


class StepLoss(Protocol):
    """How one step's micro-batch losses are computed, differentiated and reported (module docstring)."""

    def value(self, output: Tensor, target: Tensor) -> Tensor:
        """Micro-batch k's loss as the step accumulates it (a total for token means, the mean otherwise)."""
        ...

    def to_backward(self, k: int, value: Tensor) -> Tensor:
        """What micro-batch k differentiates (before mixed-precision loss scaling)."""
        ...

    def report(self, accumulated: Tensor) -> Tensor:
        """The step's loss from this rank's sum of ``value`` over its micro-batches (a collective over dp_cp)."""
        ...

    @property
    def scored(self) -> Tensor | None:
        """After ``report``: the scored items the reported loss is a mean over (a token mean; 0 when none was
        scored and the loss is 0/0), None for a loss that is not a token mean."""
        ...


class _Scale(torch.autograd.Function):
    """``value * scale`` for a 0-dim ``scale`` that needs no gradient, keeping ``scale`` out of autograd's saved
    tensors (a plain multiplication would save it: 4 bytes per micro-batch in flight that the activation
    accounting, ``plait.observe.memory.SavedActivations``, would have to count)."""

    @staticmethod
    def forward(ctx: Any, value: Tensor, scale: Tensor) -> Tensor:
        ctx.scale = scale
        return value * scale

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


class TokenMeanStep:
    """A ``MeanLoss`` normalised by the global batch's scored-item count (module docstring)."""

    def __init__(
        self, loss: MeanLoss, comm: Comm, targets: Sequence[Tensor], window: int, group: str | None = None
    ) -> None:
        self.loss, self.comm, self.group = loss, comm, group
        counts = torch.stack([loss.count(target).to(torch.int64).reshape(()) for target in targets])
        self.local = counts.sum() if comm.mesh.index("cp") == 0 else torch.zeros_like(counts[0])
        """This data rank's scored tokens (counted once per data rank: on its first cp rank)."""
        if group is None:
            comm.all_reduce(counts, COUNT_AXIS)  # N_k over the data-parallel replicas: one small all-reduce per step
        else:  # semi-synchronous: over one replica group's data ranks (each counted by its cp ranks alike)
            counts = comm.all_reduce(counts, group).div_(comm.size("cp"), rounding_mode="floor")
        self.counts = counts
        self.windows = counts.view(-1, window).sum(dim=1).clamp_min(1)  # N_w of each update window (>= 1)
        self.window = window
        self.replicas = comm.size(GRAD_AXIS if group is None else group)
        self.scored: Tensor | None = None

    def value(self, output: Tensor, target: Tensor) -> Tensor:
        return apply_total(self.loss, output, target)

    def to_backward(self, k: int, value: Tensor) -> Tensor:
        # G / N_w in the loss's dtype, on the device: no host sync (with G = 1 the gradient is 1/N, bitwise what
        # torch's mean reduction backpropagates)
        return _Scale.apply(value, self.replicas / self.windows[k // self.window].to(value.dtype))

    def report(self, accumulated: Tensor) -> Tensor:
        if self.group is not None:  # every group's (S_g, N_g) summed: the token mean over the global batch
            pair = torch.stack([accumulated.to(torch.float64), self.local.to(accumulated.device, torch.float64)])
            self.comm.all_reduce(pair, GRAD_AXIS)
            self.scored = pair[1]
            return (pair[0] / pair[1]).to(accumulated.dtype)
        total = self.comm.all_reduce(accumulated.clone(), GRAD_AXIS)
        self.scored = self.counts.sum()
        return total / self.scored.to(total.dtype)


class MicroMeanStep:
    """Any other loss: micro-batch means of equal weight (module docstring)."""

    scored: Tensor | None = None  # a mean over micro-batches, not over counted items

    def __init__(self, loss_fn: LossFn, comm: Comm, micro_batches: int, window: int) -> None:
        self.loss_fn, self.comm, self.micro_batches, self.window = loss_fn, comm, micro_batches, window

    def value(self, output: Tensor, target: Tensor) -> Tensor:
        return apply_loss(self.loss_fn, output, target)

    def to_backward(self, k: int, value: Tensor) -> Tensor:
        return value / self.window

    def report(self, accumulated: Tensor) -> Tensor:
        return self.comm.all_reduce(accumulated / self.micro_batches, GRAD_AXIS, op="avg")


def step_loss(
    loss_fn: LossFn, comm: Comm, targets: Sequence[Tensor], window: int, group: str | None = None
) -> StepLoss:
    """This step's normalisation for the micro-batches' ``targets``; ``window``: micro-batches per optimizer
    update (all of them, except under PipeDream); ``group``: the axis of one replica group when gradients are
    reduced inside it only (semi-synchronous training), else None (the whole global batch)."""
    if len(targets) % window:
        raise ValueError(f"{len(targets)} micro-batches do not split into update windows of {window}")
    if isinstance(loss_fn, MeanLoss):
        return TokenMeanStep(loss_fn, comm, targets, window, group)
    return MicroMeanStep(loss_fn, comm, len(targets), window)


__all__ = ["COUNT_AXIS", "MicroMeanStep", "StepLoss", "TokenMeanStep", "step_loss"]
