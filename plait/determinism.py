"""Deterministic mode (``train.deterministic``; ``plait train --deterministic``, ``plait certify --deterministic``):
the same job on the same layout, hardware and software gives the same bits on every rerun, CUDA included.

On one device a training step is a fixed sequence of operations, so it is repeatable unless a kernel itself
chooses its reduction order at run time. On GPUs several do, and one collective library does:

- **torch's non-deterministic kernels**: atomics-based backward passes (``index_add``, scatter, the embedding's
  backward, some pooling) accumulate in the order threads happen to arrive. ``torch.use_deterministic_algorithms
  (True)`` makes torch use a deterministic implementation where one exists and raise (naming the operation) where
  none does, so a run that finishes is repeatable; it also fills tensors made by ``torch.empty`` with NaN, so
  that reading uninitialised memory cannot pass unnoticed.
- **cuBLAS**: with more than one stream its workspace is shared and split-K reductions may land in any order;
  ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` gives each stream its own buffers (8 of 4 MiB). cuBLAS reads it when it
  creates its handle, at the first matmul on the device, so it is in the environment before CUDA starts.
- **cuDNN**: ``torch.backends.cudnn.deterministic = True`` (deterministic convolution algorithms) and
  ``benchmark = False`` (no timing-based choice of algorithm, which can differ between runs).
- **NCCL** picks an algorithm (ring, tree, CollNet, NVLS) and a protocol (LL, LL128, Simple) per collective from
  its size and the topology it measures, and the order in which a tree or NVLS reduction adds the ranks' values
  differs between them. ``NCCL_ALGO=Ring`` and ``NCCL_PROTO=Simple`` fix both: every all-reduce, reduce-scatter
  and all-gather runs one ring in rank order. NCCL reads them when it creates a communicator, so they are in the
  ranks' environment before the process group starts: ``plait train``'s launcher exports them to the workers
  torchrun starts, ``plait.launch.run_local`` (what ``plait certify`` runs on) sets them in each rank before it
  initialises the group, and ``plait.train.loop.run`` refuses an NCCL group started without them.
- **gloo** (CPU, and plait's tests) is order-deterministic already: its all-reduce is a ring (or halving-doubling)
  over the ranks in a fixed order for a given world size and tensor size, and every rank receives the same bits.
  The environment is set all the same, and CPU kernels under ``use_deterministic_algorithms`` run as before.

What it does not promise: equality across layouts (a layout reorders sums: ``plait certify``'s budget), across
GPU models, driver, CUDA or NCCL versions, or across thread counts on CPU. What it costs: the deterministic
kernels (sorting instead of atomics), the ring for every collective (tree and NVLS are faster at scale), the
NaN fill of ``torch.empty``; the step-time cost on a GPU is measured by tests/gpu/test_deterministic.py
(docs/certify.md, "Deterministic mode").
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Any

import torch

from plait.errors import ConfigError
from plait.logging import get_logger

log = get_logger(__name__)

DETERMINISTIC_ENV: dict[str, str] = {
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "NCCL_ALGO": "Ring",
    "NCCL_PROTO": "Simple",
}
"""The environment of a deterministic rank: cuBLAS's per-stream workspace, NCCL's one algorithm and protocol."""
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")
"""The two values of CUBLAS_WORKSPACE_CONFIG that cuBLAS documents as deterministic (a user's :16:8 is kept)."""


def _already(name: str, value: str | None) -> bool:
    if value is None:
        return False
    if name == "CUBLAS_WORKSPACE_CONFIG":
        return value in CUBLAS_DETERMINISTIC
    return value.strip().lower() == DETERMINISTIC_ENV[name].lower()


def export_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Put ``DETERMINISTIC_ENV`` into ``environ`` (default: this process's, which the processes it starts
    inherit); a different value the user set is replaced, and logged. Returns what was changed."""
    environ = os.environ if environ is None else environ
    changed = {}
    for name, value in DETERMINISTIC_ENV.items():
        current = environ.get(name)
        if _already(name, current):
            continue
        if current is not None:
            log.info("deterministic mode: %s=%s replaced by %s", name, current, value)
        environ[name] = value
        changed[name] = value
    return changed


def collectives_fixed(environ: MutableMapping[str, str] | None = None) -> bool:
    """Whether NCCL's algorithm and protocol are fixed in ``environ`` (default: this process's)."""
    environ = os.environ if environ is None else environ
    return all(_already(name, environ.get(name)) for name in ("NCCL_ALGO", "NCCL_PROTO"))


def make_deterministic() -> None:
    """Deterministic mode on this rank, before any work: the environment (``export_env``), torch's deterministic
    algorithms, cuDNN's deterministic and non-benchmarking settings. Idempotent. Where CUDA has already started
    and CUBLAS_WORKSPACE_CONFIG was not set, cuBLAS may have made its handle already: a warning says so."""
    changed = export_env()
    if "CUBLAS_WORKSPACE_CONFIG" in changed and torch.cuda.is_available() and torch.cuda.is_initialized():
        log.warning(
            "deterministic mode: CUBLAS_WORKSPACE_CONFIG was set after CUDA started; a cuBLAS handle made before "
            "keeps its shared workspace. Fix: set train.deterministic before any CUDA work (plait train does)."
        )
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def check_group(backend: str | None = None) -> None:
    """Refuse an NCCL process group started without ``NCCL_ALGO`` / ``NCCL_PROTO`` fixed (NCCL read its
    environment when the group started, so setting them now would change nothing): one line, the fix.
    ``backend`` None: the default process group's, if one has started."""
    import torch.distributed as dist

    if backend is None and dist.is_available() and dist.is_initialized():
        backend = dist.get_backend()
    if backend == "nccl" and not collectives_fixed():
        raise ConfigError(
            "train.deterministic: the NCCL process group was started without NCCL_ALGO=Ring and NCCL_PROTO=Simple, "
            "so NCCL may pick a different reduction order per collective. Fix: run plait train --deterministic "
            "(its launcher sets them), or call plait.determinism.make_deterministic() before plait.init()."
        )


def state() -> dict[str, Any]:
    """What is in force in this process: torch's flags and the environment (certificate.json records it; the tests
    read it back in the ranks)."""
    import torch.distributed as dist

    return {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "env": {name: os.environ.get(name) for name in DETERMINISTIC_ENV},
        "backend": dist.get_backend() if dist.is_available() and dist.is_initialized() else None,
    }


def describe_state(current: dict[str, Any]) -> str:
    """``state()`` in one line, for the log."""
    env = ", ".join(f"{name}={value}" for name, value in current["env"].items())
    flags = [
        f"use_deterministic_algorithms={current['deterministic_algorithms']}",
        f"cudnn.deterministic={current['cudnn_deterministic']}",
        f"cudnn.benchmark={current['cudnn_benchmark']}",
    ]
    backend = current["backend"]
    order = " (gloo: its collectives' order is fixed already)" if backend == "gloo" else ""
    return f"{', '.join(flags)}, {env}, backend {backend}{order}"


__all__ = [
    "describe_state",
    "CUBLAS_DETERMINISTIC",
    "DETERMINISTIC_ENV",
    "check_group",
    "collectives_fixed",
    "export_env",
    "make_deterministic",
    "state",
]
