"""What a contender builds and returns, shared by every pair: ``Trainer`` (one step, the model, facts, the
model-state probe, the whole parameters), ``Contender`` (name, builder, which share of the batch a rank trains,
its own theoretical bytes where the suite's do not fit), and the helpers the torch peers need to count and clip
like plait does (storage bytes of DTensors by their local shard; a global gradient norm over several ranks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.workload import Batch, Workload
from plait.observe.memory import storage_bytes

StepOut = tuple[float, float | None]
"""What one step returns: (loss as this rank sees it, bytes this rank sent or None)."""


@dataclass
class Probe:
    """Measures the model-state bytes at the optimizer step of the next training step, once armed (so that the
    timed steps never pay for it)."""

    armed: bool = False
    held: dict[str, int] = field(default_factory=dict)

    def take(self, measure: Callable[[], dict[str, int]]) -> None:
        if self.armed:
            self.held, self.armed = measure(), False


@dataclass
class Trainer:
    """One contender, built on one rank: ``step`` trains one step; ``model`` holds the weights it trains."""

    step: Callable[[Batch], StepOut]
    model: nn.Module
    info: Callable[[], dict[str, Any]] = field(default=lambda: {})
    """Facts known after training (e.g. DDP's bucket sizes), merged into the result row."""
    probe: Probe = field(default_factory=Probe)
    full_params: Callable[[], list[torch.Tensor]] | None = None
    """The trained parameters, whole (for sharded contenders; collective: every rank calls it)."""


Builder = Callable[[nn.Module, Workload, int, int], Trainer]
"""``build(model, workload, rank, world) -> Trainer``."""

BatchSplit = Literal["dp", "whole"]
"""Which share of the global batch a rank trains: ``dp``, rows [rG/N, (r+1)G/N) (data parallelism over every
rank); ``whole``, the whole global batch on every rank (pipeline, tensor and context parallelism with dp=1:
the stages, tp slices and cp shards of one replica all see the same batch)."""


@dataclass(frozen=True)
class Contender:
    """A way to train the workload: a name for the tables, a builder, and one line saying what it runs."""

    name: str
    build: Builder
    what: str
    batch_split: BatchSplit = "dp"
    theory: Callable[[Workload, int], float] | None = None
    """Theoretical bytes a rank sends per step, where this contender's differ from its suite's (e.g. ring vs
    Ulysses attention in one suite)."""
    theory_text: str = ""

    def batch_share(self, rank: int, world: int) -> tuple[int, int]:
        """(data-parallel rank, data-parallel size) of ``rank`` for ``ShardedBatches``."""
        return (rank, world) if self.batch_split == "dp" else (0, 1)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank holds), any other tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def torch_held(params: list[nn.Parameter], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Model-state bytes of a torch trainer, by the kinds of ``plait.measure_held`` (storages counted once)."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard's optimizer there
    states = [t for state in inner.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    return {
        "parameters": storage_bytes(local(p) for p in params),
        "master_weights": 0,
        "gradients": storage_bytes(local(p.grad) for p in params if p.grad is not None),
        "optimizer_states": storage_bytes(local(t) for t in states if t.dim() > 0),
    }


def clip_global_(
    sharded: Iterable[torch.Tensor],
    replicated: Iterable[torch.Tensor],
    max_norm: float,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Clip gradients spread over the ranks of ``group`` to a global L2 norm, as ``clip_grad_norm_`` would on
    the whole model: ||g||^2 = sum over ranks of the squares of the ``sharded`` pieces (each held by one rank:
    pipeline stages, tp slices) + the squares of the ``replicated`` ones (the same on every rank, counted
    once); scale by min(1, max_norm / (||g|| + 1e-6)). Returns the norm."""
    sharded = [local(g) for g in sharded]
    replicated = [local(g) for g in replicated]
    squares = torch.zeros((), dtype=torch.float32)
    for g in sharded:
        squares += torch.linalg.vector_norm(g.float()).square()
    if group is not None or dist.is_initialized():
        dist.all_reduce(squares, group=group)
    for g in replicated:
        squares += torch.linalg.vector_norm(g.float()).square()
    norm = squares.sqrt()
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_(sharded + replicated, coefficient)
    return norm


def gather_named(named: dict[str, torch.Tensor], order: list[str]) -> list[torch.Tensor]:
    """Parameters held by different ranks (pipeline stages), whole on every rank in ``order`` (a collective over
    the world; untimed: for the parameter comparison only)."""
    pieces: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, {name: t.detach().cpu() for name, t in named.items()})
    merged = {name: t for piece in pieces for name, t in (piece or {}).items()}
    missing = [name for name in order if name not in merged]
    if missing:
        raise RuntimeError(f"no rank holds parameters {missing[:3]}...: the stages do not cover the model")
    return [merged[name] for name in order]


def plait_trainer(
    model: nn.Module,
    workload: Workload,
    layout: Any,
    full_params: Callable[[Any], Callable[[], list[torch.Tensor]]] | None = None,
) -> Trainer:
    """``plait.parallelize(model, layout, ...)`` and ``Engine.train_step``: the loss plait reports (the batch's
    mean, the same on every rank) and the bytes its comm layer counted in the step (ring model).
    ``full_params(engine)`` gives the whole-parameter gather for layouts whose ranks hold pieces."""
    import plait
    from plait.models import lm_loss
    from plait.observe.memory import measure_held

    engine = plait.parallelize(
        model, layout, optimizer=workload.optimizer, loss_fn=lm_loss, max_grad_norm=workload.max_grad_norm
    )
    probe = Probe()
    engine.before_optimizer_step.append(lambda e: probe.take(lambda: measure_held(e)))

    def step(batch: Batch) -> StepOut:
        stats = engine.train_step(batch)
        return stats.loss, stats.comm.wire()

    def info() -> dict[str, Any]:
        """plait's gradient buckets, where its data-parallel strategy has them (bytes per bucket)."""
        buckets = getattr(getattr(engine, "strategy", None), "buckets", None) or []
        return {"bucket_bytes": [int(b.grad_bytes) for b in buckets if hasattr(b, "grad_bytes")]}

    return Trainer(step, engine.model, info, probe, full_params(engine) if full_params else None)
