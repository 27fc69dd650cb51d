"""Files whose names or contents someone else may have written: read inside their folder, regular files only.

A checkpoint's ``.metadata`` and plait.json, a Hugging Face index and a ``latest`` pointer all *name* other files.
Whoever wrote them chose those names, so plait reads a named file only when

- the name is one plain file name (``plain_name``): no ``/``, no ``..``, not absolute, so it stays in its folder;
- the file is a regular file (``open_regular``): a FIFO would block the reader forever, a device (``/dev/zero``)
  would feed it endless bytes; a symbolic link is not followed (``O_NOFOLLOW``), since it may point anywhere.

``open_regular`` opens first and checks what it opened (``fstat``), so a file swapped between a check and the
read is still caught; it opens with ``O_NONBLOCK``, so even a FIFO is refused at once instead of hanging.

Secrets the user controls (a checkpoint key, a parameter server key) come from an environment variable or a key
file (``read_key_file``: a regular file of this user that no one else may read); ``generate_key_file`` writes one.

A write that fails for a reason of the disk (full, over quota, read-only, not writable) is said in one line naming
the folder and the fix (``disk_problem``, ``disk_errors``), for every writer: checkpoints, ``plait data prepare``,
``plait convert``. plait's cache folder (``cache_folder``) is this user's alone (mode 0700).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import os
import re
import secrets
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

from plait.errors import ConfigError, PlaitError
from plait.logging import get_logger

log = get_logger(__name__)

MIN_KEY_CHARS = 16
LINK_FIX = "Fix: copy the file itself into the folder (cp -L), so that the folder holds what it names."


def plain_name(name: object) -> str | None:
    """The problem with ``name`` as a file name inside a folder (None when it is one plain name)."""
    if not isinstance(name, str):
        return f"a file name must be a string, not a {type(name).__name__} ({name!r})"
    if name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
        return f"{name!r} is not a plain file name (a path that could lead outside its folder)"
    return None


def inside(folder: Path, name: object, what: str, error: type[PlaitError] = ConfigError) -> Path:
    """``folder / name`` when ``name`` is a plain file name; else ``error`` naming ``what`` named it."""
    problem = plain_name(name)
    if problem is not None:
        raise error(f"{what} names {problem}: refusing to read outside {folder}. Fix: use files written by plait.")
    return folder / str(name)


def _kind(mode: int) -> str:
    kinds = {
        stat.S_ISDIR: "a folder",
        stat.S_ISFIFO: "a FIFO (named pipe)",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
        stat.S_ISSOCK: "a socket",
        stat.S_ISLNK: "a symbolic link",
    }
    return next((name for test, name in kinds.items() if test(mode)), "not a regular file")


def file_problem(path: Path) -> str | None:
    """Why ``path`` cannot be read as a regular file of its folder (None when it can): missing, a symbolic
    link, a FIFO, a device, a folder. Checks without opening (``lstat``)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return "is missing"
    except OSError as error:
        return f"cannot be examined ({error.strerror})"
    if stat.S_ISREG(info.st_mode):
        return None
    return f"is {_kind(info.st_mode)}, not a regular file"


def open_regular(path: Path, what: str = "", error: type[PlaitError] = ConfigError) -> io.BufferedReader:
    """``path`` opened for reading in binary mode, when it is a regular file and not a symbolic link; else
    ``error`` naming it (``what``: what the file is, for the message). Never blocks (``O_NONBLOCK``)."""
    label = f"{what} {path}" if what else str(path)
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as failure:
        if failure.errno == errno.ELOOP:
            raise error(
                f"{label} is a symbolic link: plait does not follow links out of a folder. {LINK_FIX}"
            ) from None
        if failure.errno == errno.ENOENT:
            raise error(f"{label} is missing. Fix: give a complete folder (the file may have been removed).") from None
        raise error(
            f"{label} cannot be opened: {failure.strerror}. Fix: check that it exists and is readable."
        ) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise error(
                f"{label} is {_kind(info.st_mode)}, not a regular file: plait reads only regular files (a FIFO "
                f"or a device could block or never end). Fix: replace it with the file itself."
            )
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: Path, what: str = "", error: type[PlaitError] = ConfigError) -> bytes:
    """The bytes of the regular file ``path`` (``open_regular``)."""
    with open_regular(path, what, error) as handle:
        return handle.read()


def read_text(path: Path, what: str = "", error: type[PlaitError] = ConfigError) -> str:
    """The UTF-8 text of the regular file ``path``; ``error`` when it is not UTF-8."""
    data = read_bytes(path, what, error)
    try:
        return data.decode()
    except UnicodeDecodeError as failure:
        label = f"{what} {path}" if what else str(path)
        raise error(f"{label} is not UTF-8 text ({failure.reason} at byte {failure.start}). Fix: restore it.") from None


# ----------------------------------------------------------------- secrets
def generate_key_file(path: str | Path) -> Path:
    """Write 32 random bytes (hex) to a new file at ``path`` with mode 0600; refuses to overwrite a file, and to
    create a missing folder (a key belongs where the user chose to keep it: a typo must not invent a folder)."""
    path = Path(path)
    folder = path.parent
    if not folder.is_dir():
        if os.path.lexists(folder):
            problem, fix = "is not a folder", "choose a path in an existing folder"
        else:
            problem, fix = "does not exist", f"create it first (mkdir -p -m 700 {folder}), or choose another path"
        raise ConfigError(f"cannot write the key {path}: {folder} {problem} (keygen creates no folder). Fix: {fix}.")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        kind = " (a folder)" if path.is_dir() else ""
        raise ConfigError(f"{path} exists{kind}; keygen never overwrites a key. Fix: choose another path.") from None
    except OSError as error:
        raise ConfigError(
            f"cannot write the key {path}: {error.strerror}. Fix: choose a path in a folder you can write."
        ) from None
    with os.fdopen(fd, "w") as handle:
        handle.write(secrets.token_hex(32) + "\n")
    return path


def read_key_file(path: str | Path, fix: str, named_by: str = "") -> bytes:
    """The key in ``path``: a regular file of this user with no group/other permission bits, of at least
    ``MIN_KEY_CHARS`` characters. ``fix`` ends the messages of the errors (how to make a good key); ``named_by``
    (e.g. the environment variable that named the file) begins them."""
    path = Path(path)
    label = f"{named_by}: key file {path}" if named_by else f"key file {path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        if error.errno == errno.ENOENT:
            raise ConfigError(f"{label} does not exist. {fix}") from None
        if error.errno == errno.ELOOP:
            raise ConfigError(f"{label} is a symbolic link: name the key file itself. {fix}") from None
        raise ConfigError(f"{label} cannot be opened: {error.strerror}. {fix}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{label} is {_kind(info.st_mode)}, not a key file. {fix}")
        if info.st_uid != os.getuid():
            raise ConfigError(f"{label} is owned by another user (uid {info.st_uid}). {fix}")
        if info.st_mode & 0o077:
            raise ConfigError(
                f"{label} has mode {stat.S_IMODE(info.st_mode):o}: others may read it. Fix: chmod 600 {path}."
            )
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        key = os.read(fd, 4096).strip()
    except OSError as error:
        raise ConfigError(f"{label} cannot be read: {error.strerror}. {fix}") from None
    finally:
        os.close(fd)
    if len(key) < MIN_KEY_CHARS:
        raise ConfigError(f"{label} holds {len(key)} characters, fewer than {MIN_KEY_CHARS}. {fix}")
    return key


def resolve_key(key_file: str | None, file_env: str, key_env: str, fix: str) -> bytes | None:
    """The key the user set: ``key_file`` (or the file the environment variable ``file_env`` names), else the
    value of ``key_env`` (at least ``MIN_KEY_CHARS`` characters), else None."""
    named_by = "" if key_file else file_env
    key_file = key_file or os.environ.get(file_env) or None
    if key_file:
        return read_key_file(key_file, fix, named_by)
    text = os.environ.get(key_env)
    if text is None or text == "":
        return None
    if len(text) < MIN_KEY_CHARS:
        raise ConfigError(f"{key_env} has {len(text)} characters, fewer than {MIN_KEY_CHARS}. {fix}")
    return text.encode()


# ------------------------------------------------------------------ full disks
NEARLY_FULL = 2**20
"""Bytes free below which a write failure without an errno is taken for a full disk."""
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
FULL_TEXT = re.compile(r"no space left on device|os error 28|disk quota exceeded", re.IGNORECASE)
DENIED_ERRNOS = (errno.EACCES, errno.EROFS)


def free_bytes(path: Path) -> int | None:
    """Bytes free to this user on the device of ``path`` (or of its nearest existing parent)."""
    for candidate in (path, *path.parents):
        try:
            info = os.statvfs(candidate)
        except OSError:
            continue
        return info.f_bavail * info.f_frsize
    return None


def _size(n: int) -> str:
    return f"{n} bytes" if n < 10_000 else f"{n / 1e6:.1f} MB"


def error_chain(error: BaseException) -> list[BaseException]:
    """``error`` and its causes (``__cause__`` / ``__context__``), outermost first."""
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and len(chain) < 32 and not any(current is seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def disk_problem(chain: Sequence[BaseException], folder: Path) -> str | None:
    """The disk-level root cause of a failed write into ``folder`` among the failures ``chain`` (an error and its
    causes), None when it is not one: a full disk or quota (an ``ENOSPC`` / ``EDQUOT`` errno, its text, or --
    for a writer that drops the errno -- a nearly full device right after the failure, unless a plait error
    explains it), or a folder this user may not write (``EACCES``, ``EROFS``)."""
    full = any(isinstance(e, OSError) and e.errno in FULL_ERRNOS for e in chain)
    full = full or any(FULL_TEXT.search(str(e)) for e in chain)
    free = free_bytes(folder)
    if not full and free is not None and free < NEARLY_FULL:
        full = not any(isinstance(e, PlaitError) for e in chain)
    if full:
        room = f" ({_size(free)} free)" if free is not None else ""
        return f"no space left on device at {folder}{room}"
    denied = next((e for e in chain if isinstance(e, OSError) and e.errno in DENIED_ERRNOS), None)
    if denied is not None:
        return f"cannot write to {folder}: {denied.strerror}"
    return None


@contextlib.contextmanager
def disk_errors(folder: Path, what: str, fix: str, error: type[PlaitError] = ConfigError) -> Iterator[None]:
    """Turn a failure of the disk (``disk_problem``: an ``OSError``, or a library's error that says "os error 28")
    raised in the block into ``error``: "``what`` failed: the problem. ``fix``" (e.g. what was kept and what was
    removed); any other failure passes unchanged. The block cleans up its partial output itself (this only says
    why it failed)."""
    try:
        yield
    except PlaitError:
        raise
    except Exception as failure:
        problem = disk_problem(error_chain(failure), folder)
        if problem is None:
            raise
        raise error(
            f"{what} failed: {problem}. {fix} Fix: free space on that disk or write to another one (or, if it is "
            f"not writable, choose a folder this user may write)."
        ) from None


# -------------------------------------------------------------------- the cache
CACHE_ENV = "PLAIT_CACHE_DIR"
CACHE_MODE = 0o700


def cache_root() -> Path:
    """plait's cache folder: ``$PLAIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/plait``, else ``~/.cache/plait``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "plait"
    return Path.home() / ".cache" / "plait"


def private_folder(path: Path, narrow: bool = True) -> Path:
    """``path`` as a folder only this user may enter: created with mode 0700 where missing (its missing parents
    too). An existing one that others may enter is narrowed to 0700 when ``narrow`` (plait's own folder: nothing
    but plait writes there), else left as it is with a warning (a folder the user chose)."""
    missing = [p for p in (path, *path.parents) if not os.path.lexists(p)]
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process of this user made it first
            folder.mkdir(mode=CACHE_MODE)
        os.chmod(folder, CACHE_MODE)  # mkdir's mode passes through the umask; this one does not
    info = os.stat(path)
    loose = stat.S_IMODE(info.st_mode) & 0o077
    if loose and path not in missing:
        mode = f"{stat.S_IMODE(info.st_mode):o}"
        if narrow and info.st_uid == os.getuid():
            os.chmod(path, stat.S_IMODE(info.st_mode) & ~0o077)
            log.info("narrowed plait's cache folder %s from mode %s to 700: only this user may enter it", path, mode)
        else:
            log.warning("%s has mode %s: other users may list and read it. Fix: chmod 700 %s", path, mode, path)
    return path


def cache_folder(*names: str) -> Path:
    """The folder ``names`` inside plait's cache (``cache_root``), created with mode 0700 (``private_folder``);
    the cache root is narrowed to 0700 when it is plait's default one, left as it is when ``$PLAIT_CACHE_DIR``
    names it (a folder the user chose, maybe on purpose shared)."""
    root = private_folder(cache_root(), narrow=not os.environ.get(CACHE_ENV))
    return private_folder(root.joinpath(*names)) if names else root


__all__ = [
    "CACHE_ENV",
    "MIN_KEY_CHARS",
    "cache_folder",
    "cache_root",
    "disk_errors",
    "disk_problem",
    "error_chain",
    "file_problem",
    "free_bytes",
    "private_folder",
    "generate_key_file",
    "inside",
    "open_regular",
    "plain_name",
    "read_bytes",
    "read_key_file",
    "read_text",
    "resolve_key",
]
