"""``plait checkpoint verify DIR``, ``list RUN``, ``keygen FILE`` and ``sign DIR``: is a checkpoint intact, what
is there, and signing checkpoints with a key of the user's.

    plait checkpoint verify runs/job/ckpt/step-00000300   # one checkpoint: exit 0 intact, 1 damaged
    plait checkpoint verify runs/job                      # every checkpoint of a run (or of a ckpt folder)
    plait checkpoint list runs/job                        # steps, sizes, layout, state, which one latest names
    plait checkpoint keygen ckpt.key                      # a new key (mode 0600) for PLAIT_CHECKPOINT_KEY_FILE
    plait checkpoint sign runs/job/ckpt/step-00000300     # sign a checkpoint you trust with that key

``verify`` and ``list`` read every recorded file and compare its size and SHA-256 with plait.json
(``plait.checkpoint.integrity``); ``list --quick`` compares sizes only. A damaged checkpoint prints one line per
problem, naming the file and the rank that wrote it. Nothing is changed or deleted. Without a checkpoint key
these checks detect accidents only: anyone who can write the folder can also re-seal plait.json; with a key
(``plait.checkpoint.signing``) a checkpoint is intact only when signed with it. ``sign`` checks every file first
and signs only an intact checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from plait.errors import ConfigError


def add_checkpoint_command(commands: Any) -> None:
    """Register ``plait checkpoint {verify,list}`` on the ``plait`` parser's subcommands."""
    parser = commands.add_parser(
        "checkpoint",
        help="verify checkpoints (sizes and SHA-256 of every file) or list those of a run",
        description="Check plait checkpoints against the sizes and SHA-256 digests their plait.json records.",
    )
    actions = parser.add_subparsers(dest="action", required=True)
    verify = actions.add_parser(
        "verify", help="check a checkpoint (or every one under a folder): exit 0 intact, 1 damaged"
    )
    verify.add_argument("dir", help="a step folder, a checkpoint root (with step-N folders) or a run folder")
    listing = actions.add_parser("list", help="the checkpoints of a run: step, size, layout, state, latest")
    listing.add_argument("run", help="a run folder (with ckpt/) or a checkpoint root")
    listing.add_argument("--quick", action="store_true", help="compare sizes only (read no file)")
    keygen = actions.add_parser("keygen", help="write a new random checkpoint key (mode 0600) to FILE")
    keygen.add_argument("key_path", metavar="FILE", help="where to write the key (never overwritten)")
    sign = actions.add_parser("sign", help="sign an intact checkpoint you trust with the checkpoint key")
    sign.add_argument("dir", help="a step folder, or a checkpoint root / run folder (signs every intact one)")


def _root(path: Path) -> Path:
    """The checkpoint root for a run folder (its ckpt/) or a root itself."""
    from plait.checkpoint.catalog import LATEST, entries

    if not path.exists():
        raise ConfigError(f"{path} does not exist. Fix: give a run folder, its ckpt/ folder or a step folder.")
    if (path / "ckpt").is_dir() and not entries(path) and not (path / LATEST).exists():
        return path / "ckpt"
    return path


def _layout(meta: dict[str, Any] | None) -> str:
    if not meta or not meta.get("layout"):
        return "-"
    from plait.layout import Layout

    try:
        return Layout.from_dict(meta["layout"]).short()
    except Exception:  # noqa: BLE001 - a layout this plait does not know: show the degrees it has
        return " ".join(f"{k}{meta['layout'][k]}" for k in ("pp", "dp", "cp", "tp") if k in meta["layout"])


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return f"{n} B"


def run_verify(path: Path) -> int:
    from plait.checkpoint.catalog import (
        DAMAGED,
        INCOMPLETE,
        INTACT,
        STEP,
        Entry,
        entries,
        is_checkpoint_folder,
        status,
    )

    path = _root(path)
    match = STEP.match(path.name)
    if match and match.group(2):  # a .partial (or .deleting) folder named directly
        targets = [Entry(path, int(match.group(1)), match.group(2))]
    elif is_checkpoint_folder(path):
        targets = [Entry(path, -1)]
    else:
        targets = [e for e in entries(path) if not e.kind]
    if not targets:
        raise ConfigError(f"{path} holds no checkpoint (no plait.json, no step-N folder). Fix: give a run folder.")
    run = _run_id(path, targets)
    bad = 0
    for entry in targets:
        found = status(entry, run=run)
        if found.state in (DAMAGED, INCOMPLETE):
            bad += 1
            for problem in found.problems:
                print(f"{entry.path}: {problem}")  # noqa: T201 - CLI output
        else:
            note = "" if found.state == INTACT else " (written before plait recorded checksums: sizes unknown)"
            files = len((found.meta or {}).get("files") or {})
            print(f"{entry.path}: {found.state}, {files} files, {_size(found.bytes)}{note}{_trust()}")  # noqa: T201
    return 1 if bad else 0


def _run_id(root: Path, targets: list[Any]) -> str | None:
    """The run id of ``root`` when ``targets`` are its step folders (a checkpoint of another run is damaged);
    None for a step folder named directly."""
    from plait.checkpoint.catalog import run_id

    return None if any(entry.step < 0 for entry in targets) else run_id(root)


def _trust() -> str:
    from plait.checkpoint.signing import KEY_FILE_ENV, key

    if key() is not None:
        return ", signed with the checkpoint key"
    return f" (no checkpoint key set: checksums detect accidents, not tampering; see {KEY_FILE_ENV})"


def _targets(path: Path) -> list[Any]:
    from plait.checkpoint.catalog import Entry, entries, is_checkpoint_folder

    path = _root(path)
    found = [Entry(path, -1)] if is_checkpoint_folder(path) else [e for e in entries(path) if not e.kind]
    if not found:
        raise ConfigError(f"{path} holds no checkpoint (no plait.json, no step-N folder). Fix: give a run folder.")
    return found


def run_sign(path: Path) -> int:
    """Sign every intact checkpoint at ``path`` with the checkpoint key (after checking all its files)."""
    from plait.checkpoint.integrity import META, check_files, read_meta
    from plait.checkpoint.saving import write_text_atomic
    from plait.checkpoint.signing import KEY_FIX, key, seal

    secret = key()
    if secret is None:
        raise ConfigError(f"no checkpoint key is set, so there is nothing to sign with. {KEY_FIX}")
    bad = 0
    for entry in _targets(path):
        meta, problems = read_meta(entry.path, keyed=False)
        if meta is not None:
            problems = check_files(entry.path, meta) or ([] if "files" in meta else ["it records no files"])
        if problems or meta is None:
            bad += 1
            print(f"{entry.path}: not signed: {'; '.join(problems)}", file=sys.stderr)  # noqa: T201 - CLI output
            continue
        write_text_atomic(entry.path / META, json.dumps(seal(meta, secret), indent=2))
        print(f"{entry.path}: signed")  # noqa: T201 - CLI output
    return 1 if bad else 0


def run_list(path: Path, quick: bool) -> int:
    from rich.console import Console
    from rich.table import Table

    from plait.checkpoint.catalog import INTACT, entries, latest_name, status

    root = _root(path)
    found = entries(root)
    if not found:
        raise ConfigError(f"{root} holds no checkpoint (no step-N folder). Fix: give a run folder or its ckpt/.")
    pointer = latest_name(root)
    run = _run_id(root, found)
    table = Table(title=f"checkpoints under {root}" + (" (sizes only)" if quick else ""), title_justify="left")
    for header in ("step", "folder", "size", "files", "layout", "world", "state", "latest"):
        table.add_column(header, justify="right" if header in ("step", "size", "files", "world") else "left")
    for entry in found:
        result = status(entry, deep=not quick, run=run)
        meta = result.meta or {}
        state = result.state if result.state == INTACT else f"{result.state}: {'; '.join(result.problems)}"
        table.add_row(
            str(entry.step),
            entry.name,
            _size(result.bytes),
            str(len(meta.get("files") or {})) if meta else "-",
            _layout(meta),
            str(meta.get("world_size") or "-"),
            state if result.state != "unverified" else "unverified (no checksums recorded)",
            "<- latest" if entry.name == pointer else "",
        )
    Console(width=200).print(table)
    return 0


def run_checkpoint(args: argparse.Namespace) -> int:
    if args.action == "verify":
        return run_verify(Path(args.dir))
    if args.action == "keygen":
        from plait.checkpoint.signing import KEY_FILE_ENV
        from plait.files import generate_key_file

        written = generate_key_file(args.key_path)
        print(f"wrote {written} (mode 0600). Use it: export {KEY_FILE_ENV}={written.resolve()}")  # noqa: T201
        return 0
    if args.action == "sign":
        return run_sign(Path(args.dir))
    if args.action == "list":
        return run_list(Path(args.run), args.quick)
    print(f"plait checkpoint: unknown action {args.action!r}", file=sys.stderr)  # noqa: T201
    return 2


__all__ = ["add_checkpoint_command", "run_checkpoint"]
