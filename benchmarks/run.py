"""``python -m benchmarks.run [--suite ddp|zero1|zero3|pp|tp|cp|overhead|checkpoint|all] [--world N] [--quick] [--out F]``

Runs plait and its torch-native peer on the same model, batches, optimizer and seeds, in one invocation,
alternating the two so that machine noise hits both alike, and prints one table per suite with the ratios next to
the theoretical figure. ``--out BENCHMARKS.md`` rewrites that file's result blocks in place. ``checkpoint``
(``benchmarks/checkpoint.py``) times checkpoint saves and loads against plain DCP and the stall of synchronous vs
asynchronous saves; it has its own table.

Each distributed suite runs at every world size in its ``worlds`` (2 and 4; ``tp`` at 2, ``cp`` at 4) unless
``--world`` names one.
``--quick`` (a smoke run: 2 timed steps, 1 warm-up, 1 round per contender) proves that every pair runs; its
figures mean nothing. From code (e.g. a smoke test): ``run_suite("ddp", world=2, steps=2, warmup=1)`` returns the
rows as dicts.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from benchmarks.contenders import SUITES, Suite
from benchmarks.launch import launch
from benchmarks.measure import summarise
from benchmarks.report import busy_cpu_seconds, conditions, machine, print_tables, replace_block, write_markdown
from benchmarks.worker import RankResult, RunSpec, run_rank
from benchmarks.workload import write_text

log = logging.getLogger("benchmarks.run")


QUICK = {"steps": 2, "warmup": 1, "rounds": 1}
"""``--quick``: the smallest run that exercises every contender (timing, bytes, probe, parameters)."""


def worlds_of(suite: Suite, world: int | None) -> list[int]:
    """The world sizes to run ``suite`` at: its own list, or ``world`` where the suite is distributed."""
    return list(suite.worlds) if world is None or suite.fixed_world else [world]


def _resolve_world(suite: Suite, world: int | None) -> int:
    if suite.fixed_world or world is None:
        if world is not None and world not in suite.worlds:
            log.info(
                "suite %s runs at world size %d (--world %d applies to the distributed suites)",
                suite.name,
                suite.worlds[0],
                world,
            )
        return suite.worlds[0]
    if world < suite.min_world:
        raise ValueError(f"suite {suite.name!r} needs at least {suite.min_world} ranks, got world={world}")
    if suite.workload.global_batch % world:
        raise ValueError(
            f"suite {suite.name!r}: global batch {suite.workload.global_batch} does not split over "
            f"world={world}; use a divisor of it (e.g. 2 or 4)"
        )
    return world


def run_suite(
    name: str,
    world: int | None = None,
    steps: int | None = None,
    warmup: int | None = None,
    rounds: int | None = None,
) -> list[dict[str, Any]]:
    """Run suite ``name`` and return one row (a dict) per contender, plait first; see ``measure.summarise``.

    ``steps``: timed steps per round (a launch, or a block in one process); ``warmup``: untimed steps per
    contender per launch; ``rounds``: alternations (per contender). None takes the suite's default.
    """
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}: use one of {', '.join(SUITES)}")
    suite = SUITES[name]
    world = _resolve_world(suite, world)
    steps = suite.steps if steps is None else steps
    warmup = suite.warmup if warmup is None else warmup
    rounds = suite.rounds if rounds is None else rounds
    if steps < 1 or warmup < 0 or rounds < 1:
        raise ValueError(f"need steps >= 1, warmup >= 0, rounds >= 1; got {steps}, {warmup}, {rounds}")
    with tempfile.TemporaryDirectory(prefix="plait-bench-") as tmp:
        workload = suite.workload.with_text(write_text(Path(tmp) / "text.txt"))
        launches: list[list[RankResult]] = []
        if suite.interleave == "block":
            spec = RunSpec(suite.contenders, workload, warmup, steps, blocks=rounds)
            log.info("%s: %d blocks x %d steps of %s in one process", name, rounds, steps, " / ".join(suite.contenders))
            launches.append(launch(run_rank, world, spec))
        else:
            for r in range(rounds):
                order = suite.contenders if r % 2 == 0 else tuple(reversed(suite.contenders))
                for contender in order:
                    log.info("%s round %d/%d: %s on %d ranks", name, r + 1, rounds, contender, world)
                    spec = RunSpec((contender,), workload, warmup, steps, saved_activations=suite.saved_activations)
                    launches.append(launch(run_rank, world, spec))
    return summarise(suite, world, launches)


def wait_for_quiet(max_load: float, patience_s: float) -> float:
    """Wait (up to ``patience_s``) until the 1-minute load average is at most ``max_load``; return the load."""
    deadline = time.monotonic() + patience_s
    load = os.getloadavg()[0]
    while load > max_load and time.monotonic() < deadline:
        log.info("1-minute load %.2f > %.2f: waiting 30 s before measuring", load, max_load)
        time.sleep(30)
        load = os.getloadavg()[0]
    if load > max_load:
        log.warning("1-minute load still %.2f (> %.2f): the figures are taken on a busy machine", load, max_load)
    return load


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[1])
    parser.add_argument(
        "--suite", default="all", choices=[*SUITES, "checkpoint", "all"], help="which pair to run (default all)"
    )
    parser.add_argument("--world", type=int, help="ranks for the distributed suites (default: each of 2 and 4)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 2 timed steps, 1 warm-up, 1 round (overrides --steps/--warmup/--rounds)",
    )
    parser.add_argument("--steps", type=int, help="timed steps per round (default: the suite's)")
    parser.add_argument("--warmup", type=int, help="untimed steps per contender and launch (default: the suite's)")
    parser.add_argument("--rounds", type=int, help="alternations per contender (default: the suite's)")
    parser.add_argument("--out", type=Path, help="markdown file whose result blocks to rewrite (e.g. BENCHMARKS.md)")
    parser.add_argument("--json", type=Path, help="also write the rows and the machine facts to this JSON file")
    parser.add_argument(
        "--max-load",
        type=float,
        default=None,
        help="wait until the 1-minute load is at most this before measuring (e.g. 0.5)",
    )
    parser.add_argument("--patience", type=float, default=600.0, help="longest wait for --max-load, seconds")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        stream=sys.stderr,
        format="[%(asctime)s %(levelname)s %(name)s] %(message)s",
        datefmt="%H:%M:%S",
    )
    if args.max_load is not None:
        wait_for_quiet(args.max_load, args.patience)
    info = machine()
    names = list(SUITES) if args.suite == "all" else [name for name in [args.suite] if name in SUITES]
    rows: list[dict[str, Any]] = []
    started, (machine_before, own_before) = time.monotonic(), busy_cpu_seconds()
    counts = QUICK if args.quick else {"steps": args.steps, "warmup": args.warmup, "rounds": args.rounds}
    for name in names:
        for world in worlds_of(SUITES[name], args.world):
            rows += run_suite(name, world, **counts)
    checkpoint_rows = _checkpoint_suite(args) if args.suite in ("checkpoint", "all") else []
    machine_after, own_after = busy_cpu_seconds()
    info["wall_s"] = time.monotonic() - started
    info["foreign_cpu_s"] = max(0.0, (machine_after - machine_before) - (own_after - own_before))
    log.info(
        "done in %.0f s; 1-minute load %.2f before; other processes took %.1f CPU-s meanwhile",
        info["wall_s"],
        info["load_1m"],
        info["foreign_cpu_s"],
    )
    console = Console(width=max(Console().width, 200))
    if rows:
        print_tables(console, {n: SUITES[n].title for n in names}, rows, info)
    command = shlex.join(["python", "-m", "benchmarks.run", *argv])
    if checkpoint_rows:
        from benchmarks.checkpoint import markdown

        console.print(markdown(checkpoint_rows, command, f"plait {info['plait']}; {conditions(info)}"))
    if args.json is not None:
        args.json.write_text(json.dumps({"machine": info, "rows": rows + checkpoint_rows}, indent=1, default=str))
    if args.out is not None:
        if rows:
            write_markdown(args.out, rows, command, info)
        if checkpoint_rows:
            from benchmarks.checkpoint import markdown

            body = markdown(
                checkpoint_rows,
                command,
                f"plait {info['plait']}. Machine: {info['nproc']} cores, "
                f"{info['cpu']}, torch {info['torch']}; {conditions(info)}",
            )
            replace_block(args.out, "checkpoint", body)
        log.info("wrote %s", args.out)
    return 0


def _checkpoint_suite(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The ``checkpoint`` suite (``benchmarks/checkpoint.py``): --quick is 1 round and a 4-step stall block."""
    from benchmarks.checkpoint import run_checkpoint_suite

    if args.quick:
        return run_checkpoint_suite(rounds=1, stall_steps=4, stall_every=2)
    return run_checkpoint_suite(rounds=args.rounds or 3)


if __name__ == "__main__":
    sys.exit(main())
