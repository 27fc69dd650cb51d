"""``plait ps``: train the reference GPT on the synthetic addition task with a parameter server.

    plait ps --servers 2 --workers 4                      # both roles as local processes (default BSP)
    plait ps --mode ssp --staleness 2 --optimizer AdamW --lr 3e-3 --steps 200
    plait ps --role server --index 0 --servers 2 --bind 0.0.0.0:29600          # on server host 0
    plait ps --role worker --index 3 --servers 2 --connect h0:29600,h1:29600   # on any worker host

A local run shows the servers' progress live (version, updates/s, staleness, live workers: a table in a terminal,
log lines otherwise) and ends with a summary and the held-out loss; a server started with ``--role server`` logs
the same figures every second. Bad input is a ``ConfigError``: ``plait`` prints it and exits with 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from plait.errors import ConfigError


def add_ps_command(commands: Any) -> None:
    """Register ``plait ps`` on the ``plait`` parser's subcommands."""
    parser = commands.add_parser(
        "ps",
        help="parameter-server training: BSP / ASP / SSP, workers may die or join",
        description="Train the reference GPT on synthetic addition with parameter servers (docs/param_server.md).",
    )
    parser.add_argument("--servers", type=int, default=2, help="server processes owning the parameters (default 2)")
    parser.add_argument("--workers", type=int, default=4, help="local worker processes (default 4)")
    parser.add_argument("--steps", type=int, default=100, help="pull/compute/push steps per worker (default 100)")
    parser.add_argument("--mode", default="bsp", help="bsp, asp or ssp (default bsp)")
    parser.add_argument("--staleness", type=int, default=None, help="SSP bound s (default 2 with --mode ssp)")
    parser.add_argument("--optimizer", default="AdamW", help="any torch.optim class name (default AdamW)")
    parser.add_argument("--lr", type=float, default=3e-3, help="learning rate (default 3e-3)")
    parser.add_argument("--batch", type=int, default=8, help="samples per worker and step (default 8)")
    parser.add_argument("--checkpoint-dir", help="servers write server-I.pt here (atomically) and resume from it")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="updates between checkpoints (0: never)")
    parser.add_argument(
        "--role",
        choices=("local", "server", "worker"),
        default="local",
        help="local: everything here; server/worker: one process of a multi-machine job",
    )
    parser.add_argument("--index", type=int, default=0, help="this server's or worker's index (--role server/worker)")
    parser.add_argument("--bind", default="0.0.0.0:29600", help="HOST:PORT a server listens on (--role server)")
    parser.add_argument("--connect", default="", help="servers' HOST:PORT, comma-separated, in index order (worker)")


def _config(args: argparse.Namespace):
    from plait.param_server import AdditionGPT, Consistency, JobConfig, OptimizerSpec

    staleness = args.staleness if args.staleness is not None else (2 if args.mode == "ssp" else 0)
    if args.batch < 1:
        raise ConfigError(f"--batch {args.batch} must be at least 1.")
    config = JobConfig(
        servers=args.servers,
        workers=args.workers,
        steps=args.steps,
        consistency=Consistency(args.mode, staleness),
        optimizer=OptimizerSpec(args.optimizer, {"lr": args.lr}),
        task=AdditionGPT(batch=args.batch),
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
    )
    config.validate()
    config.optimizer.build(list(config.task.build_model().parameters()))  # an unknown optimizer fails here
    return config


def run_ps(args: argparse.Namespace) -> int:
    """Run the chosen role; ``PlaitError`` propagates to ``plait.cli.main.main``."""
    import torch

    from plait.logging import configure
    from plait.param_server import run_local, run_worker, serve_shard
    from plait.param_server.progress import ProgressView, summary_line
    from plait.param_server.transport import parse_address

    config = _config(args)
    try:
        if args.role == "server":
            host, port = parse_address(args.bind)
            serve_shard(config, args.index, host, port)
            return 0
        if args.role == "worker":
            addresses = [parse_address(item) for item in args.connect.split(",") if item]
            if len(addresses) != config.servers:
                raise ConfigError(
                    f"--connect lists {len(addresses)} servers but --servers is {config.servers}. Fix: "
                    f"give every server's HOST:PORT in index order."
                )
            run_worker(config, args.index, addresses)
            return 0
    except ValueError as error:
        raise ConfigError(str(error)) from error
    configure(rank=0)
    title = f"plait ps: {config.consistency.mode.upper()}, {config.servers} servers, {config.workers} workers"
    view = ProgressView(title)
    try:  # the view shows progress here, so the servers' own progress log lines are off
        result = run_local(dataclasses.replace(config, log_every_s=0.0), on_reports=view.update)
    finally:
        view.close()
    model = config.task.build_model()
    model.load_state_dict(result.params)
    with torch.no_grad():
        held_out = float(config.task.loss(model, config.task.eval_batch()))
    lines = [f"{title}: held-out loss {held_out:.3f}"]
    lines += [f"  {summary_line(report)}, {report['pushes_applied']} pushes applied" for report in result.reports]
    print("\n".join(lines), file=sys.stdout)  # noqa: T201 - the command's output
    return 0


__all__ = ["add_ps_command", "run_ps"]
