"""Where ``plait data prepare`` writes: the rules of ``--out``, so that nothing of the user's is ever lost.

* plait never deletes or overwrites a file it did not write. An existing ``--out`` is used only when it is empty or
  a plait token folder (a ``meta.json`` of plait's format); anything else there is refused, ``--overwrite`` or not.
* A plait token folder is replaced only with ``--overwrite``, and then only plait's own files: the fixed names in
  ``PLAIT_FILES`` that its ``meta.json`` lists (so a ``meta.json`` cannot name a user's file for deletion); other
  files in the folder stay as they are, and a user's file that has one of plait's names there is refused.
* The new folder is written into a hidden temporary sibling (``.NAME.<random>.partial``, on the same file system) and
  renamed into place when complete, ``meta.json`` last. An interrupted prepare leaves ``--out`` as it was (a run
  killed outright, which cannot clean up, may leave that sibling behind: it is plait's and can be deleted).
* ``--out`` may not be an input folder, lie inside one, or hold an input: prepare would read its own output.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from plait.errors import DataError

META_FILE = "meta.json"
INPUTS_FILE = "inputs.jsonl"
FORMAT = "plait-tokens"
PLAIT_FILES = frozenset(
    {"train.bin", "train.idx", "val.bin", "val.idx", "train.mask.bin", "val.mask.bin", "tokenizer.json", INPUTS_FILE}
    | {META_FILE},
)
"""Every name plait writes into a token folder (the only names ``--overwrite`` ever replaces or removes)."""


@dataclass(frozen=True)
class OutFolder:
    """A checked ``--out``: the folder, and plait's own files already in it (replaced at the end)."""

    path: Path
    owned: frozenset[str]

    def stage(self) -> Path:
        """A new empty temporary sibling of the folder to write into (its parents created as needed)."""
        parent = self.path.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            staging = parent / f".{self.path.name}.{secrets.token_hex(4)}.partial"
            staging.mkdir()
        except OSError as error:
            raise DataError(
                f"cannot write beside --out {self.path} ({error.strerror or error}). Fix: name a folder in a "
                f"writable place."
            ) from error
        return staging

    def install(self, staging: Path) -> None:
        """Move the complete ``staging`` folder into place: a rename when the folder is new or empty; else plait's
        old files go (``meta.json`` first, so the folder reads as incomplete meanwhile) and the new ones come in,
        ``meta.json`` last. Removes ``staging``."""
        path = self.path
        if not path.exists() or (path.is_dir() and not any(path.iterdir())):
            os.replace(staging, path)  # rename(2) replaces an empty folder atomically
            return
        new = sorted(p.name for p in staging.iterdir())
        (path / META_FILE).unlink(missing_ok=True)
        for name in sorted(self.owned - set(new)):
            (path / name).unlink(missing_ok=True)
        for name in [n for n in new if n != META_FILE] + [META_FILE]:
            os.replace(staging / name, path / name)
        staging.rmdir()

    @staticmethod
    def discard(staging: Path) -> None:
        """Remove a staging folder (plait's: created by ``stage``) after a failure."""
        shutil.rmtree(staging, ignore_errors=True)


def _plait_files(path: Path) -> frozenset[str] | None:
    """Plait's own files in folder ``path`` when it is a plait token folder, else None."""
    meta = path / META_FILE
    if not meta.is_file():
        return None
    try:
        record = json.loads(meta.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or record.get("format") != FORMAT or not isinstance(record.get("files"), dict):
        return None
    return frozenset({META_FILE, *record["files"]} & PLAIT_FILES)


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_out(out: Path, inputs: Sequence[str | Path], overwrite: bool) -> OutFolder:
    """Refuse an ``--out`` that would lose a user's file or read its own output (module doc), before any work.
    A symbolic link is followed (the folder it names is written; the link stays)."""
    if out.is_symlink():
        out = out.resolve()
    ancestor = out
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        what = "is a file" if ancestor == out else f"lies under {ancestor}, which is a file"
        raise DataError(f"--out {out} {what}. Fix: name a folder (created if missing) under folders only.")
    if not os.access(ancestor, os.W_OK):
        raise DataError(f"--out {out}: {ancestor} is not writable. Fix: name a folder in a writable place.")
    resolved = out.resolve()
    for given in inputs:
        source = Path(given).expanduser().resolve()
        if source.is_dir() and _inside(resolved, source):
            raise DataError(
                f"--out {out} lies inside the input folder {given}: prepare would read its own output (inputs.jsonl, "
                f"...) as input. Fix: put --out outside the input folders."
            )
        if _inside(source, resolved):
            raise DataError(
                f"the input {given} lies inside --out {out}: prepare would read and replace its own output. Fix: "
                f"give the original inputs, or another --out."
            )
    if not out.is_dir() or not any(out.iterdir()):
        return OutFolder(out, frozenset())
    owned = _plait_files(out)
    if owned is None:
        theirs = sorted(p.name for p in out.iterdir())
        raise DataError(
            f"--out {out} already holds files plait did not write ({', '.join(theirs[:5])}"
            f"{', ...' if len(theirs) > 5 else ''}); plait never overwrites them, --overwrite or not. Fix: name a "
            f"new or empty folder."
        )
    if not overwrite:
        raise DataError(f"{out} already holds prepared data. Fix: --overwrite to replace it, or another --out.")
    clashing = sorted(name for name in PLAIT_FILES - owned if (out / name).exists())
    if clashing:
        raise DataError(
            f"--out {out} holds {', '.join(clashing)}, which its meta.json does not list: not plait's, so not "
            f"replaced. Fix: move them away, or name another --out."
        )
    return OutFolder(out, owned)


__all__ = ["FORMAT", "INPUTS_FILE", "META_FILE", "PLAIT_FILES", "OutFolder", "check_out"]
