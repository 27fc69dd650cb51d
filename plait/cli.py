"""The ``plait`` command.

``plait train`` on a laptop launches ``--nproc`` local processes through torchrun's own launcher
(``torch.distributed.run``, standalone rendezvous) running ``python -m plait train`` again; inside a torchrun
worker (LOCAL_RANK set) it is the training program itself. So on a cluster the same program runs under
``torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m plait train``.

``plait schedule`` simulates and draws a pipeline schedule in this process (``cli_schedule.py``); ``plait ps``
trains with parameter servers (``cli_ps.py``); ``plait plan``, ``plait simulate`` and ``plait calibrate`` are the
planner's (``plait/planner/commands.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from plait.cli_ps import add_ps_command, run_ps
from plait.cli_schedule import add_schedule_command, run_schedule
from plait.errors import ConfigError, PlaitError
from plait.planner.commands import PLANNER_COMMANDS, add_planner_commands, run_planner


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plait", description="Parallel training with every paradigm, in one place.")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser(
        "train",
        help="train the reference GPT (default: synthetic addition, 4 local CPU processes)",
        description="Train the reference GPT. Without torchrun around it, launches --nproc local processes.",
    )
    train.add_argument("--config", help="a TOML run configuration ([layout], [model], [data], [train])")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override one setting, e.g. --set layout.dp=2 --set train.steps=100 (repeatable)")
    train.add_argument("--nproc", type=int, default=4, help="local processes to launch (default 4)")
    train.add_argument("--out", help="run folder for metrics, plot and checkpoints (default runs/<id>)")
    add_schedule_command(commands)
    add_ps_command(commands)
    add_planner_commands(commands)
    return parser


def _in_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "RANK" in os.environ


def _launch(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Re-run this command in ``args.nproc`` processes under torchrun's launcher; returns the exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    out = args.out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    forwarded = ["train", "--out", out]  # inside torchrun, plait train is the worker whatever --nproc says
    if args.config:
        forwarded += ["--config", args.config]
    for item in args.overrides:
        forwarded += ["--set", item]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    parser = get_args_parser()
    parser.allow_abbrev = False  # the worker's own flags (--nproc, --out) must not match torchrun's by prefix
    torchrun_args = parser.parse_args(["--standalone", f"--nproc-per-node={args.nproc}", "--module", "plait", *forwarded])
    try:
        run(torchrun_args)
    except ChildFailedError as error:
        failed = ", ".join(f"rank {rank} (exit code {f.exitcode})" for rank, f in error.failures.items())
        print(f"plait: error: training failed on {failed}; see that rank's error above.", file=sys.stderr)  # noqa: T201
        return 1
    return 0


def _check_before_launch(args: argparse.Namespace) -> None:
    """Raise the error a worker would raise for bad input, before any process is started."""
    from plait.data import make_dataset
    from plait.run_config import load_config

    config = load_config(args.config, args.overrides)
    config.layout.resolve(args.nproc).check_batch(config.train.global_batch)
    try:
        make_dataset(config.data.name, **config.data.dataset_kwargs())
    except ValueError as error:
        raise ConfigError(f"[data] section: {error}") from error


def _train(args: argparse.Namespace) -> int:
    from plait.distributed import shutdown
    from plait.run_config import load_config
    from plait.train import run

    overrides = list(args.overrides) + ([f"train.out={args.out!r}".replace("'", '"')] if args.out else [])
    config = load_config(args.config, overrides)
    try:
        run(config)
    except BaseException:
        shutdown(wait_for_peers=False)
        raise
    shutdown()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    try:
        if args.command == "train":
            if args.nproc < 1:
                raise PlaitError(f"--nproc {args.nproc} must be at least 1.")
            if not _in_torchrun() and args.nproc > 1:
                from plait.run_config import load_config

                _check_before_launch(args)
                return _launch(args, argv)
            return _train(args)
        if args.command == "schedule":
            return run_schedule(args)
        if args.command == "ps":
            return run_ps(args)
        if args.command in PLANNER_COMMANDS:
            return run_planner(args)
    except PlaitError as error:
        print(f"plait: error: {type(error).__name__}: {error}", file=sys.stderr)  # noqa: T201 - CLI output
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
