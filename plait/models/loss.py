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

**Chunked cross-entropy** (``ChunkedCrossEntropy``): with a large vocabulary the [tokens x V] logits (and, in
backward, their gradient) dominate a step's memory. Given as ``loss_fn``, ``plait.parallelize`` binds it to the
model's LM head (``bind_head_chunks``, after tensor parallelism has swapped the head): in training the head hands
on its input instead of logits, and the loss runs head and cross-entropy over ``chunk`` tokens at a time, each chunk
checkpointed, so only one chunk's logits ever exist, forward and backward (``HeadChunks``). Evaluation gets
whole logits as before.

A user's loss says "I am a mean over these items" by subclassing ``MeanLoss`` (``total`` and ``count``) or with
``mean_loss(total, count)``. Any other ``loss_fn`` is treated as before: each micro-batch's loss is a mean of
equal weight, averaged over micro-batches and data-parallel ranks, which is exact only when every piece holds
the same number of items. ``torch.nn.functional.cross_entropy`` and a plain ``nn.CrossEntropyLoss`` (mean,
no class weights, no label smoothing) are recognised as token means (``as_mean_loss``).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from plait.errors import LayoutError

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


class ChunkedCrossEntropy(CrossEntropyMean):
    """``lm_loss`` whose LM head and cross-entropy run over ``chunk`` tokens at a time (module docstring): pass it
    as ``loss_fn`` to ``plait.parallelize``. On logits (nothing bound) it is plain ``lm_loss``."""

    def __init__(self, chunk: int = 4096, ignore_index: int = IGNORE_INDEX, upcast: bool = True) -> None:
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk={chunk!r} tokens must be a positive integer (e.g. 4096).")
        super().__init__(ignore_index, upcast)
        self.chunk = chunk

    def __repr__(self) -> str:
        return f"ChunkedCrossEntropy(chunk={self.chunk}, ignore_index={self.ignore_index}, upcast={self.upcast})"


def _enter(head: nn.Module, x: Tensor) -> Tensor:
    """What the head does to its input once (a tensor-parallel head: enter the tp region), else ``x``."""
    enter = getattr(head, "enter", None)
    return enter(x) if callable(enter) else x


def _project(head: nn.Module, x: Tensor) -> Tensor:
    """The head's logits of (entered) hidden states ``x``: its own ``project`` (a tensor-parallel head: this
    rank's vocabulary slice), or a Linear's x W^T + b."""
    project = getattr(head, "project", None)
    if callable(project):
        return project(x)
    assert isinstance(head, nn.Linear)  # bind_head_chunks admits nothing else
    return F.linear(x, head.weight, head.bias)


def _deferred_forward(self: nn.Module, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """The forward of a head bound to ``HeadChunks``: in training its entered input (the loss projects it chunk
    by chunk), in evaluation its logits."""
    if self.training:
        return _enter(self, x)
    return type(self).forward(self, x, *args, **kwargs)


class HeadChunks(MeanLoss):
    """A token-mean loss ``inner`` on the logits of ``head``, computed ``chunk`` tokens at a time (module docstring).

    ``total(hidden, target)``: in training the head returns its (entered) input [..., d]; each chunk of tokens is
    projected by the head and scored by ``inner.total`` inside a checkpoint, which keeps for backward only the
    chunk's inputs (views of the hidden states and the targets) and recomputes its logits in backward, so at most
    one chunk's logits (and their gradient) exist at a time. In evaluation the head returns whole logits and
    ``inner`` scores them as usual. ``count`` is ``inner``'s."""

    def __init__(self, head: nn.Module | None, inner: MeanLoss, chunk: int) -> None:
        self.head, self.inner, self.chunk = head, inner, chunk

    def _piece(self, hidden: Tensor, target: Tensor) -> Tensor:
        assert self.head is not None
        return self.inner.total(_project(self.head, hidden), target)

    def total(self, output: Tensor, target: Tensor) -> Tensor:
        if self.head is None or not self.head.training:  # evaluation: whole logits
            return self.inner.total(output, target)
        hidden, flat = output.reshape(-1, output.shape[-1]), target.reshape(-1)
        if hidden.shape[0] != flat.shape[0]:
            raise ValueError(
                f"chunked cross-entropy: {hidden.shape[0]} hidden states for {flat.shape[0]} targets. Fix: the model "
                f"must hand its LM head's input on unchanged (the head is bound by plait.parallelize)."
            )
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, flat.shape[0], self.chunk):
            piece = slice(start, start + self.chunk)
            total = total + checkpoint(
                self._piece, hidden[piece], flat[piece], use_reentrant=False, preserve_rng_state=False
            )
        return total

    def count(self, target: Tensor) -> Tensor:
        return self.inner.count(target)

    def __repr__(self) -> str:
        return f"HeadChunks(chunk={self.chunk}, inner={self.inner!r})"


def check_head_chunks(requested: object, zero: int, tp_mode: str = "1d", tp: int = 1) -> None:
    """LayoutError (pure, before any collective) for a chunked cross-entropy under ZeRO-3 (its root unit, the head,
    is sharded again when the model's forward returns, but the chunks project with the head's weight after it) or
    under 2D/2.5D/3D tensor parallelism (whose head cuts the batch as well as the vocabulary)."""
    if not isinstance(requested, ChunkedCrossEntropy):
        return
    if zero == 3:
        raise LayoutError(
            "chunked cross-entropy (ChunkedCrossEntropy, train.loss_chunk) projects with the LM head's weight after "
            "the model's forward, when ZeRO-3 has sharded it again. Fix: zero=1 or zero=2 with chunks, or lm_loss "
            "(train.loss_chunk=0) with zero=3."
        )
    if tp > 1 and tp_mode != "1d":
        raise LayoutError(
            f"chunked cross-entropy (ChunkedCrossEntropy, train.loss_chunk) projects chunks of tokens with a Linear or "
            f"1D vocab-parallel head, but tp_mode={tp_mode!r} cuts the head's batch as well. Fix: tp_mode='1d' with "
            f"chunks, or lm_loss (train.loss_chunk=0)."
        )


def bind_head_chunks(requested: object, roots: Iterable[nn.Module], loss_fn: LossFn) -> LossFn:
    """``loss_fn`` (the loss chosen so far: ``requested`` itself, or a tensor-parallel loss) as ``HeadChunks``
    over this rank's LM head when ``requested`` is a ``ChunkedCrossEntropy``, else ``loss_fn``. The head is the
    module named ``lm_head`` under ``roots`` (plait's GPT and Hugging Face causal LMs; under pipeline parallelism
    only the last stage's rank has it); it is made to hand its input on in training (parameter names unchanged)."""
    if not isinstance(requested, ChunkedCrossEntropy):
        return loss_fn
    if not isinstance(loss_fn, MeanLoss):
        raise TypeError(f"chunked cross-entropy needs a token-mean loss to score its chunks, got {loss_fn!r}")
    heads = {id(m): m for root in roots for path, m in root.named_modules() if path.rsplit(".", 1)[-1] == "lm_head"}
    if len(heads) > 1:
        raise ValueError("chunked cross-entropy found several modules named lm_head; the model must have one LM head")
    head = next(iter(heads.values()), None)
    if head is not None:
        if not callable(getattr(head, "project", None)) and not isinstance(head, nn.Linear):
            raise ValueError(
                f"chunked cross-entropy projects with the LM head chunk by chunk, but lm_head is a "
                f"{type(head).__name__}. Fix: an nn.Linear head (or a 1D tensor-parallel one), or lm_loss."
            )
        head.forward = types.MethodType(_deferred_forward, head)  # an instance attribute: names stay
    return HeadChunks(head, loss_fn, requested.chunk)


__all__ = [
    "IGNORE_INDEX",
    "ChunkedCrossEntropy",
    "CrossEntropyMean",
    "HeadChunks",
    "bind_head_chunks",
    "check_head_chunks",
    "LossFn",
    "MeanLoss",
    "apply_loss",
    "apply_total",
    "as_mean_loss",
    "lm_loss",
    "mean_loss",
]
