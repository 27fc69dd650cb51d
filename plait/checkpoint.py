"""Checkpoints on torch.distributed.checkpoint (DCP), written atomically.

A checkpoint root holds one folder per saved step and a ``latest`` pointer::

    ckpt/step-00000010/   DCP files (each rank writes its own part) + plait.json (step, layout; plain JSON)
    ckpt/latest           "step-00000010"

Every rank writes into ``step-N.partial``; after a barrier rank 0 renames it to ``step-N`` and then replaces
``latest`` with ``os.replace`` (atomic on POSIX). A crash at any moment leaves ``latest`` naming the previous,
complete checkpoint. Model and optimizer states are keyed by parameter name (the data-parallel strategy's ``state_dicts``), so
they do not depend on the rank layout.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from plait.errors import LayoutError, PlaitError
from plait.logging import get_logger

if TYPE_CHECKING:
    from plait.engine import Engine

LATEST = "latest"
META = "plait.json"
log = get_logger(__name__)


class CheckpointError(PlaitError, FileNotFoundError):
    """No complete checkpoint where one was expected."""


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns that it 'assumes a single process' when no process group exists: that is intended here."""
    with warnings.catch_warnings():
        if not (dist.is_available() and dist.is_initialized()):
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _states(engine: Engine) -> dict[str, object]:
    return engine.strategy.state_dicts()


def save(engine: Engine, root: str | Path) -> Path:
    """Save ``engine``'s model and optimizer under ``root``/step-N and point ``root``/latest at it."""
    root = Path(root)
    final = _step_dir(root, engine.step)
    partial = final.with_name(final.name + ".partial")
    if engine.mesh.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
    engine.comm.barrier()
    with _quiet_single_process():
        dcp.save(_states(engine), checkpoint_id=str(partial))
    engine.comm.barrier()
    if engine.mesh.rank == 0:
        meta = {"step": engine.step, "layout": engine.layout.to_dict(), "world_size": engine.mesh.world_size}
        _write_text_atomic(partial / META, json.dumps(meta, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        _write_text_atomic(root / LATEST, final.name)
        log.info("saved checkpoint %s", final)
    engine.comm.barrier()
    return final


def latest(root: str | Path) -> Path:
    """The folder of the newest complete checkpoint under ``root``."""
    root = Path(root)
    pointer = root / LATEST
    if not pointer.is_file():
        raise CheckpointError(f"no checkpoint under {root}: {pointer} is missing. Fix: save one first with engine.save().")
    folder = root / pointer.read_text().strip()
    if not (folder / META).is_file():
        raise CheckpointError(f"{pointer} names {folder}, which is not a complete checkpoint.")
    return folder


def _check_same_sharding(meta: dict, engine: Engine) -> None:
    """ZeRO optimizer states are saved per shard: refuse, clearly and before reading, a different sharding."""
    saved = meta["layout"]
    now = engine.layout
    saved_shards = saved["dp"] * saved["cp"] if saved["zero"] else 1
    now_shards = now.dp * now.cp if now.zero else 1
    if (saved["zero"] or now.zero) and (saved["zero"] != now.zero or saved_shards != now_shards):
        raise LayoutError(
            f"checkpoint {meta['step']} was saved with zero={saved['zero']} over {saved_shards} data-parallel shards, "
            f"but this engine has zero={now.zero} over {now_shards}. Loading sharded optimizer state under another "
            f"sharding is not supported yet. Fix: load with the saved layout (dp={saved['dp']}, cp={saved['cp']}, "
            f"zero={saved['zero']})."
        )


def load(engine: Engine, root: str | Path) -> int:
    """Load the latest checkpoint under ``root`` into ``engine``; returns (and sets) its step."""
    folder = latest(root)
    meta = json.loads((folder / META).read_text())
    _check_same_sharding(meta, engine)
    states = _states(engine)
    with _quiet_single_process():
        dcp.load(states, checkpoint_id=str(folder))
    engine.strategy.load_state_dicts(states)
    engine.step = int(meta["step"])
    if dist.is_available() and dist.is_initialized():
        engine.comm.barrier()
    log.info("loaded checkpoint %s (step %d)", folder, engine.step)
    return engine.step
