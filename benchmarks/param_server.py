"""``python -m benchmarks.param_server [--steps N] [--modes asp,bsp] [--out BENCHMARKS.md]``

Parameter-server throughput: worker pushes applied per second with 1, 2 and 4 workers and 1 vs 2 servers, for
each consistency mode, on the reference GPT and the synthetic addition task (plait's `run_local`, every process
on this machine). torch has no parameter-server module to race (torch.distributed.rpc is a toolkit, not a
server), so the figure beside each row is the ceiling this machine allows: a worker step (pull, forward,
backward, push) cannot beat one process's forward + backward + optimizer step, and W workers share the cores,
so pushes/s <= min(W, cores) x that rate ("ideal"). The rate is taken between the servers' first applied push
and the last worker's finish, from the servers' own counters, so process start-up is not counted.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import conditions, machine, replace_block
from plait.param_server import AdditionGPT, Consistency, JobConfig, LocalCluster, OptimizerSpec

log = logging.getLogger("benchmarks.param_server")
OPTIMIZER = OptimizerSpec("AdamW", {"lr": 3e-3})
GRID = [(servers, workers) for servers in (1, 2) for workers in (1, 2, 4)]


def one_process_steps_per_s(task: AdditionGPT, steps: int) -> float:
    """Forward + backward + optimizer steps per second of the same model and batch in this one process."""
    torch.set_num_threads(1)
    model = task.build_model()
    optimizer = OPTIMIZER.build(list(model.parameters()))
    batch = task.batch_of(0, 0)
    for _ in range(3):  # warm-up
        task.loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    started = time.perf_counter()
    for _ in range(steps):
        task.loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    return steps / (time.perf_counter() - started)


def measure(mode: str, servers: int, workers: int, steps: int) -> dict[str, Any]:
    """Run one job; pushes/s and server updates/s between the first applied push and the end."""
    staleness = 2 if mode == "ssp" else 0
    config = JobConfig(
        servers=servers,
        workers=workers,
        steps=steps,
        consistency=Consistency(mode, staleness),
        optimizer=OPTIMIZER,
        log_every_s=0.0,
    )
    samples: list[tuple[float, int, int]] = []  # (time, pushes applied by server 0, server 0's version)

    def record(reports: list[dict[str, Any]]) -> None:
        first = next((r for r in reports if r["index"] == 0), None)
        if first is not None:
            samples.append((time.monotonic(), first["pushes_applied"], first["version"]))

    with LocalCluster(config) as cluster:
        cluster.start_servers()
        for index in range(workers):
            cluster.start_worker(index)
        cluster.wait_workers(on_reports=record, poll_s=0.05)
        cluster.stop()
    started = next(sample for sample in samples if sample[1] > 0)
    ended = samples[-1]
    seconds = ended[0] - started[0]
    return {
        "mode": mode,
        "servers": servers,
        "workers": workers,
        "pushes_per_s": (ended[1] - started[1]) / seconds,
        "updates_per_s": (ended[2] - started[2]) / seconds,
        "pushes": ended[1],
    }


def markdown(rows: list[dict[str, Any]], single: float, command: str, info: dict[str, Any]) -> str:
    cores = os.cpu_count() or 1
    lines = [
        f"`{command}`",
        "",
        "| mode | servers | workers | pushes/s | server updates/s | ideal pushes/s | x ideal |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ideal = min(row["workers"], cores) * single
        lines.append(
            f"| {row['mode']} | {row['servers']} | {row['workers']} | {row['pushes_per_s']:.1f} | "
            f"{row['updates_per_s']:.1f} | {ideal:.1f} | {row['pushes_per_s'] / ideal:.2f} |"
        )
    task = AdditionGPT()
    lines += [
        "",
        f"Workload: reference GPT {task.n_layer} layers x d_model {task.d_model} on {task.digits}-digit "
        f"addition, {task.batch} samples per worker step, AdamW; one process alone: {single:.1f} steps/s. "
        f"plait {info['plait']}. Machine: {info['nproc']} cores, {info['cpu']}, torch {info['torch']}; "
        f"{conditions(info)}.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="steps per worker (default 60)")
    parser.add_argument("--modes", default="asp,bsp", help="comma-separated consistency modes (default asp,bsp)")
    parser.add_argument("--out", type=Path, help="write the table into this file's <!-- bench:ps --> block")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    info = machine()
    single = one_process_steps_per_s(AdditionGPT(), steps=100)
    rows = []
    for mode in args.modes.split(","):
        for servers, workers in GRID:
            rows.append(measure(mode, servers, workers, args.steps))
            log.info(
                "%s servers=%d workers=%d: %.1f pushes/s, %.1f updates/s",
                mode,
                servers,
                workers,
                rows[-1]["pushes_per_s"],
                rows[-1]["updates_per_s"],
            )
    text = markdown(rows, single, "python -m benchmarks.param_server " + shlex.join(sys.argv[1:]), info)
    print(text)  # noqa: T201 - the benchmark's output
    if args.out:
        replace_block(args.out, "ps", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
