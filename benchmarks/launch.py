"""Start the ranks of one launch with torchrun's own machinery and collect what each returns.

``torch.distributed.launcher.api.elastic_launch`` is what ``torchrun --standalone`` runs: a local c10d
rendezvous on a free port, one agent, ``nproc_per_node`` workers with RANK/WORLD_SIZE/MASTER_* set, and every
worker's return value handed back to the caller. Workers come from a fork server (``start_method="forkserver"``):
one clean process, started once, that has imported torch, plait and the benchmark modules (``FORKSERVER_PRELOAD``)
and forks a worker per rank, so a launch costs a fraction of a second instead of the seconds a fresh interpreter
needs to import torch on every rank (which would dominate a benchmark on two cores). Forking the launching
process itself (what this module did before) is unsafe: its rendezvous threads may be mid-call when it forks, and
such a rank then never joins (measured: up to 8 of 64 launches of the ``pp`` suite stalled 60 s that way). The workers'
function and arguments are pickled (module-level functions, plain data). Each worker pins itself to one intra-op
thread before computing anything. Modules the contenders import lazily on first use (torch's optimizers and DDP
both pull in ``torch._dynamo``, about 2 s on a busy 2-core machine) are in the preload, so no launch imports them
again.
"""

from __future__ import annotations

import logging
import multiprocessing
import uuid
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

log = logging.getLogger("benchmarks.launch")


class LaunchError(RuntimeError):
    """A rank of a benchmark launch failed; the message names the rank and carries its error."""


def _last_line(message: object) -> str:
    """The exception line of a failure message (a dict from the rank's error file, or text ending in it)."""
    if isinstance(message, dict):
        message = message.get("message", message)
    lines = [line for line in str(message or "").splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


FORKSERVER_PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch.distributed.elastic.multiprocessing",
    "plait",
    "benchmarks.worker",
    "benchmarks.contenders",
)
"""Imported once by the fork server, so that every worker starts with them (see above)."""

START_UP_FAILURES = ("DistStoreError", "wait timeout")
"""Signs that a launch failed while its ranks were still connecting, before anything was measured."""
START_UP_ATTEMPTS = 5


def launch(fn: Callable[..., Any], world: int, *args: Any, start_method: str = "forkserver") -> list[Any]:
    """Run ``fn(*args)`` on ``world`` local ranks; return their results in rank order.

    A launch that fails with a store timeout before any step ran (a rank that never joined: with
    ``start_method="fork"``, up to one launch in eight) is retried, up to ``START_UP_ATTEMPTS`` launches; any other
    failure is raised.
    """
    multiprocessing.set_forkserver_preload(list(FORKSERVER_PRELOAD))  # read when the fork server first starts
    for attempt in range(1, START_UP_ATTEMPTS + 1):
        try:
            return _launch_once(fn, world, args, start_method)
        except LaunchError as error:
            if attempt == START_UP_ATTEMPTS or not any(sign in str(error) for sign in START_UP_FAILURES):
                raise
            log.warning("launch %d/%d failed while connecting (%s); launching again", attempt, START_UP_ATTEMPTS, error)
    raise AssertionError("unreachable")


def _launch_once(fn: Callable[..., Any], world: int, args: tuple[Any, ...], start_method: str) -> list[Any]:
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world,
        run_id=f"plait-bench-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.05,
        start_method=start_method,
    )
    log.debug("launching %s on %d ranks (%s)", getattr(fn, "__name__", fn), world, start_method)
    try:
        results = elastic_launch(config, fn)(*args)
    except ChildFailedError as error:
        failures = "; ".join(  # failures: global rank -> ProcessFailure
            f"rank {rank} (exit code {failure.exitcode}): {_last_line(failure.message) or 'no message'}"
            for rank, failure in sorted(error.failures.items())
        )
        raise LaunchError(f"benchmark worker failed on {failures}") from error
    return [results[rank] for rank in range(world)]
