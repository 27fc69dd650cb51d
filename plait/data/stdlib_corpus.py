"""A real corpus every machine running plait already has: the Python standard library's own source.

The corpus is every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` (one document per file, sorted by path)
except the folders in ``EXCLUDED_DIRS``: third-party packages (``site-packages``), the test suites (``test``,
``tests``, ``idle_test``: 19 MB of deliberately odd code on CPython 3.11) and ``encodings`` (generated codec
tables). On CPython 3.11.7 that leaves 612 files, 10.7 MB of code, comments and docstrings; it differs a little
between Python versions and builds, so ``meta.json`` records its sha256 (over every file's path and sha256) and
the Python version, and a cached folder is reused only while they match.

``ensure_stdlib_tokens(vocab)`` prepares it on first use with a byte-level BPE of ``vocab`` tokens into
``<cache>/stdlib-bpe<vocab>`` (``<cache>``: ``$PLAIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/plait``, else
``~/.cache/plait``; then ``data/``), under a file lock so that ranks starting together prepare it once.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sysconfig
from pathlib import Path
from typing import Any

from plait.data.prepare import META_FILE, prepare
from plait.data.sources import sha256_of
from plait.data.tokens import TokenDataset, TokenFolder
from plait.errors import DataError
from plait.files import cache_folder
from plait.files import cache_root as plait_cache
from plait.logging import get_logger

log = get_logger(__name__)

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings", "__pycache__"})
PARALLEL_BYTES = 4_000_000
"""Below this much text one process tokenizes faster than starting worker processes (each imports torch)."""
VAL_FRACTION = 0.05
"""Share of the stdlib files held out for validation (about 30 of 612 on CPython 3.11)."""


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None, max_bytes: int = 0) -> list[Path]:
    """The corpus files in sorted order; with ``max_bytes`` > 0, the shortest prefix of them holding that many."""
    root = root or stdlib_root()
    files = []
    total = 0
    for path in sorted(root.rglob("*.py")):
        if EXCLUDED_DIRS.intersection(path.relative_to(root).parts[:-1]) or not path.is_file():
            continue
        size = path.stat().st_size
        if size == 0:
            continue
        files.append(path)
        total += size
        if max_bytes and total >= max_bytes:
            break
    if not files:
        raise DataError(f"no .py file found under {root}. Fix: point data at your own text (data.name='tokens').")
    return files


def corpus_record(files: list[Path], root: Path) -> dict[str, Any]:
    """What ``meta.json`` records of the corpus: Python version, file count, bytes, sha256 of (path, sha256) lines."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.relative_to(root).as_posix()}\0{sha256_of(path)}\n".encode())
    return {
        "name": "python-stdlib",
        "python": platform.python_version(),
        "root": str(root),
        "files": len(files),
        "bytes": sum(path.stat().st_size for path in files),
        "sha256": digest.hexdigest(),
    }


def cache_root() -> Path:
    """``data`` in plait's cache folder (``plait.files.cache_root``: ``$PLAIT_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/plait``, else ``~/.cache/plait``)."""
    return plait_cache() / "data"


def _usable(folder: Path, spec: str, corpus: dict[str, Any]) -> bool:
    if not (folder / META_FILE).is_file():
        return False
    try:
        meta = TokenFolder(folder).meta
    except DataError as error:
        log.warning("the cached corpus %s cannot be used (%s); preparing it again", folder, error)
        return False
    return (
        meta.get("corpus", {}).get("sha256") == corpus["sha256"]
        and meta["tokenizer"].get("spec") == spec
        and meta.get("val_fraction") == VAL_FRACTION
    )


def ensure_stdlib_tokens(vocab: int = 4096, corpus_mb: float = 0.0, workers: int | None = None) -> Path:
    """The prepared folder of the stdlib corpus with a ``bpe:vocab`` tokenizer (prepared now if not cached).

    ``corpus_mb`` > 0 takes only the first files (sorted) holding that many MB: quick runs and tests."""
    if corpus_mb < 0:
        raise DataError(f"data.corpus_mb={corpus_mb} must be >= 0 (0: the whole corpus). Fix: e.g. 1.")
    root = stdlib_root()
    files = stdlib_files(root, int(corpus_mb * 1e6))
    corpus = corpus_record(files, root)
    spec = f"bpe:{vocab}"
    name = f"stdlib-bpe{vocab}" + (f"-{corpus_mb:g}mb" if corpus_mb else "")
    folder = cache_root() / name
    if _usable(folder, spec, corpus):
        return folder
    cache_folder("data")  # mode 0700: this user's alone
    import fcntl  # POSIX: where torch.distributed runs plait

    with open(folder.parent / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another rank may be preparing it: wait, then look again
        if not _usable(folder, spec, corpus):
            log.info(
                "preparing the Python %s standard library corpus (%d files, %.1f MB) with %s into %s (first use)",
                corpus["python"],
                corpus["files"],
                corpus["bytes"] / 1e6,
                spec,
                folder,
            )
            prepare(
                files,
                folder,
                tokenizer=spec,
                val_fraction=VAL_FRACTION,
                workers=workers or (max(1, min(4, os.cpu_count() or 1)) if corpus["bytes"] > PARALLEL_BYTES else 1),
                overwrite=True,
                extra_meta={"corpus": corpus},
            )
    return folder


def stdlib_dataset(
    seq_len: int, seed: int = 0, vocab: int = 4096, corpus_mb: float = 0.0, verify: bool = False, **documents: Any
) -> TokenDataset:
    """``data.name = "stdlib"``: the token dataset of the stdlib corpus (prepared and cached on first use); one
    document per file (``documents``: ``TokenDataset``'s ``attention`` and ``eod_mask_loss``)."""
    return TokenDataset(ensure_stdlib_tokens(vocab, corpus_mb), seq_len, seed=seed, verify=verify, **documents)


__all__ = ["EXCLUDED_DIRS", "cache_root", "ensure_stdlib_tokens", "stdlib_dataset", "stdlib_files"]
