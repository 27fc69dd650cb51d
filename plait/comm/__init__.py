"""Collectives (+ byte accounting), differentiable ops and point-to-point: the only code that talks to
torch.distributed's collectives."""

from plait.comm.autograd import (
    all_gather,
    all_to_all,
    all_to_all_v,
    copy_to,
    gather_from,
    reduce_from,
    reduce_scatter,
    scatter_to,
)
from plait.comm.collectives import Comm, Pending
from plait.comm.stats import CommStats, OpCount, wire_bytes

__all__ = [
    "Comm",
    "CommStats",
    "OpCount",
    "Pending",
    "all_gather",
    "all_to_all",
    "all_to_all_v",
    "copy_to",
    "gather_from",
    "reduce_from",
    "reduce_scatter",
    "scatter_to",
    "wire_bytes",
]
