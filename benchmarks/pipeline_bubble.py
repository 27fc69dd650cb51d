"""``python -m benchmarks.pipeline_bubble [--p 4] [--m 8] [--unit-ms 20] [--steps 3]``: the pipeline runtime's
measured bubble against the simulator's prediction, for every schedule, with equal-cost stages.

Each stage is one ``SleepStage``: its forward sleeps F units, its backward sleeps I units for the input gradient
and W units for the weight gradient, on separate autograd nodes (so a zero-bubble schedule can run them apart).
Sleeping keeps the figures independent of how many CPU cores the ranks share: what is measured is the schedule as
the runtime executes it (ordering, waits for p2p, Python overhead), not arithmetic speed. With F = I = W = 1 unit
(B = 2; per chunk 1/v of that with v virtual stages), the simulator predicts the bubble on the same costs (the
first stage's I is 0 and its W 2 units: it has no input gradient to compute).

Measured, per step: every rank starts after a barrier; busy = the time its compute actions took; makespan = last
compute end on any rank - first step start; bubble = 1 - sum(busy) / (p x makespan) (the simulator's definition).
The best of ``--steps`` steps is reported (the first includes the one-off shape pass and is dropped).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import plait
from benchmarks.launch import launch
from plait import Layout
from plait.parallel.pipeline import Costs, build_schedule, simulate


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


def _rank(schedule: str, p: int, m: int, v: int, unit_s: float, steps: int) -> dict:
    plait.init()
    try:
        chunk = unit_s / v
        model = nn.Sequential(*[SleepStage(4, chunk, chunk, chunk) for _ in range(p * v)])
        layout = Layout(pp=p, dp=1, microbatches=m, schedule=schedule, virtual_stages=v)
        engine = plait.parallelize(model, layout, optimizer=lambda params: torch.optim.SGD(params, lr=0.0),
                                   loss_fn=lambda out, target: (out - target).square().mean())
        batch = (torch.randn(m, 4), torch.randn(m, 4))
        runs = []
        for _ in range(steps + 1):
            engine.comm.barrier("world")
            engine.train_step(batch)
            runner = engine.pipeline
            busy = sum(end - start for _, start, end in runner.timeline)
            runs.append((runner.step_start, max(end for _, _, end in runner.timeline), busy))
        return {"runs": runs[1:]}
    finally:
        plait.distributed.shutdown()


def measure(schedule: str, p: int, m: int, v: int, unit_s: float, steps: int) -> tuple[float, float]:
    """(measured bubble fraction, simulated bubble fraction) for one schedule."""
    ranks = launch(_rank, p, schedule, p, m, v, unit_s, steps)
    bubbles = []
    for step in range(steps):
        start = min(r["runs"][step][0] for r in ranks)
        makespan = max(r["runs"][step][1] for r in ranks) - start
        busy = sum(r["runs"][step][2] for r in ranks)
        bubbles.append(1 - busy / (p * makespan))
    # the first stage has no input gradient to compute: the runtime's I does nothing there and its W the whole
    # backward (I = 0, W = 2 units), which only zero-bubble schedules see
    first_i = [0.0] + [1 / v] * (p * v - 1)
    first_w = [2 / v] + [1 / v] * (p * v - 1)
    costs = Costs(F=1 / v, B=2 / v, I=first_i, W=first_w)
    predicted = simulate(build_schedule(schedule, p, m, v), costs).bubble_fraction
    return min(bubbles), predicted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--p", type=int, default=4)
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--unit-ms", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    print(f"p={args.p} m={args.m}, equal stages: F = I = W = {args.unit_ms:g} ms (B = 2 units)")
    print(f"{'schedule':<14}{'v':>3}{'measured':>11}{'simulated':>11}{'rel. diff':>11}")
    for schedule, v in (("naive", 1), ("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero-bubble", 1)):
        measured, predicted = measure(schedule, args.p, args.m, v, args.unit_ms / 1000, args.steps)
        print(f"{schedule:<14}{v:>3}{measured:>11.2%}{predicted:>11.2%}{(measured - predicted) / predicted:>+11.1%}")


if __name__ == "__main__":
    main()
