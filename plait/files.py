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
"""

from __future__ import annotations

import errno
import fcntl
import io
import os
import secrets
import stat
from pathlib import Path

from plait.errors import ConfigError, PlaitError

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


__all__ = [
    "MIN_KEY_CHARS",
    "file_problem",
    "generate_key_file",
    "inside",
    "open_regular",
    "plain_name",
    "read_bytes",
    "read_key_file",
    "read_text",
    "resolve_key",
]
