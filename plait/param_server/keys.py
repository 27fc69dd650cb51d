"""The job's shared secret and the bind policy: who may talk to a parameter server.

- A server bound to a loopback address (127.0.0.0/8, ::1, localhost: the default) is reachable from this host
  only. It may run without a key; it then says so in its log (any local user could connect, none could run code,
  since nothing received is ever executed).
- A server bound to any other address refuses to start without a key the user set: ``PLAIT_PS_AUTHKEY`` (at least
  16 characters) or a key file (``plait ps keygen FILE``: 32 random bytes, hex, mode 0600) named by
  ``--key-file`` / ``PLAIT_PS_KEY_FILE``. There is no built-in default key.
- A key file that others may read (group/other permission bits) or that another user owns is refused.
- ``LocalCluster`` (``plait ps`` on one machine) draws a fresh random key for each job and hands it to its own
  processes, so a local job is authenticated with no setup.
"""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path

from plait import files
from plait.errors import ConfigError
from plait.files import MIN_KEY_CHARS

KEY_ENV = "PLAIT_PS_AUTHKEY"
KEY_FILE_ENV = "PLAIT_PS_KEY_FILE"
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
    "check_bind",
    "generate_key_file",
    "is_loopback",
    "read_key_file",
    "resolve_key",
]
