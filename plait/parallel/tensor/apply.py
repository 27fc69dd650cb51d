"""What ``plait.parallelize`` does for tp > 1: check the plan before any collective (``plan_tensor_parallel``),
then swap the layers and choose the loss (``apply_tensor_parallel``). Megatron 1D plans (``plan``) and, for
``tp_mode`` "2d" / "2.5d" / "3d", grid plans (``grid_plan``) go the same way.

The loss: when the plan keeps the LM head's logits split over the vocabulary ("colwise_vocab") and the loss
is cross-entropy (``torch.nn.functional.cross_entropy``, plait's ``lm_loss``, or a plain
``nn.CrossEntropyLoss``), the loss becomes vocab-parallel cross-entropy and the full logits never exist in
training (on a grid, "grid_vocab": the logits are cut over batch and vocabulary, ``GridVocabLoss``). Any other
loss gets whole logits (the head all-gathers them), so it works unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import Tensor, nn

from plait.comm import Comm
from plait.errors import LayoutError
from plait.layout import Layout, TpMode
from plait.models.loss import ChunkedCrossEntropy, CrossEntropyMean, as_mean_loss
from plait.parallel.tensor.fields import int_field
from plait.parallel.tensor.grid import HEAD_AXIS, GridLinear
from plait.parallel.tensor.grid_plan import apply_grid_plan, default_grid_plan, resolve_grid_plan
from plait.parallel.tensor.layers import AXIS
from plait.parallel.tensor.loss import GridVocabLoss, VocabParallelLoss
from plait.parallel.tensor.plan import Plan, ResolvedPlan, apply_plan, default_plan, resolve_plan
from plait.parallel.tensor.sequence import check_sequence_parallel

LossFn = Callable[[Tensor, Tensor], Tensor]


def plan_tensor_parallel(model: nn.Module, layout: Layout, plan: Plan | None = None) -> ResolvedPlan | None:
    """None when tp == 1 (a plan given then is an error); otherwise the checked plan (``plan`` or the built-in
    one of the model's class). Pure: the same LayoutError on every rank, before any collective."""
    if layout.tp == 1:
        if plan is not None:
            raise LayoutError("tp_plan was given, but the layout has tp=1. Fix: set tp > 1, or leave tp_plan out.")
        return None
    if layout.zero == 3 and layout.tp_mode != TpMode.ONE_D:
        raise LayoutError(
            f"zero=3 with tp={layout.tp} is not supported in tp_mode={layout.tp_mode!r}: ZeRO-3 is proven with Megatron "
            f"1D tensor parallelism only (grid layers keep weights replicated over some of their axes). Fix: use "
            f"tp_mode='1d' with zero=3, or zero=1/2 with tp_mode={layout.tp_mode!r}."
        )
    if getattr(model, "_plait_tensor_parallel", False):
        raise LayoutError("this model already has tensor parallelism applied. Fix: pass a fresh model to parallelize.")
    if layout.tp_mode != TpMode.ONE_D:
        _check_grid_layout(layout)
        return resolve_grid_plan(model, plan if plan is not None else default_grid_plan(model, layout.tp_mode), layout)
    check_sequence_parallel(layout)
    return resolve_plan(
        model,
        plan if plan is not None else default_plan(model),
        layout.tp,
        layout.sequence_parallel,
        layout.tp_pad_vocab,
    )


def _check_grid_layout(layout: Layout) -> None:
    """2D / 2.5D / 3D tensor parallelism combines with dp (and ZeRO-1/2 over it), not yet with pp or cp."""
    for axis, what in (("pp", "pipeline"), ("cp", "context")):
        if getattr(layout, axis) > 1:
            raise LayoutError(
                f"tp_mode={layout.tp_mode!r} with {axis}={getattr(layout, axis)} is not supported: {what} parallelism "
                f"would pass grid-cut activations between ranks that expect whole ones. Fix: use tp_mode='1d' with "
                f"{axis} > 1, or {axis}=1 with tp_mode={layout.tp_mode!r}."
            )


def cross_entropy_ignore_index(loss_fn: object) -> int | None:
    """The ignore_index of a loss that is plain mean cross-entropy over logits (``lm_loss``, torch's
    cross-entropy, a plain ``nn.CrossEntropyLoss``), None for any other loss."""
    mean = as_mean_loss(loss_fn)
    if type(mean) is CrossEntropyMean or type(mean) is ChunkedCrossEntropy:  # chunks are bound later
        return mean.ignore_index
    return None


def apply_tensor_parallel(resolved: ResolvedPlan, roots: Iterable[nn.Module], comm: Comm, loss_fn: LossFn) -> LossFn:
    """Swap the planned layers under ``roots`` (the local model first) and return the loss to train with."""
    roots = list(roots)
    ignore_index = cross_entropy_ignore_index(loss_fn)
    head_style = "colwise_vocab" if comm.mesh.layout.tp_mode == TpMode.ONE_D else "grid_vocab"
    vocab_split = ignore_index is not None and head_style in resolved.styles.values()
    # vocab-parallel loss: logits stay split in training and are gathered in evaluation (for metrics)
    gather_logits = "eval" if vocab_split else True
    if head_style == "grid_vocab":
        apply_grid_plan(resolved, roots[0], comm, gather_logits)
    else:
        apply_plan(resolved, roots, comm, gather_logits=gather_logits)
    for root in roots:
        # torch's stubs type Module.__setattr__'s value as Tensor | Module; a plain attribute is fine at runtime
        root._plait_tensor_parallel = True  # type: ignore[assignment]
    if not vocab_split:
        return loss_fn
    assert ignore_index is not None
    vocab_paths = [p for p, s in resolved.styles.items() if s == head_style]
    if head_style == "grid_vocab":
        head = roots[0].get_submodule(vocab_paths[0])
        assert isinstance(head, GridLinear)  # apply_grid_plan has just swapped it for a grid linear
        batch_axes = tuple(head.output_placement()[0][1])
        return GridVocabLoss(comm, head.out_features, HEAD_AXIS, batch_axes, ignore_index)
    return VocabParallelLoss(comm, _full_vocab(roots, vocab_paths), AXIS, ignore_index)


def _full_vocab(roots: list[nn.Module], paths: list[str]) -> int:
    """The LM head's real vocabulary (without a padded vocabulary's extra rows)."""
    for root in roots:
        modules = dict(root.named_modules())
        for path in paths:
            if path in modules:
                return int_field(modules[path], "out_features")
    return -1  # this pipeline rank has no LM head: its loss_fn is never called


__all__ = ["apply_tensor_parallel", "cross_entropy_ignore_index", "plan_tensor_parallel"]
