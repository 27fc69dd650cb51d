"""A checkpoint's integrity: the size and SHA-256 digest of every file, recorded in its own plait.json when it
is written and checked before anything of it is read.

Writing (``ChecksumWriter``, DCP's ``FileSystemWriter`` with two additions):

- each rank digests the files it wrote, once they are complete (closed and fsynced): its DCP data files
  ``__<rank>_<n>.distcp`` and the files plait wrote beside them (``rng-rank<R>.safetensors``,
  ``optim-rank<R>.json``), and hands the records to DCP's coordinator with its write results (DCP gathers those
  to rank 0 anyway: no extra collective);
- the coordinator (rank 0) strips them out before DCP writes ``.metadata``, digests ``.metadata`` too, and keeps
  the whole manifest, ``{file: {"rank", "bytes", "sha256"}}``, for plait.json.

plait.json, written last, holds the manifest under ``files``, the whole model's tensor names and shapes under
``model_tensors`` (what ``identity`` compares on resume), and its seals (``signing``): ``checksum``, the digest of
its own other content, so a changed or truncated plait.json is found as well, and with the user's key a
``signature``. A checkpoint is *intact* when plait.json matches its seals, has the value types plait writes
(``schema``) and every recorded file is a regular file of the folder with its recorded size and digest;
``check`` lists what is not, one line per problem naming the file and the rank that wrote it. Without a key the
checksums detect accidents only: whoever can write the folder can also re-seal it (``signing``).

Why SHA-256: it is in the standard library (hashlib), hardware-accelerated on current x86 (SHA-NI) and ARM
(ARMv8 crypto) CPUs -- on this project's CPU machine 0.9 GB/s per core against blake2b's 0.3 GB/s (measured
with 256 MiB of random bytes, machine busy) --, releases the GIL while it hashes (a background save does not
stall training), and anyone can check a file by hand with ``sha256sum``. zlib's crc32 is ~1.8x faster but
32 bits and not checkable with common tools; for damage found at load time, reading the bytes costs more than
hashing them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from plait import files as safe_files
from plait.checkpoint import schema, signing
from plait.checkpoint.canonical import MODEL
from plait.errors import CheckpointError

META = "plait.json"
FORMAT = 2
"""plait.json's ``format``: 2 = canonical global tensors (any layout). Checksums were added within format 2."""
DCP_METADATA = ".metadata"
DIGEST = "sha256"
CHUNK = 8 * 2**20
STEP_FOLDER = re.compile(r"^step-(\d+)$")
"""A complete step folder's name: the step its plait.json must record (``step_problem``)."""
FILES_KEY = "__plait_files__"
"""The fqn of the extra write result that carries a rank's file records to the coordinator."""
FIX = (
    "Fix: resume from an older checkpoint (engine.load(root) and plait train pick the newest intact one by "
    "themselves), or restore the file from a copy; `plait checkpoint verify` lists every problem."
)


def digest_file(path: str | os.PathLike[str]) -> tuple[int, str]:
    """(bytes, SHA-256 hex digest) of the file at ``path``, read in 8 MiB chunks into one buffer."""
    hasher = hashlib.sha256()
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    size = 0
    with safe_files.open_regular(Path(path), "checkpoint file", CheckpointError) as handle:
        while True:
            n = handle.readinto(view)
            if not n:
                break
            hasher.update(view[:n])
            size += n
    return size, hasher.hexdigest()


def record_files(folder: Path, names: list[str], rank: int) -> dict[str, dict[str, Any]]:
    """The manifest entries of ``names`` (files in ``folder`` that ``rank`` wrote)."""
    out = {}
    for name in sorted(set(names)):
        size, digest = digest_file(folder / name)
        out[name] = {"rank": rank, "bytes": size, DIGEST: digest}
    return out


# ----------------------------------------------------------------- plait.json
def seal(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` with its seals: ``checksum`` and, when the user set a checkpoint key, ``signature`` (``signing``)."""
    return signing.seal(meta)


def read_meta(folder: Path, keyed: bool = True) -> tuple[dict[str, Any] | None, list[str]]:
    """plait.json of ``folder`` and the problems found with it (missing, not a regular file, unreadable, not
    matching its checksum, malformed values, under a key not signed with it, a step other than the folder's name
    says; ``keyed=False``: the signature is not checked, for ``plait checkpoint sign``).

    A plait.json of another format raises ``CheckpointError`` (it is not damage: another plait wrote it). One
    written before checksums were recorded (no ``files``) comes back with no problem; ``verified(meta)`` is
    False for it."""
    path = folder / META
    problem = safe_files.file_problem(path)
    if problem == "is missing":
        what = "is missing" if folder.is_dir() else "is missing (the folder is gone)"
        return None, [f"{META} {what}: the save never completed, or the file was removed"]
    try:
        meta = json.loads(safe_files.read_text(path, META, CheckpointError))
    except (CheckpointError, ValueError, RecursionError) as error:
        return None, [f"{META} (written by rank 0) is unreadable: {type(error).__name__}: {error}"]
    if not isinstance(meta, dict):
        return None, [f"{META} (written by rank 0) holds a {type(meta).__name__}, not an object"]
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{folder} is a plait checkpoint of format {str(meta.get('format', 1))[:20]}, this plait reads format "
            f"{FORMAT} (layout-free global tensors). Fix: load it with the plait version that wrote it and save it again."
        )
    if "checksum" in meta and not isinstance(meta["checksum"], str):
        return None, [f"{META} (written by rank 0) has a malformed checksum"]
    sealed = signing.problem(meta, None)
    if sealed is not None:
        return None, [sealed]
    malformed = schema.problems(meta)
    if malformed:
        return None, [f"{META} (written by rank 0) is malformed: {'; '.join(malformed[:3])}"]
    sealed = signing.problem(meta, signing.key()) if keyed else None
    if sealed is not None:
        return None, [sealed]
    moved = step_problem(folder, meta)
    return (meta, []) if moved is None else (None, [moved])


def step_problem(folder: Path, meta: dict[str, Any]) -> str | None:
    """Whether plait.json's step is the one its folder's name says (None when it is, or when the folder is not
    named ``step-N``). A checkpoint copied or renamed to another step's name would otherwise be resumed as that
    step, and the run's records after its real step deleted; plait.json's seals (under a key, its signature)
    cover the step, so the name cannot be made to match without re-sealing."""
    named = STEP_FOLDER.match(folder.name)
    if named is None or int(named.group(1)) == meta["step"]:
        return None
    return (
        f"recorded step {meta['step']} in folder {folder.name}: the checkpoint was copied or renamed from another "
        f"step's folder ({META} records the step it was saved at)"
    )


def verified(meta: dict[str, Any]) -> bool:
    """Whether plait.json records the files' checksums (checkpoints of earlier plait versions do not)."""
    return isinstance(meta.get("files"), dict) and "checksum" in meta


# ----------------------------------------------------------------- checking
def shares(files: dict[str, dict[str, Any]], world: int) -> list[list[str]]:
    """Split the files over ``world`` ranks, largest first to the least loaded (the same split on every rank)."""
    load = [0] * world
    out: list[list[str]] = [[] for _ in range(world)]
    for name in sorted(files, key=lambda n: (-int(files[n].get("bytes", 0)), n)):
        rank = min(range(world), key=lambda r: (load[r], r))
        out[rank].append(name)
        load[rank] += int(files[name].get("bytes", 0))
    return out


def check_file(folder: Path, name: str, record: dict[str, Any], deep: bool = True) -> str | None:
    """The problem with one recorded file (None when it has its size and, if ``deep``, its digest)."""
    who = f"{name} (written by rank {record.get('rank', '?')})"
    path = folder / name  # a plain name: schema.problems checked every recorded one
    problem = safe_files.file_problem(path)
    if problem is not None:
        return f"{who} {problem}"
    size = path.stat().st_size
    if size != record["bytes"]:
        return f"{who} has {size} bytes where {META} records {record['bytes']} (truncated or overwritten)"
    if deep:
        try:
            _, digest = digest_file(path)
        except CheckpointError as error:  # replaced by a FIFO or a link since the check above
            return f"{who}: {error}"
        if digest != record.get(DIGEST):
            return f"{who} has the right size but not its recorded {DIGEST} (its bytes changed)"
    return None


def check_files(folder: Path, meta: dict[str, Any], rank: int = 0, world: int = 1, deep: bool = True) -> list[str]:
    """The problems with this rank's share (``shares``) of the files plait.json (``meta``) records."""
    if not verified(meta):
        return []
    files = meta["files"]
    mine = shares(files, world)[rank]
    return [p for name in mine if (p := check_file(folder, name, files[name], deep)) is not None]


def check(folder: Path, rank: int = 0, world: int = 1, deep: bool = True) -> list[str]:
    """The problems of the checkpoint in ``folder`` that this rank finds: plait.json (every rank reads it) and
    this rank's share of the recorded files (``shares``); all of them with ``world`` = 1. ``deep=False``
    checks sizes only (no file is read)."""
    meta, problems = read_meta(folder)
    return problems if meta is None else check_files(folder, meta, rank, world, deep)


# ----------------------------------------------------------------- writing
class ChecksumWriter(FileSystemWriter):
    """DCP's FileSystemWriter that digests what each rank wrote and gives the coordinator the whole manifest
    (``manifest``, on the coordinator only, once ``dcp.save`` has returned)."""

    def __init__(self, path: str | os.PathLike[str], rank: int, rank_files: list[str] | None = None) -> None:
        super().__init__(path)
        self.writer_rank = rank
        self.rank_files = list(rank_files or [])
        """Files this rank wrote into the folder before the save (plait's rng and optimizer-group files)."""
        self.manifest: dict[str, dict[str, Any]] = {}
        self.model_tensors: dict[str, list[int]] = {}
        """The whole model's tensors by single-device name, with their global shapes (coordinator only)."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        written = super().write_data(plan, planner)
        written.wait()
        results = list(written.value())
        folder = Path(self.path)
        names = {str(result.storage_data.relative_path) for result in results}
        prefix = getattr(plan.storage_data, "prefix", None)
        if prefix is not None:  # a rank with nothing to write still creates its (empty) data file
            names |= {path.name for path in folder.glob(f"{prefix}*.distcp")}
        records = record_files(folder, [*names, *self.rank_files], self.writer_rank)
        results.append(WriteResult(MetadataIndex(FILES_KEY), 0, json.dumps(records)))
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)  # torch.futures.Future: DCP calls wait() and value()
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        manifest: dict[str, dict[str, Any]] = {}
        plain = []
        for rank_results in results:
            kept = []
            for result in rank_results:
                if result.index.fqn == FILES_KEY:
                    manifest.update(json.loads(result.storage_data))
                else:
                    kept.append(result)
            plain.append(kept)
        super().finish(metadata, plain)
        self.model_tensors = {
            fqn[len(MODEL) :]: list(stored.size)
            for fqn, stored in metadata.state_dict_metadata.items()
            if fqn.startswith(MODEL) and isinstance(stored, TensorStorageMetadata)
        }
        manifest.update(record_files(Path(self.path), [DCP_METADATA], self.writer_rank))
        self.manifest = manifest
