"""Sharded, layout-free checkpoints on torch.distributed.checkpoint (DCP), written atomically, checked on load.

A checkpoint root holds one folder per saved step and a ``latest`` pointer::

    ckpt/step-00000010/   DCP files (.metadata + each rank's pieces), plait.json, rng-rank<R>.safetensors
    ckpt/latest           "step-00000010"

Every rank writes only its own pieces of the *global* (single-device) tensors: parameters, fp32 masters and
elementwise optimizer states by parameter name (``canonical``), located by global offsets (``chunks``), so
``load`` reads them into an engine of any other layout and world size (dp, tp, pp, ZeRO stage) or into one
process. Replicas are written once. Hyper-parameters, the lr scheduler, the step and the layout are JSON in
plait.json; nothing is pickled, and loading never unpickles anything but DCP's metadata classes (``storage``).

Writes go to ``step-N.partial``; rank 0 then renames it to ``step-N`` and replaces ``latest`` with
``os.replace`` (atomic on POSIX): a crash at any moment leaves ``latest`` naming a complete checkpoint
(``saving``; ``Checkpointer`` also saves asynchronously and applies retention). plait.json records every file's
size and SHA-256 (``integrity``); ``load`` checks them and resumes from the newest intact checkpoint, saying
once what it skipped (``catalog``).

For ``plait convert``: ``load_full_state`` (whole model tensors + plait.json, one process) and
``save_model_state`` (a model-only checkpoint ``Engine.load`` accepts). docs/checkpoints.md has the details.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from plait.checkpoint import canonical, catalog, extras, failures, identity, integrity, storage
from plait.checkpoint.canonical import MODEL
from plait.checkpoint.catalog import LATEST, has_checkpoints, step_dir
from plait.checkpoint.integrity import FORMAT, META, ChecksumWriter
from plait.checkpoint.restore import load_engine
from plait.checkpoint.saving import Checkpointer, publish, save
from plait.checkpoint.signing import check_key
from plait.errors import CheckpointError
from plait.logging import get_logger

if TYPE_CHECKING:
    from plait.engine import Engine

log = get_logger(__name__)


def latest(root: str | Path) -> Path:
    """The folder of the newest complete checkpoint under ``root``."""
    root = Path(root)
    pointer = root / LATEST
    if not pointer.exists():
        raise CheckpointError(
            f"no checkpoint under {root}: {pointer} is missing. Fix: save one first with engine.save()."
        )
    name = catalog.latest_name(root)
    if name is None:
        raise CheckpointError(
            f"{pointer} does not name a step folder of {root} (it must be a regular file holding e.g. "
            f"step-00000010). Fix: write the newest step folder's name into it."
        )
    folder = root / name
    if not (folder / META).is_file():
        raise CheckpointError(f"{pointer} names {folder}, which is not a complete checkpoint.")
    return folder


def _read_meta(folder: Path) -> dict[str, Any]:
    meta, problems = integrity.read_meta(folder)
    if meta is None:
        raise CheckpointError(f"checkpoint {folder} is damaged: {'; '.join(problems)}. {integrity.FIX}")
    return meta


def _choose(root: str | Path, rank: int = 0, world: int = 1, gather: catalog.Gather | None = None) -> Path:
    """The checkpoint to load (``catalog.choose``), with one warning (rank 0) naming what was skipped."""
    folder, skipped = catalog.choose(Path(root), rank, world, gather)
    if skipped and rank == 0:
        log.warning(
            "resuming from %s, the newest intact checkpoint under %s; skipped %d newer one(s): %s",
            folder.name,
            root,
            len(skipped),
            " | ".join(skipped),
        )
    return folder


def load(engine: Engine, root: str | Path) -> int:
    """Load the newest intact checkpoint under ``root`` (or the step folder ``root``) into ``engine``, whatever
    layout saved it; returns (and sets) its step. Every file is checked against plait.json's sizes and SHA-256
    first (each rank its share); a damaged or incomplete newer checkpoint is skipped with one warning, the same
    decision on every rank, and so is one whose plait.json records another step than its folder's name or, under
    a root, another run than the root's ``run-id`` (``catalog``). Random states are restored when the layout and
    world size are the saved ones."""
    gather = lambda data: engine.comm.all_gather_bytes(data, "world")  # noqa: E731
    folder = _choose(root, engine.mesh.rank, engine.mesh.world_size, gather)
    meta = _read_meta(folder)
    if not integrity.verified(meta):
        log.info("%s was written before plait recorded checksums: its files are not verified", folder)
    metadata = storage.read_metadata(folder)
    identity.check(engine, folder, meta, metadata, gather)
    load_engine(engine, folder, metadata)
    optimizer = engine.strategy.optimizer
    try:  # plait.json is the same on every rank: a value that does not fit raises on every rank
        if meta.get("optimizer") is not None and optimizer.state:
            extras.load_param_groups(optimizer, canonical.group_names(engine), meta["optimizer"]["param_groups"])
        extras.load_scheduler(engine.lr_scheduler, meta.get("lr_scheduler"))
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise CheckpointError(
            f"checkpoint {folder}: plait.json's optimizer or lr scheduler state does not fit this run's "
            f"({type(error).__name__}: {error}). Fix: resume with the optimizer and schedule it was trained with."
        ) from None
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
    engine.run_id = meta.get("run")  # a root without a run id yet takes this one at its next save
    if engine.run_id is None:
        log.info(
            "%s records no run (written before plait recorded runs, or a model-only import): it is loaded without "
            "checking that it belongs to this run",
            folder,
        )
    engine.comm.barrier()
    log.info("loaded checkpoint %s (step %d)", folder, engine.step)
    return engine.step


def load_full_state(root: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The whole model tensors by single-device name and the plait.json metadata of the latest checkpoint
    under ``root`` (or of the step folder ``root``), read in this one process (no process group needed;
    optimizer entries are not read). Tied names each come back, as separate tensors."""
    from plait.checkpoint.slices import CheckpointSource

    source = CheckpointSource(root)
    state = {name: torch.empty(shape, dtype=source.dtype(name)) for name, shape in source.shapes().items()}
    source.read([(name, tuple(slice(0, size) for size in t.shape), t) for name, t in state.items()])  # one read
    return state, source.meta


def save_model_state(root: str | Path, state: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    """Write ``state`` (whole tensors by single-device name) as a model-only checkpoint under ``root`` (one
    process). ``Engine.load`` accepts it under any layout; the optimizer then starts fresh (logged). ``meta``
    goes into plait.json (its ``step``, default 0, is the step loaded); layout and world size are left empty."""
    root = Path(root)
    step = int(meta.get("step", 0))
    final = step_dir(root, step)
    partial = final.with_name(final.name + ".partial")
    root.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    bad = [name for name, value in state.items() if not isinstance(value, torch.Tensor)]
    if bad:
        raise TypeError(f"save_model_state takes tensors by name; {bad[:3]} are not tensors")
    writer = ChecksumWriter(partial, 0)
    tensors = {MODEL + name: value.detach().contiguous() for name, value in state.items()}
    try:
        storage.write(tensors, partial, no_dist=True, writer=writer)
        full = {
            **meta,
            "format": FORMAT,
            "step": step,
            "layout": meta.get("layout"),
            "world_size": meta.get("world_size"),
            "optimizer": None,
            "lr_scheduler": None,
            "files": writer.manifest,
            "model_tensors": writer.model_tensors,
        }
        publish(root, partial, final, full)
    except failures.WRITE_FAILURES as error:  # DCP's CheckpointException is a BaseException
        shutil.rmtree(partial, ignore_errors=True)
        raise failures.save_failed(error, partial, f"the save of a model-only checkpoint under {root}") from None
    log.info("saved model-only checkpoint %s (%d tensors)", final, len(state))
    return final


__all__ = [
    "FORMAT",
    "LATEST",
    "META",
    "CheckpointError",
    "Checkpointer",
    "check_key",
    "has_checkpoints",
    "latest",
    "load",
    "load_full_state",
    "save",
    "save_model_state",
]
