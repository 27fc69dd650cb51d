"""`PSWorker`: pulls the parameters from every server, computes a gradient on its own data, pushes the shards back.

Each push carries ``(wid, seq, version)``: ``wid`` names this worker incarnation, ``seq`` its step, ``version`` the
shard version the gradient was computed on. A push whose reply does not come (timeout, broken connection, restarted
server) is re-sent with the same seq after reconnecting; the server applies it at most once. A heartbeat thread on
its own connections tells the servers this worker is alive while it computes.

Pulls and pushes go to every server at once (a thread per server), as a real parameter server's client does: the
step's latency is the slowest server's, not their sum. A step adds exactly one gradient to every shard: a server
that refuses a push (under BSP: a restarted server whose round went back to its checkpoint's version, or a worker
it declared dead) gets it again, recomputed after pulling that shard anew, so every shard's rounds stay in step.
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
from plait.param_server.service import request
from plait.param_server.sharding import model_spec
from plait.param_server.transport import ServerUnreachable, connect, send

log = get_logger(__name__)


class PSWorker:
    """A worker of a parameter-server job; `model` is this worker's replica (the servers' model, same spec)."""

    def __init__(
        self,
        addresses: list[tuple[str, int]],
        model: nn.Module,
        name: str,
        *,
        timeout_s: float = 60.0,
        heartbeat_s: float = 0.25,
        retries: int = 3,
    ) -> None:
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
        self._each(self._join, list(range(len(self.addresses))))
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

    def _each(self, fn: Callable[[int], Any], shards: list[int]) -> list[Any]:
        """`fn(index)` for every server in `shards` at once; the results in that order (the first error is raised)."""
        return list(self._io.map(fn, shards))

    def pull(self, shards: list[int] | None = None) -> list[int]:
        """Copy the shards of `shards` (default: every server) into the local model; returns all shard versions."""
        shards = list(range(len(self.addresses))) if shards is None else shards
        for index, reply in zip(shards, self._each(lambda index: self._call(index, "pull"), shards)):
            self.versions[index] = reply["version"]
            with torch.no_grad():
                for name, value in reply["params"].items():
                    self.params[name].copy_(value)
        return list(self.versions)

    def push(self, seq: int, shards: list[int] | None = None) -> list[int]:
        """Send each server of `shards` (default: all) its shard of the local gradients, tagged with the pulled
        version; returns the servers that did not apply it (under BSP: computed on a version that server's round
        no longer has, e.g. after it restarted from a checkpoint, or sent by a worker it declared dead)."""
        shards = list(range(len(self.addresses))) if shards is None else shards
        grads = {index: {name: _grad(self.params[name]) for name in self.shard_names[index]} for index in shards}
        replies = self._each(
            lambda index: self._call(index, "push", seq=seq, version=self.versions[index], grads=grads[index]), shards
        )
        return [index for index, reply in zip(shards, replies) if not reply["applied"]]

    def step(self, seq: int, loss_of: Callable[[nn.Module], Tensor]) -> tuple[float, bool]:
        """pull -> loss -> backward -> push; returns (loss, applied by every server).

        A step adds exactly one gradient to every shard's round: a server that refuses the push gets it again,
        recomputed on the same batch after pulling that shard anew (up to `retries` times). Skipping it instead
        would leave this worker one round behind on that shard but not on the others, and two such offsets make
        a cross-shard cycle under BSP (waiting in shard 1's round for a worker that waits in shard 0's for us)."""
        shards: list[int] | None = None
        first_loss = None
        for attempt in range(self.retries + 1):
            self.pull(shards)
            self.model.zero_grad(set_to_none=True)
            loss = loss_of(self.model)
            loss.backward()
            first_loss = float(loss.detach()) if first_loss is None else first_loss
            shards = self.push(seq, shards)
            if not shards:
                self.acked += 1
                return first_loss, True
            log.warning(
                "%s: step %d was not applied by servers %s (attempt %d); pulling and pushing again",
                self.name,
                seq,
                shards,
                attempt + 1,
            )
        return first_loss, False

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
