"""Straggler detection: which rank holds the job back, by how much, and whether it stays slow.

In synchronous training every collective waits for its slowest member, so one slow rank (a throttled GPU, a noisy
neighbour, a bad link) slows every rank to its pace. ``StragglerMeter`` finds it at almost no cost:

Per rank and step, measured locally with no collective and no synchronisation:

- **comm**: host seconds inside plait's collectives (``Comm.timed``: the time in ``Pending.wait``, i.e. a blocking
  call after its launch, or the exposed part of an ``async_op=True`` one; ``plait.comm.stats``);
- **compute**: the rest of ``Engine.train_step``'s wall time (``StepStats.seconds`` - comm): forward, backward,
  optimizer and everything else the rank does on its own inside the step.

Each step the meter adds its window sums (two numbers) to the all-gather ``plait.train.metrics.StepMeter`` makes
anyway, so there is no collective of its own (only one at the start, for every rank's host name). Every
``every`` steps (``train.straggler_every``) every rank reads the gathered sums alike and computes, over the ranks
that do the same work (the same pipeline stage; the whole job without pipeline parallelism):

- **wait** of rank r: comm_r - min over its peers of comm (the usual estimate: in a collective the fast ranks
  wait for the slowest, whose own time in it is the least, mostly the transfer);
- **lag** of rank r: compute_r / median over its peers of compute - 1 (0.5: half again as slow as the typical
  rank; with two ranks the median is their mean, so a rank twice as slow has lag 1/3);
- the **slowest rank**: the largest lag. Rank 0 logs it (rank, host, lag) and writes ``straggler_rank``,
  ``straggler_host``, ``straggler_lag`` and ``rank_seconds`` (per rank the window's mean compute, comm and wait
  seconds per step) into that step's record in metrics.jsonl; TensorBoard gets ``straggler/*`` scalars.

A rank that stays slow, the same slowest rank with lag above ``train.straggler_lag`` for ``train.straggler_windows``
windows in a row, is warned about once (``job_warning``: rank 0), naming its host and rank; the episode ends when
a window has another slowest rank or a lag under the threshold, and a new episode warns again.

The first step a meter sees is left out (it grows the allocator and builds lazy state, unevenly across ranks).
On CUDA the figures are host times: a step's host time is the time to queue it, and an NCCL wait does not block
the host, so a slow GPU shows in neither; the measurements are exact on the CPU (gloo), where every rank's host
does the work and waits in the collectives.
"""

from __future__ import annotations

import socket
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from plait.logging import get_logger, job_warning

log = get_logger(__name__)
COLUMNS = 2
"""Numbers each rank adds to the step's all-gather: the window's compute and comm seconds so far."""


@dataclass
class Window:
    """What one window of ``steps`` steps found (the same on every rank)."""

    steps: int
    compute: list[float]
    """Per rank: seconds of compute per step, the window's mean."""
    comm: list[float]
    """Per rank: seconds inside collectives per step."""
    wait: list[float]
    """Per rank: comm minus the least comm of its peers, per step."""
    lag: list[float]
    """Per rank: compute over its peers' median compute, minus 1."""

    @property
    def slowest(self) -> int:
        """The rank with the largest lag (the lowest such rank on a tie)."""
        return max(range(len(self.lag)), key=lambda r: (self.lag[r], -r))


def analyse(steps: int, compute: Sequence[float], comm: Sequence[float], stage: Sequence[int]) -> Window:
    """The window of ``steps`` steps whose per-rank sums are ``compute`` and ``comm``; ``stage[r]``: the peer group
    of rank r (its pipeline stage), whose ranks do the same work and are compared with each other (module
    docstring: wait_r = comm_r - min comm of the peers; lag_r = compute_r / median compute of the peers - 1)."""
    per_compute = [c / steps for c in compute]
    per_comm = [c / steps for c in comm]
    groups: dict[int, list[int]] = {}
    for rank, group in enumerate(stage):
        groups.setdefault(group, []).append(rank)
    wait, lag = [0.0] * len(stage), [0.0] * len(stage)
    for ranks in groups.values():
        least = min(per_comm[r] for r in ranks)
        median = statistics.median(per_compute[r] for r in ranks)
        for r in ranks:
            wait[r] = per_comm[r] - least
            lag[r] = per_compute[r] / median - 1 if median > 0 else 0.0
    return Window(steps, per_compute, per_comm, wait, lag)


class SlowRankWatch:
    """Whether a rank has stayed slow: the same slowest rank with lag above ``threshold`` for ``windows`` windows
    in a row. ``observe`` says True once per such episode, at the window that completes it."""

    def __init__(self, threshold: float, windows: int) -> None:
        self.threshold, self.windows = threshold, windows
        self.rank: int | None = None
        self.streak = 0
        self.warned = False

    def observe(self, rank: int, lag: float) -> bool:
        if lag <= self.threshold:
            self.rank, self.streak, self.warned = None, 0, False
            return False
        if rank != self.rank:
            self.rank, self.streak, self.warned = rank, 0, False
        self.streak += 1
        if self.streak >= self.windows and not self.warned:
            self.warned = True
            return True
        return False


def _rounded(values: list[float]) -> list[float]:
    return [round(v, 6) for v in values]


class StragglerMeter:
    """Accumulates this rank's compute and comm seconds per step and reads every rank's at each window's end
    (module docstring). ``start`` builds it (a collective: every rank's host name) or returns None when off."""

    def __init__(self, engine: Any, every: int, threshold: float, windows: int, hosts: list[str]) -> None:
        self.every, self.threshold = every, threshold
        self.hosts = hosts
        grid = engine.mesh.grid
        self.stage = [grid.coords(r).get("pp", 0) for r in range(engine.mesh.world_size)]
        self.watch = SlowRankWatch(threshold, windows)
        self.compute = self.comm = 0.0
        self.steps = 0
        self.seen = 0

    @classmethod
    def start(cls, engine: Any, every: int, threshold: float, windows: int) -> StragglerMeter | None:
        """The meter of a run, timing ``engine.comm``'s collectives from now on; None when ``every`` is 0 or the
        job has one rank. Every rank must call it (it gathers every rank's host name, once)."""
        if every <= 0 or engine.mesh.world_size == 1:
            return None
        hosts = [h.decode() for h in engine.comm.all_gather_bytes(socket.gethostname().encode(), "world")]
        engine.comm.timed = True
        return cls(engine, every, threshold, windows, hosts)

    def columns(self, stats: Any) -> list[float]:
        """Count one step (``StepStats``: its wall seconds and its collectives' seconds) and return this rank's
        window sums, the numbers it adds to the step's all-gather."""
        self.seen += 1
        if self.seen > 1:  # the first step is warm-up (module docstring)
            comm = stats.comm.seconds
            self.compute += max(0.0, stats.seconds - comm)
            self.comm += comm
            self.steps += 1
        return [self.compute, self.comm]

    def gathered(self, step: int, rows: torch.Tensor) -> dict[str, Any]:
        """After the all-gather of step ``step`` (``rows``: per rank its ``columns``): at a window's end the record
        fields of the window (module docstring), logged by rank 0; else {}."""
        if step % self.every or self.steps == 0:
            return {}
        window = analyse(self.steps, rows[:, 0].tolist(), rows[:, 1].tolist(), self.stage)
        self.compute = self.comm = 0.0
        self.steps = 0
        slowest, lag = window.slowest, window.lag[window.slowest]
        host = self.hosts[slowest]
        log.info(
            "stragglers, %d steps to step %d: slowest rank %d (host %s), compute %.4g s/step, lag %+.1f%% over the "
            "median; most waiting: rank %d, %.4g s/step",
            window.steps,
            step,
            slowest,
            host,
            window.compute[slowest],
            100 * lag,
            max(range(len(window.wait)), key=window.wait.__getitem__),
            max(window.wait),
        )
        if self.watch.observe(slowest, lag):
            job_warning(
                log,
                "rank %d on host %s stays slow: the slowest rank for %d windows of %d steps in a row, compute "
                "%.1f%% above the median (train.straggler_lag=%g) up to step %d; check that host (its GPU's clocks "
                "and temperature, other jobs on it, its links)",
                slowest,
                host,
                self.watch.streak,
                self.every,
                100 * lag,
                self.threshold,
                step,
            )
        return {
            "straggler_rank": slowest,
            "straggler_host": host,
            "straggler_lag": round(lag, 6),
            "straggler_windows": self.watch.streak,
            "rank_seconds": {
                "steps": window.steps,
                "compute": _rounded(window.compute),
                "comm": _rounded(window.comm),
                "wait": _rounded(window.wait),
            },
        }


def straggler_scalars(record: dict[str, Any]) -> dict[str, Any]:
    """The TensorBoard scalars of a train record's straggler fields; {} for a step that ends no window."""
    seconds = record.get("rank_seconds")
    if not seconds or "straggler_lag" not in record:
        return {}
    return {
        "straggler/lag": record["straggler_lag"],
        "straggler/rank": record["straggler_rank"],
        "straggler/compute_s_max": max(seconds["compute"]),
        "straggler/compute_s_median": statistics.median(seconds["compute"]),
        "straggler/wait_s_max": max(seconds["wait"]),
    }


__all__ = ["COLUMNS", "SlowRankWatch", "StragglerMeter", "Window", "analyse", "straggler_scalars"]
