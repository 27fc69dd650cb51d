"""Where ``plait convert`` writes: never over anything plait did not write, and always whole or not at all.

An existing OUT is left alone unless ``--overwrite`` is given *and* OUT is an earlier output of plait, recognised
by what plait put there:

- a ``.safetensors`` export by the ``plait`` entry of its header (``convert.SAFETENSORS_META``);
- a Hugging Face folder export by its marker file ``plait-export.json``, which lists the files plait wrote: a
  folder holding anything else (a tokenizer the user added, ...) is refused, since replacing it would delete that;
- an imported checkpoint root by its only content: ``latest`` and ``step-00000000`` whose plait.json records
  ``imported_from``.

OUT may never be the checkpoint being converted, a folder holding it, or a folder inside it, ``--overwrite`` or
not. New output is written to a temporary sibling (``.OUT.tmp<pid>``) and renamed into place: an existing OUT is
first renamed aside (``.OUT.replaced<pid>``), the new one renamed in, then the old one removed, so a crash at any
point loses neither (the aside copy stays until the rename in has happened).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from plait import files
from plait.errors import ConfigError

MARKER = "plait-export.json"
"""The file that marks a Hugging Face folder as plait's export, listing the files plait wrote there."""
OVERWRITE_FIX = "Fix: choose another OUT, or pass --overwrite to replace an earlier output of plait there."


def protect(source: Path, out: Path) -> None:
    """Refuse an OUT that is the checkpoint / weights being converted (``source``), holds it, or lies inside it
    (for a step folder, inside its checkpoint root)."""
    guarded = [source.resolve()]
    if (source / "plait.json").exists() and ((source.parent / "latest").exists() or source.name.startswith("step-")):
        guarded.append(source.parent.resolve())
    target = out.resolve()
    for folder in guarded:
        if target == folder or folder.is_relative_to(target):
            where = "is" if target == folder else "holds"
            raise ConfigError(
                f"OUT {out} {where} {folder}, which holds what is being converted: writing OUT would replace it. "
                f"Fix: give an OUT outside {folder}, e.g. a new folder beside it."
            )
        if target.is_relative_to(folder):
            raise ConfigError(
                f"OUT {out} lies inside {folder}, which holds what is being converted: plait keeps its outputs out "
                f"of a checkpoint's or model's folder. Fix: give an OUT outside {folder}."
            )


def _refuse(out: Path, why: str) -> ConfigError:
    return ConfigError(f"{out} exists and {why}: plait never replaces what it did not write. {OVERWRITE_FIX}")


def check_file_out(out: Path, overwrite: bool, is_ours: Callable[[Path], bool]) -> None:
    """An OUT file may be written: missing, or (with ``overwrite``) a regular file ``is_ours`` recognises."""
    if not os.path.lexists(out):
        return
    problem = files.file_problem(out)
    if problem is not None:
        raise _refuse(out, f"{problem.removeprefix('is ')}")
    if not overwrite:
        raise ConfigError(f"{out} exists. {OVERWRITE_FIX}")
    if not is_ours(out):
        raise _refuse(out, "is not a file plait exported")


def _listing(folder: Path) -> set[str]:
    return {entry.name for entry in folder.iterdir()}


def marked_files(folder: Path) -> set[str] | None:
    """The files plait's marker in ``folder`` lists (None when there is no valid marker)."""
    try:
        marker = json.loads(files.read_text(folder / MARKER, MARKER))
    except (ConfigError, ValueError):
        return None
    names = marker.get("files") if isinstance(marker, dict) else None
    if not isinstance(names, list) or any(files.plain_name(name) for name in names):
        return None
    return {*names, MARKER}


def check_folder_out(out: Path, overwrite: bool, ours: Callable[[Path], set[str] | None]) -> None:
    """An OUT folder may be written: missing, empty, or (with ``overwrite``) an earlier output of plait holding
    nothing but what ``ours`` says plait wrote there."""
    if not os.path.lexists(out):
        return
    if out.is_symlink() or not out.is_dir():
        raise _refuse(out, "is not a folder")
    present = _listing(out)
    if not present:
        return
    if not overwrite:
        raise ConfigError(f"{out} exists and is not empty. {OVERWRITE_FIX}")
    written = ours(out)
    if written is None:
        raise _refuse(out, "is not an output of plait (no marker of plait's there)")
    foreign = sorted(present - written)
    if foreign:
        raise _refuse(out, f"holds files plait did not write there ({', '.join(foreign[:5])})")


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A temporary sibling of ``out`` to write into; renamed onto ``out`` when the block ends without error
    (module docstring), removed when it fails."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    _remove(tmp)
    try:
        yield tmp
    except BaseException:
        _remove(tmp)
        raise
    aside = out.with_name(f".{out.name}.replaced{os.getpid()}")
    replacing = os.path.lexists(out) and not (out.is_dir() and not out.is_symlink() and not _listing(out))
    if replacing:
        os.replace(out, aside)
    try:
        os.replace(tmp, out)
    except BaseException:
        if replacing:
            os.replace(aside, out)
        _remove(tmp)
        raise
    if replacing:
        _remove(aside)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        path.unlink()


__all__ = ["MARKER", "check_file_out", "check_folder_out", "marked_files", "protect", "staged"]
