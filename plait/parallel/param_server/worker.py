"""`PSWorker`: pulls the parameters from every server, computes a gradient on its own data, pushes the shards back.

Each push carries ``(wid, seq, version)``: ``wid`` names this worker incarnation, ``seq`` its step, ``version`` the
shard version the gradient was computed on. A push whose reply does not come (timeout, broken connection, restarted
server) is re-sent with the same seq after reconnecting; the server applies it at most once. A heartbeat thread on
its own connections tells the servers this worker is alive while it computes.

Pulls and pushes go to every server at once (a thread per server), as a real parameter server's client does: the
step's latency is the slowest server's, not their sum, and under BSP a worker has submitted its gradient to every
shard's round before it waits on any of them. Sequential pushes could deadlock once two shards' rounds fall out of
step (after a server restarts from an older checkpoint): worker A waiting in shard 1's round for B, while B, whose
shard-1 push was dropped as stale, waits in shard 0's next round for A.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

import torch
from torch import Tensor, nn

from plait.logging import get_logger
from plait.parallel.param_server.service import request
from plait.parallel.param_server.sharding import model_spec
from plait.parallel.param_server.transport import ServerUnreachable, connect, send

log = get_logger(__name__)


class PSWorker:
    """A worker of a parameter-server job; `model` is this worker's replica (the servers' model, same spec)."""

    def __init__(self, addresses: list[tuple[str, int]], model: nn.Module, name: str, *, timeout_s: float = 60.0,
                 heartbeat_s: float = 0.25, retries: int = 3) -> None:
        self.addresses, self.model, self.name = list(addresses), model, name
        self.wid = f"{name}-{uuid.uuid4().hex[:8]}"
        self.timeout_s, self.heartbeat_s, self.retries = timeout_s, heartbeat_s, retries
        self.params = dict(model.named_parameters())
        self.spec = model_spec(model)
        self.conns: list[Connection | None] = [None] * len(self.addresses)
        self.shard_names: list[list[str]] = [[] for _ in self.addresses]
        self.versions = [0] * len(self.addresses)
        self.acked = 0
        self._stop = threading.Event()
        self._io = ThreadPoolExecutor(max_workers=len(self.addresses), thread_name_prefix="ps-io")
        self._each(self._join)
        self._heartbeat = threading.Thread(target=self._beat, name="ps-heartbeat", daemon=True)
        self._heartbeat.start()

    def _join(self, index: int) -> None:
        if self.conns[index] is not None:
            self.conns[index].close()
        self.conns[index] = connect(self.addresses[index], self.timeout_s)
        joined = request(self.conns[index], "join", self.timeout_s, wid=self.wid, name=self.name, spec=self.spec)
        self.shard_names[index] = joined["names"]

    def _call(self, index: int, op: str, **kwargs: Any) -> Any:
        """One request to server `index`, reconnecting and re-sending (same arguments, same seq) on failure."""
        for attempt in range(self.retries + 1):
            try:
                return request(self.conns[index], op, self.timeout_s, wid=self.wid, **kwargs)
            except (EOFError, OSError, TimeoutError, PermissionError) as error:
                if attempt == self.retries or isinstance(error, ServerUnreachable):
                    raise
                log.warning("%s: %s to server %d failed (%s); reconnecting", self.name, op, index, error)
                self._join(index)
        raise AssertionError("unreachable")

    def _each(self, fn: Callable[[int], Any]) -> list[Any]:
        """`fn(index)` for every server at once; the results in server order (the first error is raised)."""
        return list(self._io.map(fn, range(len(self.addresses))))

    def pull(self) -> list[int]:
        """Copy every server's shard into the local model; returns the shard versions."""
        for index, reply in enumerate(self._each(lambda index: self._call(index, "pull"))):
            self.versions[index] = reply["version"]
            with torch.no_grad():
                for name, value in reply["params"].items():
                    self.params[name].copy_(value)
        return list(self.versions)

    def push(self, seq: int) -> bool:
        """Send each server its shard of the local gradients (tagged with the pulled versions); True iff every
        server applied it (a BSP push computed on an old version, or by a worker declared dead, is dropped)."""
        shards = [{name: _grad(self.params[name]) for name in names} for names in self.shard_names]
        replies = self._each(lambda index: self._call(index, "push", seq=seq, version=self.versions[index],
                                                      grads=shards[index]))
        applied = all(reply["applied"] for reply in replies)
        if applied:
            self.acked += 1
        return applied

    def step(self, seq: int, loss_of: Callable[[nn.Module], Tensor]) -> tuple[float, bool]:
        """pull -> loss -> backward -> push; returns (loss, applied)."""
        self.pull()
        self.model.zero_grad(set_to_none=True)
        loss = loss_of(self.model)
        loss.backward()
        return float(loss.detach()), self.push(seq)

    def _beat(self) -> None:
        beats: list[Connection | None] = [None] * len(self.addresses)
        while not self._stop.wait(self.heartbeat_s):
            for index, address in enumerate(self.addresses):
                try:
                    if beats[index] is None:
                        beats[index] = connect(address, self.heartbeat_s)
                    send(beats[index], ("beat", {"wid": self.wid}))
                except Exception as error:  # noqa: BLE001 - a heartbeat thread that died would get us declared dead
                    log.debug("%s: heartbeat to server %d failed (%s); retrying", self.name, index, error)
                    beats[index] = None  # the main connection reports the failure; keep trying
        for conn in beats:
            if conn is not None:
                conn.close()

    def close(self) -> None:
        """Leave every server (it stops counting this worker), then close the connections and the heartbeat."""
        for conn in self.conns:
            if conn is None:
                continue
            try:
                request(conn, "leave", self.timeout_s, wid=self.wid)
            except (EOFError, OSError, TimeoutError):
                pass
            conn.close()
        self._stop.set()
        self._heartbeat.join(timeout=2 * self.heartbeat_s + 1)
        self._io.shutdown(wait=False)


def _grad(param: nn.Parameter) -> Tensor:
    return param.grad.detach().clone() if param.grad is not None else torch.zeros_like(param)


__all__ = ["PSWorker"]
