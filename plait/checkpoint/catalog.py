"""The checkpoints under a root: what they are (intact / damaged / incomplete), which one to resume from, and
which ones retention may remove.

A root holds ``step-N/`` folders (complete: published with plait.json), ``step-N.partial/`` (a save that never
completed, or one in flight), ``step-N.deleting/`` (retention's, removed on its next pass) and ``latest``.

Choosing (``choose``): the newest complete checkpoint whose plait.json and files check out (``integrity``) is the
one to load. Newer ones that do not are skipped, and ``choose`` says which and why; with none intact it refuses
and deletes nothing. In a job every rank checks its share of the files, the ranks exchange what they found
(``gather``: the same bytes on every rank), and each decides from the same list: the same decision everywhere.

Retention (``prune``): keep the ``keep`` newest complete checkpoints, every step that is a multiple of
``keep_every``, the one ``latest`` names and everything newer than the newest intact one; remove the rest, and
never anything when no checkpoint is intact. Removal renames a folder to ``.deleting`` first (atomic), so a crash
while deleting never leaves a half-removed ``step-N`` that would look damaged.

Only real folders count: a ``step-N`` that is a symbolic link is not a checkpoint of this root (it may point
anywhere), and ``latest`` must be a regular file naming a ``step-N`` folder of the root.

Identity: a checkpoint belongs to one step and one run. Its plait.json records the step it was saved at, and a
folder named for another step is damaged (``integrity.step_problem``). A root belongs to one run: ``run-id``, a
random id written by the first save into the root (``ensure_run_id``; a resumed engine keeps the run of the
checkpoint it loaded), which every save records in plait.json as ``run``. Choosing from a root refuses a
checkpoint of another run like a damaged one (copied from another run's folder), so resume falls back to the
newest intact checkpoint of this run. Both are in plait.json's sealed content: under a checkpoint key, neither
can be changed without the key. A checkpoint that records no run (written before plait recorded runs, or a
model-only import) is not compared (``load`` notes it); a step folder named directly is loaded whatever its run.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plait import files
from plait.checkpoint import integrity, schema
from plait.checkpoint.integrity import META
from plait.errors import CheckpointError
from plait.logging import get_logger

log = get_logger(__name__)
LATEST = "latest"
RUN_ID = "run-id"
"""The file of a checkpoint root naming the run its checkpoints belong to (module docstring)."""
STEP = re.compile(r"^step-(\d+)(\.partial|\.deleting)?$")
INTACT, DAMAGED, INCOMPLETE, UNVERIFIED = "intact", "damaged", "incomplete", "unverified"
Gather = Callable[[bytes], list[bytes]]
"""Every rank's bytes, in rank order, on every rank (``Comm.all_gather_bytes``; ``lambda b: [b]`` alone)."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


@dataclass(frozen=True)
class Entry:
    """One folder under a checkpoint root."""

    path: Path
    step: int
    kind: str = ""
    """"" (complete), ".partial" or ".deleting"."""

    @property
    def name(self) -> str:
        return self.path.name


def entries(root: Path) -> list[Entry]:
    """The step folders under ``root``, newest step first (a complete one before a partial one of its step)."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = STEP.match(path.name)
        if match and path.is_dir() and not path.is_symlink():
            found.append(Entry(path, int(match.group(1)), match.group(2) or ""))
    return sorted(found, key=lambda e: (-e.step, e.kind != "", e.kind))


def latest_name(root: Path) -> str | None:
    """The step folder name ``root/latest`` holds (None when it is missing, not a regular file or names no
    ``step-N``: a pointer never leads outside ``root``)."""
    try:
        name = files.read_text(root / LATEST, LATEST, CheckpointError).strip()
    except CheckpointError:
        return None
    match = STEP.match(name)
    return name if match is not None and not match.group(2) else None


def run_id(root: Path) -> str | None:
    """The run whose checkpoints ``root`` holds (``root/run-id``), None when no save has written one yet. Raises
    ``CheckpointError`` when it is not a regular file holding a run id (32 hex digits)."""
    path = root / RUN_ID
    if files.file_problem(path) == "is missing":
        return None
    text = files.read_text(path, RUN_ID, CheckpointError).strip()
    if not schema.RUN_ID.match(text):
        raise CheckpointError(
            f"{path} holds {text[:40]!r}, not a run id (32 hex digits). Fix: write back the run id this run's "
            f"checkpoints record (plait.json's `run`), or remove the file (the next save records the run of the "
            f"checkpoint it resumed from)."
        )
    return text


def ensure_run_id(root: Path, adopt: str | None = None) -> str:
    """``root``'s run id, written first when it has none: ``adopt`` (the run of the checkpoint the saving engine
    resumed from, if any), else a new random one. Rank 0, at a save, once ``root`` exists."""
    found = run_id(root)
    if found is not None:
        return found
    from plait.checkpoint.saving import write_text_atomic  # saving imports this module

    made = adopt if adopt is not None and schema.RUN_ID.match(adopt) else secrets.token_hex(16)
    write_text_atomic(root / RUN_ID, made + "\n")
    return made


def run_problem(meta: dict[str, Any], run: str | None) -> list[str]:
    """[why] when plait.json (``meta``) records a run other than ``run`` (its root's), else []: nothing to compare
    when either is unknown."""
    theirs = meta.get("run")
    if run is None or theirs is None or theirs == run:
        return []
    return [
        f"it is from another run (run {theirs}, this folder's {RUN_ID} names {run}): copied from another run's "
        f"checkpoints"
    ]


def is_checkpoint_folder(path: Path) -> bool:
    """A single checkpoint (a step folder), rather than a root of them."""
    return (path / META).is_file() or (path / integrity.DCP_METADATA).is_file()


def has_checkpoints(root: str | os.PathLike[str]) -> bool:
    """Whether ``root`` holds anything to resume from (``latest`` or a completed step folder): a resumed run must
    then load one, or refuse; a root with only ``.partial`` folders (the first save never completed) has none."""
    root = Path(root)
    return (root / LATEST).exists() or any(not e.kind for e in entries(root))


@dataclass
class Status:
    """What one step folder is: its state, the problems found, its plait.json and its size on disk."""

    entry: Entry
    state: str
    problems: list[str] = field(default_factory=list)
    meta: dict[str, Any] | None = None
    bytes: int = 0


def folder_bytes(folder: Path) -> int:
    try:
        return sum(p.lstat().st_size for p in folder.iterdir() if not p.is_symlink() and p.is_file())
    except OSError:
        return 0


def status(entry: Entry, deep: bool = True, run: str | None = None) -> Status:
    """The state of one folder, checked in this process (every file; sizes only unless ``deep``); ``run``: its
    root's run id (a checkpoint of another run is damaged)."""
    size = folder_bytes(entry.path)
    if entry.kind:
        what = "a save that never completed (or is still in flight)" if entry.kind == ".partial" else "being removed"
        return Status(entry, INCOMPLETE, [f"{entry.name} is {what}"], None, size)
    meta, problems = integrity.read_meta(entry.path)
    if meta is not None:
        problems = run_problem(meta, run) or integrity.check_files(entry.path, meta, deep=deep)
    if problems:
        return Status(entry, DAMAGED, problems, meta, size)
    return Status(entry, INTACT if meta is not None and integrity.verified(meta) else UNVERIFIED, [], meta, size)


def _agreed(names: list[str], gather: Gather) -> list[str]:
    """The union of every rank's lines, in rank order, without repeats: the same list on every rank."""
    seen: dict[str, None] = {}
    for payload in gather("\n".join(names).encode()):
        for line in payload.decode().splitlines():
            if line:
                seen.setdefault(line, None)
    return list(seen)


def choose(root: Path, rank: int = 0, world: int = 1, gather: Gather | None = None) -> tuple[Path, list[str]]:
    """The checkpoint to load from ``root`` and what was skipped to reach it (newest first), the same on every
    rank; ``root`` may also be one step folder (loaded only if intact). Every rank of a job calls it.

    Raises ``CheckpointError`` when there is no checkpoint, or none intact (naming each one's problems)."""
    gather = gather or (lambda data: [data])
    strict = is_checkpoint_folder(root)
    view: dict[str, Any] = {"strict": strict, "names": [] if strict else [e.name for e in entries(root)]}
    try:
        view["run"] = None if strict else run_id(root)
    except CheckpointError as error:
        view["refused"] = str(error)
    view = json.loads(gather(json.dumps(view).encode())[0].decode())  # rank 0's view of root, on every rank
    if view.get("refused"):
        raise CheckpointError(view["refused"])
    strict, agreed, run = bool(view["strict"]), list(view["names"]), view.get("run")
    if strict:
        candidates = [Entry(root, -1)]
    else:
        candidates = [e for e in (_entry(root / name) for name in agreed) if e.kind != ".deleting"]
        complete_steps = {e.step for e in candidates if not e.kind}
        candidates = [e for e in candidates if not e.kind or e.step not in complete_steps]
        if not candidates:
            pointer = "" if (root / LATEST).exists() else f"{root / LATEST} is missing and "
            raise CheckpointError(
                f"no checkpoint under {root}: {pointer}there is no step folder. "
                f"Fix: save one first with engine.save(), or point at the folder that holds them."
            )
    skipped: list[str] = []
    for entry in candidates:
        if entry.kind == ".partial":
            skipped.append(f"{entry.name} is incomplete (a save that never completed)")
            continue
        meta, problems = integrity.read_meta(entry.path)
        if meta is not None:  # another run's checkpoint: its files need not be read
            problems = run_problem(meta, run) or integrity.check_files(entry.path, meta, rank, world)
        problems = _agreed(problems, gather)
        if not problems:
            return entry.path, skipped
        if strict:
            raise CheckpointError(f"checkpoint {root} is damaged: {'; '.join(problems)}. {integrity.FIX}")
        skipped.append(f"{entry.name} is damaged: {'; '.join(problems)}")
    raise CheckpointError(
        f"no intact checkpoint under {root}: {' | '.join(skipped)}. Nothing was deleted. Fix: restore the damaged "
        f"files from a copy (`plait checkpoint verify {root}` lists them), move a checkpoint copied from another "
        f"step or run back where it came from, or start a fresh run in another folder."
    )


def _entry(path: Path) -> Entry:
    match = STEP.match(path.name)
    if match is None:
        raise CheckpointError(f"{path} is not a step folder")
    return Entry(path, int(match.group(1)), match.group(2) or "")


def prune(root: Path, keep: int, keep_every: int = 0) -> list[Path]:
    """Remove the checkpoints retention does not keep (see the module's docstring); returns what was removed.
    ``keep`` = 0 keeps everything. Checks sizes and plait.json (not digests) to find the newest intact one."""
    if keep <= 0:
        return []
    found = entries(root)
    for leftover in (e for e in found if e.kind == ".deleting"):
        shutil.rmtree(leftover.path, ignore_errors=True)
    complete = [e for e in found if not e.kind]
    try:
        run = run_id(root)
    except CheckpointError as error:  # changed since the save that called retention read it
        log.warning("retention removes nothing under %s: %s", root, error)
        return []
    newest = next((e for e in complete if status(e, deep=False, run=run).state == INTACT), None)
    if newest is None:
        if complete:
            log.warning("retention removes nothing under %s: no checkpoint there is intact", root)
        return []
    kept = {e.name for e in complete[:keep]} | {e.name for e in complete if e.step >= newest.step}
    kept |= {e.name for e in complete if keep_every and e.step % keep_every == 0}
    pointer = latest_name(root)
    if pointer:
        kept.add(pointer)
    stale = [e for e in found if e.kind == ".partial" and e.step < newest.step]
    removed = []
    for entry in [e for e in complete if e.name not in kept] + stale:
        doomed = entry.path.with_name(f"step-{entry.step:08d}.deleting")
        try:
            os.replace(entry.path, doomed)
            shutil.rmtree(doomed)
        except OSError as error:
            log.warning("retention could not remove %s: %s", entry.path, error)
            continue
        removed.append(entry.path)
    if removed:
        log.info("retention (keep %d, keep_every %d) removed %s", keep, keep_every, [p.name for p in removed])
    return removed
