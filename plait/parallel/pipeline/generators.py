"""The schedule generators: naive, GPipe, 1F1B, interleaved 1F1B, zero-bubble (ZB-H1), PipeDream, and the
V-shaped ZB-V and DualPipeV (``vshape.py``).

Each is ``(p, m, v=1) -> Schedule``: the per-rank action lists of ``p`` ranks, ``m`` micro-batches and ``v``
model chunks per rank (stage s on rank s % p; the V-shaped ones place 2p stages in a V, ``Placement.V``). ``GENERATORS`` maps a ``Layout.schedule`` name to its
generator; ``schedule.build_schedule(name, p, m, v)`` looks it up. The bubbles and in-flight activations of
each are derived in docs/pipeline.md and checked against the simulator in tests/test_pipeline_schedule.py.
"""

from __future__ import annotations

from collections.abc import Callable

from plait.errors import ScheduleError
from plait.parallel.pipeline.schedule import Action, Kind, Schedule
from plait.parallel.pipeline.vshape import dualpipev, zb_v


def naive(p: int, m: int = 1, v: int = 1) -> Schedule:
    """Naive model parallelism: one micro-batch at a time, forward through every stage, then backward."""
    _check_sizes(p, m, v)
    acts: list[list[Action]] = [[] for _ in range(p)]
    for j in range(m):
        for s in range(p * v):
            acts[s % p].append(Action(s, Kind.FORWARD, j))
        for s in reversed(range(p * v)):
            acts[s % p].append(Action(s, Kind.BACKWARD, j))
    return Schedule(p, m, acts, v, "naive")


def gpipe(p: int, m: int, v: int = 1) -> Schedule:
    """GPipe (Huang et al. 2019): every forward, then every backward (flush); holds m activations per stage."""
    _check_sizes(p, m, v)
    acts: list[list[Action]] = [[] for _ in range(p)]
    for s in range(p * v):
        acts[s % p] += [Action(s, Kind.FORWARD, j) for j in range(m)]
    for s in reversed(range(p * v)):
        acts[s % p] += [Action(s, Kind.BACKWARD, j) for j in range(m)]
    return Schedule(p, m, acts, v, "gpipe")


def one_f_one_b(p: int, m: int, v: int = 1) -> Schedule:
    """1F1B / PipeDream-flush (Narayanan et al. 2021): rank r runs p-r-1 warm-up forwards, then alternates one
    forward and one backward, then drains; same bubble as GPipe, at most p activations in flight."""
    _check_sizes(p, m, v)
    if v != 1:
        raise ScheduleError(f"1f1b runs one stage per rank (v=1), got v={v}. Fix: use schedule 'interleaved'.")
    return _warmup_steady_cooldown(
        p,
        m,
        1,
        "1f1b",
        lambda r: min(p - r - 1, m),
        lambda r, k: Action(r, Kind.FORWARD, k),
        lambda r, k: Action(r, Kind.BACKWARD, k),
    )


def pipedream(p: int, m: int, v: int = 1) -> Schedule:
    """PipeDream (Narayanan et al. 2019): the 1F1B order on each rank. What makes it asynchronous (no flush
    between steps, weight stashing) belongs to the runtime; one step of it is simulated as 1F1B."""
    schedule = one_f_one_b(p, m, v)
    schedule.name = "pipedream"
    return schedule


def interleaved(p: int, m: int, v: int = 2) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021): v model chunks per rank (stage s on rank s % p) shrink the
    bubble to (p-1)/v x (tF + tB); micro-batches go round in groups of p, so m must be a multiple of p."""
    _check_sizes(p, m, v)
    if v == 1:
        schedule = one_f_one_b(p, m)
        schedule.name = "interleaved"
        return schedule
    if m % p:
        raise ScheduleError(
            f"interleaved needs the micro-batches to be a multiple of pp: m={m}, p={p}. "
            f"Fix: use m={max(p, m - m % p)} or m={m + p - m % p}, or schedule '1f1b'."
        )

    def forward(r: int, k: int) -> Action:
        return Action(((k // p) % v) * p + r, Kind.FORWARD, (k // (p * v)) * p + k % p)

    def backward(r: int, k: int) -> Action:
        return Action((v - 1 - (k // p) % v) * p + r, Kind.BACKWARD, (k // (p * v)) * p + k % p)

    def warmup(r: int) -> int:  # Megatron-LM's count; m == p runs all forwards first
        return m * v if m == p else min((p - r - 1) * 2 + (v - 1) * p, m * v)

    return _warmup_steady_cooldown(p, m, v, "interleaved", warmup, forward, backward)


def zero_bubble(p: int, m: int, v: int = 1) -> Schedule:
    """ZB-H1 (Qi et al. 2023): the backward split into I (input gradient, on the critical path) and W (weight
    gradient, deferrable); rank r defers r of its W passes to fill the cool-down bubbles. Bubble
    (p-1)(tF + tI - tW) while tW <= min(tF, tI) (a third of 1F1B's when all are equal); memory as 1F1B:
    p - r activations on rank r until their I, and at most p micro-batches whose W is still to run."""
    _check_sizes(p, m, v)
    if v != 1:
        raise ScheduleError(f"zero-bubble (ZB-H1) runs one stage per rank (v=1), got v={v}.")
    acts: list[list[Action]] = []
    for r in range(p):
        warm = min(p - r, m)
        lag = min(r, m - 1)  # rank r keeps r weight passes back, to fill its cool-down bubbles
        seq = [Action(r, Kind.FORWARD, j) for j in range(warm)]
        done_w = 0
        for k in range(m):  # I, then a deferred W (before the next F: at most p micro-batches open), then F
            seq.append(Action(r, Kind.BACKWARD_INPUT, k))
            if k >= lag:
                seq.append(Action(r, Kind.BACKWARD_WEIGHT, done_w))
                done_w += 1
            if warm + k < m:
                seq.append(Action(r, Kind.FORWARD, warm + k))
        seq += [Action(r, Kind.BACKWARD_WEIGHT, j) for j in range(done_w, m)]
        acts.append(seq)
    return Schedule(p, m, acts, 1, "zero-bubble")


def _warmup_steady_cooldown(
    p: int,
    m: int,
    v: int,
    name: str,
    warmup: Callable[[int], int],
    forward: Callable[[int, int], Action],
    backward: Callable[[int, int], Action],
) -> Schedule:
    """Rank r: ``warmup(r)`` forwards, then (forward, backward) pairs, then the remaining backwards."""
    total, acts = m * v, []
    for r in range(p):
        warm = warmup(r)
        seq = [forward(r, k) for k in range(warm)]
        for k in range(total - warm):
            seq += [forward(r, warm + k), backward(r, k)]
        seq += [backward(r, k) for k in range(total - warm, total)]
        acts.append(seq)
    return Schedule(p, m, acts, v, name)


def _check_sizes(p: int, m: int, v: int) -> None:
    for key, value in (("p", p), ("m", m), ("v", v)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{key}={value!r} must be an integer >= 1.")


GENERATORS: dict[str, Callable[..., Schedule]] = {
    "naive": naive,
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "zero-bubble": zero_bubble,
    "pipedream": pipedream,
    "zb-v": zb_v,
    "dualpipev": dualpipev,
}
"""Schedule generators by their ``Layout.schedule`` name: each is ``(p, m, v=1) -> Schedule``."""


__all__ = [
    "GENERATORS",
    "dualpipev",
    "gpipe",
    "interleaved",
    "naive",
    "one_f_one_b",
    "pipedream",
    "zb_v",
    "zero_bubble",
]
