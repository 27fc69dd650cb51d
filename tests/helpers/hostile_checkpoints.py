"""What the adversarial checkpoint tests share: a tiny saved model, an attacker's re-sealing of plait.json, byte
snapshots of folders (nothing lost), a guard against hangs, a small full disk, and the one-line error check."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import torch

import plait
from plait import Layout
from plait.models import GPT, GPTConfig

TINY = {"vocab_size": 16, "seq_len": 8, "n_layer": 2, "n_head": 4, "d_model": 16}


def engine(layout: Layout | None = None, **fields: object) -> plait.Engine:
    """An engine of a tiny GPT (``fields`` override its config; one process unless ``layout``), AdamW, seeded."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**TINY, **fields}))  # type: ignore[arg-type]
    optimizer = lambda params: torch.optim.AdamW(params, lr=1e-3)  # noqa: E731
    return plait.parallelize(model, layout or Layout(), optimizer=optimizer)


def step(built: plait.Engine) -> None:
    """One training step on a fixed batch."""
    tokens = torch.randint(0, TINY["vocab_size"], (2, TINY["seq_len"] + 1), generator=torch.Generator().manual_seed(1))
    built.train_step((tokens[:, :-1], tokens[:, 1:]))


def trained(root: Path, steps: int = 1, **fields: object) -> tuple[plait.Engine, Path]:
    """An engine trained ``steps`` steps and saved under ``root`` (returns it and the step folder)."""
    built = engine(**fields)
    for _ in range(steps):
        step(built)
    return built, built.save(root)


def reseal(folder: Path, edit: object = None) -> None:
    """Do what anyone who can write ``folder`` can do without a key: apply ``edit`` (a function of plait.json's
    dict) and record every regular file's size and SHA-256 and plait.json's checksum again (no signature)."""
    meta = json.loads((folder / "plait.json").read_text())
    files = meta.get("files")
    if isinstance(files, dict):
        for name, record in files.items():
            path = folder / str(name)
            if isinstance(record, dict) and path.is_file() and not path.is_symlink():
                data = path.read_bytes()
                record["bytes"], record["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    if callable(edit):
        edit(meta)
    meta.pop("signature", None)
    body = {key: value for key, value in meta.items() if key != "checksum"}
    meta["checksum"] = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    (folder / "plait.json").write_text(json.dumps(meta))


def snapshot(*roots: Path) -> dict[str, str]:
    """Every entry under ``roots`` without following links: file contents' digests, link targets, other kinds."""
    found: dict[str, str] = {}
    for root in roots:
        for folder, dirs, names in os.walk(root):
            for name in dirs + names:
                path = Path(folder) / name
                info = path.lstat()
                if stat.S_ISLNK(info.st_mode):
                    found[str(path)] = "link -> " + os.readlink(path)
                elif stat.S_ISREG(info.st_mode):
                    found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
                else:
                    found[str(path)] = "dir" if stat.S_ISDIR(info.st_mode) else f"mode {info.st_mode:o}"
    return found


def one_line(message: str, *patterns: str) -> None:
    """``message`` is one line that names the fix and matches every regex of ``patterns`` (case-insensitive),
    and never tells the user to unpickle."""
    text = message.strip()
    assert "\n" not in text, f"not one line: {text}"
    assert "Traceback" not in text and "weights_only=False" not in text.replace(" ", ""), text
    assert "Fix" in text, f"names no fix: {text}"
    for pattern in patterns:
        assert re.search(pattern, text, re.IGNORECASE), f"{pattern!r} not in: {text}"


@contextlib.contextmanager
def no_hang(seconds: int = 20) -> Iterator[None]:
    """Fail (TimeoutError) instead of hanging: a blocked open() of a FIFO is interrupted by SIGALRM."""

    def expire(_signum: int, _frame: object) -> None:
        raise TimeoutError(f"hung for {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def small_disk(folder: Path, size: str = "4m") -> Iterator[Path | None]:
    """A tmpfs of ``size`` mounted at ``folder`` (root only); None where mounting is not allowed."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True, timeout=20
        )
    except (OSError, subprocess.SubprocessError):
        mounted = None
    if mounted is None or mounted.returncode != 0:
        yield None
        return
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True, timeout=20)


def fill(folder: Path, leave: int) -> None:
    """Fill the device of ``folder`` until ``leave`` bytes are free."""
    info = os.statvfs(folder)
    free = info.f_bavail * info.f_frsize
    with open(folder / "filler", "wb") as handle:
        handle.write(b"\0" * max(0, free - leave))


KEY = "a-checkpoint-key-of-the-user"
"""A checkpoint key (PLAIT_CHECKPOINT_KEY) the adversarial tests sign with."""


def cli(capsys: object, *argv: str) -> tuple[int, str, str]:
    """``plait ARGV`` in this process: its exit code, stdout and stderr (only what the command printed)."""
    from plait.cli.main import main

    capsys.readouterr()  # type: ignore[attr-defined]
    code = main(list(argv))
    out, err = capsys.readouterr()  # type: ignore[attr-defined]
    return code, out, err
