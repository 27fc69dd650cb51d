"""Contenders and the suites that pair them.

A ``Contender`` builds, on one rank, a ``Trainer`` from the freshly initialised model: ``step(batch)`` runs one
full training step on this rank's share of the global batch and returns ``(loss, wire_bytes)`` (the loss as this
rank sees it; the bytes this rank sent, or None when the contender cannot count them). A ``Suite`` names a pair,
plait first and its torch-native peer (the baseline of the ratios) second, and how to run them.

To add a pair (ZeRO vs ZeroRedundancyOptimizer, ZeRO-3 vs fully_shard, TP vs DTensor parallelize_module, PP vs
torch.distributed.pipelining): write two ``build_*`` functions, register them in ``CONTENDERS``, add a ``Suite``
with the theoretical bytes per step for that paradigm.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

import plait
from plait.models import lm_loss

from benchmarks.workload import Batch, Workload

StepOut = tuple[float, float | None]
"""What one step returns: (loss as this rank sees it, bytes this rank sent or None)."""


@dataclass
class Trainer:
    """One contender, built on one rank: ``step`` trains one step; ``model`` holds the weights it trains."""

    step: Callable[[Batch], StepOut]
    model: nn.Module
    info: Callable[[], dict[str, Any]] = field(default=lambda: {})
    """Facts known after training (e.g. DDP's bucket sizes), merged into the result row."""


Builder = Callable[[nn.Module, Workload, int, int], Trainer]
"""``build(model, workload, rank, world) -> Trainer``."""


@dataclass(frozen=True)
class Contender:
    """A way to train the workload: a name for the tables, a builder, and one line saying what it runs."""

    name: str
    build: Builder
    what: str


# ----------------------------------------------------------------------------------------------- builders
def build_plait(model: nn.Module, workload: Workload, rank: int, world: int) -> Trainer:
    """``plait.parallelize(model, Layout(dp=world))`` and ``Engine.train_step`` (no process group at world 1)."""
    layout = plait.Layout(dp=world) if world > 1 else plait.Layout()
    engine = plait.parallelize(
        model, layout, optimizer=workload.optimizer, loss_fn=lm_loss, max_grad_norm=workload.max_grad_norm
    )

    def step(batch: Batch) -> StepOut:
        stats = engine.train_step(batch)
        return stats.loss, stats.comm.wire()

    def info() -> dict[str, Any]:
        """plait's gradient buckets, where its data-parallel strategy has them (bytes per bucket)."""
        buckets = getattr(getattr(engine, "strategy", None), "buckets", None) or []
        return {"bucket_bytes": [int(b.grad_bytes) for b in buckets if hasattr(b, "grad_bytes")]}

    return Trainer(step, engine.model, info)


def _torch_loop(module: nn.Module, workload: Workload) -> Callable[[Batch], StepOut]:
    """The plain PyTorch step: forward, loss, backward, clip, optimizer step, zero_grad; the loss as a float."""
    optimizer = workload.optimizer(module.parameters())
    params = [p for p in module.parameters() if p.requires_grad]

    def step(batch: Batch) -> StepOut:
        inputs, targets = batch
        loss = lm_loss(module(inputs), targets)
        loss.backward()
        if workload.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(params, workload.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item(), None

    return step


def build_torch_loop(model: nn.Module, workload: Workload, rank: int, world: int) -> Trainer:
    """The plain single-process PyTorch training loop (the reference for plait's per-step overhead)."""
    if world != 1:
        raise ValueError(f"the plain torch loop runs in one process, not {world}: use it in a world-size-1 suite")
    return Trainer(_torch_loop(model, workload), model)


def build_torch_ddp(model: nn.Module, workload: Workload, rank: int, world: int) -> Trainer:
    """``torch.nn.parallel.DistributedDataParallel`` with its defaults: 25 MiB buckets (a 1 MiB first one once it
    rebuilds them after the first step), all-reduced asynchronously while backward runs."""
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ring = 2.0 * (world - 1) / world

    def info() -> dict[str, Any]:
        """DDP's own bucket sizes, as rebuilt after the first step (its reducer's logging data; private, so guarded)."""
        try:
            data = ddp._get_ddp_logging_data()
            sizes = str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes", ""))
            buckets = [int(size) for size in sizes.split(",") if size.strip()]
        except Exception:  # noqa: BLE001 - an optional figure; the benchmark stands without it
            return {}
        return {"bucket_bytes": buckets, "wire_bytes_per_step": ring * sum(buckets)}

    return Trainer(_torch_loop(ddp, workload), model, info)


CONTENDERS: dict[str, Contender] = {
    contender.name: contender
    for contender in (
        Contender("plait", build_plait, "plait.parallelize(model, Layout(dp=N)); engine.train_step(batch)"),
        Contender("torch DDP", build_torch_ddp, "DistributedDataParallel(model); forward, loss, backward, step"),
        Contender("torch loop", build_torch_loop, "plain loop: forward, loss, backward, clip, step, zero_grad"),
    )
}


# ----------------------------------------------------------------------------------------------- suites
def ring_all_reduce_bytes(num_params: int, world: int) -> float:
    """Bytes one rank sends per step when fp32 gradients are all-reduced in a ring: 2(N-1)/N x P x 4."""
    return 2.0 * (world - 1) / world * num_params * 4


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
    contenders: tuple[str, str]
    title: str
    world: int = 2
    min_world: int = 1
    fixed_world: bool = False
    interleave: Literal["process", "block"] = "process"
    steps: int = 10
    warmup: int = 3
    rounds: int = 4
    workload: Workload = field(default_factory=Workload)
    theory: Callable[[int, int], float] = ring_all_reduce_bytes
    theory_text: str = "2(N-1)/N x P x 4 B"


SUITES: dict[str, Suite] = {
    suite.name: suite
    for suite in (
        Suite(
            "ddp", ("plait", "torch DDP"), "Data parallel: plait vs DistributedDataParallel",
            world=2, min_world=2, interleave="process", steps=15, warmup=3, rounds=6,
            workload=Workload(global_batch=16),
        ),
        Suite(
            "overhead", ("plait", "torch loop"), "Engine overhead at world size 1: plait vs a plain PyTorch loop",
            world=1, fixed_world=True, interleave="block", steps=5, warmup=3, rounds=20,
            workload=Workload(global_batch=8), theory=no_bytes, theory_text="0 (one process)",
        ),
    )
}
