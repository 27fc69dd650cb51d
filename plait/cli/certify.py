"""``plait certify``: prove the user's own job equal under each layout to one process, or show where it is not.

Takes what ``plait train`` takes (``--config``, ``--preset``, ``--set``; the default data and model when none is
given) plus ``--layouts``, ``--steps``, ``--model MODULE:FUNCTION`` (the user's own nn.Module factory),
``--layers N`` (a depth-N slice), ``--optimizer MODULE:NAME`` (the user's own optimizer factory) and
``--deterministic`` (``plait.determinism``). Writes certificate.json, summary.md and certificate.png to ``--out``, prints the
verdicts, and exits 0 when every layout is equal (bitwise or within its budget), 1 when any DIFFERS; bad input is
one line and exit code 2, before any process starts (``plait.cli.main``). Processes are started by plait's local
launcher (``plait.launch.run_local``), one layout after another.
"""

from __future__ import annotations

import argparse
from typing import Any

from plait.cli.train import add_deterministic_flag
from plait.errors import PlaitError


def add_certify_command(commands: Any) -> None:
    """Register ``plait certify`` on the ``plait`` parser's subcommands."""
    certify = commands.add_parser(
        "certify",
        help="prove a job equal under each layout to one process (or find the first module that is not)",
        description="Train the job in one process and under each layout for a few steps on the same global "
        "batches; compare losses, gradient norms, gradients and parameters; locate a divergence module by module. "
        "Exit 0: every layout equal; 1: a layout DIFFERS.",
    )
    certify.add_argument("--config", help="a TOML run configuration, as plait train takes it")
    certify.add_argument("--preset", metavar="NAME", help="a named run configuration (plait train --preset)")
    certify.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one setting, e.g. --set model.n_layer=4 (repeatable)",
    )
    certify.add_argument(
        "--layouts",
        nargs="+",
        required=True,
        metavar="LAYOUT",
        help="layouts to certify, each KEY=VALUE pairs of [layout] joined by commas, e.g. 'dp=4' "
        "'tp=2,pp=2,microbatches=4' 'dp=2,zero=3,cp=2'",
    )
    certify.add_argument("--steps", type=int, default=5, help="steps to train and compare (default 5)")
    certify.add_argument(
        "--nproc", type=int, default=None, help="processes per layout (default: the largest world size any needs)"
    )
    certify.add_argument("--out", default="certify", help="folder for certificate.json, summary.md, certificate.png")
    certify.add_argument(
        "--model",
        default="",
        metavar="MODULE:FUNCTION",
        help="your own nn.Module: a function returning it (trained with the LM loss on the job's data)",
    )
    certify.add_argument("--layers", type=int, default=0, metavar="N", help="certify a depth-N slice of the model")
    certify.add_argument(
        "--optimizer",
        default="",
        metavar="MODULE:NAME",
        help="your own optimizer instead of train.optimizer: a factory params -> torch.optim.Optimizer (a plain "
        "torch.optim.Muon factory too: plait hands it whole tensors) or a plait WholeTensorOptimizer",
    )
    add_deterministic_flag(certify, "runs (reruns of a layout give the same bits)")
    certify.add_argument(
        "--no-locate", action="store_true", help="do not run the module-by-module pass on a layout that differs"
    )
    certify.add_argument("--backend", choices=("gloo", "nccl"), default="gloo", help="torch.distributed backend")


def run_certify(args: argparse.Namespace) -> int:
    """``plait certify``: 0 when every layout is equal, 1 when one DIFFERS."""
    from plait.certification import certify

    if args.steps <= 0:
        raise PlaitError(f"--steps {args.steps} must be at least 1. Fix: e.g. --steps 5.")
    certificate = certify(
        args.config,
        args.layouts,
        args.steps,
        overrides=args.overrides,
        preset=args.preset,
        model=args.model,
        layers=args.layers,
        optimizer=args.optimizer,
        deterministic=args.deterministic,
        nproc=args.nproc,
        locate_divergence=not args.no_locate,
        backend=args.backend,
    )
    paths = certificate.write(args.out)
    for result in certificate.layouts:
        where = f": {result.divergence.describe()}" if result.divergence else ""
        budget = f"(budget {result.budget.rel(0):.3g} x (1+step), {result.budget.dtype})"
        print(f"{result.layout:<28} {result.short:<36} {budget:<28} {result.verdict}{where}")  # noqa: T201 - CLI output
    print(f"{len(certificate.layouts)} layout(s) in {certificate.seconds:.0f} s -> {', '.join(map(str, paths))}")  # noqa: T201
    return 0 if certificate.equal else 1


__all__ = ["add_certify_command", "run_certify"]
