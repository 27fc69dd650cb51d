"""``plait train``'s fault-tolerance flags and ``plait lighthouse`` (docs/fault_tolerance.md).

``--ft`` runs the job's ``layout.dp_replicate`` = R replica groups under a quorum on this machine
(``plait.ft.launch``); ``--ft-replay RUN`` trains RUN's committed log again without faults (``plait.ft.log``).
On a cluster each replica group is a torchrun job of its own: ``plait lighthouse`` serves the quorum, and
``--ft-group g --ft-groups R --ft-lighthouse URL`` makes one ``plait train`` (or torchrun command) group g.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from plait.errors import ConfigError


def add_ft_arguments(train: Any) -> None:
    """The flags on ``plait train``'s parser."""
    ft = train.add_argument_group("fault tolerance (docs/fault_tolerance.md)")
    ft.add_argument(
        "--ft",
        action="store_true",
        help="per-step fault tolerance across layout.dp_replicate replica groups: a lost group is dropped for the "
        "step, restarted by its own agent (--max-restarts) and healed from a live group; the others never stop",
    )
    ft.add_argument(
        "--ft-spares",
        type=int,
        default=0,
        metavar="K",
        help="K spare replica groups beyond layout.dp_replicate: they step with the others and take a lost group's "
        "place at the next step, back at full strength without waiting for its restart (with --ft-group: the job's K)",
    )
    ft.add_argument("--ft-replay", metavar="RUN", help="train RUN's committed log (RUN/committed.jsonl) without faults")
    ft.add_argument("--ft-group", type=int, metavar="G", help="be replica group G of a fault-tolerant job (clusters)")
    ft.add_argument("--ft-groups", type=int, metavar="R", help="with --ft-group: the job's replica groups")
    ft.add_argument("--ft-lighthouse", metavar="URL", help="with --ft-group: the quorum service (plait lighthouse)")


def set_group_environment(args: argparse.Namespace) -> None:
    """``--ft-group``: what the group's ranks read (``plait.ft.options``), checked here first."""
    from plait.ft.options import GROUP_ENV, GROUPS_ENV, LIGHTHOUSE_ENV, SPARES_ENV, FTOptions

    if args.ft_groups is None or not args.ft_lighthouse:
        raise ConfigError(
            "--ft-group needs --ft-groups R and --ft-lighthouse URL. Fix: e.g. --ft-group 1 --ft-groups 2 "
            "--ft-lighthouse http://HOST:29510 (the address plait lighthouse printed)."
        )
    env = {GROUP_ENV: str(args.ft_group), GROUPS_ENV: str(args.ft_groups), LIGHTHOUSE_ENV: args.ft_lighthouse}
    env[SPARES_ENV] = str(args.ft_spares)
    FTOptions.from_env({**os.environ, **env})
    os.environ.update(env)


def add_lighthouse_command(commands: Any) -> None:
    lighthouse = commands.add_parser(
        "lighthouse", help="serve the quorum of a fault-tolerant job (torchft's Lighthouse) until stopped"
    )
    lighthouse.add_argument(
        "--bind", default="127.0.0.1:29510", help="HOST:PORT to serve on (default 127.0.0.1:29510: this machine only)"
    )
    lighthouse.add_argument("--heartbeat-ms", type=int, default=2000, help="a group silent this long is dropped")


def run_lighthouse(args: argparse.Namespace) -> int:
    from plait.ft.launch import lighthouse

    server, address = lighthouse(args.bind, args.heartbeat_ms)
    print(address, flush=True)  # noqa: T201 - the address replica groups are started with
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 130
    finally:
        server.shutdown()


__all__ = ["add_ft_arguments", "add_lighthouse_command", "run_lighthouse", "set_group_environment"]
