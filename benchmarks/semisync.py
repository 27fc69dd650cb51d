"""Bytes crossing HSDP replica groups per step: synchronous HSDP vs LocalSGD vs DiLoCo (``plait.parallel.semisync``).

``python -m benchmarks.semisync [--steps 8] [--every 4] [--out BENCHMARKS.md]`` trains the benchmark workload
(``benchmarks.workload``: the 0.88 M-parameter GPT on bytes, AdamW, clip 1) on 4 CPU ranks as 2 replica groups
of 2 ZeRO-3 ranks (``Layout(dp=4, dp_replicate=2, zero=3)``), once per mode in one run, and reports per rank and
step the wire bytes ``plait.comm`` counted on ``replicate`` (the links between groups: across nodes on a cluster),
on ``shard`` (inside a group) and on ``dp``/``dp_cp`` (the step's token counts and loss report), next to theory:
synchronous HSDP all-reduces every gradient shard every step, 2(R-1)/R x 4 P/N bytes; LocalSGD and DiLoCo send the
same all-reduce once per H steps (the parameters' shards), 1/H of it per step. The loss after the last step is
shown for the record (a few steps of a tiny model: it says the runs train, not which algorithm is better). Step
time is not compared: on one machine's loopback the bytes between groups cost what bytes inside a group do, which
is not what the algorithms save on a cluster (slow links between nodes).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import plait
from benchmarks.report import replace_block
from benchmarks.workload import Workload, write_text
from plait import Layout
from plait.launch import run_local
from plait.parallel.semisync import SemiSync, held_tensors

WORLD, REPLICAS = 4, 2
MODES = ("sync", "localsgd", "diloco")


def _train(workload: Workload, mode: str, every: int, steps: int) -> dict[str, Any]:
    """One rank's run: per step its wire bytes by axis, and the last loss."""
    sync = SemiSync(mode, every=every) if mode != "sync" else None
    engine = plait.parallelize(
        workload.build_model(),
        Layout(dp=WORLD, dp_replicate=REPLICAS, zero=3),
        optimizer=workload.optimizer,
        max_grad_norm=workload.max_grad_norm,
        sync=sync,
    )
    batches = workload.batches(engine.mesh.index("dp"), WORLD, steps)
    by_axis: list[dict[str, int]] = []
    loss = 0.0
    for batch in batches:
        stats = engine.train_step(batch)
        loss = stats.loss
        axes: dict[str, int] = {}
        for (axis, _op), count in stats.comm.counts.items():
            axes[axis] = axes.get(axis, 0) + count.wire_bytes
        by_axis.append(axes)
    shards = sum(tensor.numel() for tensor in held_tensors(engine.strategy))  # this rank's master shards
    return {"bytes": by_axis, "loss": loss, "shard_elements": shards}


def _mean_bytes(per_step: list[dict[str, int]], axes: tuple[str, ...]) -> float:
    return sum(sum(step.get(axis, 0) for axis in axes) for step in per_step) / len(per_step)


def measure(steps: int, every: int) -> str:
    """The markdown table of one run (every mode, rank 0's counts: every rank sends the same)."""
    with tempfile.TemporaryDirectory() as folder:
        workload = Workload().with_text(write_text(Path(folder) / "text.txt"))
        results = {mode: run_local(_train, WORLD, workload, mode, every, steps)[0] for mode in MODES}
    shard_elements = results["sync"]["shard_elements"]
    theory_sync = 2 * (REPLICAS - 1) / REPLICAS * 4 * shard_elements
    base = _mean_bytes(results["sync"]["bytes"], ("replicate",))
    rows = [
        "| mode | `replicate` B/step (measured) | theory | vs sync | `shard` B/step | `dp`+`dp_cp` B/step | "
        "loss after the last step |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in MODES:
        result = results[mode]
        replicate = _mean_bytes(result["bytes"], ("replicate",))
        theory = theory_sync if mode == "sync" else theory_sync / every
        rows.append(
            f"| {mode if mode == 'sync' else f'{mode} (H={every})'} | {replicate:,.0f} | {theory:,.0f} | "
            f"{replicate / base:.3f} | {_mean_bytes(result['bytes'], ('shard',)):,.0f} | "
            f"{_mean_bytes(result['bytes'], ('dp', 'dp_cp')):,.0f} | "
            f"{result['loss']:.4f} |"
        )
    head = (
        f"{Workload().describe()}; `Layout(dp=4, dp_replicate=2, zero=3)`, {steps} steps, per rank (rank 0; every "
        f"rank sends the same); P/N = {shard_elements:,} padded elements per shard.\n\n"
    )
    return head + "\n".join(rows) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None, help="rewrite the bench:semisync block of this file")
    args = parser.parse_args()
    table = measure(args.steps, args.every)
    if args.out is not None:
        replace_block(args.out, "semisync", table)
    print(table)  # noqa: T201 - a command-line report


if __name__ == "__main__":
    main()
