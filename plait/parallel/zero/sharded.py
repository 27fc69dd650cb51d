"""ZeRO-1 and ZeRO-2: optimizer states (and gradients) sharded over the data-parallel ranks.

ZeRO-DP (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models")
removes the redundancy of data parallelism's model states. With P parameters on N ranks and an optimizer with
K bytes of state per parameter (fp32 Adam: master copy 4 + momentum 4 + variance 4):

- stage 1 (P_os): each rank keeps the optimizer state and the fp32 master weights of 1/N of the flat parameter
  space: K P / N bytes instead of K P. Gradients are whole during backward.
- stage 2 (P_os+g): gradients too: each bucket of gradients is reduce-scattered as soon as backward has
  produced it and its full copy is freed, so a rank ends backward holding 4 P / N bytes of gradient.

Parameters stay whole (replicated) on every rank for forward and backward. One step on rank r::

    backward                                   grads g (full, local)           ZeRO-2: bucket by bucket, async
    reduce-scatter(avg) of the flat gradient   -> g_r = mean over ranks of g[shard r]
    (clip by the global norm: sqrt(all-reduce of sum_r |g_r|^2))
    optimizer.step() on the master shard m_r   (fp32; on the CPU with offload)
    all-gather of the updated shards           -> every rank's parameters = concat_r m_r

An all-reduce is a reduce-scatter followed by an all-gather, so each rank sends (N-1)/N x P x b bytes for the
reduce-scatter and the same for the all-gather: 2(N-1)/N x P x b, the volume of plain data parallelism (paper,
sec. 7.2.1), here measured in ``StepStats.comm``.

The optimizer is built by calling the user's factory on this rank's master shards (one fp32 ``nn.Parameter``
per bucket), so any torch.optim optimizer works, with two limits:

- the factory sees shard tensors, not the model's parameters: parameter groups (e.g. no weight decay for norms
  and biases) come from ``parallelize(..., param_groups=...)``, which lays each bucket out group after group and
  hands the factory one view of the shard per group (``plait.parallel.param_groups``). An optimizer already
  built on ``model.parameters()`` is refused (it would hold the full parameters).
- elementwise optimizers (SGD, Adam, AdamW, Adagrad, RMSprop, ...) take exactly the step of single-device
  training; optimizers with per-tensor statistics (LAMB, LARS, Adafactor, Shampoo, Muon) would compute them per
  shard, a different algorithm: torch.optim's are refused (``plait.parallel.zero.optimizers``) unless passed as a
  ``WholeTensorOptimizer``, whose parameters go into tensor-atomic buckets (``owned_buckets``: each parameter whole
  on one owner, docs/optimizers.md).

Gradient accumulation: inside ``no_sync()`` backward accumulates full gradients in ``param.grad`` without
communication (under ZeRO-2 too, as DeepSpeed does: accumulating sharded gradients would need a
reduce-scatter per micro-batch), so the full-gradient memory is held until the synced backward reduces it.
After ``finish_backward`` no ``param.grad`` of the model is held under either stage; the reduced shard
gradients are the master shards' ``.grad`` (``owned_grads``).

HSDP (``Layout.dp_replicate`` = R > 1, docs/zero.md): ``axis`` is ``shard``, one replica group of N = dp/R x cp
ranks; each reduced shard is then averaged over ``replicate`` (R ranks), so a rank sends (N-1)/N x P x b
(reduce-scatter) + 2(R-1)/R x P/N x b (all-reduce of its shard) + (N-1)/N x P x b (all-gather) per step.

Offload ("cpu"/"nvme", ``plait.parallel.zero.offload``): master shards and optimizer states live in host memory
or in memory-mapped files; the step runs on the CPU.

One rank (dp=1) without offload, fp32 parameters: the "shard" is the whole flat buffer and the master would be
a second full fp32 copy of the parameters, so the parameters become views of the master instead
(``ShardBucket.alias_params``): the optimizer's in-place step updates them and publishing copies nothing. The
model states held are then those of plain data parallelism (``plait.measure_held``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from plait.comm import Comm
from plait.layout import Layout
from plait.logging import get_logger
from plait.parallel.param_groups import GroupOf
from plait.parallel.precision import cast_for_reduction
from plait.parallel.strategy import GRAD_AXIS, OptimizerFactory, reduce_axis, reduce_scale
from plait.parallel.zero.base import FlatBuffer, ShardedStrategy
from plait.parallel.zero.shard_buckets import ShardBucket, check_reducible, master_dtype, owned_buckets, plan_buckets

log = get_logger(__name__)


class ShardedOptimizerStrategy(ShardedStrategy):
    """ZeRO stage ``layout.zero`` (1 or 2) over ``axis``, with optional offload (``layout.offload``)."""

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        optimizer: OptimizerFactory | torch.optim.Optimizer,
        layout: Layout | None = None,
        axis: str = GRAD_AXIS,
        offload_dir: str | None = None,
        param_groups: GroupOf | None = None,
    ) -> None:
        layout = layout or Layout(zero=1).resolve(comm.mesh.world_size)
        if layout.zero not in (1, 2):
            raise ValueError(f"ShardedOptimizerStrategy runs ZeRO stage 1 or 2, not zero={layout.zero}")
        super().__init__(model, comm, optimizer, layout, axis, offload_dir, param_groups)
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters (requires_grad=True); there is nothing to shard")
        self.params = [p for _, p in named]
        group = comm.mesh.group(axis)
        if group is not None:
            check_reducible(named, dist.get_backend(group), comm.device.type)

        cap = None if self.stage == 1 else layout.bucket_mb * 2**20
        group_ids = self._plan_groups(named)
        even = [i for i, (_, p) in enumerate(named) if id(p) not in self._whole_ids]
        axes: list[str | None] = [reduce_axis(named[i][1], axis) for i in even]  # expert slices: over edp
        sharding = {a: (comm.size(a), comm.mesh.index(a)) for a in axes if a is not None}
        self.buckets: list[ShardBucket] = plan_buckets(
            [named[i] for i in even], self.world, self.index, cap, [group_ids[i] for i in even], axes, sharding
        )  # a WholeTensorOptimizer's parameters: tensor-atomic buckets, one per dtype, each owned whole by one rank
        self.buckets += owned_buckets(
            [item for item in named if id(item[1]) in self._whole_ids], self, len(self.buckets)
        )
        for bucket in self.buckets:
            bucket.master = self._make_master(bucket.shard_values(master_dtype(bucket.dtype)), f"master{bucket.index}")
            if bucket.layout.shards == 1 and not self.placement.offloaded and bucket.master.dtype == bucket.dtype:
                bucket.alias_params()  # one rank owns everything: the parameters are views of the master
        self._by_dtype: dict[tuple[torch.dtype, str], list[ShardBucket]] = {}
        for bucket in self.buckets:
            self._by_dtype.setdefault((bucket.dtype, bucket.axis or self.axis), []).append(bucket)
        self._where = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._next = 0
        """Buckets [0, _next) have had their reduce-scatter issued in this backward (always in bucket order)."""
        self.optimizer = self._build_optimizer(
            [b.master for b in self.buckets],
            [FlatBuffer(b.layout, b.rank, b.master, b.params) for b in self.buckets],
        )
        self._hooks = []
        if self.stage == 2:
            self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        numel = sum(b.layout.numel for b in self.buckets)
        log.info(
            "ZeRO-%d over %s=%d: %d parameters in %d bucket(s), %d per rank (shard), offload=%s",
            self.stage,
            axis,
            self.world,
            numel,
            len(self.buckets),
            sum(b.shard_size for b in self.buckets),
            layout.offload,
        )

    # ----------------------------------------------------------------- backward
    def _on_grad(self, param: torch.Tensor) -> None:
        """ZeRO-2 post-accumulate-grad hook: move the gradient into its bucket, free it, launch ready buckets."""
        if not self._sync or param.grad is None:
            return
        bucket, position = self._where[id(param)]
        if bucket.pending is not None or position in bucket.arrived:
            raise RuntimeError(
                f"ZeRO-2: parameter {bucket.names[position]!r} received a second gradient before finish_backward(). "
                f"Fix: call strategy.finish_backward() after each synced backward (the Engine does), and run the "
                f"other backward passes of an accumulation inside strategy.no_sync()."
            )
        bucket.add_grad(position, param.grad)
        param.grad = None
        if bucket.complete:
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Issue the reduce-scatters of complete buckets, in bucket order (the same order on every rank)."""
        while self._next < len(self.buckets) and self.buckets[self._next].complete:
            self._launch(self.buckets[self._next])

    def _launch(self, bucket: ShardBucket) -> None:
        flat = cast_for_reduction(bucket.take_flat(self.comm.device), self.reduce_dtype)
        bucket.pending = self.comm.reduce_scatter(flat, bucket.axis or self.axis, op="avg", async_op=True)
        self._next = bucket.index + 1

    def finish_backward(self) -> None:
        """Reduce-scatter (average) every bucket not yet issued, wait for all (under HSDP average each shard over
        the replica groups too), and hand each rank its shard's gradient as the master shard's ``.grad``.
        Parameters without a gradient contribute zeros."""
        for bucket in self.buckets[self._next :]:
            for position, param in enumerate(bucket.params):
                if param.grad is not None and position not in bucket.arrived:
                    bucket.add_grad(position, param.grad)
                    param.grad = None
            self._launch(bucket)
        replicas = []
        for bucket in self.buckets:  # HSDP: each shard averaged over the replica groups as soon as it is reduced
            assert bucket.pending is not None
            replicas.append(self.all_reduce_replicas(bucket.pending.wait()))
        for bucket, pending in zip(self.buckets, replicas):
            reduced = pending.wait()
            if bucket.axis not in (None, self.axis):  # expert slices: sum over edp / dp_cp (strategy.reduce_axis)
                reduced = reduced * reduce_scale(self.comm, bucket.axis, self.axis)
            self._receive_grad(bucket.master, reduced)
            bucket.reset()
        self.placement.synchronize()
        self._next = 0

    # ----------------------------------------------------------------- gradients and step
    def owned_grads(self) -> list[torch.Tensor]:
        """This rank's shard gradients (padding elements are zero, so norms over them are exact)."""
        return [b.master.grad for b in self.buckets if b.master.grad is not None]

    def param_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Views of the shard gradients, one per parameter piece in this rank's shard (for tensor-parallel norm
        weights and sequence-parallel sums, which treat tp slices and replicated parameters differently)."""
        pieces = []
        for bucket in self.buckets:
            grad = bucket.master.grad
            if grad is not None:
                for piece in bucket.layout.slices(bucket.rank):
                    pieces.append((bucket.params[piece.index], grad[piece.at : piece.at + piece.end - piece.start]))
        return pieces

    def _publish(self) -> None:
        """All-gather the stepped master shards (one call per dtype) into every rank's parameters."""
        shards = {b.index: self.placement.to_compute(b.master.detach(), b.dtype) for b in self.buckets}
        for bucket, full in self._all_gather(shards):
            bucket.write_params(full)

    def _all_gather(self, shards: dict[int, torch.Tensor]) -> Iterator[tuple[ShardBucket, torch.Tensor]]:
        """All-gather one shard per bucket (in the bucket's dtype, on the compute device), one call per dtype and
        axis; yield each bucket with its whole padded flat buffer."""
        for (_dtype, axis), buckets in self._by_dtype.items():
            rows = self.comm.all_gather(torch.cat([shards[b.index] for b in buckets]), axis)
            rows = rows.view(self.comm.size(axis), -1)  # row r: rank r's shards, bucket after bucket
            column = 0
            for bucket in buckets:
                yield bucket, rows[:, column : column + bucket.shard_size].reshape(-1)
                column += bucket.shard_size

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for param in self.params:
            param.grad = None
        for master in self._owners:
            master.grad = None
        for bucket in self.buckets:
            bucket.reset()
        self._next = 0

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every parameter's reduced gradient, whole, by name: all-gathers the shard gradients (this costs
        communication; it is for checks and debugging, not for training)."""
        shards = {}
        for bucket in self.buckets:
            grad = bucket.master.grad if bucket.master.grad is not None else torch.zeros_like(bucket.master)
            shards[bucket.index] = grad.detach().to(self.comm.device, bucket.dtype)
        out: dict[str, torch.Tensor] = {}
        for bucket, full in self._all_gather(shards):
            for name, view in zip(bucket.names, bucket.layout.views(full)):
                out[name] = view.clone()
        return out

    # ----------------------------------------------------------------- memory
    def _compute_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The model's whole parameters and whatever full gradients they hold now."""
        return {"parameters": list(self.params), "gradients": [p.grad for p in self.params if p.grad is not None]}

    def close(self) -> None:
        """Remove the ZeRO-2 hooks and delete offload files (the strategy cannot train afterwards)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        super().close()
