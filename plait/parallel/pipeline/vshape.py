"""V-shaped schedules: two model chunks per rank placed in a V (``Placement.V``), ZB-V and DualPipeV.

The 2p stages run down the ranks and back up: rank r holds stage r (its chunk 0) and stage 2p - 1 - r (its chunk
1), so rank 0 holds the first stage and the last (the loss), and rank p - 1 hands stage p - 1's output to stage p
without a message. A micro-batch's forward thus ends where it began, and its backward starts there at once; the
warm-up of chunk 1 overlaps the cool-down of chunk 0 on every rank.

ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, sec. 6; "Pipeline Parallelism with Controllable
Memory", 2024): the backward is split into I (input gradient) and W (weight gradient, deferrable). Rank r runs

    warm-up   2(p - r) - 1 forwards of chunk 0, then r pairs (F chunk 1, F chunk 0), then p - r triples
              (F, I, W of chunk 1);
    steady    (F chunk 0, I chunk 0, W chunk 0, F chunk 1, I chunk 1, W chunk 1) while forwards remain;
    cool-down r pairs (I chunk 0, I chunk 1), p - r pairs (I chunk 0, W chunk 0), then the deferred W's.

Its idle time per rank is (p - 1)(tF + tI - tW) of one chunk once m >= 2p - 1, at tF = tI = tW and at
tI = 2 tF = 2 tW (the simulator's, tests/test_pipeline_vshape.py; the order is fixed, not fitted to the costs, so
other costs land near this form, not on it): ZB-H1's closed form, on chunks that are half a stage, so half of
ZB-H1's bubble and a sixth of 1F1B's at tF = tI = tW. The peak activation memory is 1F1B's: every rank holds at
most 2p half-stage activations (rank 0: 2p - 1 forwards of chunk 0 and one of chunk 1), p whole-stage ones, as
1F1B's rank 0.
The order is built for m' = max(m, 2p - 1) micro-batches and the actions of micro-batches >= m dropped (what
torch.distributed.pipelining's ``ScheduleZBVZeroBubble`` does too), so any m >= 1 runs.

DualPipeV (DeepSeek-V3's DualPipe "cut in half", as torch's ``ScheduleDualPipeV`` and deepseek-ai/DualPipe build
it): the same V, and in its steady state the forward chunk of one micro-batch is paired with the backward chunk of
another (F chunk 0 + B chunk 1, then F chunk 1 + B chunk 0): on hardware the pair's compute and its MoE
all-to-alls overlap. Here each pair is two adjacent actions; under expert parallelism the runtime runs them
overlapped (``overlap.py``: the expert exchanges of each travel while the other computes), else back to back.
Rank r runs

    1  2(p - r - 1) forwards of chunk 0
    2  r + 1 pairs (F chunk 0, F chunk 1)
    3  p - r - 1 triples (I chunk 1, a deferred W, F chunk 1)
    4  m - 2p + r + 1 times: (F chunk 0 + B chunk 1), (F chunk 1 + B chunk 0)
    5  p - r - 1 times: B chunk 1, (F chunk 1 + B chunk 0)
    6  r + 1 pairs (B chunk 1, B chunk 0), from the middle pair on as I's (zero bubble for the second half)
    7  p - r - 1 times: a deferred W, a backward of chunk 0 (I when step 6 switched to I's)
    8  the remaining deferred W's.

It needs m >= 2p micro-batches (step 4 runs at least once on rank 0). Its peak is 2p + 1 chunk activations on
every rank (``simulate(...).peak_activations``): half a stage more than 1F1B's rank 0, the price of running a
forward of chunk 0 before the backward of chunk 1 that frees one (DeepSeek's table counts DualPipeV's activation
memory as PP + 1 against 1F1B's PP, in its own units).
"""

from __future__ import annotations

from plait.errors import ScheduleError
from plait.parallel.pipeline.schedule import Action, Kind, Placement, Schedule


class _RankOps:
    """One rank's action list under construction: the next micro-batch of each (stage, kind), and a queue of
    deferred W's (each I enqueues its W; ``deferred_w`` runs the oldest, of one stage or of any)."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.next: dict[tuple[int, str], int] = {}
        self.weights: list[Action] = []

    def add(self, stage: int, kind: Kind) -> None:
        """The next micro-batch's ``kind`` on ``stage``; B and I share one counter (a micro-batch has one of them)."""
        key = (stage, Kind.BACKWARD_INPUT if kind == Kind.BACKWARD else kind)
        j = self.next.get(key, 0)
        self.next[key] = j + 1
        self.actions.append(Action(stage, kind, j))
        if kind == Kind.BACKWARD_INPUT:
            self.weights.append(Action(stage, Kind.BACKWARD_WEIGHT, j))

    def deferred_w(self, stage: int | None = None) -> None:
        """The oldest deferred W (of ``stage``, when given), if there is one."""
        for index, weight in enumerate(self.weights):
            if stage is None or weight.stage == stage:
                self.actions.append(self.weights.pop(index))
                return

    def count(self, stage: int, kind: Kind) -> int:
        return self.next.get((stage, kind), 0)


def _check_v(name: str, p: int, m: int, v: int) -> None:
    for key, value in (("p", p), ("m", m), ("v", v)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{key}={value!r} must be an integer >= 1.")
    if v != 2:
        raise ScheduleError(
            f"{name} runs two model chunks per rank placed in a V (v=2), got v={v}. Fix: use virtual_stages=2 (the "
            f"layout sets it for {name} when left at 1)."
        )


def zb_v(p: int, m: int, v: int = 2) -> Schedule:
    """ZB-V (module doc): 2p stages in a V, split backward, W deferred into the bubbles; any m >= 1."""
    _check_v("zb-v", p, m, v)
    n = max(m, 2 * p - 1)  # enough micro-batches to fill the V; those >= m are dropped below
    acts: list[list[Action]] = []
    for r in range(p):
        ops = _RankOps()
        down, up = r, 2 * p - 1 - r  # chunk 0, chunk 1
        for _ in range(2 * (p - r) - 1):
            ops.add(down, Kind.FORWARD)
        for _ in range(r):
            ops.add(up, Kind.FORWARD)
            ops.add(down, Kind.FORWARD)
        for _ in range(p - r):
            ops.add(up, Kind.FORWARD)
            ops.add(up, Kind.BACKWARD_INPUT)
            ops.deferred_w(up)
        while ops.count(up, Kind.FORWARD) < ops.count(down, Kind.FORWARD) or ops.count(down, Kind.FORWARD) < n:
            if ops.count(down, Kind.FORWARD) < n:
                ops.add(down, Kind.FORWARD)
            ops.add(down, Kind.BACKWARD_INPUT)
            ops.deferred_w(down)
            ops.add(up, Kind.FORWARD)
            ops.add(up, Kind.BACKWARD_INPUT)
            ops.deferred_w(up)
        for _ in range(r):  # cool-down: the I's on the critical path first, their W's deferred
            ops.add(down, Kind.BACKWARD_INPUT)
            ops.add(up, Kind.BACKWARD_INPUT)
        for _ in range(p - r):
            ops.add(down, Kind.BACKWARD_INPUT)
            ops.deferred_w(down)
        while ops.weights:  # chunk 1's deferred W's, then chunk 0's
            ops.deferred_w(up if any(w.stage == up for w in ops.weights) else down)
        acts.append([a for a in ops.actions if a.microbatch < m])
    return Schedule(p, m, acts, 2, "zb-v", Placement.V)


def dualpipev(p: int, m: int, v: int = 2) -> Schedule:
    """DualPipeV (module doc): 2p stages in a V, pairs of one micro-batch's forward chunk and another's
    backward chunk in the steady state; needs m >= 2p."""
    _check_v("dualpipev", p, m, v)
    if m < 2 * p:
        raise ScheduleError(
            f"dualpipev needs at least as many micro-batches as stages, m >= 2p = {2 * p}, got m={m}. "
            f"Fix: use microbatches={2 * p} or more, or schedule 'zb-v' (any m)."
        )
    acts: list[list[Action]] = []
    for r in range(p):
        ops = _RankOps()
        down, up = r, 2 * p - 1 - r
        for _ in range(2 * (p - r - 1)):
            ops.add(down, Kind.FORWARD)
        for _ in range(r + 1):
            ops.add(down, Kind.FORWARD)
            ops.add(up, Kind.FORWARD)
        for _ in range(p - r - 1):
            ops.add(up, Kind.BACKWARD_INPUT)
            ops.deferred_w()
            ops.add(up, Kind.FORWARD)
        for _ in range(m - 2 * p + r + 1):  # the overlapped pairs: (F down, B up), (F up, B down)
            ops.add(down, Kind.FORWARD)
            ops.add(up, Kind.BACKWARD)
            ops.add(up, Kind.FORWARD)
            ops.add(down, Kind.BACKWARD)
        for _ in range(p - r - 1):
            ops.add(up, Kind.BACKWARD)
            ops.add(up, Kind.FORWARD)
            ops.add(down, Kind.BACKWARD)
        split = False  # from the middle of step 6 on, backwards are I's whose W's fill the tail
        half = (r + 1) // 2
        for i in range(r + 1):
            if i == half and r % 2 == 1:
                split = True
            ops.add(up, Kind.BACKWARD_INPUT if split else Kind.BACKWARD)
            if i == half and r % 2 == 0:
                split = True
            ops.add(down, Kind.BACKWARD_INPUT if split else Kind.BACKWARD)
        for _ in range(p - r - 1):
            ops.deferred_w()
            ops.add(down, Kind.BACKWARD_INPUT if split else Kind.BACKWARD)
        while ops.weights:
            ops.deferred_w()
        acts.append(ops.actions)
    return Schedule(p, m, acts, 2, "dualpipev", Placement.V)


__all__ = ["dualpipev", "zb_v"]
