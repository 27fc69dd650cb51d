"""Client side of the wire: connect (with retries and the key handshake) and one request/reply.

Why not torch.distributed.rpc: with dynamic membership (init_rpc without a world size) a joining process calls
every registered member during init_rpc, and a member killed with SIGKILL stays registered, so after the first
worker death no worker can join again (checked on torch 2.13: the join times out on the group-membership token).
Plain TCP connections give what faults need: a killed peer's socket closes at once (EOF), a restarted server is
just a new listener to reconnect to, and every wait has our own timeout. The frames and their authentication are
``wire.py``'s (JSON header + raw tensor bytes + HMAC; nothing received is executed).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Mapping
from typing import Any

from plait.errors import ConfigError
from plait.param_server.keys import job_key
from plait.param_server.wire import AuthenticationError, Channel, Message, ProtocolError, Staged, client_handshake


class ServerUnreachable(ConnectionError):
    """A server could not be reached, or its connection broke, within the time allowed."""


class RemoteError(RuntimeError):
    """A server-side failure the server reported by name (not one of the known exception classes)."""


ERRORS: dict[str, type[Exception]] = {
    "ConfigError": ConfigError,
    "TimeoutError": TimeoutError,
    "PermissionError": PermissionError,
    "KeyError": KeyError,
    "ProtocolError": ProtocolError,
}


def parse_address(text: str) -> tuple[str, int]:
    """ "host:port" -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"server address {text!r} is not HOST:PORT (e.g. 10.0.0.5:29600).")
    return host.strip("[]"), int(port)


def open_socket(sock: socket.socket) -> socket.socket:
    """Disable Nagle's algorithm (a frame is header + payload; Nagle + delayed ACK adds ~40 ms per message)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def connect(address: tuple[str, int], key: bytes | None, timeout_s: float, max_payload: int) -> Channel:
    """Connect and authenticate to a server, retrying while it is not (yet or again) listening. Without a key,
    a loopback server is authenticated with this user's local key (keys.py)."""
    key = job_key(key, address[0])
    deadline = time.monotonic() + timeout_s
    while True:
        sock = None
        try:
            sock = open_socket(socket.create_connection(address, timeout=max(0.1, deadline - time.monotonic())))
            session = client_handshake(sock, key)
            return Channel(sock, session, "client", max_payload, f"{address[0]}:{address[1]}")
        except AuthenticationError as error:
            if sock is not None:
                sock.close()
            raise ConfigError(
                f"server {address[0]}:{address[1]}: {error} Fix: use the same PLAIT_PS_AUTHKEY / --key-file "
                f"on every server and worker."
            ) from None
        except (OSError, EOFError, TimeoutError, ProtocolError) as error:
            if sock is not None:
                sock.close()
            if time.monotonic() >= deadline:
                raise ServerUnreachable(
                    f"cannot reach the parameter server at {address[0]}:{address[1]} within "
                    f"{timeout_s:g} s ({error}). Fix: start the servers first, check the address and the firewall."
                ) from error
            time.sleep(0.05)


def call(channel: Channel, op: str, timeout_s: float, staged: Staged | None = None, **args: Any) -> tuple[Any, Message]:
    """Send one request and return (its value, the reply message, whose tensors the caller reads and checks);
    a server-side error is raised as the same exception class."""
    channel.send({"op": op, "args": args}, staged)
    reply = channel.receive(timeout_s)
    header = reply.header
    if header.get("ok") is True:
        return header.get("value"), reply
    kind, message = header.get("error"), header.get("message")
    if not isinstance(kind, str) or not isinstance(message, str):
        raise ProtocolError(f"malformed reply to {op}: {str(header)[:200]}")
    raise ERRORS.get(kind, RemoteError)(message[:4000])


def request(channel: Channel, op: str, timeout_s: float, **args: Any) -> Any:
    """``call`` for requests without tensors: the reply's value."""
    return call(channel, op, timeout_s, **args)[0]


def as_mapping(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise ProtocolError(f"reply to {what} is not an object")
    return value


__all__ = [
    "ERRORS",
    "RemoteError",
    "ServerUnreachable",
    "as_mapping",
    "call",
    "connect",
    "open_socket",
    "parse_address",
    "request",
]
