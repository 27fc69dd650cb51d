"""Contenders and the suites that pair them.

A ``Contender`` builds, on one rank, a ``Trainer`` from the freshly initialised model: ``step(batch)`` runs one
full training step on this rank's share of the global batch and returns ``(loss, wire_bytes)`` (the loss as this
rank sees it; the bytes this rank sent, or None when the contender cannot count them). A ``Suite`` names a pair,
plait first and its torch-native peer (the baseline of the ratios) second, and how to run them.

Pairs: plait DDP vs ``DistributedDataParallel`` (``ddp``), plait ZeRO-1 vs DDP + ``ZeroRedundancyOptimizer``
(``zero1``), plait ZeRO-3 vs ``fully_shard`` (FSDP2, ``zero3``), plait's pipeline vs ``torch.distributed.pipelining``
(GPipe and 1F1B, ``pp``; ZB-V and DualPipeV, ``ppv``, on an 8-block GPT: 2p = 8 chunks at 4 ranks), plait TP vs ``parallelize_module`` (``tp``), ring vs Ulysses vs no context parallelism
(``cp``; torch's ``context_parallel`` does not run on CPU), plait's engine vs a plain loop (``overhead``). The
model-parallel builders are in ``model_parallel.py``.
Every trainer also reports its *model-state bytes* at the optimizer step of one extra, untimed step: the
storages of the parameters, gradients, master weights and optimizer states it holds (DTensors by their local
shard), counted the same way for both contenders (``plait.observe.memory.storage_bytes``).

To add a pair: write two ``build_*`` functions, register them in ``CONTENDERS``, add a ``Suite`` with the
theoretical bytes per step for that paradigm (or give each contender its own ``theory``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

import plait
from benchmarks import model_parallel as mp
from benchmarks.trainer import Builder, Contender, Probe, StepOut, Trainer, plait_trainer, torch_held  # noqa: F401
from benchmarks.workload import Batch, Workload
from plait.models import GPTConfig, lm_loss

PP_THEORY = "G T d x 4 B (rank 0: each micro-batch's activation)"
PPV_THEORY = "2 G T d x 4 B (rank 0: each micro-batch's activation and, holding the last stage, its gradient)"
TP_THEORY = "2(t-1)/t x ((4L+2) G T d x 4 + 12 G T) B"


# ----------------------------------------------------------------------------------------------- builders
def _build_plait(model: nn.Module, workload: Workload, world: int, zero: int) -> Trainer:
    """``plait.parallelize(model, Layout(dp=world, zero=zero))`` and ``Engine.train_step``."""
    layout = plait.Layout(dp=world, zero=zero) if world > 1 else plait.Layout(zero=zero)
    full = None
    if zero == 3:  # collective gather of the shards
        full = lambda engine: lambda: list(engine.strategy.full_parameters().values())  # noqa: E731
    return plait_trainer(model, workload, layout, full)


def build_plait(model: nn.Module, workload: Workload, rank: int, world: int) -> Trainer:
    """plait data parallel (DDP; no process group at world 1)."""
    return _build_plait(model, workload, world, zero=0)


def build_plait_zero1(model: nn.Module, workload: Workload, rank: int, world: int) -> Trainer:
    """plait ZeRO-1: optimizer states and fp32 master shards over the ranks (reduce-scatter + all-gather)."""
    return _build_plait(model, workload, world, zero=1)


def build_plait_zero3(model: nn.Module, workload: Workload, rank: int, world: int) -> Trainer:
    """plait ZeRO-3: parameters too, gathered per block with prefetch (FSDP-style)."""
    return _build_plait(model, workload, world, zero=3)


def _torch_loop(
    module: nn.Module, workload: Workload, probe: Probe, optimizer: torch.optim.Optimizer | None = None
) -> Callable[[Batch], StepOut]:
    """The plain PyTorch step: forward, loss, backward, clip, optimizer step, zero_grad; the loss as a float.
    ``optimizer``: AdamW over ``module``'s parameters unless given (e.g. a ZeroRedundancyOptimizer)."""
    optimizer = optimizer if optimizer is not None else workload.optimizer(module.parameters())
    params = [p for p in module.parameters() if p.requires_grad]

    def step(batch: Batch) -> StepOut:
        inputs, targets = batch
        loss = lm_loss(module(inputs), targets)
        loss.backward()
        if workload.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(params, workload.max_grad_norm)
        probe.take(lambda: torch_held(params, optimizer))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item(), None

    return step


def build_torch_loop(model: nn.Module, workload: Workload, rank: int, world: int) -> Trainer:
    """The plain single-process PyTorch training loop (the reference for plait's per-step overhead)."""
    if world != 1:
        raise ValueError(f"the plain torch loop runs in one process, not {world}: use it in a world-size-1 suite")
    probe = Probe()
    return Trainer(_torch_loop(model, workload, probe), model, probe=probe)


def _ddp_buckets(ddp: torch.nn.parallel.DistributedDataParallel) -> list[int]:
    """DDP's own bucket sizes, as rebuilt after the first step (its reducer's logging data; private, so guarded)."""
    try:
        data = ddp._get_ddp_logging_data()
        sizes = str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes", ""))
        return [int(size) for size in sizes.split(",") if size.strip()]
    except Exception:  # noqa: BLE001 - an optional figure; the benchmark stands without it
        return []


def build_torch_ddp(model: nn.Module, workload: Workload, rank: int, world: int) -> Trainer:
    """``torch.nn.parallel.DistributedDataParallel`` with its defaults: 25 MiB buckets (a 1 MiB first one once it
    rebuilds them after the first step), all-reduced asynchronously while backward runs."""
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ring = 2.0 * (world - 1) / world

    def info() -> dict[str, Any]:
        buckets = _ddp_buckets(ddp)
        return {"bucket_bytes": buckets, "wire_bytes_per_step": ring * sum(buckets)} if buckets else {}

    probe = Probe()
    return Trainer(_torch_loop(ddp, workload, probe), model, info, probe)


def build_torch_zero1(model: nn.Module, workload: Workload, rank: int, world: int) -> Trainer:
    """DDP + ``torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)``: gradients all-reduced whole, each rank
    steps the parameters it owns (whole tensors, assigned greedily by size) and broadcasts them to the others.
    Bytes (ring model): DDP's buckets x 2(N-1)/N plus the broadcasts, counted as an all-gather, (N-1)/N x 4P."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = ZeroRedundancyOptimizer(
        list(model.parameters()), optimizer_class=torch.optim.AdamW, **workload.optimizer_kwargs
    )
    ring = (world - 1) / world
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def info() -> dict[str, Any]:
        buckets = _ddp_buckets(ddp)
        if not buckets:
            return {}
        return {"bucket_bytes": buckets, "wire_bytes_per_step": 2 * ring * sum(buckets) + ring * param_bytes}

    probe = Probe()
    return Trainer(_torch_loop(ddp, workload, probe, optimizer), model, info, probe)


def build_torch_fsdp2(model: nn.Module, workload: Workload, rank: int, world: int) -> Trainer:
    """``torch.distributed.fsdp.fully_shard`` (FSDP2) on each block, then on the root, over a 1-D CPU mesh; AdamW
    on the DTensor parameters; ``clip_grad_norm_`` on DTensors. Bytes (ring model, dim-0 padding per parameter):
    each block all-gathered in forward and backward and its gradient reduce-scattered, 3(N-1)/N; the root is not
    resharded after forward (FSDP2's default for the root), 2(N-1)/N."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sizes = {name: (p.shape, p.element_size()) for name, p in model.named_parameters()}
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    probe = Probe()
    step = _torch_loop(model, workload, probe)

    def padded_bytes(shape: torch.Size, element: int) -> int:
        rows = -(-shape[0] // world) * world
        return rows * (shape.numel() // shape[0]) * element

    moves = sum((3 if name.startswith("blocks.") else 2) * padded_bytes(*size) for name, size in sizes.items())

    def info() -> dict[str, Any]:
        return {"wire_bytes_per_step": (world - 1) / world * moves}

    def full_params() -> list[torch.Tensor]:
        return [p.full_tensor() for p in model.parameters()]

    return Trainer(step, model, info, probe, full_params)


CONTENDERS: dict[str, Contender] = {
    contender.name: contender
    for contender in (
        Contender("plait", build_plait, "plait.parallelize(model, Layout(dp=N)); engine.train_step(batch)"),
        Contender("torch DDP", build_torch_ddp, "DistributedDataParallel(model); forward, loss, backward, step"),
        Contender("torch loop", build_torch_loop, "plain loop: forward, loss, backward, clip, step, zero_grad"),
        Contender("plait ZeRO-1", build_plait_zero1, "plait.parallelize(model, Layout(dp=N, zero=1))"),
        Contender("torch ZeRO-1", build_torch_zero1, "DDP + ZeroRedundancyOptimizer(optimizer_class=AdamW)"),
        Contender("plait ZeRO-3", build_plait_zero3, "plait.parallelize(model, Layout(dp=N, zero=3))"),
        Contender("torch FSDP2", build_torch_fsdp2, "fully_shard(block) for each block, fully_shard(model)"),
        Contender(
            "plait GPipe",
            mp.build_plait_pp("gpipe"),
            "plait.parallelize(model, Layout(pp=N, schedule='gpipe', microbatches=m))",
            "whole",
            mp.pipeline_bytes,
            PP_THEORY,
        ),
        Contender(
            "torch GPipe",
            mp.build_torch_pp("gpipe"),
            "PipelineStage(stage r of the GPT cut by hand) + ScheduleGPipe(stage, m, loss_fn)",
            "whole",
            mp.pipeline_bytes,
            PP_THEORY,
        ),
        Contender(
            "plait 1F1B",
            mp.build_plait_pp("1f1b"),
            "plait.parallelize(model, Layout(pp=N, schedule='1f1b', microbatches=m))",
            "whole",
            mp.pipeline_bytes,
            PP_THEORY,
        ),
        Contender(
            "torch 1F1B",
            mp.build_torch_pp("1f1b"),
            "PipelineStage(stage r of the GPT cut by hand) + Schedule1F1B(stage, m, loss_fn)",
            "whole",
            mp.pipeline_bytes,
            PP_THEORY,
        ),
        *(
            Contender(
                f"{side} {label}",
                (mp.build_plait_pp if side == "plait" else mp.build_torch_pp)(schedule),
                f"plait.parallelize(model, Layout(pp=N, schedule={schedule!r}, microbatches=m)): 2 chunks per rank"
                if side == "plait"
                else f"2 PipelineStages per rank (stages r and 2N-1-r of the GPT cut by hand) + {torch_class}",
                "whole",
                mp.pipeline_v_bytes,
                PPV_THEORY,
            )
            for schedule, label, torch_class in (
                ("zb-v", "ZB-V", "ScheduleZBVZeroBubble"),
                ("dualpipev", "DualPipeV", "ScheduleDualPipeV"),
            )
            for side in ("plait", "torch")
        ),
        Contender(
            "plait TP",
            mp.build_plait_tp,
            "plait.parallelize(model, Layout(tp=N)): Megatron 1D, vocab-parallel cross-entropy",
            "whole",
            mp.tensor_bytes,
            TP_THEORY,
        ),
        Contender(
            "torch TP",
            mp.build_torch_tp,
            "parallelize_module(model, mesh, Colwise/RowwiseParallel plan) + loss_parallel()",
            "whole",
            mp.tensor_bytes,
            TP_THEORY,
        ),
        Contender(
            "plait cp ring",
            mp.build_plait_cp("ring"),
            "plait.parallelize(model, Layout(cp=N, cp_mode='ring')): zigzag ring attention",
            "whole",
            mp.ring_cp_bytes,
            "2(N-1)/N x 4P + L x 6(N-1) x B T/N d x 4 B",
        ),
        Contender(
            "plait cp Ulysses",
            mp.build_plait_cp("ulysses"),
            "plait.parallelize(model, Layout(cp=N, cp_mode='ulysses')): all-to-all over heads",
            "whole",
            mp.ulysses_cp_bytes,
            "2(N-1)/N x 4P + L x 2(N-1)/N x B T/N 4d x 4 B",
        ),
        Contender(
            "plait dp (no cp)", build_plait, "plait.parallelize(model, Layout(dp=N)): whole sequences, G/N per rank"
        ),
    )
}


# ----------------------------------------------------------------------------------------------- suites
def ring_all_reduce_bytes(num_params: int, world: int) -> float:
    """Bytes one rank sends per step when fp32 gradients are all-reduced in a ring: 2(N-1)/N x P x 4."""
    return 2.0 * (world - 1) / world * num_params * 4


def zero3_bytes(num_params: int, world: int) -> float:
    """ZeRO-3 (paper, sec. 7.2.2): all-gather in forward and backward plus a reduce-scatter: 3(N-1)/N x P x 4."""
    return 3.0 * (world - 1) / world * num_params * 4


def no_bytes(num_params: int, world: int) -> float:
    """A single process sends nothing."""
    return 0.0


@dataclass(frozen=True)
class Suite:
    """A pair to compare: ``contenders[0]`` is plait, ``contenders[1]`` the torch-native baseline.

    ``interleave="process"``: every round launches fresh processes for one contender (peak RSS is then that
    contender's own), in the order A B B A A B ... so that drift hits both alike. ``interleave="block"``: one
    process holds both and alternates blocks of ``steps`` steps (finer drift cancelling; RSS is shared).
    """

    name: str
    contenders: tuple[str, ...]
    title: str
    worlds: tuple[int, ...] = (2, 4)
    """The world sizes ``--suite all`` runs it at (``--world`` picks one for the distributed suites)."""
    min_world: int = 1
    fixed_world: bool = False
    interleave: Literal["process", "block"] = "process"
    steps: int = 10
    warmup: int = 3
    rounds: int = 4
    workload: Workload = field(default_factory=Workload)
    theory: Callable[[int, int], float] = ring_all_reduce_bytes
    theory_text: str = "2(N-1)/N x P x 4 B"
    baselines: tuple[tuple[str, str], ...] = ()
    """(contender, its baseline) pairs where the suite holds more than a pair; by default every contender is
    measured against the last one."""
    saved_activations: bool = False
    """Also count the bytes autograd saves for backward in the probe step (plain-tensor contenders only)."""

    def baseline_of(self, name: str) -> str:
        """The contender that ``name``'s ratios are taken against."""
        return name if self.is_baseline(name) else dict(self.baselines).get(name, self.contenders[-1])

    def is_baseline(self, name: str) -> bool:
        return name == self.contenders[-1] if not self.baselines else name in dict(self.baselines).values()


SUITES: dict[str, Suite] = {
    suite.name: suite
    for suite in (
        Suite(
            "ddp",
            ("plait", "torch DDP"),
            "Data parallel: plait vs DistributedDataParallel",
            min_world=2,
            interleave="process",
            steps=15,
            warmup=3,
            rounds=6,
            workload=Workload(global_batch=16),
        ),
        Suite(
            "zero1",
            ("plait ZeRO-1", "torch ZeRO-1"),
            "ZeRO-1: plait vs DDP + ZeroRedundancyOptimizer",
            min_world=2,
            interleave="process",
            steps=15,
            warmup=3,
            rounds=6,
            workload=Workload(global_batch=16),
        ),
        Suite(
            "zero3",
            ("plait ZeRO-3", "torch FSDP2"),
            "ZeRO-3: plait vs fully_shard (FSDP2)",
            min_world=2,
            interleave="process",
            steps=15,
            warmup=3,
            rounds=6,
            workload=Workload(global_batch=16),
            theory=zero3_bytes,
            theory_text="3(N-1)/N x P x 4 B",
        ),
        Suite(
            "pp",
            ("plait GPipe", "torch GPipe", "plait 1F1B", "torch 1F1B"),
            "Pipeline: plait vs torch.distributed.pipelining (GPipe and 1F1B)",
            min_world=2,
            interleave="process",
            steps=10,
            warmup=3,
            rounds=4,
            workload=Workload(global_batch=16, microbatches=8),
            baselines=(("plait GPipe", "torch GPipe"), ("plait 1F1B", "torch 1F1B")),
        ),
        Suite(
            "ppv",
            ("plait ZB-V", "torch ZB-V", "plait DualPipeV", "torch DualPipeV"),
            "V-shaped pipelines: plait vs torch.distributed.pipelining (ZB-V and DualPipeV)",
            min_world=2,
            interleave="process",
            steps=10,
            warmup=3,
            rounds=4,
            workload=Workload(
                model=GPTConfig(vocab_size=256, seq_len=128, n_layer=8, n_head=4, d_model=128),
                global_batch=16,
                microbatches=8,
            ),
            baselines=(("plait ZB-V", "torch ZB-V"), ("plait DualPipeV", "torch DualPipeV")),
        ),
        Suite(
            "tp",
            ("plait TP", "torch TP"),
            "Tensor parallel: plait vs parallelize_module + loss_parallel",
            worlds=(2,),
            min_world=2,
            interleave="process",
            steps=15,
            warmup=3,
            rounds=6,
            workload=Workload(global_batch=16),
        ),
        Suite(
            "cp",
            ("plait cp ring", "plait cp Ulysses", "plait dp (no cp)"),
            "Context parallel: ring vs Ulysses vs no cp (dp) at the same global batch and sequence length",
            worlds=(4,),
            min_world=2,
            interleave="process",
            steps=10,
            warmup=3,
            rounds=4,
            workload=Workload(global_batch=16),
            saved_activations=True,
        ),
        Suite(
            "overhead",
            ("plait", "torch loop"),
            "Engine overhead at world size 1: plait vs a plain PyTorch loop",
            worlds=(1,),
            fixed_world=True,
            interleave="block",
            steps=5,
            warmup=3,
            rounds=20,
            workload=Workload(global_batch=8),
            theory=no_bytes,
            theory_text="0 (one process)",
        ),
    )
}
