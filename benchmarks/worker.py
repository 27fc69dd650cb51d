"""The timed loop that every rank runs, and what it reports back.

One call of ``run_rank`` is one process of one launch: it joins the process group (world > 1), builds each
contender named in the spec from the same seed, runs ``warmup`` untimed steps of each, then ``blocks`` blocks of
``steps`` timed steps, alternating the contenders from block to block (A B, B A, A B, ...). Step k of a contender
always trains on global batch k, whichever block it falls in, so contenders see the same data in the same order.
Last, one untimed *probe* step per contender measures the model-state bytes it holds at its optimizer step
(``Trainer.probe``; with ``saved_activations`` also the bytes autograd saved for backward in that step), and the
trained parameters are collected (gathered whole for sharded contenders). Each contender trains its own share
of every global batch (``Contender.batch_share``: a data-parallel slice, or the whole batch).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import logging
import os
import resource
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from benchmarks.contenders import CONTENDERS, Trainer
from benchmarks.workload import Workload
from plait.observe.memory import SavedActivations

log = logging.getLogger("benchmarks.worker")

COMM_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class RunSpec:
    """What one launch runs (picklable: it is handed to every rank)."""

    contenders: tuple[str, ...]
    workload: Workload
    warmup: int
    steps: int
    blocks: int = 1
    threads: int = 1
    saved_activations: bool = False
    """Count the bytes autograd saves for backward during the probe step (``SavedActivations``)."""


@dataclass
class Trace:
    """One contender's timed steps on one rank."""

    name: str
    seconds: list[float] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    wire_bytes: list[float | None] = field(default_factory=list)
    params: np.ndarray | None = None
    """The trained parameters, flattened (rank 0 only; every replica holds the same)."""
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class RankResult:
    """Everything one rank measured in one launch; ``*_rss_kb`` are this process's resident set sizes."""

    rank: int
    world: int
    traces: dict[str, Trace]
    start_rss_kb: int
    peak_rss_kb: int


def current_rss_kb() -> int:
    """This process's resident set size now, in KiB (/proc/self/statm; ru_maxrss where /proc is missing)."""
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") // 1024
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def peak_rss_kb() -> int:
    """The peak resident set size of this process over its whole life, in KiB (Linux ru_maxrss)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _flat_params(trainer: Trainer) -> np.ndarray:
    """The trained parameters, whole, flattened (a collective for sharded contenders: every rank calls it)."""
    with torch.no_grad():
        params = trainer.full_params() if trainer.full_params else list(trainer.model.parameters())
        return torch.cat([p.detach().reshape(-1).float() for p in params]).cpu().numpy()


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def run_rank(spec: RunSpec) -> RankResult:
    """Run ``spec`` on this rank (RANK/WORLD_SIZE come from the launcher's environment) and report."""
    torch.set_num_threads(spec.threads)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        # a rank that has not joined when the others time out prints where it stands (the launch is then retried)
        faulthandler.dump_traceback_later(COMM_TIMEOUT_S - 5, exit=False)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=COMM_TIMEOUT_S))
        faulthandler.cancel_dump_traceback_later()
    try:
        start_rss = current_rss_kb()
        total = spec.warmup + spec.steps * spec.blocks
        shares = {name: CONTENDERS[name].batch_share(rank, world) for name in spec.contenders}
        by_share = {share: spec.workload.batches(*share, total + 1) for share in set(shares.values())}  # + probe
        batches_of = {name: by_share[share] for name, share in shares.items()}
        trainers = {
            name: CONTENDERS[name].build(spec.workload.build_model(), spec.workload, rank, world)
            for name in spec.contenders
        }
        traces = {name: Trace(name) for name in spec.contenders}
        for name, trainer in trainers.items():
            for k in range(spec.warmup):
                trainer.step(batches_of[name][k])
        _barrier(world)
        for block in range(spec.blocks):
            order = spec.contenders if block % 2 == 0 else tuple(reversed(spec.contenders))
            for name in order:
                trace, step = traces[name], trainers[name].step
                for k in range(spec.steps):
                    batch = batches_of[name][spec.warmup + block * spec.steps + k]
                    started = time.perf_counter()
                    loss, wire = step(batch)
                    trace.seconds.append(time.perf_counter() - started)
                    trace.blocks.append(block)
                    trace.losses.append(loss)
                    trace.wire_bytes.append(wire)
        for name, trainer in trainers.items():
            trainer.probe.armed = True
            saved = SavedActivations(exclude=trainer.model.parameters()) if spec.saved_activations else None
            with saved or contextlib.nullcontext():
                trainer.step(batches_of[name][total])
            traces[name].info = {**trainer.info(), "model_state_bytes": trainer.probe.held}
            if saved is not None:
                traces[name].info["saved_activation_bytes"] = saved.bytes
            params = _flat_params(trainer)
            if rank == 0:
                traces[name].params = params
        _barrier(world)
        log.debug("rank %d done: %s", rank, {n: len(t.seconds) for n, t in traces.items()})
        return RankResult(rank, world, traces, start_rss, peak_rss_kb())
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()
