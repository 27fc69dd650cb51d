"""Serve a `ShardServer` on a TCP listener: one thread per connection, a monitor thread for heartbeats and progress.

Requests are tuples ``(op, kwargs)``; replies ``("ok", value)`` or ``("error", kind, message)`` where kind names the
exception class the caller re-raises (ConfigError, TimeoutError, PermissionError...). A connection that reaches EOF
(its process died, even by SIGKILL) marks the worker it spoke for dead at once; a worker whose heartbeats stop for
``dead_after_s`` is marked dead by the monitor. ``("stop", {})`` from the launcher ends the service and returns the
final report (shard included).
"""

from __future__ import annotations

import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from plait.errors import ConfigError
from plait.logging import get_logger
from plait.param_server.server import ShardServer
from plait.param_server.transport import authkey, no_delay, receive, send

log = get_logger(__name__)

REQUEST_TIMEOUT_S = 60.0
"""How long a blocked pull (SSP) or push (BSP) may wait for other workers before its caller gets a TimeoutError."""


class Service:
    """Accepts connections for one `ShardServer` until stopped."""

    def __init__(self, server: ShardServer, host: str = "127.0.0.1", port: int = 0, log_every_s: float = 1.0) -> None:
        self.server = server
        self.listener = Listener((host, port), authkey=authkey())
        self.address: tuple[str, int] = self.listener.address  # type: ignore[assignment]
        self.stopped = threading.Event()
        self.log_every_s = log_every_s
        self.final_report: dict[str, Any] | None = None

    def serve_forever(self) -> dict[str, Any]:
        """Run until a stop request; returns the final report (with the shard)."""
        monitor = threading.Thread(target=self._monitor, name="ps-monitor", daemon=True)
        monitor.start()
        while not self.stopped.is_set():
            try:
                conn = no_delay(self.listener.accept())
            except Exception as error:  # noqa: BLE001 - a client failing authentication must not stop the server
                if not self.stopped.is_set():
                    log.warning("server %d: rejected a connection: %s", self.server.settings.index, error)
                continue
            threading.Thread(target=self._handle, args=(conn,), name="ps-conn", daemon=True).start()
        self.listener.close()
        return self.final_report or self.server.report(with_params=True)

    def _monitor(self) -> None:
        last_log = time.monotonic()
        while not self.stopped.wait(0.1):
            self.server.sweep()
            if self.log_every_s and time.monotonic() - last_log >= self.log_every_s:
                last_log = time.monotonic()
                report = self.server.report()
                log.info(
                    "server %d: version %d, %.1f updates/s, staleness mean %.2f max %d, %d live workers",
                    report["index"],
                    report["version"],
                    report["updates_per_s"],
                    report["staleness"]["mean"],
                    report["staleness"]["max"],
                    report["live_workers"],
                )

    def _handle(self, conn: Connection) -> None:
        """Serve one connection; on EOF declare its worker dead (unless it left cleanly)."""
        speaks_for: str | None = None
        try:
            while not self.stopped.is_set():
                if not conn.poll(0.2):
                    continue
                op, kwargs = receive(conn, 0.0, "request")
                if op in ("join", "beat", "pull", "push"):
                    speaks_for = kwargs["wid"]
                if op == "stop":
                    self.final_report = self.server.report(with_params=True)
                    send(conn, ("ok", self.final_report))
                    self.stopped.set()
                    self._wake_accept()
                    return
                try:
                    value = self._dispatch(op, kwargs)
                except (ConfigError, TimeoutError, PermissionError, KeyError, ValueError) as error:
                    send(conn, ("error", type(error).__name__, str(error)))
                    continue
                if op != "beat":
                    send(conn, ("ok", value))
        except (EOFError, OSError):
            pass
        finally:
            conn.close()
            if speaks_for is not None and not self.stopped.is_set():
                self.server.lost(speaks_for, "connection closed")

    def _dispatch(self, op: str, kwargs: dict[str, Any]) -> Any:
        server = self.server
        if op == "join":
            return server.join(kwargs["wid"], kwargs["name"], kwargs["spec"])
        if op == "beat":
            return server.beat(kwargs["wid"])
        if op == "pull":
            return server.pull(kwargs["wid"], REQUEST_TIMEOUT_S)
        if op == "push":
            return server.push(kwargs["wid"], kwargs["seq"], kwargs["version"], kwargs["grads"], REQUEST_TIMEOUT_S)
        if op == "leave":
            return server.leave(kwargs["wid"])
        if op == "report":
            return server.report()
        raise ValueError(f"unknown request {op!r}")

    def _wake_accept(self) -> None:
        """Unblock `accept` after a stop by connecting once to ourselves."""
        try:
            Client(self.address, authkey=authkey()).close()
        except OSError:
            pass


def request(conn: Connection, op: str, timeout_s: float, **kwargs: Any) -> Any:
    """Send one request and return its value, re-raising a server-side error as the same exception class."""
    send(conn, (op, kwargs))
    reply = receive(conn, timeout_s, op)
    if reply[0] == "ok":
        return reply[1]
    _, kind, message = reply
    error_class = {
        "ConfigError": ConfigError,
        "TimeoutError": TimeoutError,
        "PermissionError": PermissionError,
        "KeyError": KeyError,
    }.get(kind, RuntimeError)
    raise error_class(message)


__all__ = ["REQUEST_TIMEOUT_S", "Service", "request"]
