"""What ``plait.parallelize`` does for tp > 1: check the plan before any collective (``plan_tensor_parallel``),
then swap the layers and choose the loss (``apply_tensor_parallel``).

The loss: when the plan keeps the LM head's logits split over the vocabulary ("colwise_vocab") and the loss
is cross-entropy (``torch.nn.functional.cross_entropy``, plait's ``lm_loss``, or a plain
``nn.CrossEntropyLoss``), the loss becomes vocab-parallel cross-entropy and the full logits never exist in
training. Any other loss gets whole logits (the head all-gathers them), so it works unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch.nn.functional as F
from torch import Tensor, nn

from plait.comm import Comm
from plait.config import Layout
from plait.errors import LayoutError
from plait.models.gpt import lm_loss
from plait.parallel.sequence import check_sequence_parallel
from plait.parallel.tensor.layers import AXIS
from plait.parallel.tensor.loss import IGNORE_INDEX, VocabParallelLoss
from plait.parallel.tensor.plan import Plan, ResolvedPlan, apply_plan, default_plan, resolve_plan

LossFn = Callable[[Tensor, Tensor], Tensor]


def plan_tensor_parallel(model: nn.Module, layout: Layout, plan: Plan | None = None) -> ResolvedPlan | None:
    """None when tp == 1 (a plan given then is an error); otherwise the checked plan (``plan`` or the built-in
    one of the model's class). Pure: the same LayoutError on every rank, before any collective."""
    if layout.tp_mode != "1d":
        raise LayoutError(
            f"tp_mode={layout.tp_mode!r} is not yet available through parallelize: 2D / 2.5D / 3D tensor parallelism "
            f"exists as modules (plait.parallel.tensor.Linear2D / MLP2D, Linear2p5D / MLP2p5D, Linear3D / MLP3D, built "
            f"from nn.Linear on a Mesh of that Layout), not as a parallelize plan. Fix: use tp_mode='1d' with "
            f"parallelize, or build those modules yourself."
        )
    if layout.tp == 1:
        if plan is not None:
            raise LayoutError("tp_plan was given, but the layout has tp=1. Fix: set tp > 1, or leave tp_plan out.")
        return None
    check_sequence_parallel(layout)
    if layout.zero == 3:
        raise LayoutError(
            f"zero=3 with tp={layout.tp} is not supported: ZeRO-3's flat units would mix tensor-parallel slices with "
            f"replicated parameters. Fix: use zero=1 or zero=2 (or zero=0) with tp > 1."
        )
    if getattr(model, "_plait_tensor_parallel", False):
        raise LayoutError("this model already has tensor parallelism applied. Fix: pass a fresh model to parallelize.")
    return resolve_plan(model, plan if plan is not None else default_plan(model), layout.tp, layout.sequence_parallel)


def cross_entropy_ignore_index(loss_fn: object) -> int | None:
    """The ignore_index of a loss that is plain mean cross-entropy over logits (None for any other loss)."""
    if loss_fn is F.cross_entropy or loss_fn is lm_loss:
        return IGNORE_INDEX
    if isinstance(loss_fn, nn.CrossEntropyLoss) and loss_fn.weight is None and loss_fn.label_smoothing == 0.0 \
            and loss_fn.reduction == "mean":
        return loss_fn.ignore_index
    return None


def apply_tensor_parallel(resolved: ResolvedPlan, roots: Iterable[nn.Module], comm: Comm, loss_fn: LossFn) -> LossFn:
    """Swap the planned layers under ``roots`` (the local model first) and return the loss to train with."""
    roots = list(roots)
    ignore_index = cross_entropy_ignore_index(loss_fn)
    vocab_split = ignore_index is not None and "colwise_vocab" in resolved.styles.values()
    # vocab-parallel loss: logits stay split in training and are gathered in evaluation (for metrics)
    apply_plan(resolved, roots, comm, gather_logits="eval" if vocab_split else True)
    for root in roots:
        root._plait_tensor_parallel = True  # type: ignore[attr-defined]
    if not vocab_split:
        return loss_fn
    assert ignore_index is not None
    vocab_paths = [p for p, s in resolved.styles.items() if s == "colwise_vocab"]
    return VocabParallelLoss(comm, _full_vocab(roots, vocab_paths, comm), AXIS, ignore_index)


def _full_vocab(roots: list[nn.Module], paths: list[str], comm: Comm) -> int:
    for root in roots:
        modules = dict(root.named_modules())
        for path in paths:
            if path in modules:
                return modules[path].weight.shape[0] * comm.size(AXIS)
    return -1  # this pipeline rank has no LM head: its loss_fn is never called


__all__ = ["apply_tensor_parallel", "cross_entropy_ignore_index", "plan_tensor_parallel"]
