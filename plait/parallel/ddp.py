"""Data parallelism: replicas see different samples; gradients are averaged before each optimizer step.

With N replicas each computing the mean loss of B/N samples, the average of their gradients is the gradient
of the mean loss over all B samples:  (1/N) sum_r grad L_r = grad (1/B) sum_i l_i  (equal shares). So after the
average every replica takes the same step as single-device training on the whole batch.

The plain version (one flat all-reduce after backward) is ``DataParallelStrategy`` itself
(plait/parallel/strategy.py); ``DistributedDataParallel`` here overlaps bucketed all-reduces with backward
(Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel Training").
"""

from __future__ import annotations

import torch
from torch import nn

from plait.comm import Comm
from plait.comm.collectives import Pending
from plait.layout import Layout
from plait.logging import get_logger
from plait.parallel.buckets import Bucket, build_buckets, check_reducible
from plait.parallel.param_groups import GroupOf
from plait.parallel.precision import cast_for_reduction
from plait.parallel.strategy import (
    GRAD_AXIS,
    DataParallelStrategy,
    OptimizerFactory,
    reduce_axis,
    reduce_scale,
)

logger = get_logger(__name__)

"""Set to 1 to turn on ``find_unused_parameters`` where the strategy is built for you (``plait.parallelize``)."""


def broadcast_parameters(module: nn.Module, comm: Comm, axis: str = GRAD_AXIS) -> None:
    """Make every replica start from the weights of the replica at index 0 of ``axis`` (parameters and buffers);
    over dp_cp an expert slice is broadcast over ``edp``, the ranks holding the same experts
    (``plait.parallel.strategy.reduce_axis``)."""
    for tensor in list(module.parameters()) + list(module.buffers()):
        comm.broadcast(tensor.data, reduce_axis(tensor, axis) if axis == GRAD_AXIS else axis, src=0)


class DistributedDataParallel(DataParallelStrategy):
    """Bucketed gradient averaging that overlaps communication with backward.

    Gradients are packed into flat buckets of at most ``layout.bucket_mb`` MiB (``plait.parallel.buckets``).
    A ``register_post_accumulate_grad_hook`` on every trainable parameter counts the gradients of the synced
    backward as they arrive; when a bucket's last gradient is in, its all-reduce (avg over ``axis``) is issued
    asynchronously while autograd goes on computing the earlier layers' gradients. ``finish_backward`` waits
    for every bucket. Per step each rank sends 2(N-1)/N x P x bytes(dtype) in ring terms, the same as one
    flat all-reduce, in ``len(buckets)`` calls.

    Buckets are launched in index order only (a ready bucket waits for the ones before it), as torch's DDP
    does: every rank then issues the same collectives in the same order even if its gradients arrive in
    another order, which the backends require.

    Gradients as bucket views: after a parameter's first gradient of a step arrives, the hook copies it into
    the parameter's slice of the bucket and makes ``param.grad`` a view of that slice. Later micro-batches
    accumulate into the view in place (autograd adds into an existing ``.grad``), the all-reduce averages the
    buffer in place, and the optimizer, clipping and loss scaling read and write the reduced values directly:
    no copy back and one set of gradient memory. ``zero_grad`` keeps set-to-None semantics (the next step's
    first gradient is copied in again: one copy per parameter per step) rather than pre-assigning zeroed
    views, because optimizers skip parameters whose ``.grad`` is None (the reference behaviour for unused
    parameters) and torch.distributed.checkpoint refuses to initialise optimizer state while gradients exist.

    Unused parameters: a parameter without a gradient leaves its bucket incomplete. By default
    ``finish_backward`` raises, naming it. With ``find_unused_parameters`` every bucket carries one "used"
    slot per parameter; missing gradients are sent as zeros, and a parameter no rank used keeps
    ``grad=None`` (so the optimizer skips it, as on one device), while one used by some ranks gets
    (sum of the ranks' gradients) / N. Parameters with ``requires_grad=False`` are not bucketed at all.
    """

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        optimizer: OptimizerFactory | torch.optim.Optimizer,
        layout: Layout | None = None,
        axis: str = GRAD_AXIS,
        *,
        find_unused_parameters: bool = False,
        param_groups: GroupOf | None = None,
    ) -> None:
        """``find_unused_parameters``: parameters that get no gradient in a step count as zeros instead of being
        refused (``plait.parallelize`` defaults it from ``PLAIT_FIND_UNUSED_PARAMETERS``)."""
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        distributed = comm.size(axis) > 1
        if distributed:  # refuse before any work (the optimizer is built by the base class)
            self._check(model, named, comm, axis)
        super().__init__(model, comm, optimizer, layout, axis, param_groups)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.buckets: list[Bucket] = []
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        if not distributed:
            return  # nothing to average: gradients stay as autograd leaves them
        axes: list[str | None] = [reduce_axis(p, axis) for _, p in named]
        self.buckets = build_buckets(named, self.layout.bucket_mb * 2**20, self.find_unused_parameters, axes)
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, slot)
        for bucket in self.buckets:
            for slot, param in enumerate(bucket.params):
                self._where[id(param)] = (bucket.index, slot)
                self._hooks.append(param.register_post_accumulate_grad_hook(self._on_grad_ready))
        self._reset()
        logger.info(
            "DDP over '%s' (%d ranks): %d buckets of <= %g MiB (%s bytes), find_unused_parameters=%s",
            axis,
            comm.size(axis),
            len(self.buckets),
            self.layout.bucket_mb,
            ", ".join(str(b.grad_bytes) for b in self.buckets),
            self.find_unused_parameters,
        )

    @staticmethod
    def _check(model: nn.Module, named: list[tuple[str, nn.Parameter]], comm: Comm, axis: str) -> None:
        """Refuse what buckets cannot carry: dtypes the backend cannot reduce, sparse gradients."""
        group = comm.mesh.group(axis)
        backend = torch.distributed.get_backend(group) if group is not None else None
        check_reducible(named, backend, comm.device.type)
        for name, module in model.named_modules():
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse and module.weight.requires_grad:
                raise TypeError(
                    f"{name or type(module).__name__} has sparse=True: its sparse gradients cannot go into a dense "
                    f"DDP bucket. Fix: build it with sparse=False."
                )

    def _reset(self) -> None:
        """Forget the current step's bookkeeping (after finish_backward, or zero_grad)."""
        self._ready = [[False] * len(b.params) for b in self.buckets]
        self._missing = [len(b.params) for b in self.buckets]
        self._pending: list[Pending | None] = [None] * len(self.buckets)
        self._next = 0  # the first bucket not yet launched

    def remove_hooks(self) -> None:
        """Detach from the model (its parameters then accumulate gradients without any communication)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    # ----------------------------------------------------------------- backward
    def _adopt(self, bucket: Bucket, slot: int) -> None:
        """Make ``param.grad`` the bucket view, copying a fresh gradient into it (first arrival of a step)."""
        param, view = bucket.params[slot], bucket.views[slot]
        grad = param.grad
        if grad is not None and grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
            param.grad = view

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        """Post-accumulate hook: take the gradient into its bucket; in a synced backward, maybe launch."""
        b, slot = self._where[id(param)]
        bucket = self.buckets[b]
        if self._pending[b] is not None or (self._sync and self._ready[b][slot]):
            raise RuntimeError(
                f"the gradient of {bucket.names[slot]} arrived after its bucket was already reduced this step: "
                f"only the last backward before finish_backward() may run outside strategy.no_sync()."
            )
        self._adopt(bucket, slot)
        if not self._sync:
            return
        self._ready[b][slot] = True
        self._missing[b] -= 1
        while self._next < len(self.buckets) and self._missing[self._next] == 0:
            self._launch(self._next)

    def _launch(self, b: int) -> None:
        """Issue bucket ``b``'s asynchronous average (buckets go strictly in index order)."""
        assert b == self._next, f"bucket {b} launched out of order (next is {self._next})"
        bucket = self.buckets[b]
        if bucket.flags is not None:
            for slot, param in enumerate(bucket.params):
                bucket.flags[slot] = 0 if param.grad is None else 1
        buffer = cast_for_reduction(bucket.buffer, self.reduce_dtype)  # a bf16/fp16 copy with reduce_dtype="compute"
        self._pending[b] = self.comm.all_reduce(buffer, bucket.axis or self.axis, op="avg", async_op=True)
        self._next += 1

    def finish_backward(self) -> None:
        """Launch the buckets that backward left incomplete, wait for all, leave averaged views in ``.grad``."""
        if not self.buckets:
            return
        unused = [
            bucket.names[slot]
            for bucket in self.buckets[self._next :]
            for slot, param in enumerate(bucket.params)
            if param.grad is None
        ]
        if unused and not self.find_unused_parameters:
            self._reset()
            raise RuntimeError(
                f"rank {self.comm.mesh.rank}: these parameters got no gradient in this step's backward, so their "
                f"gradient buckets cannot be reduced: {', '.join(unused)}. Fix: if the model skips them on purpose, "
                f"pass find_unused_parameters=True to plait.parallelize (or set PLAIT_FIND_UNUSED_PARAMETERS=1), or "
                f"freeze them with requires_grad_(False); otherwise make sure the loss "
                f"depends on them."
            )
        for b in range(self._next, len(self.buckets)):
            bucket = self.buckets[b]
            for slot, param in enumerate(bucket.params):
                if param.grad is None:
                    bucket.views[slot].zero_()  # contributes zeros; .grad stays None unless another rank used it
                else:
                    self._adopt(bucket, slot)
            self._launch(b)
        for bucket, pending in zip(self.buckets, self._pending):
            assert pending is not None
            reduced = pending.wait()
            if reduced is not bucket.buffer:  # reduced in the compute dtype: back into the fp32 gradient views
                bucket.buffer.copy_(reduced)
            if bucket.axis not in (None, self.axis):  # expert slices: sum over edp / dp_cp (strategy.reduce_axis)
                bucket.buffer.mul_(reduce_scale(self.comm, bucket.axis, self.axis))
        if self.find_unused_parameters:
            for bucket in self.buckets:
                assert bucket.flags is not None
                used = (bucket.flags != 0).tolist()
                for slot, param in enumerate(bucket.params):
                    param.grad = bucket.views[slot] if used[slot] else None
        self._reset()

    def zero_grad(self) -> None:
        super().zero_grad()
        if self.buckets:
            self._reset()
