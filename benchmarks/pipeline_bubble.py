"""``python -m benchmarks.pipeline_bubble [--p 4] [--m 8] [--unit-ms 20] [--steps 3] [--trace PREFIX] [--schedules
1f1b,zb-v]``: the pipeline runtime's measured bubble against the simulator's prediction, for every schedule (the
V-shaped zb-v and dualpipev with their two chunks per rank), with equal-cost stages.

Each stage is one ``SleepStage``: its forward sleeps F units, its backward sleeps I units for the input gradient
and W units for the weight gradient, on separate autograd nodes (so a zero-bubble schedule can run them apart).
Sleeping keeps the figures independent of how many CPU cores the ranks share: what is measured is the schedule as
the runtime executes it (ordering, waits for p2p, Python overhead), not arithmetic speed. With F = I = W = 1 unit
(B = 2; per chunk 1/v of that with v virtual stages), the simulator predicts the bubble on the same costs (the
first stage's I is 0 and its W 2 units: it has no input gradient to compute).

Measured, per step: every rank starts after a barrier; the pp group's timelines are gathered on one clock
(``engine.pipeline_timeline()``); busy = the time a rank's compute actions took; makespan = last compute end -
first step start; bubble = 1 - sum(busy) / (p x makespan) (the simulator's definition). The best of ``--steps``
steps is reported (the first includes the one-off shape pass and is dropped). Three predictions:

- simulated: the nominal costs (F = I = W = 1 unit, no latency);
- calibrated: the run's own per-stage mean F, B (I, W) durations; its hop latency ``p2p`` = the median delay
  from an action's end on one rank to the start of the action it feeds on another, where that rank was waiting
  for it; and its per-action ``overhead`` = the median gap between two actions of a rank whose input was
  already there (posting the sends and receives in between, Python). Sleeps overshoot and autograd adds to
  each action; gloo adds to each hop; overhead is idle time that every action pays;
- replayed: every action's own measured duration (same hop latency and overhead), through the same simulator.

What remains between measured and replayed is what medians do not capture: hops and gaps longer than usual
(ranks woken late by a loaded machine), and their position on the critical path. It grows with the machine's
load (ranks share cores). ``--trace PREFIX`` writes each schedule's last step as a Chrome trace and a PNG.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field

import torch
from torch import nn

import plait
from benchmarks.launch import launch
from plait import Layout
from plait.parallel.pipeline import Action, Costs, SimResult, build_schedule, simulate


class _Sleep(torch.autograd.Function):
    """Identity that sleeps ``forward_s`` in forward and ``backward_s`` in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:  # type: ignore[override]
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        time.sleep(ctx.backward_s)
        return grad, None, None


class SleepStage(nn.Module):
    """y = sleep_I(x + b) + sleep_W(w): F in forward; I on the input path, W on the weight's own branch. The
    bias b puts the input path in the graph on the first stage too (its input needs no gradient), so every
    stage's backward costs I + W."""

    def __init__(self, width: int, forward_s: float, input_s: float, weight_s: float) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(width))
        self.weight = nn.Parameter(torch.zeros(width))
        self.forward_s, self.input_s, self.weight_s = forward_s, input_s, weight_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        path = _Sleep.apply(x + self.bias, self.forward_s, self.input_s)
        return path + _Sleep.apply(self.weight, 0.0, self.weight_s)


def _rank(schedule: str, p: int, m: int, v: int, unit_s: float, steps: int, trace: str) -> list[SimResult]:
    plait.init()
    try:
        chunk = unit_s / v
        model = nn.Sequential(*[SleepStage(4, chunk, chunk, chunk) for _ in range(p * v)])
        layout = Layout(pp=p, dp=1, microbatches=m, schedule=schedule, virtual_stages=v)
        engine = plait.parallelize(
            model,
            layout,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.0),
            loss_fn=lambda out, target: (out - target).square().mean(),
        )
        batch = (torch.randn(m, 4), torch.randn(m, 4))
        runs = []
        for step in range(steps + 1):
            engine.comm.barrier("world")
            engine.train_step(batch)
            if step == steps and trace:
                runs.append(engine.save_pipeline_trace(f"{trace}_{schedule}.json", png=f"{trace}_{schedule}.png"))
            else:
                runs.append(engine.pipeline_timeline())
        return runs[1:]
    finally:
        plait.distributed.shutdown()


def calibrated_costs(result: SimResult) -> Costs:
    """The run's own per-stage mean durations of F, B, I, W (ms) and its hop latency: ``p2p`` = the median
    delay from the end of an action on one rank to the start of the action it feeds on another, over the hops
    where the consumer was idle waiting for it (everything between: the gloo message, posting and waiting)."""
    spans = {(s.action.stage, s.action.kind, s.action.microbatch): s for spans in result.timelines for s in spans}
    stages = result.schedule.num_stages
    per_kind: dict[str, list[float]] = {}
    for kind in ("F", "B", "I", "W"):
        means = []
        for stage in range(stages):
            durations = [s.end - s.start for (st, k, _), s in spans.items() if st == stage and k == kind]
            means.append(statistics.fmean(durations) if durations else 0.0)
        per_kind[kind] = means
    previous_end = {}
    for timeline in result.timelines:
        for before, after in zip(timeline, timeline[1:]):
            previous_end[after.action] = before.end
    hops, gaps = [], []
    for (stage, kind, j), span in spans.items():
        producer = (stage - 1, "F", j) if kind == "F" else None
        if kind in ("B", "I") and stage < stages - 1:
            producer = (stage + 1, "B", j) if (stage + 1, "B", j) in spans else (stage + 1, "I", j)
        remote = (
            producer is not None
            and producer in spans
            and result.schedule.rank_of(stage) != result.schedule.rank_of(producer[0])
        )
        ready = spans[producer].end if remote else 0.0
        if span.action not in previous_end:  # a rank's first action: no previous end to measure from
            continue
        if previous_end[span.action] <= ready:  # the consumer was waiting for this input
            hops.append(span.start - ready)
        else:  # its input was there: the gap is the runtime's own overhead between actions
            gaps.append(span.start - previous_end[span.action])
    has_split = any(per_kind["I"]) or any(per_kind["W"])
    return Costs(
        F=per_kind["F"],
        B=per_kind["B"] if not has_split else [i + w for i, w in zip(per_kind["I"], per_kind["W"])],
        I=per_kind["I"] if has_split else None,
        W=per_kind["W"] if has_split else None,
        p2p=statistics.median(hops) if hops else 0.0,
        overhead=statistics.median(gaps) if gaps else 0.0,
    )


@dataclass(frozen=True)
class Replay(Costs):
    """Costs that give every compute action its own measured duration (ms): the simulator replays the run."""

    durations: dict = field(default_factory=dict)

    def of(self, action: Action) -> float:
        return 0.0 if action.is_comm else self.durations[action]


def measure(
    schedule: str, p: int, m: int, v: int, unit_s: float, steps: int, trace: str = ""
) -> tuple[float, float, float, float, Costs]:
    """(measured bubble, simulated on the nominal costs, simulated on the run's calibrated per-stage means,
    replayed with every action's own duration, the calibrated costs) for one schedule; the step with the
    smallest measured bubble is reported."""
    runs = launch(_rank, p, schedule, p, m, v, unit_s, steps, trace)[0]
    best = min(runs, key=lambda result: result.bubble_fraction)
    # the first stage has no input gradient to compute: the runtime's I does nothing there and its W the whole
    # backward (I = 0, W = 2 units), which only zero-bubble schedules see
    first_i = [0.0] + [1 / v] * (p * v - 1)
    first_w = [2 / v] + [1 / v] * (p * v - 1)
    nominal = Costs(F=1 / v, B=2 / v, I=first_i, W=first_w)
    built = build_schedule(schedule, p, m, v)
    costs = calibrated_costs(best)
    durations = {s.action: s.end - s.start for spans in best.timelines for s in spans}
    replay = Replay(p2p=costs.p2p, overhead=costs.overhead, durations=durations)
    return (
        best.bubble_fraction,
        simulate(built, nominal).bubble_fraction,
        simulate(built, costs).bubble_fraction,
        simulate(built, replay).bubble_fraction,
        costs,
    )


SCHEDULES = (
    ("naive", 1),
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved", 2),
    ("zero-bubble", 1),
    ("zb-v", 2),
    ("dualpipev", 2),
)
"""Each schedule and its chunks per rank v (each chunk F = I = W = 1/v units)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--p", type=int, default=4)
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--unit-ms", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--trace", default="", help="write each schedule's last step as PREFIX_<schedule>.json/.png")
    parser.add_argument(
        "--schedules", default=",".join(name for name, _ in SCHEDULES), help="comma-separated (default: all)"
    )
    args = parser.parse_args()
    chosen = args.schedules.split(",")
    unknown = sorted(set(chosen) - {name for name, _ in SCHEDULES})
    if unknown:
        parser.error(f"unknown schedule(s) {', '.join(unknown)}; choose from {', '.join(n for n, _ in SCHEDULES)}")
    print(f"p={args.p} m={args.m}, equal stages: F = I = W = {args.unit_ms:g} ms (B = 2 units)")
    print(
        f"{'schedule':<13}{'v':>2}{'measured':>10}{'simulated':>11}{'rel.':>8}{'calibrated':>12}{'rel.':>8}"
        f"{'replayed':>10}{'rel.':>8}   hop, overhead, mean F / B (ms)"
    )
    for schedule, v in [(name, v) for name, v in SCHEDULES if name in chosen]:
        measured, *predictions, costs = measure(
            schedule, args.p, args.m, v, args.unit_ms / 1000, args.steps, args.trace
        )
        cells = "".join(
            f"{value:>{width}.2%}{(measured - value) / value:>+8.1%}" for value, width in zip(predictions, (11, 12, 10))
        )
        print(
            f"{schedule:<13}{v:>2}{measured:>10.2%}{cells}   {costs.p2p:.2f}, {costs.overhead:.2f}, "
            f"{statistics.fmean(costs.F):.2f} / {statistics.fmean(costs.B):.2f}"
        )


if __name__ == "__main__":
    main()
