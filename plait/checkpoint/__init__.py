"""Sharded, layout-free checkpoints on torch.distributed.checkpoint (DCP), written atomically.

A checkpoint root holds one folder per saved step and a ``latest`` pointer::

    ckpt/step-00000010/   DCP files (.metadata + each rank's pieces), plait.json, rng-rank<R>.safetensors
    ckpt/latest           "step-00000010"

Every rank writes only its own pieces of the *global* (single-device) tensors: parameters, fp32 masters and
elementwise optimizer states by parameter name (``canonical``), located by global offsets (``chunks``), so
``load`` reads them into an engine of any other layout and world size (dp, tp, pp, ZeRO stage) or into one
process. Replicas are written once. Hyper-parameters, the lr scheduler, the step and the layout are JSON in
plait.json; nothing is pickled, and loading never unpickles anything but DCP's metadata classes (``storage``).

Writes go to ``step-N.partial``; after a barrier rank 0 renames it to ``step-N`` and replaces ``latest``
with ``os.replace`` (atomic on POSIX): a crash at any moment leaves ``latest`` naming a complete checkpoint.

For ``plait convert``: ``load_full_state`` (whole model tensors + plait.json, one process) and
``save_model_state`` (a model-only checkpoint ``Engine.load`` accepts). docs/checkpoints.md has the details.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from plait.checkpoint import canonical, extras, storage
from plait.checkpoint.canonical import MODEL
from plait.checkpoint.restore import _agree, load_engine
from plait.checkpoint.storage import CheckpointError
from plait.errors import LayoutError
from plait.logging import get_logger

if TYPE_CHECKING:
    from plait.engine import Engine

LATEST = "latest"
META = "plait.json"
FORMAT = 2
"""plait.json's ``format``: 2 = canonical global tensors (any layout)."""
log = get_logger(__name__)


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _publish(root: Path, partial: Path, final: Path, meta: dict[str, Any]) -> None:
    """Complete ``partial`` with plait.json, rename it to ``final`` and point ``latest`` at it (one process)."""
    _write_text_atomic(partial / META, json.dumps(meta, indent=2))
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)
    _write_text_atomic(root / LATEST, final.name)


def _rank_file(folder: Path, rank: int) -> Path:
    return folder / f"optim-rank{rank:05d}.json"


def _model_meta(engine: Engine) -> dict[str, Any] | None:
    """What model was trained, for ``plait convert``: ``{"hf": config}`` for a Hugging Face model (its
    ``config.to_dict()`` as JSON), ``{"config": fields}`` for a model with a dataclass ``config`` (plait's GPT)."""
    for module in (engine.model, engine.strategy.model):
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "to_json_string") and hasattr(config, "model_type"):
            return {"hf": json.loads(config.to_json_string(use_diff=False))}
        if dataclasses.is_dataclass(config) and not isinstance(config, type):
            try:
                return {"config": extras.to_json(dataclasses.asdict(config))}
            except TypeError:
                return None
    return None


def save(engine: Engine, root: str | Path) -> Path:
    """Save ``engine``'s model, optimizer, lr scheduler and random states under ``root``/step-N (every rank its
    own pieces) and point ``root``/latest at it. A collective: every rank calls it."""
    root = Path(root)
    final = _step_dir(root, engine.step)
    partial = final.with_name(final.name + ".partial")
    problem: Exception | None = None
    try:
        entries = canonical.save_state(engine)
        groups = extras.param_groups(engine.strategy.optimizer, canonical.group_names(engine))
    except (LayoutError, TypeError, ValueError) as error:  # agreed over the ranks, then raised on every one
        problem = error
    _agree(engine, problem)
    rank = engine.mesh.rank
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
    engine.comm.barrier()
    storage.write(entries, partial)
    extras.save_rng(partial, rank)
    _write_text_atomic(_rank_file(partial, rank), json.dumps(groups))
    engine.comm.barrier()
    if rank == 0:
        merged: list[dict[str, Any]] = []
        for other in range(engine.mesh.world_size):
            for group in json.loads(_rank_file(partial, other).read_text()):
                if group not in merged:
                    merged.append(group)
        meta = {
            "format": FORMAT,
            "step": engine.step,
            "layout": engine.layout.to_dict(),
            "world_size": engine.mesh.world_size,
            "model": _model_meta(engine),
            "optimizer": {"param_groups": merged},
            "lr_scheduler": extras.scheduler_state(engine.lr_scheduler),
        }
        _publish(root, partial, final, meta)
        log.info("saved checkpoint %s", final)
    engine.comm.barrier()
    return final


def latest(root: str | Path) -> Path:
    """The folder of the newest complete checkpoint under ``root``."""
    root = Path(root)
    pointer = root / LATEST
    if not pointer.is_file():
        raise CheckpointError(
            f"no checkpoint under {root}: {pointer} is missing. Fix: save one first with engine.save()."
        )
    folder = root / pointer.read_text().strip()
    if not (folder / META).is_file():
        raise CheckpointError(f"{pointer} names {folder}, which is not a complete checkpoint.")
    return folder


def _read_meta(folder: Path) -> dict[str, Any]:
    meta = json.loads((folder / META).read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{folder} is a plait checkpoint of format {meta.get('format', 1)}, this plait reads format {FORMAT} "
            f"(layout-free global tensors). Fix: load it with the plait version that wrote it and save it again."
        )
    return meta


def load(engine: Engine, root: str | Path) -> int:
    """Load the latest checkpoint under ``root`` into ``engine``, whatever layout saved it; returns (and sets)
    its step. Random states are restored when the layout and world size are the saved ones."""
    folder = latest(root)
    meta = _read_meta(folder)
    load_engine(engine, folder, storage.read_metadata(folder))
    optimizer = engine.strategy.optimizer
    if meta.get("optimizer") is not None and optimizer.state:
        extras.load_param_groups(optimizer, canonical.group_names(engine), meta["optimizer"]["param_groups"])
    extras.load_scheduler(engine.lr_scheduler, meta.get("lr_scheduler"))
    same = meta["layout"] == engine.layout.to_dict() and meta["world_size"] == engine.mesh.world_size
    if same and extras.load_rng(folder, engine.mesh.rank):
        log.info("restored the random generators of rank %d", engine.mesh.rank)
    else:
        log.info(
            "random generators not restored (saved at world size %s, layout %s): this job's seeds stay",
            meta["world_size"],
            meta["layout"],
        )
    engine.step = int(meta["step"])
    engine.comm.barrier()
    log.info("loaded checkpoint %s (step %d)", folder, engine.step)
    return engine.step


def _folder_of(root: str | Path) -> Path:
    root = Path(root)
    return root if (root / META).is_file() else latest(root)


def load_full_state(root: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The whole model tensors by single-device name and the plait.json metadata of the latest checkpoint
    under ``root`` (or of the step folder ``root``), read in this one process (no process group needed;
    optimizer entries are not read). Tied names each come back, as separate tensors."""
    folder = _folder_of(root)
    meta = _read_meta(folder)
    metadata = storage.read_metadata(folder)
    state = {}
    for key, stored in metadata.state_dict_metadata.items():
        if key.startswith(MODEL):
            if not hasattr(stored, "size"):
                raise CheckpointError(f"checkpoint entry {key!r} is not a tensor: refusing to load it.")
            state[key] = torch.empty(stored.size, dtype=stored.properties.dtype)
    storage.read(state, folder, no_dist=True)
    return {key[len(MODEL) :]: tensor for key, tensor in state.items()}, meta


def save_model_state(root: str | Path, state: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    """Write ``state`` (whole tensors by single-device name) as a model-only checkpoint under ``root`` (one
    process). ``Engine.load`` accepts it under any layout; the optimizer then starts fresh (logged). ``meta``
    goes into plait.json (its ``step``, default 0, is the step loaded); layout and world size are left empty."""
    root = Path(root)
    step = int(meta.get("step", 0))
    final = _step_dir(root, step)
    partial = final.with_name(final.name + ".partial")
    root.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    bad = [name for name, value in state.items() if not isinstance(value, torch.Tensor)]
    if bad:
        raise TypeError(f"save_model_state takes tensors by name; {bad[:3]} are not tensors")
    storage.write({MODEL + name: value.detach().contiguous() for name, value in state.items()}, partial, no_dist=True)
    full = {
        **meta,
        "format": FORMAT,
        "step": step,
        "layout": meta.get("layout"),
        "world_size": meta.get("world_size"),
        "optimizer": None,
        "lr_scheduler": None,
    }
    _publish(root, partial, final, full)
    log.info("saved model-only checkpoint %s (%d tensors)", final, len(state))
    return final


__all__ = ["LATEST", "META", "CheckpointError", "latest", "load", "load_full_state", "save", "save_model_state"]
