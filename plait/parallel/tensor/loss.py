"""Cross-entropy over vocab-parallel logits, without ever materialising the full [tokens, vocab] logits.

Rank i of t holds z_i = logits[:, V_i] (its 1/t of the vocabulary). Per token, with target y:

    m = max_i max(z_i)                      (all-reduce max; only for stability, not differentiated)
    S = sum_i sum exp(z_i - m)              (all-reduce sum)
    z_y - m = picked by the rank owning y   (others contribute 0 to the same all-reduce sum as S)
    loss = log S - (z_y - m)

and the gradient on the local shard is softmax(z)_i - onehot(y)_i = exp(z_i - m) / S - [y in V_i], scaled by
the upstream gradient: each rank computes exactly its slice of the single-device gradient, with no
communication in backward. Two all-reduces of [tokens] floats forward (max; then S and z_y together), as in
Megatron-LM's vocab-parallel cross-entropy. Tokens whose target is ``ignore_index`` contribute nothing, and
the mean is over the others, like ``torch.nn.functional.cross_entropy``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from plait.comm import Comm, reduce_from
from plait.models.loss import IGNORE_INDEX, MeanLoss
from plait.parallel.tensor.grid import batch_block


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, comm: Comm, axis: str, ignore_index: int) -> Tensor:
        local = logits.float()
        vocab_local = local.shape[-1]
        start = comm.mesh.index(axis) * vocab_local
        maximum = local.max(dim=-1).values  # no grad needed: the shift cancels in log S - (z_y - m)
        comm.all_reduce(maximum, axis, op="max")
        shifted = local - maximum.unsqueeze(-1)
        exp = shifted.exp()
        ignored = targets == ignore_index
        local_targets = targets - start
        mine = (local_targets >= 0) & (local_targets < vocab_local) & ~ignored
        safe_targets = local_targets.masked_fill(~mine, 0)
        picked = shifted.gather(-1, safe_targets.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        sums = torch.stack((exp.sum(dim=-1), picked))  # one all-reduce for S and z_y - m
        comm.all_reduce(sums, axis)
        total, target_logit = sums[0], sums[1]
        loss = (total.log() - target_logit).masked_fill(ignored, 0.0)
        exp.div_(total.unsqueeze(-1))  # the local softmax, kept for backward
        ctx.save_for_backward(exp, safe_targets, mine, ignored)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Any, ...]:
        softmax, safe_targets, mine, ignored = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, safe_targets] -= mine.to(grad.dtype)
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    local_logits: Tensor,
    targets: Tensor,
    comm: Comm,
    axis: str = "tp",
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
) -> Tensor:
    """Cross-entropy of logits split over ``axis`` along the last dim ([..., V/t]) against ``targets`` [...].

    Equal to ``F.cross_entropy(full_logits.flatten(0, -2), targets.flatten(), ignore_index=ignore_index)``
    (reduction "mean" over non-ignored tokens, "sum", or "none" per token) on every rank of the axis."""
    if local_logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"vocab-parallel cross-entropy needs logits [..., V/t] and targets [...] with the same leading shape, got "
            f"{tuple(local_logits.shape)} and {tuple(targets.shape)}"
        )
    per_token = _VocabParallelCrossEntropy.apply(
        local_logits.reshape(-1, local_logits.shape[-1]), targets.reshape(-1), comm, axis, ignore_index
    )
    if reduction == "none":
        return per_token.view(targets.shape)
    if reduction == "sum":
        return per_token.sum()
    if reduction != "mean":
        raise ValueError(f"reduction={reduction!r}: use 'mean', 'sum' or 'none'")
    counted = (targets != ignore_index).sum()
    return per_token.sum() / counted.to(per_token.dtype)


class VocabParallelLoss(MeanLoss):
    """``loss_fn(logits, targets)`` for the Engine: vocab-parallel cross-entropy on ``axis`` for logits split
    over the vocabulary (training), plain cross-entropy for whole logits (``vocab_size`` wide: evaluation,
    where the LM head gathers them for metrics). A token mean (``MeanLoss``): the Engine differentiates its
    ``total`` over the global batch's token count."""

    def __init__(self, comm: Comm, vocab_size: int, axis: str = "tp", ignore_index: int = IGNORE_INDEX) -> None:
        self.comm, self.vocab_size, self.axis, self.ignore_index = comm, vocab_size, axis, ignore_index

    def total(self, logits: Tensor, targets: Tensor) -> Tensor:
        if logits.shape[-1] == self.vocab_size:
            return F.cross_entropy(
                logits.reshape(-1, self.vocab_size).float(),
                targets.reshape(-1),
                ignore_index=self.ignore_index,
                reduction="sum",
            )
        return vocab_parallel_cross_entropy(logits, targets, self.comm, self.axis, self.ignore_index, reduction="sum")

    def count(self, targets: Tensor) -> Tensor:
        return (targets != self.ignore_index).sum()

    def __call__(self, logits: Tensor, targets: Tensor) -> Tensor:
        if logits.shape[-1] == self.vocab_size:
            return F.cross_entropy(
                logits.reshape(-1, self.vocab_size).float(), targets.reshape(-1), ignore_index=self.ignore_index
            )
        return vocab_parallel_cross_entropy(logits, targets, self.comm, self.axis, self.ignore_index)


class GridVocabLoss(MeanLoss):
    """``loss_fn(logits, targets)`` for an LM head on a 2D / 2.5D / 3D grid, whose logits are cut over the batch
    (``batch_axes``) and the vocabulary (``vocab_axis``): this rank's batch block of the (whole) targets,
    vocab-parallel cross-entropy per token over ``vocab_axis``, the token sum all-reduced over the batch axes
    (identity backward: every rank's loss is the same, each backpropagates 1/n into its own block) and divided by
    the number of counted tokens of the whole batch. Whole logits (evaluation) take plain cross-entropy. A token
    mean (``MeanLoss``): ``total`` is that all-reduced sum."""

    def __init__(
        self,
        comm: Comm,
        vocab_size: int,
        vocab_axis: str,
        batch_axes: tuple[str, ...],
        ignore_index: int = IGNORE_INDEX,
    ) -> None:
        self.comm, self.vocab_size, self.vocab_axis, self.batch_axes = comm, vocab_size, vocab_axis, batch_axes
        self.ignore_index = ignore_index

    def total(self, logits: Tensor, targets: Tensor) -> Tensor:
        flat_targets = targets.reshape(-1)
        flat_logits = logits.reshape(-1, logits.shape[-1])
        if flat_logits.shape == (flat_targets.numel(), self.vocab_size):
            return F.cross_entropy(flat_logits.float(), flat_targets, ignore_index=self.ignore_index, reduction="sum")
        local_targets = batch_block(targets, self.comm, self.batch_axes, "grid cross-entropy targets").reshape(-1)
        per_token = vocab_parallel_cross_entropy(
            flat_logits, local_targets, self.comm, self.vocab_axis, self.ignore_index, reduction="none"
        )
        total = per_token.sum()
        for axis in self.batch_axes:
            total = reduce_from(total, self.comm, axis)
        return total

    def count(self, targets: Tensor) -> Tensor:
        return (targets != self.ignore_index).sum()

    def __call__(self, logits: Tensor, targets: Tensor) -> Tensor:
        flat_targets = targets.reshape(-1)
        flat_logits = logits.reshape(-1, logits.shape[-1])
        if flat_logits.shape == (flat_targets.numel(), self.vocab_size):
            return F.cross_entropy(flat_logits.float(), flat_targets, ignore_index=self.ignore_index)
        total = self.total(logits, targets)
        return total / self.count(targets).to(total.dtype)


__all__ = ["IGNORE_INDEX", "GridVocabLoss", "VocabParallelLoss", "vocab_parallel_cross_entropy"]
