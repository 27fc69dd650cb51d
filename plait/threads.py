"""CPU threads per rank: the cores this process may use, shared evenly by the ranks of its machine.

torch's intra-op pool defaults to every core. With several ranks on one machine each rank would then run a pool
of every core, so N ranks oversubscribe the cores N times and spend their time in the kernel's scheduler (a
one-process run on a busy 2-core machine: 133 s with torch's default, 38 s with one thread). plait's default is
``cores // local ranks`` (at least 1), where ``cores`` are the cores this process is allowed to run on
(``os.sched_getaffinity``: a cgroup or ``taskset`` limit counts, the machine's total does not). The default only
ever lowers torch's pool (a count the program set before ``plait.init`` that is already lower stays).

The user's choice wins: ``OMP_NUM_THREADS`` set in the environment (by the user, or by torchrun, which sets 1 for
several processes per node when it is unset) is kept as it is. ``plait train``'s launcher sets it to the
per-rank default for its workers when the user did not. ``plait.init`` applies the default and logs the count
once (rank 0), with where it came from.
"""

from __future__ import annotations

import os

import torch

from plait.logging import get_logger

log = get_logger(__name__)
THREADS_ENV = "OMP_NUM_THREADS"


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the platform has one, else the machine's)."""
    affinity = getattr(os, "sched_getaffinity", None)
    if affinity is not None:
        return max(1, len(affinity(0)))
    return max(1, os.cpu_count() or 1)


def per_rank_default(local_ranks: int) -> int:
    """``usable cores // local_ranks``, at least 1: each rank of a machine gets its share of the cores."""
    return max(1, usable_cores() // max(1, local_ranks))


def configure_threads(local_ranks: int) -> int:
    """Give this rank its threads (module docstring) unless ``OMP_NUM_THREADS`` chose; log the count; return it."""
    chosen = os.environ.get(THREADS_ENV, "").strip()
    if chosen:
        threads = torch.get_num_threads()
        log.info("%d CPU thread(s) per rank (%s=%s)", threads, THREADS_ENV, chosen)
        return threads
    threads = min(torch.get_num_threads(), per_rank_default(local_ranks))  # lowers an oversubscribed pool only
    torch.set_num_threads(threads)
    log.info(
        "%d CPU thread(s) per rank (%d usable cores / %d local rank(s)); set %s to choose another count",
        threads,
        usable_cores(),
        local_ranks,
        THREADS_ENV,
    )
    return threads


__all__ = ["THREADS_ENV", "configure_threads", "per_rank_default", "usable_cores"]
