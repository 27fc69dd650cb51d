"""Serve a `ShardServer` on a TCP listener: one thread per connection, a monitor thread for heartbeats and progress.

A connection first authenticates (``wire.server_handshake``); then each request is a frame whose header is
``{"op": OP, "args": {...}}`` (checked against the op's schema below) and whose payload, for a push, holds the
gradients (checked against this shard's names, shapes and dtypes). Replies are ``{"ok": true, "value": ...}``
(plus tensors for pulls) or ``{"ok": false, "error": CLASS, "message": ...}``. A request that breaks the protocol
closes its connection (logged with the peer's address; an authenticated peer is first told why, in one line); the
server goes on serving the others. Every refused request is logged (peer, worker, op, reason), and so is every
``stop``, the one request that ends the server and hands out its whole shard.

A connection that reaches EOF (its process died, even by SIGKILL) marks the worker it spoke for dead at once; a
worker whose heartbeats stop for ``dead_after_s`` is marked dead by the monitor. ``stop`` (sent by the launcher)
ends the service and returns the final report (shard included). Every server logs its own progress (version,
updates/s, live workers) every ``log_every_s`` and, under BSP, what it waits for (workers not yet joined, or the
workers an open round lacks) every WAIT_LOG_S.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from plait.errors import ConfigError
from plait.logging import get_logger
from plait.param_server.agreement import JobSettings
from plait.param_server.keys import check_bind, is_loopback, job_key, local_key_path
from plait.param_server.server import ShardServer
from plait.param_server.sharding import ParamSpec
from plait.param_server.transport import open_socket
from plait.param_server.wire import (
    DTYPES,
    MAX_TENSORS,
    AuthenticationError,
    Channel,
    Message,
    ProtocolError,
    SharedBuffer,
    Staged,
    dtype_name,
    server_handshake,
    shard_bytes,
)

log = get_logger(__name__)

REQUEST_TIMEOUT_S = 60.0
"""How long a blocked pull (SSP) or push (BSP) may wait for other workers before its caller gets a TimeoutError."""
WAIT_LOG_S = 1.5
ROUND_WAIT_S = 2.0
MAX_CONNECTIONS = 512
MAX_TEXT = 128
COMPRESSED = ("float16", "bfloat16")
"""Wire dtypes a floating-point gradient may be pushed in besides its own (push compression)."""


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_TEXT:
        raise ProtocolError(f"{what} must be a string of 1 to {MAX_TEXT} characters")
    return value


def _count(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not -1 <= value < 2**62:
        raise ProtocolError(f"{what} must be an integer")
    return value


def _flag(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise ProtocolError(f"{what} must be true or false")
    return value


def _size(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**62:
        raise ProtocolError("a shape entry must be an integer >= 0")
    return value


def _spec(value: Any) -> tuple[ParamSpec, ...]:
    """A worker's model spec, ``[[name, [sizes], dtype], ...]``: every element's JSON type checked before use."""
    if not isinstance(value, list) or len(value) > MAX_TENSORS:
        raise ProtocolError("spec must be a list of [name, shape, dtype]")
    spec = []
    for item in value:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[1], list) and len(item[1]) <= 16):
            raise ProtocolError("a spec entry must be [name, shape, dtype]")
        name, shape, dtype = item
        if not (isinstance(name, str) and 0 < len(name) <= 1024):
            raise ProtocolError("a spec entry's name must be a string of 1 to 1024 characters")
        if not (isinstance(dtype, str) and dtype in DTYPES):
            raise ProtocolError(f"a spec entry's dtype must be one of {sorted(DTYPES)}")
        spec.append(ParamSpec(name, tuple(_size(size) for size in shape), dtype))
    return tuple(spec)


SCHEMAS: dict[str, dict[str, Callable[[Any], Any]]] = {
    "join": {
        "wid": lambda v: _text(v, "wid"),
        "name": lambda v: _text(v, "name"),
        "spec": _spec,
        "settings": lambda v: None if v is None else JobSettings.from_json(v),
    },
    "beat": {"wid": lambda v: _text(v, "wid")},
    "pull": {"wid": lambda v: _text(v, "wid"), "have": lambda v: _count(v, "have")},
    "push": {
        "wid": lambda v: _text(v, "wid"),
        "seq": lambda v: _count(v, "seq"),
        "version": lambda v: _count(v, "version"),
        "items": lambda v: _count(v, "items"),
        "pull": lambda v: _flag(v, "pull"),
    },
    "leave": {"wid": lambda v: _text(v, "wid")},
    "shm": {
        "c2s": lambda v: _text(v, "c2s"),
        "s2c": lambda v: _text(v, "s2c"),
        "c2s_bytes": lambda v: _count(v, "c2s_bytes"),
        "s2c_bytes": lambda v: _count(v, "s2c_bytes"),
    },
    "report": {},
    "stop": {},
}
"""Every request's arguments and their checks: nothing else is accepted."""


def parse_request(header: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(op, checked arguments) of a request header; ProtocolError for anything unexpected."""
    op, args = header.get("op"), header.get("args")
    if not isinstance(op, str) or op not in SCHEMAS:
        raise ProtocolError(f"unknown request {str(op)[:40]!r}")
    schema = SCHEMAS[op]
    if not isinstance(args, dict) or set(args) != set(schema):
        raise ProtocolError(f"request {op!r} takes exactly the arguments {sorted(schema)}")
    try:
        return op, {name: check(args[name]) for name, check in schema.items()}
    except ProtocolError as error:
        raise ProtocolError(f"request {op!r}: {error}") from None


class Service:
    """Accepts connections for one `ShardServer` until stopped."""

    def __init__(
        self,
        server: ShardServer,
        host: str = "127.0.0.1",
        port: int = 0,
        log_every_s: float = 1.0,
        key: bytes | None = None,
    ) -> None:
        check_bind(host, key)
        if key is None:
            log.info(
                "server %d: no key set: using this user's local key %s, so only this user's processes may "
                "connect to %s",
                server.settings.index,
                local_key_path(),
                host,
            )
        self.server, self.key = server, job_key(key, host)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((host, port))
        self.listener.listen(128)
        self.listener.settimeout(0.2)
        self.address: tuple[str, int] = self.listener.getsockname()[:2]
        self.stopped = threading.Event()
        self.log_every_s = log_every_s
        self.final_report: dict[str, Any] | None = None
        self.connections = 0
        self.refused = 0
        self._lock = threading.Lock()
        params = server.params
        self.max_payload = shard_bytes((tuple(p.shape), p.dtype) for p in params.values())
        self.push_expected = {
            name: (tuple(p.shape), (dtype_name(p.dtype), *(COMPRESSED if p.dtype.is_floating_point else ())))
            for name, p in params.items()
        }

    def serve_forever(self) -> dict[str, Any]:
        """Run until a stop request; returns the final report (with the shard)."""
        monitor = threading.Thread(target=self._monitor, name="ps-monitor", daemon=True)
        monitor.start()
        while not self.stopped.is_set():
            try:
                sock, peer = self.listener.accept()
            except TimeoutError:
                continue
            except OSError as error:
                if not self.stopped.is_set():
                    log.warning("server %d: accept failed: %s", self.server.settings.index, error)
                continue
            with self._lock:
                if self.connections >= MAX_CONNECTIONS:
                    log.warning(
                        "server %d: refused %s: %d connections open", self.server.settings.index, peer, self.connections
                    )
                    sock.close()
                    continue
                self.connections += 1
            threading.Thread(target=self._handle, args=(open_socket(sock), peer), name="ps-conn", daemon=True).start()
        self.listener.close()
        return self.final_report or self.server.report(with_params=True)

    def _monitor(self) -> None:
        index = self.server.settings.index
        last_log = last_wait = time.monotonic()
        last_version = self.server.version
        while not self.stopped.wait(0.1):
            self.server.sweep()
            now = time.monotonic()
            if now - last_wait >= WAIT_LOG_S:
                last_wait = now
                waiting = self.server.waiting(ROUND_WAIT_S)
                if waiting:
                    log.info("server %d: %s", index, waiting)
            if self.log_every_s and now - last_log >= self.log_every_s:
                report = self.server.report()
                log.info(
                    "server %d: version %d, %.1f updates/s, staleness mean %.2f max %d, %d live workers",
                    index,
                    report["version"],
                    (report["version"] - last_version) / (now - last_log),
                    report["staleness"]["mean"],
                    report["staleness"]["max"],
                    report["live_workers"],
                )
                last_log, last_version = now, report["version"]

    def _handle(self, sock: socket.socket, peer: Any) -> None:
        """Serve one connection; on EOF declare its worker dead (unless it left cleanly)."""
        where = f"{peer[0]}:{peer[1]}"
        index = self.server.settings.index
        speaks_for: str | None = None
        channel: Channel | None = None
        try:
            session = server_handshake(sock, self.key)
            channel = Channel(sock, session, "server", self.max_payload, where)
            while not self.stopped.is_set():
                if not channel.readable(0.2):
                    continue
                message = channel.receive(0.0)
                op, args = self._parse(channel, message)
                if op == "stop":
                    self._stop(channel, where)
                    return
                try:
                    value, staged = self._dispatch(op, args, channel, message, peer)
                except (ConfigError, TimeoutError, PermissionError, KeyError) as error:
                    self._refused(op, args, where, error)
                    channel.send({"ok": False, "error": type(error).__name__, "message": str(error)})
                    continue
                if op in ("join", "beat", "pull", "push"):
                    speaks_for = args["wid"]
                if op != "beat":
                    channel.send({"ok": True, "value": value}, staged)
        except (AuthenticationError, ProtocolError) as error:
            with self._lock:
                self.refused += 1
            who = f" (worker {speaks_for})" if speaks_for else ""
            log.warning("server %d: refused a message from %s%s: %s; connection closed", index, where, who, error)
        except (EOFError, OSError, TimeoutError):
            pass
        except Exception as error:  # noqa: BLE001 - one connection's failure must not end the server
            log.error(
                "server %d: internal error serving %s: %s: %s; connection closed, serving the others",
                index,
                where,
                type(error).__name__,
                error,
            )
            log.debug("server %d: the internal error's traceback", index, exc_info=True)
        finally:
            if channel is not None:
                channel.close()
            else:
                sock.close()
            with self._lock:
                self.connections -= 1
            if speaks_for is not None and not self.stopped.is_set():
                self.server.lost(speaks_for, "connection closed")

    @staticmethod
    def _parse(channel: Channel, message: Message) -> tuple[str, dict[str, Any]]:
        """The request's op and checked arguments; a malformed one (from a peer that holds the key: the MAC was
        checked) is answered with the reason before its connection is closed."""
        try:
            return parse_request(message.header)
        except ProtocolError as error:
            with contextlib.suppress(OSError):
                reason = f"{error}; connection closed. Fix: run the same plait version on every server and worker"
                channel.send({"ok": False, "error": "ProtocolError", "message": reason})
            raise

    def _refused(self, op: str, args: dict[str, Any], where: str, error: Exception) -> None:
        """Log a request refused with a reply (a join whose settings or model differ, a dead worker's push...)."""
        who = f"worker {args['wid']}'s " if "wid" in args else ""
        level = log.error if isinstance(error, ConfigError) else log.warning
        level("server %d: refused %s%s from %s: %s", self.server.settings.index, who, op, where, error)

    def _dispatch(
        self, op: str, args: dict[str, Any], channel: Channel, message: Message, peer: Any
    ) -> tuple[Any, Staged | None]:
        server = self.server
        if op != "push" and message.header.get("t"):
            raise ProtocolError(f"request {op!r} carries no tensors")
        if op == "join":
            return server.join(args["wid"], args["name"], args["spec"], args["settings"]), None
        if op == "beat":
            server.beat(args["wid"])
            return None, None
        if op == "pull":
            reply = server.pull(args["wid"], REQUEST_TIMEOUT_S, args["have"], lambda p: channel.stage(p.items()))
            staged = reply.pop("params")
            return reply, staged
        if op == "push":
            grads = channel.tensors(message, self.push_expected)
            reply = server.push(
                args["wid"],
                args["seq"],
                args["version"],
                grads,
                REQUEST_TIMEOUT_S,
                items=max(args["items"], 0),
                then_pull=args["pull"],
                snapshot=lambda p: channel.stage(p.items()),
            )
            staged = reply["pulled"].pop("params") if "pulled" in reply else None
            return reply, staged
        if op == "leave":
            server.leave(args["wid"])
            return None, None
        if op == "shm":
            return self._attach(args, channel, peer), None
        return server.report(), None

    def _attach(self, args: dict[str, Any], channel: Channel, peer: Any) -> dict[str, Any]:
        """Map a same-host worker's two shared-memory segments (wire.py: the checks)."""
        if not (SharedBuffer.available() and is_loopback(peer[0])):
            return {"shm": False, "reason": "shared memory is offered over loopback connections only"}
        if channel.shm_in is not None:
            return {"shm": False, "reason": "this connection already has shared memory"}
        try:
            incoming = SharedBuffer.attach(args["c2s"], args["c2s_bytes"], self.max_payload)
            outgoing = SharedBuffer.attach(args["s2c"], args["s2c_bytes"], self.max_payload)
        except ProtocolError as error:  # the worker goes on over the socket (and unlinks its segments)
            return {"shm": False, "reason": str(error)}
        channel.shm_in, channel.shm_out = incoming, outgoing
        return {"shm": True}

    def _stop(self, channel: Channel, where: str) -> None:
        report = self.server.report(with_params=True)
        log.info(
            "server %d: stop requested by %s (authenticated): sending the final report and the shard, then stopping",
            self.server.settings.index,
            where,
        )
        params, history = report.pop("params"), report.pop("history")
        tensors: list[tuple[str, torch.Tensor]] = [(f"p/{name}", value) for name, value in params.items()]
        for step, shard in enumerate(history):
            tensors += [(f"h/{step}/{name}", value) for name, value in shard.items()]
        self.final_report = {**report, "params": params, "history": history}
        channel.shm_out = None  # the launcher's connection: in-band
        channel.send({"ok": True, "value": report}, channel.stage(tensors))
        self.stopped.set()


__all__ = ["REQUEST_TIMEOUT_S", "SCHEMAS", "Service", "parse_request"]
