"""``python -m benchmarks.stragglers [--blocks 20] [--block-steps 5]``: what straggler accounting costs per step.

Two gloo ranks train one GPT under ``Layout(dp=2)`` and run, each step, what ``plait train`` runs: the step
(``engine.train_step``) and the step metrics' all-gather (``StepMeter.measure``). One process per rank holds both
contenders and alternates blocks of steps (A B, B A, ...), step k of either training on global batch k:

- *off*: ``train.straggler_every=0``: no timing of collectives, the all-gather without the two extra numbers;
- *on*: ``train.straggler_every`` = the block length, so every "on" block ends one window (its analysis and its
  log line included): ``Comm.timed`` set (two ``perf_counter_ns`` per collective wait) and the meter's two window
  sums in the all-gather (``plait.observe.stragglers``).

A step's time is the max over ranks of ``perf_counter`` around both calls; per block the median; **on / off** is
the median over rounds of (the on block's median / the off block's in the same round) with min..max over rounds.
Two shapes: the ``ddp`` suite's GPT (4 x 128, batch 16 of 128 tokens) and a tiny one (2 x 64, batch 8 of 32
tokens) whose short step makes any fixed per-step cost show more.

On a loaded machine the step times move by more than the accounting costs, so the accounting is also timed on
its own (``accounting_cost``): per step, the collective waits of a step times one timed wait's cost, plus the
meter's per-step sums, plus one window's analysis spread over the window's steps; "/ off step" is that over the
off contender's median step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.workload import Workload, write_text
from plait.launch import run_local
from plait.models import GPTConfig

SHAPES = {
    "ddp suite GPT": Workload(),
    "tiny GPT": Workload(model=GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=4, d_model=64), global_batch=8),
}


def accounting_cost(stats: Any, meter: Any, repeats: int = 20000) -> dict[str, float]:
    """Host microseconds of the accounting alone, timed in a loop (robust to a loaded machine's noise, unlike the
    steps): one timed collective wait (two ``perf_counter_ns`` and ``CommStats.add_seconds``), ``columns`` (each
    step) and ``gathered`` at a window's end (its analysis; the log line muted)."""
    import logging

    from plait.comm.stats import CommStats

    counted = CommStats()
    counted.record("dp", "all_reduce", 4, 2)
    started = time.perf_counter()
    for _ in range(repeats):
        waited = time.perf_counter_ns()
        counted.add_seconds("dp", "all_reduce", (time.perf_counter_ns() - waited) / 1e9)
    wait_us = (time.perf_counter() - started) / repeats * 1e6
    started = time.perf_counter()
    for _ in range(repeats):
        meter.columns(stats)
    columns_us = (time.perf_counter() - started) / repeats * 1e6
    rows = torch.tensor([[1.0, 0.5], [1.2, 0.3]], dtype=torch.float64)
    logger = logging.getLogger("plait.observe.stragglers")
    level, windows = logger.level, repeats // 20
    logger.setLevel(logging.ERROR)
    started = time.perf_counter()
    for _ in range(windows):
        meter.gathered(meter.every, rows)
        meter.steps = 1
    window_us = (time.perf_counter() - started) / windows * 1e6
    logger.setLevel(level)
    return {"wait_us": wait_us, "columns_us": columns_us, "window_us": window_us}


def run_rank(workload: Workload, blocks: int, block_steps: int) -> dict[str, Any]:
    """This rank's (contender, step seconds) for every timed step, in order, its collective waits per step and
    the accounting's own cost (``accounting_cost``)."""
    import plait
    from plait.observe.stragglers import StragglerMeter
    from plait.train.metrics import StepMeter

    torch.set_num_threads(1)
    engine = plait.parallelize(workload.build_model(), plait.Layout(dp=2), optimizer=workload.optimizer)
    warmup = 3
    batches = workload.batches(engine.mesh.index("dp"), 2, warmup + 2 * blocks * block_steps)
    stragglers = StragglerMeter.start(engine, block_steps, 0.2, 3)
    meters = {
        "off": StepMeter(engine, workload.model, workload.model.seq_len),
        "on": StepMeter(engine, workload.model, workload.model.seq_len, stragglers),
    }
    for batch in batches[:warmup]:
        meters["off"].measure(engine.train_step(batch))
    times: list[tuple[str, float]] = []
    step = warmup
    for block in range(2 * blocks):
        rnd, second = divmod(block, 2)
        name = ("off", "on")[(rnd + second) % 2]  # A B, B A, A B, ...
        engine.comm.timed = name == "on"
        while engine.step % block_steps:  # an on block ends its window at its last step
            meters["off"].measure(engine.train_step(batches[step % len(batches)]))  # untimed alignment
            step += 1
        for _ in range(block_steps):
            started = time.perf_counter()
            meters[name].measure(engine.train_step(batches[step % len(batches)]))
            times.append((name, time.perf_counter() - started))
            step += 1
    stats = engine.train_step(batches[0])
    waits = sum(count.calls for count in stats.comm.counts.values()) + 1  # + the metrics' all-gather
    return {"times": times, "waits": waits} | accounting_cost(stats, stragglers)


def summarise(ranks: list[dict[str, Any]], block_steps: int) -> dict[str, Any]:
    """Per contender the median step ms, on / off paired by round (module docstring), and rank 0's accounting
    microseconds per step: waits x one wait's + columns + one window's analysis / the window's steps."""
    times = [r["times"] for r in ranks]
    steps = [(times[0][i][0], max(t[i][1] for t in times)) for i in range(len(times[0]))]  # max over ranks
    blocks = [steps[i : i + block_steps] for i in range(0, len(steps), block_steps)]
    medians = [(block[0][0], statistics.median(t for _, t in block)) for block in blocks]
    ratios = []
    for a, b in zip(medians[0::2], medians[1::2]):
        on, off = (a[1], b[1]) if a[0] == "on" else (b[1], a[1])
        ratios.append(on / off)
    return {
        "off_ms": 1e3 * statistics.median(t for name, t in steps if name == "off"),
        "on_ms": 1e3 * statistics.median(t for name, t in steps if name == "on"),
        "ratio": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
        "waits": ranks[0]["waits"],
        "accounting_us": ranks[0]["waits"] * ranks[0]["wait_us"]
        + ranks[0]["columns_us"]
        + ranks[0]["window_us"] / block_steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=20, help="rounds of one block per contender")
    parser.add_argument("--block-steps", type=int, default=5)
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(
        f"plait {commit}; 2 gloo ranks, Layout(dp=2), {args.blocks} rounds of {args.block_steps}-step blocks per "
        f"contender; 1-minute load {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores before the run"
    )
    print(
        f"{'shape':16s} {'off ms':>8s} {'on ms':>8s} {'on / off, paired (min..max)':>30s} {'waits/step':>10s} "
        f"{'accounting us/step':>18s} {'/ off step':>10s}"
    )
    with tempfile.TemporaryDirectory() as folder:
        text = write_text(Path(folder) / "text.txt")
        for shape, workload in SHAPES.items():
            ranks = run_local(run_rank, 2, workload.with_text(text), args.blocks, args.block_steps, timeout=1800)
            row = summarise(ranks, args.block_steps)
            print(
                f"{shape:16s} {row['off_ms']:8.2f} {row['on_ms']:8.2f} "
                f"{row['ratio']:>12.4f} ({row['min']:.3f}..{row['max']:.3f}) {row['waits']:10d} "
                f"{row['accounting_us']:18.2f} {row['accounting_us'] / 1e3 / row['off_ms']:10.2e}"
            )


if __name__ == "__main__":
    main()
