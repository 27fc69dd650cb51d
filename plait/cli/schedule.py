"""``plait schedule``: simulate a pipeline schedule in this process, print its summary, draw it, trace it.

    plait schedule --schedule 1f1b --pp 4 --microbatches 8 --out 1f1b.png --trace 1f1b.json
    plait schedule --schedule interleaved --pp 4 --microbatches 8 --virtual-stages 2 --costs F=1,B=2,p2p=0.1
    plait schedule --schedule zb-v --pp 4 --microbatches 8 --costs F=0.5,B=1   # two half-stage chunks per rank
    plait schedule --text mine.txt --out mine.png        # or --csv mine.csv: a hand-written schedule

Costs are ``KEY=VALUE`` pairs separated by commas (F, B, I, W, p2p, overhead; F/B/I/W may be per stage, values
separated by colons: ``F=1:1:2:2``); the default is F=1, B=2 (I = W = 1 when the backward is split). A schedule
that cannot run (unknown name, malformed, deadlocking) is a ``ScheduleError``: ``plait`` prints it and exits
with 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from plait.errors import ConfigError
from plait.layout import V_SHAPED, PipelineSchedule


def add_schedule_command(commands: Any) -> None:
    """Register ``plait schedule`` on the ``plait`` parser's subcommands."""
    parser = commands.add_parser(
        "schedule",
        help="simulate and draw a pipeline schedule (bubbles, activations in flight, deadlocks)",
        description="Simulate a pipeline schedule in one process: print the bubble and the activations in flight "
        "per rank, draw the timeline (--out) and write a Chrome/Perfetto trace (--trace).",
    )
    parser.add_argument(
        "--schedule",
        default="1f1b",
        help="naive, gpipe, 1f1b, interleaved, zero-bubble, pipedream, zb-v or dualpipev (default 1f1b)",
    )
    parser.add_argument("--pp", type=int, help="pipeline ranks p (default 4; from the file with --text/--csv)")
    parser.add_argument("--microbatches", type=int, help="micro-batches m per step (default 8)")
    parser.add_argument(
        "--virtual-stages", type=int, help="model chunks per rank v (default 1; interleaved, zb-v, dualpipev: 2)"
    )
    parser.add_argument(
        "--costs",
        default="",
        metavar="F=1,B=2,...",
        help="action costs: F, B, I, W (numbers, or per-stage a:b:c), p2p, overhead (default F=1,B=2)",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--text", metavar="FILE", help="read a custom schedule: one line of actions per rank")
    source.add_argument("--csv", metavar="FILE", help="read a custom schedule: rows rank,action,action,...")
    parser.add_argument("--out", metavar="PNG", help="draw the timeline to this picture")
    parser.add_argument("--trace", metavar="JSON", help="write a Chrome/Perfetto trace (open in ui.perfetto.dev)")
    parser.add_argument("--save-text", metavar="FILE", help="write the schedule as text (a start for editing)")
    parser.add_argument("--lowered", action="store_true", help="print the schedule with its explicit sends/recvs")


def parse_costs(text: str) -> dict[str, Any]:
    """``"F=1,B=2:2:3:3,p2p=0.1"`` -> ``{"F": 1.0, "B": [2.0, 2.0, 3.0, 3.0], "p2p": 0.1}``."""
    costs: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        try:
            if not sep or not key:
                raise ValueError
            numbers = [float(v) for v in value.split(":")]
        except ValueError:
            raise ConfigError(
                f"--costs item {item!r} is not KEY=NUMBER. Fix: e.g. --costs F=1,B=2,p2p=0.1, or per stage F=1:1:2:2."
            ) from None
        if key in ("p2p", "overhead") and len(numbers) != 1:
            raise ConfigError(f"--costs {key} takes one number (the same for every hop / action).")
        costs[key] = numbers[0] if len(numbers) == 1 else numbers
    return costs


def _load(args: argparse.Namespace):
    from plait.parallel.pipeline import Schedule, build_schedule

    sizes = {"p": args.pp, "m": args.microbatches, "v": args.virtual_stages}
    path = args.text or args.csv
    if path is None:
        two = args.schedule == PipelineSchedule.INTERLEAVED or args.schedule in V_SHAPED
        defaults = {"p": 4, "m": 8, "v": 2 if two else 1}
        p, m, v = (defaults[key] if sizes[key] is None else sizes[key] for key in ("p", "m", "v"))
        return build_schedule(args.schedule, p, m, v)
    try:
        if args.csv:
            return Schedule.from_csv(path, **sizes)
        return Schedule.from_text(Path(path).read_text(), **sizes, name=Path(path).stem)
    except OSError as error:
        raise ConfigError(f"cannot read the schedule file {path}: {error.strerror or error}.") from None


def run_schedule(args: argparse.Namespace) -> int:
    """Build or read the schedule, simulate it, report; ``PlaitError`` propagates to ``plait.cli.main.main``."""
    from plait.parallel.pipeline import draw_schedule, lower, simulate

    costs = parse_costs(args.costs)
    schedule = _load(args)
    result = simulate(schedule, costs)
    lines = [result.summary()]
    for rank, (busy, idle) in enumerate(zip(result.busy, result.idle)):
        lines.append(
            f"  rank {rank}: busy {busy:g}, idle {idle:g}, activations in flight at most "
            f"{result.peak_activations[rank]}, micro-batches with backward pending at most "
            f"{result.peak_unfinished[rank]}"
        )
    if args.lowered:
        lines.append(lower(schedule, costs).to_text().rstrip())
    try:
        if args.save_text:
            Path(args.save_text).write_text(schedule.to_text())
            lines.append(f"schedule text: {args.save_text}")
        if args.out:
            lines.append(f"timeline: {draw_schedule(result, args.out)}")
        if args.trace:
            Path(args.trace).write_text(json.dumps(result.to_chrome_trace()))
            lines.append(f"trace: {args.trace} (open in ui.perfetto.dev or chrome://tracing)")
    except OSError as error:
        raise ConfigError(
            f"cannot write {error.filename or 'an output file'}: {error.strerror or error}. Fix: "
            f"give a path in an existing, writable folder."
        ) from None
    print("\n".join(lines), file=sys.stdout)  # noqa: T201 - the command's output
    return 0


__all__ = ["add_schedule_command", "parse_costs", "run_schedule"]
