"""The job's shared secret and the bind policy: who may talk to a parameter server.

Every connection is authenticated: there is no keyless mode.
- A server bound to a loopback address (127.0.0.0/8, ::1, localhost: the default) is reachable from this host
  only. Started without a key, it uses this user's *local key* (``local_key``: 32 random bytes, hex, created once
  in ``~/.cache/plait/ps-local.key``, mode 0600 in a 0700 folder; ``PLAIT_PS_LOCAL_KEY_FILE`` names another
  file), and so do workers started without a key that connect to a loopback address. So "no key" still
  authenticates: this user's processes can read the file and join; other local users cannot read it and are
  refused (and logged) before any request is parsed: no ``stop``, no pull of the shard. The boundary is the user
  account, as for the process itself (the same user could read its memory anyway).
- A server bound to any other address refuses to start without a key the user set: ``PLAIT_PS_AUTHKEY`` (at least
  16 characters) or a key file (``plait ps keygen FILE``: 32 random bytes, hex, mode 0600) named by
  ``--key-file`` / ``PLAIT_PS_KEY_FILE``. There is no built-in default key.
- A key file that others may read (group/other permission bits) or that another user owns is refused.
- ``LocalCluster`` (``plait ps`` on one machine) draws a fresh random key for each job and hands it to its own
  processes, so a local job is authenticated with no setup.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

from plait import files
from plait.errors import ConfigError
from plait.files import MIN_KEY_CHARS

KEY_ENV = "PLAIT_PS_AUTHKEY"
KEY_FILE_ENV = "PLAIT_PS_KEY_FILE"
LOCAL_KEY_FILE_ENV = "PLAIT_PS_LOCAL_KEY_FILE"
KEY_FIX = (
    f"Fix: run `plait ps keygen ps.key` once, copy the file (mode 0600) to every host and pass --key-file ps.key, "
    f"or export {KEY_ENV}=<a secret of at least {MIN_KEY_CHARS} characters> on every host."
)


def generate_key_file(path: str | Path) -> Path:
    """Write 32 random bytes (hex) to a new file at ``path`` with mode 0600; refuses to overwrite a file."""
    return files.generate_key_file(path)


def read_key_file(path: str | Path) -> bytes:
    """The key in ``path``: it must be a regular file of this user with no group/other permission bits."""
    return files.read_key_file(path, KEY_FIX)


def resolve_key(key_file: str | None = None) -> bytes | None:
    """The key the user set: ``key_file`` (or ``PLAIT_PS_KEY_FILE``), else ``PLAIT_PS_AUTHKEY``, else None."""
    return files.resolve_key(key_file, KEY_FILE_ENV, KEY_ENV, KEY_FIX)


def local_key_path() -> Path:
    """Where this user's local key lives: ``PLAIT_PS_LOCAL_KEY_FILE``, else ``~/.cache/plait/ps-local.key``."""
    named = os.environ.get(LOCAL_KEY_FILE_ENV)
    return Path(named) if named else Path.home() / ".cache" / "plait" / "ps-local.key"


def local_key() -> bytes:
    """This user's key for loopback jobs started without one: read from ``local_key_path()``, created there
    first (0600, its folder 0700 when plait creates it) if missing. Refused like any key file that others may
    read or another user owns."""
    path = local_key_path()
    if not path.exists():
        try:
            if os.environ.get(LOCAL_KEY_FILE_ENV):
                path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            else:
                files.private_folder(path.parent)  # plait's cache folder ~/.cache/plait: mode 0700
            generate_key_file(path)
        except ConfigError:
            pass  # another process of this user created it first: read theirs
        except OSError as error:
            raise ConfigError(
                f"cannot create this user's local parameter-server key {path}: {error.strerror or error}. Fix: "
                f"set {LOCAL_KEY_FILE_ENV} to a path this user may write, or give the job a key. {KEY_FIX}"
            ) from None
    return read_key_file(path)


def job_key(key: bytes | None, host: str) -> bytes:
    """The key a server at (or a connection to) ``host`` uses: ``key`` when set; else, on loopback, this user's
    local key; elsewhere a ConfigError (a non-loopback job needs a key the user set)."""
    if key is not None:
        if len(key) < MIN_KEY_CHARS:
            raise ConfigError(f"a key of {len(key)} characters is too short (at least {MIN_KEY_CHARS}). {KEY_FIX}")
        return key
    if is_loopback(host):
        return local_key()
    raise ConfigError(f"no key set for the parameter server at {host}: a non-loopback job needs one. {KEY_FIX}")


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface only (a name must resolve to loopback only)."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def check_bind(host: str, key: bytes | None) -> None:
    """Refuse a non-loopback bind without a key (before the socket is opened)."""
    if key is None and not is_loopback(host):
        raise ConfigError(
            f"refusing to listen on {host} without a key: anyone who can reach the port could read the "
            f"parameters and push gradients. {KEY_FIX} (Or bind 127.0.0.1 for a job on this host only.)"
        )


__all__ = [
    "KEY_ENV",
    "KEY_FILE_ENV",
    "LOCAL_KEY_FILE_ENV",
    "check_bind",
    "generate_key_file",
    "is_loopback",
    "job_key",
    "local_key",
    "local_key_path",
    "read_key_file",
    "resolve_key",
]
