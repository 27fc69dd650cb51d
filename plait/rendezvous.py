"""A single-machine rendezvous for ``plait train``'s launcher whose store listens on loopback only.

torchrun's ``--standalone`` rendezvous (c10d on ``localhost:0``) starts two TCP stores in the launcher, the
rendezvous store and the one the workers bootstrap from, and torch's ``TCPStore`` server binds every interface
whatever host it is given: during a local run anyone who can reach the machine can connect to them. A local run
needs none of that, so ``plait train --nproc N`` registers this backend with torchrun's agent instead
(``PLAIT_LOCAL_BACKEND``): each round of the rendezvous (the first start, and each restart under
``--max-restarts``) opens one fresh store on a socket plait binds to 127.0.0.1 itself (``TCPStore``'s
``master_listen_fd``); the agent uses it for its own bookkeeping and hands its address to the workers as
MASTER_ADDR / MASTER_PORT (``use_agent_store``: they connect as clients and listen on nothing for it). A fresh
store per round means a restarted worker never reads the keys of the attempt before it (pytorch/pytorch#135712).
A multi-node job (``torchrun --nnodes N --rdzv-backend c10d ...``) keeps torchrun's own rendezvous, which must be
reachable from the other machines (docs/launching.md, docs/security.md).
"""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

LOOPBACK = "127.0.0.1"
PLAIT_LOCAL_BACKEND = "plait-local"
"""The rendezvous backend name ``plait train``'s launcher passes to torchrun (``--rdzv-backend``)."""
STORE_TIMEOUT = datetime.timedelta(seconds=300)


def loopback_store() -> dist.TCPStore:
    """A TCPStore server listening on 127.0.0.1 only, on a free port (``store.port``)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((LOOPBACK, 0))
        listener.listen(128)
        port = listener.getsockname()[1]
        fd = listener.detach()  # the store owns the descriptor from here on
    except BaseException:
        listener.close()
        raise
    return dist.TCPStore(
        LOOPBACK,
        port,
        None,
        True,
        timeout=STORE_TIMEOUT,
        wait_for_workers=False,
        multi_tenant=False,
        master_listen_fd=fd,
    )


class LoopbackRendezvous(RendezvousHandler):
    """One node, always rank 0 of a world of 1 (the agent's world: its workers are ranks of the job), on a fresh
    loopback store per round."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.store: dist.TCPStore | None = None
        self.round = 0
        self.closed = False

    def get_backend(self) -> str:
        return PLAIT_LOCAL_BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # the workers connect to this round's store: nothing else listens for them

    def next_rendezvous(self) -> RendezvousInfo:
        self.store = loopback_store()  # the last round's store goes with its workers
        self.round += 1
        return RendezvousInfo(self.store, 0, 1, RendezvousStoreInfo(LOOPBACK, self.store.port))

    def is_closed(self) -> bool:
        return self.closed

    def set_closed(self) -> None:
        self.closed = True

    def num_nodes_waiting(self) -> int:
        return 0  # no other node ever joins

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        self.closed, self.store = True, None
        return True


def _create(params: RendezvousParameters) -> LoopbackRendezvous:
    return LoopbackRendezvous(params.run_id)


def register_loopback_backend() -> str:
    """Make ``PLAIT_LOCAL_BACKEND`` known to torchrun's agent (idempotent); returns its name."""
    rendezvous_handler_registry.register(PLAIT_LOCAL_BACKEND, _create)
    return PLAIT_LOCAL_BACKEND


__all__ = [
    "LOOPBACK",
    "PLAIT_LOCAL_BACKEND",
    "LoopbackRendezvous",
    "loopback_store",
    "register_loopback_backend",
]
