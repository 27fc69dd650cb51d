"""Losses: the language-model cross-entropy, ``MeanLoss`` (a loss that says what it is a mean over), and
``apply_loss``, which shapes a model's output for any loss.

A causal LM's logits are [B, T, V] and its targets [B, T]; a classifier's are [B, C] and [B]. ``apply_loss``
flattens the first to [B*T, V] against [B*T], so every ``loss_fn(output, target)`` written for the second works
for the first. ``lm_loss`` computes the cross-entropy in fp32 (the logits may be bf16/fp16 under autocast) and
averages over the tokens whose target is not ``ignore_index``.

**Means over the global batch.** One device computes a token-mean loss over the whole global batch B:

    L = sum_{i in B} l_i / N,    N = |{i in B : target_i != ignore_index}|

A parallel step sees B in pieces (micro-batches, data-parallel ranks, context-parallel shards), and the mean of
the pieces' own means is not L when the pieces score different numbers of tokens (padding, prompt masking,
end-of-document masking): the error of the 2024 gradient-accumulation bug of Hugging Face transformers. A
``MeanLoss`` therefore splits itself into a ``total`` (the sum of l_i over a piece, computed by each piece) and a
``count`` (N of a piece, read off its targets alone, so it is known before any forward). plait's Engine adds the
counts of the whole global batch once per step and differentiates each piece's total divided by that global N
(``plait.parallel.loss_normalization``, docs/training.md "Loss normalisation").

A user's loss says "I am a mean over these items" by subclassing ``MeanLoss`` (``total`` and ``count``) or with
``mean_loss(total, count)``. Any other ``loss_fn`` is treated as before: each micro-batch's loss is a mean of
equal weight, averaged over micro-batches and data-parallel ranks, which is exact only when every piece holds
the same number of items. ``torch.nn.functional.cross_entropy`` and a plain ``nn.CrossEntropyLoss`` (mean,
no class weights, no label smoothing) are recognised as token means (``as_mean_loss``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

LossFn = Callable[[Tensor, Tensor], Tensor]
IGNORE_INDEX = -100
"""The target value that scores nothing (torch's cross-entropy default)."""


class MeanLoss:
    """A loss that is a mean over items counted from the target alone: ``loss(output, target) = total(output,
    target) / count(target)``. Subclasses implement ``total`` and ``count``; ``__call__`` is their quotient (what
    evaluation and users see). ``count`` must not depend on the output, so the Engine can add every piece's count
    before the forward passes (module docstring)."""

    def total(self, output: Tensor, target: Tensor) -> Tensor:
        """The sum of the per-item losses (a 0-dim tensor that backpropagates)."""
        raise NotImplementedError

    def count(self, target: Tensor) -> Tensor:
        """The number of items ``total`` sums over (a 0-dim integer tensor on the target's device)."""
        raise NotImplementedError

    def __call__(self, output: Tensor, target: Tensor) -> Tensor:
        total = self.total(output, target)
        return total / self.count(target).to(total.dtype)


class CrossEntropyMean(MeanLoss):
    """Cross-entropy averaged over the targets that are not ``ignore_index``, like
    ``F.cross_entropy(..., reduction="mean")``; ``upcast`` computes it in fp32 (for bf16/fp16 logits)."""

    def __init__(self, ignore_index: int = IGNORE_INDEX, upcast: bool = True) -> None:
        self.ignore_index, self.upcast = ignore_index, upcast

    def _flat(self, output: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        logits = output.reshape(-1, output.shape[-1])
        return (logits.float() if self.upcast else logits), target.reshape(-1)

    def total(self, output: Tensor, target: Tensor) -> Tensor:
        logits, flat = self._flat(output, target)
        return F.cross_entropy(logits, flat, ignore_index=self.ignore_index, reduction="sum")

    def count(self, target: Tensor) -> Tensor:
        return (target != self.ignore_index).sum()

    def __call__(self, output: Tensor, target: Tensor) -> Tensor:
        logits, flat = self._flat(output, target)  # torch's own mean: bitwise what a plain loop computes
        return F.cross_entropy(logits, flat, ignore_index=self.ignore_index)

    def __repr__(self) -> str:
        return f"CrossEntropyMean(ignore_index={self.ignore_index}, upcast={self.upcast})"


class _FunctionMean(MeanLoss):
    def __init__(self, total: LossFn, count: Callable[[Tensor], Tensor]) -> None:
        self._total, self._count = total, count

    def total(self, output: Tensor, target: Tensor) -> Tensor:
        return self._total(output, target)

    def count(self, target: Tensor) -> Tensor:
        return torch.as_tensor(self._count(target), device=target.device)


def mean_loss(total: LossFn, count: Callable[[Tensor], Tensor]) -> MeanLoss:
    """A ``MeanLoss`` from two functions: ``total(output, target)`` (the sum over items) and ``count(target)``
    (how many items), e.g. a masked regression loss::

        loss_fn = mean_loss(lambda out, y: ((out - y) ** 2).nan_to_num().sum(), lambda y: y.isfinite().sum())
    """
    return _FunctionMean(total, count)


lm_loss = CrossEntropyMean(IGNORE_INDEX, upcast=True)
"""Cross-entropy of logits [B, T, V] against targets [B, T], in fp32, averaged over the tokens not equal to -100."""


def as_mean_loss(loss_fn: object) -> MeanLoss | None:
    """``loss_fn`` as a ``MeanLoss`` when it is one (or is torch's mean cross-entropy), else None."""
    if isinstance(loss_fn, MeanLoss):
        return loss_fn
    if loss_fn is F.cross_entropy:
        return CrossEntropyMean(IGNORE_INDEX, upcast=False)
    if (
        type(loss_fn) is nn.CrossEntropyLoss
        and loss_fn.weight is None
        and loss_fn.label_smoothing == 0.0
        and loss_fn.reduction == "mean"
    ):
        return CrossEntropyMean(loss_fn.ignore_index, upcast=False)
    return None


def apply_loss(loss_fn: LossFn, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Call ``loss_fn``, flattening a sequence model's [B, T, C] output and [B, T] target to [B*T, C] and [B*T]."""
    if output.dim() > 2 and output.dim() == target.dim() + 1:
        output, target = output.flatten(0, -2), target.flatten()
    return loss_fn(output, target)


def apply_total(loss: MeanLoss, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``loss.total`` with ``apply_loss``'s flattening."""
    if output.dim() > 2 and output.dim() == target.dim() + 1:
        output, target = output.flatten(0, -2), target.flatten()
    return loss.total(output, target)


__all__ = [
    "IGNORE_INDEX",
    "CrossEntropyMean",
    "LossFn",
    "MeanLoss",
    "apply_loss",
    "apply_total",
    "as_mean_loss",
    "lm_loss",
    "mean_loss",
]
