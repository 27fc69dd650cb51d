"""``plait runs [PATH]``: what is in a run folder, or in a folder of them (``plait.train.run_info``).

    plait runs                    # every run under runs/: one line each (status, step, loss, checkpoints)
    plait runs runs/stdlib        # one run: status, configuration, losses, checkpoints, picture, what to run next
    plait runs runs/stdlib --verify   # ... reading every checkpoint file's SHA-256 (default: sizes only)

Reads only; changes nothing. Exit status 0, or 2 (``ConfigError``) when PATH is not a folder.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_runs_command(commands: Any) -> None:
    """Register ``plait runs`` on the ``plait`` parser's subcommands."""
    parser = commands.add_parser(
        "runs",
        help="what is in a run folder (status, last step, losses, checkpoints, how to resume), or in runs/",
        description="Show a run folder written by plait train: whether it finished, is running or stopped, its "
        "configuration, losses, checkpoints with their integrity, its picture, and how to resume, generate or "
        "export. Given a folder of runs, one line per run.",
    )
    parser.add_argument("path", nargs="?", default="runs", help="a run folder or a folder of them (default runs/)")
    parser.add_argument(
        "--verify", action="store_true", help="read every checkpoint file's SHA-256 (default: compare sizes only)"
    )


def _table(runs: list[Path], verify: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    from plait.train.run_info import read_run

    table = Table(title="runs", title_justify="left")
    for header in ("run", "status", "step", "loss", "checkpoints", "latest intact"):
        table.add_column(header, justify="right" if header in ("step", "loss", "checkpoints") else "left")
    for path in runs:
        info = read_run(path, verify)
        step = f"{info.last_step}" + (f"/{info.steps}" if info.steps is not None else "")
        loss = f"{info.last_loss:.4f}" if info.last_loss is not None else "-"
        resumable = info.resumable
        table.add_row(
            str(path),
            info.status,
            step,
            loss,
            str(len(info.checkpoints)),
            resumable.name if resumable is not None else "-",
        )
    Console(width=160).print(table)
    print("details of one run: plait runs RUN")  # noqa: T201 - CLI output


def run_runs(args: argparse.Namespace) -> int:
    from plait.train.run_info import describe, find_runs, read_run

    runs = find_runs(args.path)
    if not runs:
        print(f"no run folder under {args.path} (plait train --out RUN writes one)")  # noqa: T201 - CLI output
    elif len(runs) == 1 and Path(args.path) == runs[0]:
        print("\n".join(describe(read_run(runs[0], args.verify), args.verify)))  # noqa: T201 - CLI output
    else:
        _table(runs, args.verify)
    return 0


__all__ = ["add_runs_command", "run_runs"]
