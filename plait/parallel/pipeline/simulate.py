"""Run a pipeline schedule in one process on a cost model: timelines, bubbles, activations, deadlocks.

Each rank runs its actions in order; an action starts when its rank is free and its inputs exist: F of
stage s needs F of stage s-1 (same micro-batch), B or I of stage s needs F of stage s and the B/I of stage
s+1 (the last stage: only its own F, which computed the loss), W needs I. An input from another rank
arrives ``Costs.p2p`` after it was produced.

A lowered schedule (with SF/RF/SB/RB) is checked twice. Its order: every rank must receive from a peer in
the order that peer sends (messages between two ranks are matched in posting order), and it must complete
even if every send and recv blocked until its peer is posted, consecutive ones posted together as one
``batch_isend_irecv`` (the strictest runtime, e.g. NCCL's in-order streams). Its timing, as the runtime
runs it: posting takes no time and never blocks, a recv's data lands ``p2p`` after the send was posted (and
not before the recv is), and the compute that consumes it waits for it. So ``lower`` changes no timing.

Definitions (``SimResult``):
- busy time of a rank: the sum of its F, B, I, W durations (waiting for communication is not busy);
- idle time: makespan - busy; bubble fraction: total idle / (p x makespan);
- in-flight activations of a rank (``peak_activations``): stage-micro-batch activations held, counted up
  at each F and down at each B or I (W needs only the layer inputs I leaves behind); the peak over the step.
  ``peak_unfinished`` counts down at B or W instead: micro-batches whose backward is not complete.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from plait.logging import get_logger
from plait.parallel.pipeline.schedule import Action, Kind, Schedule, ScheduleError

logger = get_logger(__name__)

Cost = float | Sequence[float]


@dataclass(frozen=True)
class Costs:
    """Durations of one action, each a number or a per-stage sequence; I defaults to B/2 and W to B - I."""

    F: Cost = 1.0
    B: Cost = 2.0
    I: Cost | None = None  # noqa: E741 - the action's name
    W: Cost | None = None
    p2p: float = 0.0
    overhead: float = 0.0
    """Time a rank spends before each compute action that is neither the action nor waiting for its input (a
    runtime's bookkeeping: posting sends and receives, Python between actions). Not busy time; hidden when
    the rank waits for an input anyway: the action starts at max(previous end + overhead, inputs ready)."""

    def of(self, action: Action) -> float:
        """How long ``action`` keeps its rank busy (send/recv: 0; their transfer time is ``p2p``)."""
        s, kind = action.stage, action.kind
        if action.is_comm:
            return 0.0
        if kind == Kind.BACKWARD_INPUT:
            return _at(self.I, s) if self.I is not None else _at(self.B, s) / 2
        if kind == Kind.BACKWARD_WEIGHT:
            return _at(self.W, s) if self.W is not None else _at(self.B, s) - self.of(Action(s, Kind.BACKWARD_INPUT, 0))
        return _at(getattr(self, kind), s)


def _at(value: Cost, stage: int) -> float:
    if isinstance(value, (int, float)):
        return float(value)
    if stage >= len(value):
        raise ScheduleError(f"costs give {len(value)} per-stage values, but stage {stage} exists.")
    return float(value[stage])


def as_costs(costs: Costs | Mapping[str, Any] | None) -> Costs:
    """``None`` -> F=1, B=2 (I=W=1); a mapping such as ``{"F": 1, "B": 1}`` -> ``Costs(**mapping)``."""
    if costs is None:
        return Costs()
    if isinstance(costs, Costs):
        return costs
    names = [f.name for f in fields(Costs)]
    unknown = sorted(set(costs) - set(names))
    if unknown:
        raise ScheduleError(f"unknown cost(s) {', '.join(unknown)}. Fix: use {', '.join(names)}.")
    return Costs(**costs)


@dataclass(frozen=True)
class Span:
    """``action`` ran on its rank from ``start`` to ``end`` (for send/recv: posted to met)."""

    start: float
    end: float
    action: Action


@dataclass
class SimResult:
    """Per-rank timelines of a simulated schedule and what they add up to (definitions: module doc)."""

    schedule: Schedule
    costs: Costs
    timelines: list[list[Span]]
    makespan: float
    busy: list[float]
    peak_activations: list[int]
    peak_unfinished: list[int]

    @property
    def idle(self) -> list[float]:
        return [self.makespan - b for b in self.busy]

    @property
    def bubble_fraction(self) -> float:
        """Total idle time / (p x makespan)."""
        return sum(self.idle) / (self.schedule.p * self.makespan) if self.makespan > 0 else 0.0

    def summary(self) -> str:
        s = self.schedule
        return (
            f"{s.name} p={s.p} m={s.m} v={s.v}: makespan {self.makespan:g}, bubble {self.bubble_fraction:.1%}, "
            f"peak activations per rank {self.peak_activations}"
        )

    def to_chrome_trace(self, us_per_unit: float = 1000.0) -> dict[str, Any]:
        """A Chrome/Perfetto trace (open in ui.perfetto.dev): one process, one thread per rank, "X" events;
        one cost unit is ``us_per_unit`` microseconds."""
        names = {
            Kind.FORWARD: "forward",
            Kind.BACKWARD: "backward",
            Kind.BACKWARD_INPUT: "backward-input",
            Kind.BACKWARD_WEIGHT: "backward-weight",
        }
        s = self.schedule
        process = f"pipeline {s.name} p={s.p} m={s.m} v={s.v}"
        events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": process}}]
        for rank, spans in enumerate(self.timelines):
            events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}})
            for span in spans:
                a = span.action
                events.append(
                    {
                        "name": str(a),
                        "cat": names.get(a.kind, "comm"),
                        "ph": "X",
                        "pid": 0,
                        "tid": rank,
                        "ts": span.start * us_per_unit,
                        "dur": (span.end - span.start) * us_per_unit,
                        "args": {"stage": a.stage, "kind": a.kind, "microbatch": a.microbatch},
                    }
                )
        return {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {"bubble_fraction": self.bubble_fraction, "makespan": self.makespan},
        }


def simulate(schedule: Schedule, costs: Costs | Mapping[str, Any] | None = None) -> SimResult:
    """Validate ``schedule``, check each rank's order (and, if lowered, its send/recv order), then run it on
    ``costs``. A deadlock raises ``ScheduleError`` naming each blocked rank's next action and what it waits for."""
    schedule.validate()
    costs = as_costs(costs)
    acts = schedule.actions
    pos = {a: (r, i) for r, rank_acts in enumerate(acts) for i, a in enumerate(rank_acts)}
    lowered = schedule.is_lowered
    deps = {a: _needs(schedule, a, pos, lowered) for a in pos}
    _check_order(schedule, pos, deps)
    for a in pos:
        if costs.of(a) < 0:
            raise ScheduleError(f"cost of {a} is {costs.of(a)}; costs must be >= 0.")
    if costs.p2p < 0 or costs.overhead < 0:
        raise ScheduleError(f"p2p={costs.p2p} and overhead={costs.overhead} must be >= 0.")
    peer = {a: schedule.required_peer(a) for a in pos if a.is_comm}
    if lowered:
        _check_pairs_in_order(schedule, pos, peer)
        _check_rendezvous(schedule, pos, peer)

    p, lat = schedule.p, costs.p2p
    ptr, free = [0] * p, [0.0] * p
    start: dict[Action, float] = {}
    ready: dict[Action, float] = {}  # when an action's output (or a recv's data) is there

    def ready_at(d: Action, rank: int) -> float | None:
        if d.kind in (
            Kind.RECV_FORWARD,
            Kind.RECV_BACKWARD,
        ):  # data lands p2p after the send was posted, once the recv is posted too
            send = peer[d]
            return None if d not in start or send not in start else max(start[d], start[send] + lat)
        if d not in ready:
            return None
        return ready[d] + (lat if pos[d][0] != rank else 0.0)

    def arrival(d: Action, rank: int) -> float:
        """``ready_at`` of an action known to be ready: a dependency of one that ran, or one that ran."""
        at = ready_at(d, rank)
        assert at is not None  # only called once waits_for() has found every dependency ready
        return at

    def waits_for(r: int) -> Action | None:
        a = acts[r][ptr[r]]
        return next((d for d in deps[a] if ready_at(d, r) is None), None)

    progress = True
    while progress:
        progress = False
        for r in range(p):
            while ptr[r] < len(acts[r]) and waits_for(r) is None:
                a = acts[r][ptr[r]]
                before = 0.0 if a.is_comm else costs.overhead
                start[a] = max([free[r] + before] + [arrival(d, r) for d in deps[a]])
                free[r] = ready[a] = start[a] + costs.of(a)
                ptr[r] += 1
                progress = True
    stuck = [r for r in range(p) if ptr[r] < len(acts[r])]
    if stuck:
        lines = []
        for r in stuck:
            blocker = waits_for(r)
            assert blocker is not None  # the loop above leaves a rank unfinished only while it waits
            where = pos[blocker][0]
            lines.append(
                f"  rank {r} is at {acts[r][ptr[r]]}, waiting for {blocker} on rank {where} "
                f"(which is at {_at_text(acts, ptr, where)})"
            )
        raise ScheduleError(_deadlock(schedule, lines))

    def span(a: Action) -> Span:
        return Span(
            start[a], arrival(a, pos[a][0]) if a.kind in (Kind.RECV_FORWARD, Kind.RECV_BACKWARD) else ready[a], a
        )

    timelines = [[span(a) for a in rank_acts] for rank_acts in acts]
    makespan = max((s.end for spans in timelines for s in spans), default=0.0)
    busy = [sum(costs.of(a) for a in rank_acts) for rank_acts in acts]
    activations = [_peak(rank_acts, (Kind.BACKWARD, Kind.BACKWARD_INPUT)) for rank_acts in acts]
    unfinished = [_peak(rank_acts, (Kind.BACKWARD, Kind.BACKWARD_WEIGHT)) for rank_acts in acts]
    result = SimResult(schedule, costs, timelines, makespan, busy, activations, unfinished)
    logger.debug("simulated %s", result.summary())
    return result


def _needs(schedule: Schedule, a: Action, pos: dict[Action, tuple[int, int]], lowered: bool) -> list[Action]:
    """The actions ``a`` must wait for. In a lowered schedule an input from another rank is its recv."""
    s, j, S = a.stage, a.microbatch, schedule.num_stages

    def backward(stage: int) -> Action:
        return (
            Action(stage, Kind.BACKWARD, j)
            if Action(stage, Kind.BACKWARD, j) in pos
            else Action(stage, Kind.BACKWARD_INPUT, j)
        )

    remote = (
        lowered
        and a.kind in (Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT)
        and bool([c for c in schedule.comms(a) if c.kind in (Kind.RECV_FORWARD, Kind.RECV_BACKWARD)])
    )
    if a.kind == Kind.FORWARD:
        return [] if s == 0 else [Action(s, Kind.RECV_FORWARD, j)] if remote else [Action(s - 1, Kind.FORWARD, j)]
    if a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
        after = [] if s == S - 1 else [Action(s, Kind.RECV_BACKWARD, j)] if remote else [backward(s + 1)]
        return [Action(s, Kind.FORWARD, j)] + after
    if a.kind == Kind.BACKWARD_WEIGHT:
        return [Action(s, Kind.BACKWARD_INPUT, j)]
    if a.kind == Kind.SEND_FORWARD:
        return [Action(s, Kind.FORWARD, j)]
    if a.kind == Kind.SEND_BACKWARD:
        return [backward(s)]
    return []  # RF, RB: met by their peer send


def _check_order(schedule: Schedule, pos: dict[Action, tuple[int, int]], deps: dict[Action, list[Action]]) -> None:
    """An action listed before something it needs from its own rank can never run."""
    for a, (r, i) in pos.items():
        for d in deps[a]:
            q, k = pos[d]
            if q == r and k > i:
                raise ScheduleError(
                    f"rank {r}: {a} (position {i}) is listed before {d} (position {k}), which it needs, on the same "
                    f"rank, so it can never run. Fix: move {a} after {d}."
                )


def _check_pairs_in_order(schedule: Schedule, pos: dict[Action, tuple[int, int]], peer: dict[Action, Action]) -> None:
    """Messages between two ranks are matched in the order they are posted (NCCL ignores tags), so rank b
    must receive from rank a in the order rank a sends to it."""
    sends: dict[tuple[int, int], list[Action]] = {}
    recvs: dict[tuple[int, int], list[Action]] = {}
    for r, acts in enumerate(schedule.actions):
        for a in acts:
            if a.is_comm:
                q = pos[peer[a]][0]
                if a.kind in (Kind.SEND_FORWARD, Kind.SEND_BACKWARD):
                    sends.setdefault((r, q), []).append(peer[a])
                else:
                    recvs.setdefault((q, r), []).append(a)
    for (sender, receiver), expected in sends.items():
        got = recvs.get((sender, receiver), [])
        for i, (want, have) in enumerate(zip(expected, got)):
            if want != have:
                raise ScheduleError(
                    f"rank {receiver} receives {have} as message #{i} from rank {sender}, but rank {sender} sends "
                    f"{peer[want]} as its message #{i} to rank {receiver}: messages between two ranks are matched "
                    f"in the order they are posted. Fix: receive in the order sent (lower() does this)."
                )


def _check_rendezvous(schedule: Schedule, pos: dict[Action, tuple[int, int]], peer: dict[Action, Action]) -> None:
    """Run the order alone as if every send and recv blocked until its peer is posted (consecutive ones posted
    together as one batch): the strictest runtime, e.g. NCCL's in-order streams. Raises on a deadlock."""
    acts, p = schedule.actions, schedule.p
    items: list[list[tuple[int, int]]] = []
    for rank_acts in acts:
        runs: list[tuple[int, int]] = []
        for i, a in enumerate(rank_acts):
            if a.is_comm and i > 0 and rank_acts[i - 1].is_comm:
                runs[-1] = (runs[-1][0], i + 1)  # joins the batch before it
            else:
                runs.append((i, i + 1))
        items.append(runs)
    item_of = [{i: k for k, (lo, hi) in enumerate(runs) for i in range(lo, hi)} for runs in items]
    ptr = [0] * p

    def at(r: int) -> str:
        if ptr[r] >= len(items[r]):
            return "finished"
        lo, hi = items[r][ptr[r]]
        return str(acts[r][lo]) if hi - lo == 1 else "[" + " ".join(map(str, acts[r][lo:hi])) + "]"

    def waits_for(r: int) -> Action | None:
        lo, hi = items[r][ptr[r]]
        for a in acts[r][lo:hi]:
            if a.is_comm:
                q, k = pos[peer[a]]
                if ptr[q] < item_of[q][k]:
                    return peer[a]
        return None

    progress = True
    while progress:
        progress = False
        for r in range(p):
            while ptr[r] < len(items[r]) and waits_for(r) is None:
                ptr[r] += 1
                progress = True
    stuck = [r for r in range(p) if ptr[r] < len(items[r])]
    if stuck:
        lines = []
        for r in stuck:
            blocker = waits_for(r)
            assert blocker is not None  # the loop above leaves a rank unfinished only while it waits
            where = pos[blocker][0]
            lines.append(
                f"  rank {r} is at {at(r)}, waiting for rank {where} to post {blocker} (rank {where} is at {at(where)})"
            )
        lines.append(
            "  (send/recv order checked as if each blocked until its peer is posted; "
            "lower() builds an order that cannot deadlock)"
        )
        raise ScheduleError(_deadlock(schedule, lines))


def _at_text(acts: list[list[Action]], ptr: list[int], rank: int) -> str:
    return str(acts[rank][ptr[rank]]) if ptr[rank] < len(acts[rank]) else "finished"


def _deadlock(schedule: Schedule, lines: list[str]) -> str:
    head = (
        f"deadlock in schedule {schedule.name!r} (p={schedule.p} m={schedule.m} v={schedule.v}): "
        f"no rank can make progress."
    )
    return "\n".join([head] + lines)


def _peak(actions: list[Action], closing: tuple[str, ...]) -> int:
    """The most micro-batches of a rank opened by F and not yet closed by an action of a ``closing`` kind."""
    held = peak = 0
    for a in actions:
        held += 1 if a.kind == Kind.FORWARD else -1 if a.kind in closing else 0
        peak = max(peak, held)
    return peak


__all__ = ["Costs", "SimResult", "Span", "as_costs", "simulate"]
