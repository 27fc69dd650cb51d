"""``python -m benchmarks.param_server [--before DIR] [--steps N] [--out BENCHMARKS.md]``

Parameter-server throughput: worker pushes applied per second, ASP and BSP, 2 servers with 1 and 2 workers, at
two model sizes: the reference GPT of the tests (2 layers x d_model 32, 26 k parameters) and one ~90x larger
(3 layers x d_model 256, 2.4 M parameters), with the same 8-sample batches of the synthetic addition task.

torch has no parameter-server module to race (torch.distributed.rpc is a toolkit, not a server), so each row stands
beside the ceiling of this machine: a worker step (pull, forward, backward, push) cannot beat one process's forward +
backward + optimizer step, and W workers share the cores, so pushes/s <= min(W, cores) x that rate ("ideal"). The
rate counts the servers' applied pushes between the first applied push and the last worker's finish (no start-up).

``--before DIR`` runs the same jobs on another checkout of plait (e.g. ``git worktree add /tmp/ps-before a4ee3b7``,
the code before issue 15: pickled messages, two round trips per step), each job in a subprocess with that tree on
PYTHONPATH, in the same run as this tree's. Only ``JobConfig``, ``LocalCluster``, ``AdditionGPT``,
``Consistency`` and ``OptimizerSpec`` are used, which both have.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("benchmarks.param_server")
SIZES = {"tiny": {"d_model": 32, "n_layer": 2}, "large": {"d_model": 256, "n_layer": 3}}
JOBS = [(mode, workers) for mode in ("asp", "bsp") for workers in (1, 2)]
SERVERS = 2


def _task(size: str) -> Any:
    from plait.param_server import AdditionGPT

    return AdditionGPT(**SIZES[size])


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process (Linux /proc), None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_process_steps_per_s(size: str, steps: int, cpu: list[float] | None = None) -> float:
    """Forward + backward + AdamW steps per second of the same model and batch in this one process (and, into
    ``cpu``, the CPU seconds one step took)."""
    import torch

    from plait.param_server import OptimizerSpec

    torch.set_num_threads(1)
    task = _task(size)
    model = task.build_model()
    optimizer = OptimizerSpec("AdamW", {"lr": 3e-3}).build(list(model.parameters()))
    batch = task.batch_of(0, 0)
    for _ in range(3):  # warm-up
        task.loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    started, cpu_started = time.perf_counter(), time.process_time()
    for _ in range(steps):
        task.loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    if cpu is not None:
        cpu.append((time.process_time() - cpu_started) / steps)
    return steps / (time.perf_counter() - started)


Sample = tuple[float, int, int]
"""(time, pushes applied by server 0, server 0's version), one per poll of the servers' reports."""


def push_window(samples: list[Sample]) -> tuple[Sample, Sample]:
    """The samples that bound the timed pushes: the first poll that saw a push and the last poll; when every push
    landed between two polls (a fast machine), the poll before the first push instead of the first."""
    ended = samples[-1]
    started = next(sample for sample in samples if sample[1] > 0)
    if started[1] == ended[1]:
        before = [sample for sample in samples if sample[1] < ended[1]]
        if not before:
            raise RuntimeError(f"no report came before the job's {ended[1]} pushes; poll more often or run more steps")
        started = before[-1]
    return started, ended


def measure(size: str, mode: str, workers: int, steps: int, extra: dict[str, Any]) -> dict[str, Any]:
    """Run one job in this process's plait; pushes/s and server updates/s between the first push and the end (from
    the last poll before it, when every push landed between two polls), and
    the one-process ceiling measured just before and just after it (the mean of both: a paired ceiling, so load
    that changes during a long run moves the job and its ceiling together)."""
    from plait.param_server import Consistency, JobConfig, LocalCluster, OptimizerSpec

    ceiling_steps = 60 if size == "tiny" else 12
    step_cpu: list[float] = []
    single_before = one_process_steps_per_s(size, ceiling_steps, step_cpu)
    config = JobConfig(
        servers=SERVERS,
        workers=workers,
        steps=steps,
        consistency=Consistency(mode, 0),
        optimizer=OptimizerSpec("AdamW", {"lr": 3e-3}),
        task=_task(size),
        log_every_s=0.0,
    )
    names = {field.name for field in dataclasses.fields(config)}
    config = dataclasses.replace(config, **{k: v for k, v in extra.items() if k in names})
    if "worker_log_every_s" in names:
        config = dataclasses.replace(config, worker_log_every_s=0.0)
    samples: list[Sample] = []
    cpu_start: dict[int, float] = {}  # every job process's CPU seconds when the first push was applied
    cpu_last: dict[int, float] = {}

    def record(reports: list[dict[str, Any]]) -> None:
        first = next((r for r in reports if r["index"] == 0), None)
        if first is None:
            return
        samples.append((time.monotonic(), first["pushes_applied"], first["version"]))
        processes = [p for p in [*cluster.servers, *cluster.workers.values()] if p is not None]
        for process in processes:
            value = cpu_seconds(process.pid)
            if value is not None:
                cpu_last[process.pid] = value
                if first["pushes_applied"] > 0 and not cpu_start_done:
                    cpu_start[process.pid] = value
        if first["pushes_applied"] > 0:
            cpu_start_done.append(True)

    cpu_start_done: list[bool] = []

    with LocalCluster(config) as cluster:
        cluster.start_servers()
        for index in range(workers):
            cluster.start_worker(index)
        cluster.wait_workers(on_reports=record, poll_s=0.05)
        cluster.stop()
    started, ended = push_window(samples)
    seconds = max(1e-9, ended[0] - started[0])
    single_after = one_process_steps_per_s(size, ceiling_steps, step_cpu)
    job_cpu = sum(cpu_last[pid] - start for pid, start in cpu_start.items())
    pushes = ended[1] - started[1]
    return {
        "cpu_efficiency": (sum(step_cpu) / len(step_cpu)) * pushes / job_cpu if job_cpu > 0 else float("nan"),
        "pushes_per_s": (ended[1] - started[1]) / seconds,
        "updates_per_s": (ended[2] - started[2]) / seconds,
        "pushes": ended[1],
        "single_steps_per_s": (single_before + single_after) / 2,
        "single_spread": abs(single_before - single_after) / max(single_before, single_after),
    }


def measure_in(tree: Path, size: str, mode: str, workers: int, steps: int, extra: dict[str, Any]) -> dict[str, Any]:
    """``measure`` in a subprocess that imports plait from ``tree``."""
    job = json.dumps({"size": size, "mode": mode, "workers": workers, "steps": steps, "extra": extra})
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, __file__, "--one", job],
        capture_output=True,
        text=True,
        env=env,
        cwd=tree,  # the job's processes (forkserver) must import plait from ``tree``, not from the caller's folder
        timeout=900,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"job {job} on {tree} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown(rows: list[dict[str, Any]], single: dict[str, float], command: str, info: dict[str, Any]) -> str:
    cores = os.cpu_count() or 1
    lines = [
        f"`{command}`",
        "",
        "| model | code | mode | servers | workers | push dtype | pushes/s | server updates/s | ideal pushes/s "
        "(ceiling drift) | x ideal | CPU efficiency |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ideal = min(row["workers"], cores) * row["single_steps_per_s"]
        lines.append(
            f"| {row['size']} | {row['code']} | {row['mode']} | {SERVERS} | {row['workers']} | "
            f"{row['extra'].get('push_dtype', 'float32')} | {row['pushes_per_s']:.1f} | {row['updates_per_s']:.1f} | "
            f"{ideal:.1f} ({100 * row['single_spread']:.0f}%) | {row['pushes_per_s'] / ideal:.2f} | "
            f"{row['cpu_efficiency']:.2f} |"
        )
    lines += [
        "",
        "Workloads: reference GPT on 2-digit addition, 8 samples per worker step, AdamW on the servers; tiny = 2 layers "
        f"x d_model 32 (26 k parameters; one process alone at the start: {single['tiny']:.1f} steps/s), large = 3 "
        f"layers x d_model 256 (2.4 M parameters, ~90x; one process alone at the start: {single['large']:.1f} "
        "steps/s). Each row's ideal is min(workers, cores) x the one-process rate measured in the job's own "
        "process just before and just after the job (their mean; the drift between the two in brackets). CPU "
        "efficiency: one process's CPU seconds per step x pushes / the CPU seconds all the job's processes (servers "
        "and workers, from /proc) used over the same window; 1 = the parameter server costs no CPU beyond the "
        "training itself. It is far less sensitive to other load than the wall-clock ratio. "
        f"plait {info['plait']}. Machine: {info['nproc']} cores, {info['cpu']}, torch {info['torch']}; "
        f"{info['conditions']}.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="steps per worker, tiny model (default 40)")
    parser.add_argument("--large-steps", type=int, default=20, help="steps per worker, large model (default 20)")
    parser.add_argument("--before", type=Path, help="another plait checkout to measure in the same run")
    parser.add_argument("--sizes", default="tiny,large", help="comma-separated model sizes (default tiny,large)")
    parser.add_argument("--out", type=Path, help="write the table into this file's <!-- bench:ps --> block")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:  # a subprocess of --before: one job, its figures as JSON on stdout
        job = json.loads(args.one)
        print(json.dumps(measure(job["size"], job["mode"], job["workers"], job["steps"], job["extra"])))  # noqa: T201
        return 0
    from benchmarks.report import conditions, machine, replace_block

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    info = machine()
    info["conditions"] = conditions(info)
    sizes = args.sizes.split(",")
    unknown = sorted(set(sizes) - set(SIZES))
    if unknown:
        parser.error(f"unknown sizes {unknown}: use {sorted(SIZES)}")
    single = {size: one_process_steps_per_s(size, 60 if size == "tiny" else 12) for size in SIZES}
    here = Path(__file__).resolve().parent.parent
    trees = [("before", args.before.resolve())] if args.before else []
    trees.append(("after", here))
    rows = []
    for size in args.sizes.split(","):
        steps = args.steps if size == "tiny" else args.large_steps
        plans = [(code, tree, mode, workers, {}) for code, tree in trees for mode, workers in JOBS]
        plans.append(("after", here, "asp", 2, {"push_dtype": "bfloat16"}))
        for code, tree, mode, workers, extra in plans:
            figures = measure_in(tree, size, mode, workers, steps, extra)
            rows.append({"size": size, "code": code, "mode": mode, "workers": workers, "extra": extra, **figures})
            log.info(
                "%s %s %s workers=%d %s: %.1f pushes/s (ideal %.1f)",
                size,
                code,
                mode,
                workers,
                extra or "",
                figures["pushes_per_s"],
                min(workers, os.cpu_count() or 1) * figures["single_steps_per_s"],
            )
    text = markdown(rows, single, "python -m benchmarks.param_server " + shlex.join(sys.argv[1:]), info)
    print(text)  # noqa: T201 - the benchmark's output
    if args.out:
        replace_block(args.out, "ps", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
