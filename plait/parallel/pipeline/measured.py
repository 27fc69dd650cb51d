"""A measured pipeline step as a ``SimResult``: every pp rank's timeline of its last ``train_step``, gathered
through ``plait.comm`` and put on one clock, so the simulator's tools draw and export a real run
(``plait.observe.pipeline_picture``: ``draw_schedule`` for the PNG, ``save_timeline`` for both the PNG and a
Chrome/Perfetto trace).

Each rank records its compute actions as (action, start, end) in ``time.perf_counter`` seconds
(``PipelineRunner.timeline``); waiting for a received tensor is not inside a span. Here every rank converts its
spans to wall-clock time (``time.time``, read next to ``perf_counter``), the spans are all-gathered over "pp" as
one float64 tensor per rank (padded to the longest), and time 0 is the earliest step start of the group. On one
host the ranks share the clock; across hosts the picture is as good as their clock synchronisation. Time unit:
milliseconds, so ``to_chrome_trace()`` (1 unit = 1000 us) has real durations. Busy time, idle time and the
bubble fraction follow the simulator's definitions (busy = sum of span durations, makespan = last end).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from plait.errors import ScheduleError
from plait.parallel.pipeline.schedule import Action, Kind
from plait.parallel.pipeline.simulate import Costs, SimResult, Span

if TYPE_CHECKING:
    from plait.parallel.pipeline.runtime import PipelineRunner

AXIS = "pp"
COMPUTE_KINDS = (Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)
FIELDS = 5
"""Per span: stage, kind code, micro-batch, start, end (ms)."""


def _encode(runner: PipelineRunner) -> torch.Tensor:
    """This rank's last step: a [1 + spans, 5] float64 tensor; row 0 holds (spans, step start, 0, 0, 0)."""
    wall = time.time() - time.perf_counter()  # perf_counter -> wall clock (seconds)
    rows = [[len(runner.timeline), (runner.step_start + wall) * 1e3, 0.0, 0.0, 0.0]]
    for action, start, end in runner.timeline:
        rows.append(
            [
                action.stage,
                COMPUTE_KINDS.index(action.kind),
                action.microbatch,
                (start + wall) * 1e3,
                (end + wall) * 1e3,
            ]
        )
    return torch.tensor(rows, dtype=torch.float64)


def _peaks(spans: list[Span], release: str) -> int:
    """Most micro-batches held at once: +1 at F, -1 at the kinds in ``release`` (as the simulator counts)."""
    held = peak = 0
    for span in spans:
        held += 1 if span.action.kind == Kind.FORWARD else -1 if span.action.kind in release else 0
        peak = max(peak, held)
    return peak


def gather_timeline(runner: PipelineRunner) -> SimResult:
    """The last ``train_step`` of every rank of this pp group, in ms from the group's first step start.
    A collective over "pp": every rank of the group must call it."""
    if not runner.timeline:
        raise ScheduleError("no pipeline step has run yet, so there is no timeline. Fix: call engine.train_step first.")
    comm = runner.comm
    mine = _encode(runner)
    count = torch.tensor([mine.shape[0]], dtype=torch.int64, device=comm.device)
    longest = int(comm.all_gather(count, AXIS).max())
    padded = torch.zeros(longest, FIELDS, dtype=torch.float64)
    padded[: mine.shape[0]] = mine
    every = comm.all_gather(padded.to(comm.device), AXIS).cpu().view(-1, longest, FIELDS)
    origin = float(every[:, 0, 1].min())
    timelines: list[list[Span]] = []
    for rows in every:
        n = int(rows[0, 0])
        timelines.append(
            [
                Span(float(r[3]) - origin, float(r[4]) - origin, Action(int(r[0]), COMPUTE_KINDS[int(r[1])], int(r[2])))
                for r in rows[1 : n + 1]
            ]
        )
    makespan = max((spans[-1].end for spans in timelines if spans), default=0.0)
    return SimResult(
        runner.schedule,
        Costs(),
        timelines,
        makespan,
        busy=[sum(s.end - s.start for s in spans) for spans in timelines],
        peak_activations=[_peaks(spans, "BI") for spans in timelines],
        peak_unfinished=[_peaks(spans, "BW") for spans in timelines],
    )


__all__ = ["gather_timeline"]
