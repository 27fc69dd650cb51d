"""``plait.init()``: join the job that torchrun (or the test harness) started, or run as one process.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT; ``init`` reads them,
picks the device ``cuda:LOCAL_RANK % gpus`` where CUDA is present (else the CPU) and the backend (``backend``,
``plait train --backend``; default NCCL with CUDA, gloo otherwise), checks the pair (``choose_backend``,
``check_gpu_sharing``: pure, so every rank refuses a bad pair the same way before any collective) and
initialises the default process group with a timeout. Without those variables it is a single process and
creates no process group. Either way each rank gets its share of the machine's CPU threads
(``plait.threads``: cores / local ranks unless ``OMP_NUM_THREADS`` says otherwise), logged once.

- NCCL runs one rank per GPU: two ranks of a node on one GPU fail inside NCCL ("Duplicate GPU detected") at
  the first collective, which would look like a dead peer. ``check_gpu_sharing`` refuses it up front, naming
  the fix (as many processes per node as GPUs, or gloo).
- gloo runs anywhere, also with CUDA tensors, several ranks per GPU included (for tests on one GPU): its
  collectives accept CUDA tensors, but its point-to-point send/recv cannot read device memory (pipeline stages,
  ring attention), so ``plait.comm`` stages those through host memory (``Comm.send_recv``).
"""

from __future__ import annotations

import datetime
import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plait import logging as plait_logging
from plait.errors import LayoutError
from plait.threads import configure_threads

TIMEOUT_ENV = "PLAIT_TIMEOUT_S"
FIND_UNUSED_ENV = "PLAIT_FIND_UNUSED_PARAMETERS"
OFFLOAD_DIR_ENV = "PLAIT_OFFLOAD_DIR"
DEFAULT_TIMEOUT_S = 300.0


def default_timeout_s() -> float:
    """The timeout of every collective when none is given: ``PLAIT_TIMEOUT_S`` seconds, else 300.

    The environment variables plait reads for its defaults are read here, when called, and nowhere else in the
    library (the paradigms take explicit values): ``PLAIT_TIMEOUT_S``, ``PLAIT_FIND_UNUSED_PARAMETERS``,
    ``PLAIT_OFFLOAD_DIR``; plus torchrun's RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE in ``init``."""
    return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))


def default_find_unused_parameters() -> bool:
    """Whether DDP treats parameters without a gradient as zeros when ``parallelize`` is not told:
    ``PLAIT_FIND_UNUSED_PARAMETERS=1`` (default off)."""
    return os.environ.get(FIND_UNUSED_ENV, "0").strip().lower() in ("1", "true", "yes")


def default_offload_dir() -> str | None:
    """Where offload="nvme" keeps its files when ``parallelize`` is not told: ``PLAIT_OFFLOAD_DIR`` (None: the
    system's temp folder)."""
    return os.environ.get(OFFLOAD_DIR_ENV) or None


BACKENDS = ("gloo", "nccl")
"""The process-group backends plait runs on: gloo (CPU, and CUDA tensors for testing) and NCCL (one GPU per rank)."""


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


def default_device(local_rank: int | None = None) -> torch.device:
    """``cuda:local_rank`` where CUDA is available (None: torchrun's ``LOCAL_RANK``, else 0), else the CPU."""
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def choose_backend(requested: str | None, device_type: str) -> str:
    """The backend for ``requested`` (None: NCCL on CUDA, gloo otherwise) on a ``device_type`` device; a
    LayoutError naming the fix for an unknown backend or NCCL without a GPU. Pure."""
    backend = requested or ("nccl" if device_type == "cuda" else "gloo")
    if backend not in BACKENDS:
        raise LayoutError(f"backend {backend!r} is unknown. Fix: use one of {', '.join(map(repr, BACKENDS))}.")
    if backend == "nccl" and device_type != "cuda":
        raise LayoutError(
            f"backend 'nccl' needs CUDA GPUs, but this process runs on {device_type!r}. Fix: use --backend gloo (or "
            f"init(backend='gloo')), or run on a machine with GPUs."
        )
    return backend


def gpu_of_local_ranks(local_world_size: int, device_count: int) -> list[int]:
    """The CUDA device index each local rank uses (``default_device``: local rank modulo the GPU count)."""
    return [local_rank % device_count for local_rank in range(local_world_size)] if device_count else []


def check_gpu_sharing(backend: str, devices: list[int], rank: int = 0) -> None:
    """Refuse ranks of one node that share a GPU under NCCL (``devices``: the device index of each local rank),
    which NCCL reports only at the first collective ("Duplicate GPU detected"). Pure: every rank computes the
    same answer from the launcher's environment."""
    if backend != "nccl":
        return
    shared: dict[int, list[int]] = {}
    for local_rank, device in enumerate(devices):
        shared.setdefault(device, []).append(local_rank)
    crowded = {device: ranks for device, ranks in shared.items() if len(ranks) > 1}
    if crowded:
        gpus = len(shared)
        which = "; ".join(f"cuda:{d} by local ranks {r}" for d, r in sorted(crowded.items()))
        raise LayoutError(
            f"rank {rank}: {len(devices)} processes on this node but {gpus} GPU(s): NCCL runs one rank per GPU and "
            f"would fail at the first collective ('Duplicate GPU detected'); shared: {which}. Fix: launch at most "
            f"{gpus} process(es) per node (plait train --nproc {gpus}, torchrun --nproc-per-node {gpus}), or use "
            f"--backend gloo, which lets ranks share a GPU (slower: for tests)."
        )


def init(backend: str | None = None, timeout_s: float | None = None) -> World:
    """Initialise torch.distributed from torchrun's environment (idempotent), or describe a single process.
    ``backend``: "gloo" or "nccl" (None: NCCL with CUDA, gloo otherwise; module docstring); ``timeout_s``: of the
    process group's operations (None: ``default_timeout_s()``)."""
    if dist.is_available() and dist.is_initialized():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        world = World(
            dist.get_rank(), dist.get_world_size(), local_rank, default_device(local_rank), dist.get_backend()
        )
        plait_logging.configure(world.rank)
        return world
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        plait_logging.configure(0)
        configure_threads(1)
        return World(0, 1, 0, default_device(0), None)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = default_device(local_rank)
    backend = choose_backend(backend, device.type)
    if device.type == "cuda":
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        check_gpu_sharing(backend, gpu_of_local_ranks(local_world, torch.cuda.device_count()), rank)
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s if timeout_s is not None else default_timeout_s())
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    plait_logging.configure(rank)
    configure_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return World(rank, world_size, local_rank, device, backend)


def shutdown(wait_for_peers: bool = True) -> None:
    """Destroy the default process group if one exists, after a barrier so that no rank exits while a peer still talks.

    Exiting with a live gloo group lets its threads be torn down mid-flight ("terminate called without an active
    exception"); pass ``wait_for_peers=False`` on an error path, where a peer may never reach the barrier. Garbage
    is collected before and after: a finished collective's work object still held in a reference cycle would
    otherwise be freed during interpreter finalisation, where releasing its tensors aborts the process (the same
    message; seen once on a finished 2-rank job while the test suite loaded the machine, not in 12 runs after).
    """
    if dist.is_available() and dist.is_initialized():
        if wait_for_peers:
            dist.barrier()
        gc.collect()
        dist.destroy_process_group()
        gc.collect()
