"""Which files of an input folder ``plait data prepare`` reads, and why it leaves the others.

Corpora come as people keep them: ``LICENSE``, ``COPYING``, ``README``, man pages (``ls.1``), ``*.tex``, files
without any suffix. A folder is therefore walked recursively (sorted, without entering linked folders) and each
file is taken

- by its suffix when it has a known one (``.txt .text .md .rst .py`` text, ``.jsonl``, ``.parquet``), or
- by its content otherwise: a file that is valid UTF-8 from its first byte to its last and holds no NUL byte is
  text (one document, as any text file); anything else is skipped — binary (a NUL byte), not UTF-8, empty, not a
  regular file (a FIFO, a device: never opened), or a symbolic link (never followed: name the target itself).

An empty file inside a folder (every Python package's ``__init__.py``) is skipped whatever its suffix; an empty
file named on the command line is an error (it was asked for).

``--include PATTERN`` keeps only the files that match one of the patterns, ``--exclude PATTERN`` drops those that
match one (both repeatable; a pattern is a shell glob matched against the file's path relative to the folder and
against its name, so ``--exclude '*.min.js'`` and ``--exclude 'build/*'`` both work); the patterns choose among
the files of folders, never among files named on the command line, which are read whatever they are. Every
skipped file is reported with its reason (``Skipped``): ``prepare`` logs them, records them in ``meta.json`` and
``plait data prepare`` prints them. Checking content reads a candidate file once (streamed, bounded memory).
"""

from __future__ import annotations

import codecs
import fnmatch
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from plait.errors import DataError

TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst", ".py")
SUFFIXES = (*TEXT_SUFFIXES, ".jsonl", ".parquet")
_READ = 1 << 16


@dataclass(frozen=True)
class Skipped:
    """A file of an input folder that is not read, and why."""

    path: str
    reason: str


def kind_of(path: Path) -> str:
    """How a file is read: "jsonl", "parquet" or "text"."""
    suffix = path.suffix.lower()
    return "jsonl" if suffix == ".jsonl" else "parquet" if suffix == ".parquet" else "text"


def not_text(path: Path) -> str | None:
    """Why the regular file ``path`` is not UTF-8 text (None when it is): read once, in blocks, strictly."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="strict")
    offset = 0
    try:
        with open(path, "rb") as stream:
            while block := stream.read(_READ):
                zero = block.find(b"\0")
                if zero >= 0:
                    return f"binary (a NUL byte at byte {offset + zero})"
                try:
                    decoder.decode(block)
                except UnicodeDecodeError as error:
                    return f"not UTF-8 text (byte {offset + error.start})"
                offset += len(block)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return f"not UTF-8 text (ends inside a character at byte {offset})"
    except OSError as error:
        return f"unreadable ({error.strerror or error})"
    return None if offset else "empty"


def _matches(relative: str, patterns: Sequence[str]) -> bool:
    name = relative.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatchcase(relative, p) or fnmatch.fnmatchcase(name, p) for p in patterns)


def _chosen(relative: str, include: Sequence[str], exclude: Sequence[str]) -> str | None:
    """Why the patterns leave this file out (None: they keep it)."""
    if include and not _matches(relative, include):
        return f"not matched by --include {' '.join(include)}"
    if exclude and _matches(relative, exclude):
        return "matched by --exclude"
    return None


def walk(folder: Path, include: Sequence[str] = (), exclude: Sequence[str] = ()) -> tuple[list[Path], list[Skipped]]:
    """The files of ``folder`` to read (sorted by path) and the skipped ones with their reasons (module doc)."""
    found: list[Path] = []
    skipped: list[Skipped] = []
    for root, dirs, files in os.walk(folder):  # os.walk never enters a linked folder
        dirs.sort()
        for name in sorted(files) + sorted(d for d in dirs if os.path.islink(os.path.join(root, d))):
            path = Path(root) / name
            relative = path.relative_to(folder).as_posix()
            reason = _chosen(relative, include, exclude) or _unreadable(path) or _empty(path)
            if reason is None and path.suffix.lower() not in SUFFIXES:
                reason = not_text(path)
            if reason is None:
                found.append(path)
            else:
                skipped.append(Skipped(str(path), reason))
    return sorted(found), skipped


def _empty(path: Path) -> str | None:
    """ "empty" for a file of no bytes (a package's ``__init__.py``): inside a folder it is skipped, not an error."""
    return "empty" if os.lstat(path).st_size == 0 else None


def _unreadable(path: Path) -> str | None:
    """Why a folder entry is not read without opening it: a link, or not a regular file."""
    try:
        info = os.lstat(path)
    except OSError as error:
        return f"cannot be examined ({error.strerror})"
    if stat.S_ISLNK(info.st_mode):
        return "a symbolic link (not followed: name its target to read it)"
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    return None


def check_patterns(include: Sequence[str], exclude: Sequence[str]) -> None:
    """DataError for an empty pattern (it would match nothing, or, excluded, silently nothing)."""
    for flag, patterns in (("--include", include), ("--exclude", exclude)):
        if any(not isinstance(p, str) or not p.strip() for p in patterns):
            raise DataError(f"{flag} takes a non-empty glob pattern. Fix: e.g. {flag} '*.txt'.")


def describe_skipped(skipped: Sequence[Skipped], limit: int = 10) -> str:
    """The skipped files in one line: their count by reason, then the first ``limit`` with their reasons."""
    if not skipped:
        return ""
    counts: dict[str, int] = {}
    for entry in skipped:
        key = entry.reason.split(" (")[0]
        counts[key] = counts.get(key, 0) + 1
    summary = ", ".join(f"{count} {reason}" for reason, count in counts.items())
    shown = "; ".join(f"{entry.path}: {entry.reason}" for entry in skipped[:limit])
    more = f"; and {len(skipped) - limit} more" if len(skipped) > limit else ""
    return f"skipped {len(skipped)} file(s) ({summary}): {shown}{more}"


__all__ = ["SUFFIXES", "TEXT_SUFFIXES", "Skipped", "check_patterns", "describe_skipped", "kind_of", "not_text", "walk"]
