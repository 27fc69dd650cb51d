"""``plait.init()``: join the job that torchrun (or the test harness) started, or run as one process.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; ``init`` reads them, picks NCCL
and ``cuda:LOCAL_RANK`` where CUDA is present and gloo on CPU otherwise, and initialises the default process
group with a timeout. Without those variables it is a single process and creates no process group.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plait import logging as plait_logging

DEFAULT_TIMEOUT_S = float(os.environ.get("PLAIT_TIMEOUT_S", "300"))


@dataclass(frozen=True)
class World:
    """This process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None

    @property
    def is_distributed(self) -> bool:
        return self.backend is not None


def default_device(local_rank: int = 0) -> torch.device:
    """``cuda:local_rank`` where CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> World:
    """Initialise torch.distributed from torchrun's environment (idempotent), or describe a single process."""
    if dist.is_available() and dist.is_initialized():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        world = World(
            dist.get_rank(), dist.get_world_size(), local_rank, default_device(local_rank), dist.get_backend()
        )
        plait_logging.configure(world.rank)
        return world
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        plait_logging.configure(0)
        return World(0, 1, 0, default_device(0), None)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = default_device(local_rank)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    plait_logging.configure(rank)
    return World(rank, world_size, local_rank, device, backend)


def shutdown(wait_for_peers: bool = True) -> None:
    """Destroy the default process group if one exists, after a barrier so that no rank exits while a peer still talks.

    Exiting with a live gloo group lets its threads be torn down mid-flight ("terminate called without an active
    exception"); pass ``wait_for_peers=False`` on an error path, where a peer may never reach the barrier.
    """
    if dist.is_available() and dist.is_initialized():
        if wait_for_peers:
            dist.barrier()
        dist.destroy_process_group()
