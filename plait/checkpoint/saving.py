"""Writing a checkpoint: synchronously (``save``, what ``engine.save`` runs) or in the background
(``Checkpointer`` with ``async_save``), each followed by publication and, optionally, retention.

One save, on every rank:

1. *prepare* (main thread, a collective): check that the state can be saved (the verdict agreed over the
   world), rank 0 creates ``step-N.partial`` (and at a root's first save its ``run-id``: ``catalog``), a
   barrier; every rank writes its random generators and optimizer param groups there (small files) and
   captures the rest of plait.json (step, layout, lr scheduler; rank 0: the run id);
2. *write*: DCP writes every rank's pieces through ``integrity.ChecksumWriter`` (each rank digests what it
   wrote; rank 0 receives the whole manifest);
3. *publish* (rank 0): plait.json with the manifest and its own checksum, rename to ``step-N``, replace
   ``latest`` (``os.replace``), then retention (``catalog.prune``) when asked. A crash before the rename leaves
   ``latest`` naming the previous complete checkpoint.

Asynchronous saves (``Checkpointer(async_save=True)``): step 1 runs in the training loop, plus *staging*: every
piece is copied to host memory (pinned under CUDA), so training may change the live tensors at once; steps 2-3
run in the background through ``torch.distributed.checkpoint.async_save`` (its thread executor) over a gloo
process group of their own (DCP's collectives must not interleave with the training's on the default group).
At most one save is in flight: ``save`` first waits for the previous one, and ``wait`` (called at the end of
the job) returns once the last one is published. A failure in the background is raised by the next ``save`` or
``wait`` on every rank (agreed over the world), naming the rank and the step.

A failed save (a full disk, a permission, any rank's error in any phase) is agreed over the world and raised on
every rank as one ``CheckpointError`` line naming its root cause (``failures``: "no space left on device at PATH
..." rather than torch's "unexpected pos 704 vs 598"); rank 0 removes the ``.partial`` folder, and ``latest``
still names the previous checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from plait.checkpoint import canonical, catalog, extras, failures, storage
from plait.checkpoint.catalog import LATEST, step_dir
from plait.checkpoint.chunks import Chunked, Piece
from plait.checkpoint.identity import model_meta
from plait.checkpoint.integrity import FORMAT, META, ChecksumWriter, seal
from plait.checkpoint.restore import _agree
from plait.errors import CheckpointError, LayoutError
from plait.logging import get_logger

if TYPE_CHECKING:
    from plait.engine import Engine

log = get_logger(__name__)


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, fsync it and ``os.replace`` it onto ``path``."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        with open(tmp, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half-written temporary file behind
        raise


def publish(root: Path, partial: Path, final: Path, meta: dict[str, Any]) -> None:
    """Complete ``partial`` with plait.json (sealed), rename it to ``final`` and point ``latest`` at it."""
    write_text_atomic(partial / META, json.dumps(seal(meta), indent=2))
    if final.exists():
        log.info("replacing the existing %s with the new save of the same step", final)
        shutil.rmtree(final)
    os.replace(partial, final)
    write_text_atomic(root / LATEST, final.name)


def optim_file(folder: Path, rank: int) -> Path:
    return folder / f"optim-rank{rank:05d}.json"


@dataclass
class Pending:
    """One save between *prepare* and *publish*: what every rank captured at its step."""

    root: Path
    step: int
    rank: int
    world: int
    entries: dict[str, Chunked]
    meta: dict[str, Any]
    rank_files: list[str]

    @property
    def final(self) -> Path:
        return step_dir(self.root, self.step)

    @property
    def partial(self) -> Path:
        return self.final.with_name(self.final.name + ".partial")

    def writer(self) -> ChecksumWriter:
        return ChecksumWriter(self.partial, self.rank, self.rank_files)

    def failed(self, error: BaseException, asynchronous: bool = False) -> CheckpointError:
        """The one-line error of this save's failure on this rank (``failures.save_failed``)."""
        kind = "asynchronous save" if asynchronous else "save"
        return failures.save_failed(
            error, self.partial, f"rank {self.rank}: the {kind} of step {self.step} under {self.root}"
        )

    @property
    def others(self) -> str:
        return (
            f"rank {self.rank}: another rank's save of step {self.step} under {self.root} failed; the previous "
            f"checkpoint is intact. Fix: see that rank's error, which names the cause (a full disk, a permission)."
        )

    def discard(self) -> None:
        """Rank 0, after a failed save: remove ``step-N.partial`` (``latest`` still names the previous one)."""
        if self.rank == 0:
            shutil.rmtree(self.partial, ignore_errors=True)

    def publish(self, writer: ChecksumWriter, keep: int = 0, keep_every: int = 0) -> Path:
        """Rank 0: merge the ranks' param groups, record the manifest, publish, then apply retention."""
        if self.rank != 0:
            return self.final
        merged: list[dict[str, Any]] = []
        for other in range(self.world):
            for group in json.loads(optim_file(self.partial, other).read_text()):
                if group not in merged:
                    merged.append(group)
        meta = {
            **self.meta,
            "optimizer": {"param_groups": merged},
            "files": writer.manifest,
            "model_tensors": writer.model_tensors,
        }
        publish(self.root, self.partial, self.final, meta)
        log.info("saved checkpoint %s", self.final)
        if keep:
            catalog.prune(self.root, keep, keep_every)
        return self.final


def prepare(engine: Engine, root: str | Path) -> Pending:
    """Step 1 of a save (a collective): agree that it can be saved, create ``step-N.partial``, write this
    rank's random generators and param groups there, capture plait.json's content."""
    root = Path(root)
    problem: Exception | None = None
    entries: dict[str, Chunked] = {}
    groups: list[dict[str, Any]] = []
    try:
        entries = canonical.save_state(engine)
        groups = extras.param_groups(engine.strategy.optimizer, canonical.group_names(engine))
    except (LayoutError, TypeError, ValueError) as error:  # agreed over the ranks, then raised on every one
        problem = error
    _agree(engine, problem)
    rank, world = engine.mesh.rank, engine.mesh.world_size
    pending = Pending(root, engine.step, rank, world, entries, {}, [])
    failed: Exception | None = None
    run: str | None = None
    try:
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            run = catalog.ensure_run_id(root, engine.run_id)  # the run every checkpoint of the root records
            shutil.rmtree(pending.partial, ignore_errors=True)
            pending.partial.mkdir()
    except CheckpointError as error:  # a run-id that is not one: its own message
        failed = error
    except OSError as error:
        failed = pending.failed(error)
    _agree(engine, failed, pending.others, pending.discard)  # also the barrier: the folder exists for every rank
    try:
        extras.save_rng(pending.partial, rank)
        write_text_atomic(optim_file(pending.partial, rank), json.dumps(groups))
    except Exception as error:  # noqa: BLE001 - OSError, safetensors' own error: agreed, then raised on every rank
        failed = pending.failed(error)
    _agree(engine, failed, pending.others, pending.discard)
    pending.rank_files = [extras.rng_file(pending.partial, rank).name, optim_file(pending.partial, rank).name]
    pending.meta = {
        "format": FORMAT,
        "step": engine.step,
        "layout": engine.layout.to_dict(),
        "world_size": world,
        "model": model_meta(engine),
        "lr_scheduler": extras.scheduler_state(engine.lr_scheduler),
    }
    if run is not None:  # rank 0, which publishes plait.json
        pending.meta["run"] = run
    return pending


def save(engine: Engine, root: str | Path, keep: int = 0, keep_every: int = 0) -> Path:
    """Save ``engine``'s model, optimizer, lr scheduler and random states under ``root``/step-N (every rank its
    own pieces, with their checksums) and point ``root``/latest at it; then retention when ``keep`` > 0. A
    collective: every rank calls it, and it returns once the checkpoint is published."""
    pending = prepare(engine, root)
    writer = pending.writer()
    problem: Exception | None = None
    final = pending.final
    try:
        storage.write(pending.entries, pending.partial, writer=writer)
        final = pending.publish(writer, keep, keep_every)
    except failures.WRITE_FAILURES as error:  # DCP's CheckpointException is a BaseException
        problem = pending.failed(error)
    _agree(engine, problem, pending.others, pending.discard)
    return final


def _host_copy(view: torch.Tensor) -> torch.Tensor:
    """A compact copy of ``view`` in host memory (pinned under CUDA, so the copy can run ahead)."""
    pinned = view.is_cuda
    out = torch.empty(view.shape, dtype=view.dtype, device="cpu", pin_memory=pinned)
    return out.copy_(view.detach(), non_blocking=pinned)


def stage(entries: dict[str, Chunked]) -> dict[str, Chunked]:
    """Host copies of every piece: what an asynchronous save writes while training changes the live tensors."""
    staged = {
        key: Chunked(value.size(), [Piece(p.offsets, _host_copy(p.view)) for p in value.pieces], value.dtype)
        for key, value in entries.items()
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return staged


class Checkpointer:
    """The saves of a training job under ``root``: synchronous or asynchronous, with retention.

    ``keep``: the number of newest checkpoints retention keeps (0: all); ``keep_every``: also keep every step
    that is a multiple of it (0: none). ``async_save``: write in the background (module docstring)."""

    def __init__(
        self, engine: Engine, root: str | Path, keep: int = 0, keep_every: int = 0, async_save: bool = False
    ) -> None:
        self.engine, self.root = engine, Path(root)
        self.keep, self.keep_every, self.async_save = keep, keep_every, async_save
        self.group: dist.ProcessGroup | None = None
        self._in_flight: tuple[Pending, Future[Path]] | None = None
        self.last_blocking_s = 0.0
        """Seconds the last ``save`` call held the training loop (staging included, waiting for the previous
        save included)."""
        if async_save and storage.distributed() and engine.mesh.world_size > 1:
            # every rank creates it, at the same point: DCP's collectives of a background save run on it
            self.group = dist.new_group(backend="gloo", timeout=engine.comm.timeout)

    def save(self) -> None:
        """Save the engine's state at its current step (every rank calls it)."""
        started = time.perf_counter()
        self.wait()
        if not self.async_save:
            save(self.engine, self.root, self.keep, self.keep_every)
            self.last_blocking_s = time.perf_counter() - started
            return
        pending = prepare(self.engine, self.root)
        staged = stage(pending.entries)
        pending.entries = {}
        writer = pending.writer()
        problem: Exception | None = None
        try:
            upload = storage.write_async(staged, writer, self.group)
        except failures.WRITE_FAILURES as error:  # planning failed (a collective: on every rank)
            problem = pending.failed(error, asynchronous=True)
        _agree(self.engine, problem, pending.others, pending.discard)
        done: Future[Path] = Future()

        def after(upload: Future[Any]) -> None:  # in DCP's executor thread, once every rank's data is written
            try:
                upload.result()
                done.set_result(pending.publish(writer, self.keep, self.keep_every))
            except BaseException as error:  # noqa: BLE001 - handed to the training thread, raised there
                done.set_exception(error)

        upload.add_done_callback(after)
        self._in_flight = (pending, done)
        self.last_blocking_s = time.perf_counter() - started

    def wait(self) -> Path | None:
        """Wait for the save in flight (if any) to be published; every rank calls it. Returns its folder."""
        if self._in_flight is None:
            return None
        pending, done = self._in_flight
        self._in_flight = None
        problem: Exception | None = None
        final = None
        try:
            final = done.result()
        except failures.WRITE_FAILURES as error:  # DCP's CheckpointException is a BaseException
            problem = pending.failed(error, asynchronous=True)
        _agree(self.engine, problem, pending.others, pending.discard)
        return final

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None
