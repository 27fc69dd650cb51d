"""Messages between workers and servers: pickled tuples over authenticated TCP (`multiprocessing.connection`).

Why not torch.distributed.rpc: with dynamic membership (init_rpc without a world size) a joining process calls
every registered member during init_rpc, and a member killed with SIGKILL stays registered, so after the first
worker death no worker can join again (checked on torch 2.13: the join times out on the group-membership token).
Plain connections give what faults need: a killed peer's socket closes at once (EOF), a restarted server is just
a new listener to reconnect to, and every wait has our own timeout. The HMAC challenge of `multiprocessing.connection`
authenticates peers (set PLAIT_PS_AUTHKEY); do not expose the port to untrusted networks, since messages are pickles.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
from multiprocessing.connection import Client, Connection
from typing import Any


class ServerUnreachable(ConnectionError):
    """A server could not be reached, or its connection broke, within the time allowed."""


def authkey() -> bytes:
    """The shared secret of one parameter-server job (PLAIT_PS_AUTHKEY, default "plait-ps")."""
    return os.environ.get("PLAIT_PS_AUTHKEY", "plait-ps").encode()


def parse_address(text: str) -> tuple[str, int]:
    """ "host:port" -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"server address {text!r} is not HOST:PORT (e.g. 10.0.0.5:29600).")
    return host, int(port)


def send(conn: Connection, message: Any) -> None:
    """Pickle (plain pickle: tensors travel by value, never as shared-memory handles) and send one message."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn: Connection, timeout_s: float, what: str) -> Any:
    """The next message, or TimeoutError naming `what` after `timeout_s`; EOFError when the peer closed."""
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no reply to {what} within {timeout_s:g} s")
    return pickle.loads(conn.recv_bytes())


def no_delay(conn: Connection) -> Connection:
    """Disable Nagle's algorithm: `Connection` writes a large message as header + payload, and Nagle would hold the
    payload until the peer's delayed ACK of the header (~40 ms per message on Linux)."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def connect(address: tuple[str, int], timeout_s: float) -> Connection:
    """Connect to a server, retrying while it is not (yet or again) listening, for up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return no_delay(Client(address, authkey=authkey()))
        except (ConnectionRefusedError, ConnectionResetError, FileNotFoundError, OSError) as error:
            if time.monotonic() >= deadline:
                raise ServerUnreachable(
                    f"cannot reach the parameter server at {address[0]}:{address[1]} within "
                    f"{timeout_s:g} s ({error}). Fix: start the servers first, check the "
                    f"address, the firewall and PLAIT_PS_AUTHKEY."
                ) from error
            time.sleep(0.05)


__all__ = ["ServerUnreachable", "authkey", "connect", "no_delay", "parse_address", "receive", "send"]
