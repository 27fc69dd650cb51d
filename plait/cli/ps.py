"""``plait ps``: train with parameter servers (the reference GPT on synthetic addition, or a run config's model).

    plait ps --servers 2 --workers 4                      # both roles as local processes (default BSP)
    plait ps --mode ssp --staleness 2 --optimizer AdamW --lr 3e-3 --steps 200
    plait ps --config run.toml --set model.d_model=128    # the [model] and [data] sections of `plait train`
    plait ps keygen ps.key                                # a random key, mode 0600, for a multi-host job
    plait ps --role server --index 0 --servers 2 --bind 0.0.0.0:29600 --key-file ps.key        # server host 0
    plait ps --role worker --index 3 --servers 2 --connect h0:29600,h1:29600 --key-file ps.key  # any worker host

A local run shows the servers' progress live (version, updates/s, staleness, live workers: a table in a terminal,
log lines otherwise), each worker logs its own, and it ends with a summary (held-out loss, updates, staleness
histogram) and writes ``<out>/{ps.png,summary.json,ckpt}`` (a plait checkpoint: ``plait convert`` reads it).
Servers bind 127.0.0.1 unless told otherwise and refuse any other address without a key (``plait ps keygen``);
on loopback without a key, servers and workers use this user's local key, so only this user's processes connect.
Bad input is a ``ConfigError``: ``plait`` prints it and exits with 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from plait.errors import ConfigError


def add_ps_command(commands: Any) -> None:
    """Register ``plait ps`` on the ``plait`` parser's subcommands."""
    parser = commands.add_parser(
        "ps",
        help="parameter-server training: BSP / ASP / SSP, workers may die or join",
        description="Train with parameter servers (docs/param_server.md). `plait ps keygen FILE` writes a key.",
    )
    parser.add_argument("action", nargs="?", choices=("keygen",), help="keygen FILE: write a random key (0600)")
    parser.add_argument("key_path", nargs="?", metavar="FILE", help="where keygen writes the key")
    parser.add_argument("--config", help="a run configuration (TOML): its [model] and [data] sections are trained")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override --config")
    parser.add_argument("--servers", type=int, default=2, help="server processes owning the parameters (default 2)")
    parser.add_argument("--workers", type=int, default=4, help="workers; BSP waits for this many (default 4)")
    parser.add_argument("--steps", type=int, default=100, help="pull/compute/push steps per worker (default 100)")
    parser.add_argument("--mode", default="bsp", help="bsp, asp or ssp (default bsp)")
    parser.add_argument("--staleness", type=int, default=None, help="SSP bound s (default 2 with --mode ssp)")
    parser.add_argument("--optimizer", default="AdamW", help="any torch.optim class name (default AdamW)")
    parser.add_argument("--lr", type=float, default=3e-3, help="learning rate (default 3e-3)")
    parser.add_argument("--batch", type=int, default=8, help="samples per worker and step (default 8)")
    parser.add_argument("--push-dtype", default="float32", help="gradients on the wire: float32, bfloat16, float16")
    parser.add_argument("--checkpoint-dir", help="servers write server-I.pt here (atomically) and resume from it")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="updates between checkpoints (0: never)")
    parser.add_argument("--out", help="local run: folder for ps.png, summary.json and ckpt (default runs/ps-TIME)")
    parser.add_argument(
        "--role",
        choices=("local", "server", "worker"),
        default="local",
        help="local: everything here; server/worker: one process of a multi-machine job",
    )
    parser.add_argument("--index", type=int, default=0, help="this server's or worker's index (--role server/worker)")
    parser.add_argument("--bind", default="127.0.0.1:29600", help="HOST:PORT a server listens on (default loopback)")
    parser.add_argument("--connect", default="", help="servers' HOST:PORT, comma-separated, in index order (worker)")
    parser.add_argument("--key-file", help="the job's key (0600 file from `plait ps keygen`); or PLAIT_PS_AUTHKEY")


def _task(args: argparse.Namespace) -> Any:
    """The demo (AdditionGPT) or, with --config, the run configuration's [model] on its [data]."""
    from plait.param_server import AdditionGPT, ModelTask, SectionModel

    if args.batch < 1:
        raise ConfigError(f"--batch {args.batch} must be at least 1.")
    if not args.config and not args.set:
        return AdditionGPT(batch=args.batch)
    from plait.data import make_dataset
    from plait.models.loss import lm_loss
    from plait.train.config import load_config

    run = load_config(args.config, args.set)
    if run.data.attention != "causal":  # the workers call model(inputs): token ids only
        raise ConfigError(
            f"plait ps trains on token ids, not packed documents: data.attention={run.data.attention!r}. "
            f"Fix: data.attention='causal' for plait ps (plait train takes documents)."
        )
    try:
        dataset = make_dataset(run.data.dataset_name, **run.data.dataset_kwargs())
    except ValueError as error:
        raise ConfigError(f"[data] section: {error}") from error
    model_fn = SectionModel(dict(run.model), dataset.vocab_size, dataset.seq_len)
    return ModelTask(model_fn, dataset, lm_loss, args.batch, run.train.seed)


def _config(args: argparse.Namespace) -> Any:
    from plait.param_server import Consistency, JobConfig, OptimizerSpec

    staleness = args.staleness if args.staleness is not None else (2 if args.mode == "ssp" else 0)
    task = _task(args)
    config = JobConfig(
        servers=args.servers,
        workers=args.workers,
        steps=args.steps,
        consistency=Consistency(args.mode, staleness),
        optimizer=OptimizerSpec(args.optimizer, {"lr": args.lr}),
        task=task,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        push_dtype=args.push_dtype,
    )
    config.validate()
    config.optimizer.build(list(task.build_model().parameters()))  # an unknown optimizer fails here
    return config


def run_ps(args: argparse.Namespace) -> int:
    """Run the chosen role; ``PlaitError`` propagates to ``plait.cli.main.main``."""
    from plait.logging import configure
    from plait.param_server import run_worker, serve_shard
    from plait.param_server.api import run_job
    from plait.param_server.keys import check_bind, generate_key_file, resolve_key
    from plait.param_server.progress import ProgressView, summary_line
    from plait.param_server.summary import summary_text
    from plait.param_server.transport import parse_address

    if args.action == "keygen":
        if not args.key_path:
            raise ConfigError("plait ps keygen needs a FILE. Fix: plait ps keygen ps.key")
        path = generate_key_file(args.key_path)
        print(f"wrote a random key to {path} (mode 0600): pass --key-file {path} to every server and worker")  # noqa: T201
        return 0
    try:
        key = resolve_key(args.key_file)
        if args.role == "server":
            host, port = parse_address(args.bind)
            check_bind(host, key)  # before any model is built
            serve_shard(_config(args), args.index, host, port, key=key)
            return 0
        if args.role == "worker":
            addresses = [parse_address(item) for item in args.connect.split(",") if item]
            if len(addresses) != args.servers:
                raise ConfigError(
                    f"--connect lists {len(addresses)} servers but --servers is {args.servers}. Fix: "
                    f"give every server's HOST:PORT in index order."
                )
            run_worker(_config(args), args.index, addresses, key=key)
            return 0
    except ValueError as error:
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(str(error)) from error
    config = _config(args)
    configure(rank=0)
    title = f"plait ps: {config.consistency.mode.upper()}, {config.servers} servers, {config.workers} workers"
    out = Path(args.out) if args.out else Path("runs") / f"ps-{time.strftime('%Y%m%d-%H%M%S')}"
    view = ProgressView(title)
    try:  # the view shows the servers' progress here, so their own progress log lines are off
        result = run_job(dataclasses.replace(config, log_every_s=0.0), out, on_reports=view.update)
    finally:
        view.close()
    lines = [f"{title}: held-out loss {result.held_out_loss:.3f}"]
    lines += [f"  {summary_line(report)}, {report['pushes_applied']} pushes applied" for report in result.reports]
    lines += [summary_text(result.summary), f"  wrote {out}/ps.png, {out}/summary.json and {out}/ckpt"]
    print("\n".join(lines), file=sys.stdout)  # noqa: T201 - the command's output
    return 0


__all__ = ["add_ps_command", "run_ps"]
