"""``python -m benchmarks.moe_overlap [--steps 4] [--schedules 1f1b,dualpipev] [--zero 3]``: how much of expert
parallelism's token exchange lies off the critical path, per step, under each pipeline schedule, read from plait's
trace.

Every rank trains the same MoE GPT under ``Layout(dp=2, pp=2, ep=2, microbatches=m, schedule=S, zero=Z)`` (4
processes on gloo) with a ``plait.observe.trace.Tracer`` recording. For each ``all_to_all_v`` over "ep" (the
dispatch and the combine of routed rows, forward and backward) the trace holds the launch, the start and the end of
its wait. Per step and rank:

- *exchange*: the summed time the exchanges take from launch to the end of their wait;
- *exposed*: the part the rank spends blocked in them (a blocking call: all of it; an asynchronous one: its wait);
- *hidden*: exchange - exposed, the time the exchanges travelled while the rank computed something else.

Two variants per schedule: ``overlap`` (plait's default: the dispatch exchange is issued asynchronously and the
shared experts' MLP runs while the rows travel, ``plait.parallel.expert.dispatch``; under DualPipeV the
steady-state pairs also run overlapped, ``plait.parallel.pipeline.overlap``: every exchange of a pair in flight
while the other chunk computes) and ``serial`` (the shared experts computed before the exchange is issued and the
pairs run in order: every exchange blocks). On a CPU machine whose
cores all compute, "exposed" also holds the time the exchange's own copies take from the compute, so the figures
are a reading of this run, not of the wire; a loaded machine's figures say so in the output.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.workload import write_text
from plait.launch import run_local

MODEL = {
    "vocab_size": 256,
    "seq_len": 64,
    "n_layer": 4,
    "n_head": 4,
    "d_model": 64,
    "n_experts": 8,
    "top_k": 2,
    "moe_d_ff": 128,
    "n_shared_experts": 1,
    "moe_start": 0,
    "moe_every": 1,
}
"""Every block MoE (each of a V's four chunks has one), with a shared expert of width 128 to overlap."""


class Serial:
    """An ``ExpertParallelDispatch`` whose in-flight work runs before the exchange is issued (every exchange
    blocks): the baseline of the overlap."""

    def __init__(self, dispatch: Any) -> None:
        self.dispatch = dispatch

    def __call__(self, x_perm: Any, counts: Any, experts: Any, in_flight: Callable[[], None] | None = None) -> Any:
        if in_flight is not None:
            in_flight()
        return self.dispatch(x_perm, counts, experts)


def exchange_times(record: dict[str, Any]) -> list[dict[str, float]]:
    """Per traced step of one rank's ``Tracer.local_record``: exchange, exposed and hidden ms of its ep
    ``all_to_all_v``s (each counted in the step its wait ended in)."""
    out = []
    for _step, start, end, _memory in record["steps"]:

        def inside(t: int) -> bool:
            return start <= t <= end  # noqa: B023 - used within this iteration

        flights = [(f[1], f[2]) for f in record["flights"] if f[0] == "all_to_all_v ep" and inside(f[2])]
        waits = [s[4] - s[3] for s in record["spans"] if s[2] == "wait all_to_all_v ep" and inside(s[4])]
        blocking = [s[4] - s[3] for s in record["spans"] if s[2] == "all_to_all_v ep" and inside(s[4])]
        exchange = sum(b - a for a, b in flights) + sum(blocking)
        exposed = sum(waits) + sum(blocking)
        out.append({"exchange": exchange / 1e6, "exposed": exposed / 1e6, "hidden": (exchange - exposed) / 1e6})
    return out


def run_rank(schedule: str, microbatches: int, serial: bool, steps: int, text: str, zero: int = 0) -> dict[str, Any]:
    """Train ``steps`` traced steps (after 2 untraced) on this rank; its per-step exchange times and step ms."""
    import plait
    from plait.data import ByteTextDataset, ShardedBatches
    from plait.models import GPT, GPTConfig
    from plait.models.moe import moe_layers
    from plait.observe.trace import Tracer

    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL))
    layout = plait.Layout(dp=2, pp=2, ep=2, microbatches=microbatches, schedule=schedule, zero=zero)
    engine = plait.parallelize(model, layout, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    if serial:
        for layer in moe_layers(engine.model):
            layer.dispatch = Serial(layer.dispatch)
        if engine.pipeline is not None:
            engine.pipeline.overlap_pairs = False
    data = ByteTextDataset(text, seq_len=MODEL["seq_len"])
    loader = ShardedBatches(data, 16, dp_rank=engine.mesh.index("dp"), dp_size=engine.mesh.size("dp"))
    for step in range(2):
        engine.train_step(loader.batch_at(step))
    tracer = Tracer(engine)
    with tracer:
        for step in range(2, 2 + steps):
            engine.train_step(loader.batch_at(step))
    record = tracer.local_record()
    return {
        "times": exchange_times(record),
        "step_ms": [(end - start) / 1e6 for _s, start, end, _m in record["steps"]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--schedules", default="1f1b,dualpipev")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--zero", type=int, default=0, help="ZeRO stage (3: each chunk of a pair gathers its units)")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    print(
        f"dp2 x pp2 x ep2 MoE GPT {MODEL['n_layer']} blocks, d {MODEL['d_model']}, {MODEL['n_experts']} experts "
        f"top-{MODEL['top_k']} + 1 shared; global batch 16, m={args.microbatches}, zero={args.zero}; {args.steps} traced "
        f"steps; 1-minute load {load:.2f} on {os.cpu_count()} cores before the run"
    )
    print(
        f"{'schedule':10s} {'variant':8s} {'step ms':>8s} {'exchange ms':>12s} {'exposed ms':>11s} {'hidden ms':>10s}"
    )
    with tempfile.TemporaryDirectory() as folder:
        text = str(write_text(Path(folder) / "text.txt"))
        for schedule in args.schedules.split(","):
            for serial in (True, False):
                ranks = run_local(
                    run_rank, 4, schedule, args.microbatches, serial, args.steps, text, args.zero, timeout=900
                )
                per_step = [t for r in ranks for t in r["times"]]  # every rank's every step
                step_ms = statistics.median(max(r["step_ms"][i] for r in ranks) for i in range(args.steps))
                row = {key: statistics.median(t[key] for t in per_step) for key in ("exchange", "exposed", "hidden")}
                print(
                    f"{schedule:10s} {'serial' if serial else 'overlap':8s} {step_ms:8.1f} {row['exchange']:12.2f} "
                    f"{row['exposed']:11.2f} {row['hidden']:10.2f}"
                )


if __name__ == "__main__":
    main()
