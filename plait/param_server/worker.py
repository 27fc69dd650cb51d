"""`PSWorker`: pulls the parameters from every server, computes a gradient on its own data, pushes the shards back.

Each push carries ``(wid, seq, version)``: ``wid`` names this worker incarnation, ``seq`` its step, ``version`` the
shard version the gradient was computed on. A push whose reply does not come (timeout, broken connection, restarted
server) is re-sent with the same seq after reconnecting; the server applies it at most once. A heartbeat thread on
its own connections tells the servers this worker is alive while it computes.

One round trip per server and step: a push asks for the parameters back (``pull: true``), so the reply to step
t's push carries what step t+1 computes on (after BSP's round closes, or SSP's gate opens); a pull is sent alone
only before the first step. Every server is served at once (a thread per server): a step's exchange costs the
slowest server's latency, not their sum. With ``overlap`` each shard's push leaves as soon as backward has
produced all of that shard's gradients (a post-accumulate-grad hook per parameter), while backward goes on with
the rest; the parameters that come back are copied into the model only once backward is done. Gradients may be
pushed in bf16/fp16 (``push_dtype``, half the bytes; the server applies them in the parameters' dtype). Over
loopback the tensors travel through shared memory (wire.py).

A step adds exactly one gradient to every shard: a server that refuses a push (under BSP: a restarted server
whose round went back to its checkpoint's version, or a worker it declared dead) gets it again, recomputed after
that shard's reply brought its current parameters, so every shard's rounds stay in step.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import torch
from torch import Tensor, nn

from plait.errors import ConfigError
from plait.logging import get_logger
from plait.param_server.agreement import JobSettings
from plait.param_server.sharding import model_spec
from plait.param_server.transport import ServerUnreachable, as_mapping, call, connect, request
from plait.param_server.wire import Channel, ProtocolError, SharedBuffer, Staged, dtype_name, shard_bytes

LossOf = Tensor | tuple[Tensor, Tensor]
"""What a step's loss function returns: the loss, or a token mean's (sum, count) (``plait.param_server.task``)."""

log = get_logger(__name__)
PUSH_DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}
Pushed = tuple[bool, Any, "dict[str, Tensor] | None"]
"""A push's outcome: applied, the reply's "pulled" (version), the parameters it brought (views to install)."""


class PSWorker:
    """A worker of a parameter-server job; `model` is this worker's replica (the servers' model, same spec)."""

    def __init__(
        self,
        addresses: list[tuple[str, int]],
        model: nn.Module,
        name: str,
        *,
        key: bytes | None = None,
        settings: JobSettings | None = None,
        timeout_s: float = 60.0,
        heartbeat_s: float = 0.25,
        retries: int = 3,
        shm: bool = True,
        push_dtype: str = "float32",
        overlap: bool = True,
    ) -> None:
        if push_dtype not in PUSH_DTYPES:
            raise ConfigError(f"push_dtype={push_dtype!r} is not one of {sorted(PUSH_DTYPES)}.")
        self.addresses, self.model, self.name = list(addresses), model, name
        self.wid = f"{name}-{uuid.uuid4().hex[:12]}"
        self.key, self.settings, self.use_shm = key, settings, shm
        self.push_dtype, self.overlap = PUSH_DTYPES[push_dtype], overlap
        self.timeout_s, self.heartbeat_s, self.retries = timeout_s, heartbeat_s, retries
        self.params = dict(model.named_parameters())
        self.spec = model_spec(model)
        self.max_payload = shard_bytes((tuple(p.shape), p.dtype) for p in self.params.values())
        self.channels: list[Channel | None] = [None] * len(self.addresses)
        self.shard_names: list[list[str]] = [[] for _ in self.addresses]
        self.versions = [-1] * len(self.addresses)
        self.acked = 0
        self.last_tau: list[int] = []
        self.exchange_s = 0.0
        self._uses: dict[str, int] | None = None
        """How many times backward accumulates into each parameter (counted in the first step, for overlap)."""
        self._last_loss = torch.zeros(())
        self.items = 1
        """How many items the gradients of the last backward sum over (a token mean's count; 1 for a mean)."""
        self._stop = threading.Event()
        self._io = ThreadPoolExecutor(max_workers=max(1, len(self.addresses)), thread_name_prefix="ps-io")
        try:
            self._each(self._join, list(range(len(self.addresses))))
        except BaseException:  # refused (settings, model, key) or unreachable: leave nothing open behind
            for channel in self.channels:
                if channel is not None:
                    channel.close()
            self._io.shutdown(wait=False)
            raise
        self._shard_of = {name: index for index, names in enumerate(self.shard_names) for name in names}
        self._heartbeat = threading.Thread(target=self._beat, name="ps-heartbeat", daemon=True)
        self._heartbeat.start()

    # ---- connections ----------------------------------------------------------------------------------------
    def _join(self, index: int) -> None:
        old = self.channels[index]
        if old is not None:
            old.close()
        channel = connect(self.addresses[index], self.key, self.timeout_s, self.max_payload)
        self.channels[index] = channel
        spec = [[p.name, list(p.shape), p.dtype] for p in self.spec]
        settings = None if self.settings is None else self.settings.to_json()
        joined = as_mapping(
            request(channel, "join", self.timeout_s, wid=self.wid, name=self.name, spec=spec, settings=settings), "join"
        )
        names = joined.get("names")
        if not isinstance(names, list) or not set(names) <= set(self.params) or not names:
            raise ProtocolError(f"server {index} named an unknown shard: {str(names)[:200]}")
        if joined.get("index") != index or joined.get("servers") != len(self.addresses):
            raise ConfigError(
                f"the server at {channel.peer} is server {joined.get('index')} of {joined.get('servers')}, but this "
                f"worker was given it as server {index} of {len(self.addresses)}. Fix: list every server's "
                f"HOST:PORT in index order (--connect) and use the same --servers everywhere."
            )
        self.shard_names[index] = names
        if self.use_shm and SharedBuffer.available():
            self._offer_shm(index, channel)

    def _offer_shm(self, index: int, channel: Channel) -> None:
        size = shard_bytes((tuple(self.params[n].shape), self.params[n].dtype) for n in self.shard_names[index])
        if size == 0:
            return
        c2s, s2c = SharedBuffer.create(size), SharedBuffer.create(size)
        try:
            reply = as_mapping(
                request(channel, "shm", self.timeout_s, c2s=c2s.name, s2c=s2c.name, c2s_bytes=size, s2c_bytes=size),
                "shm",
            )
        finally:
            SharedBuffer.unlink(c2s.name)
            SharedBuffer.unlink(s2c.name)
        if reply.get("shm") is True:
            channel.shm_out, channel.shm_in = c2s, s2c
        else:
            log.debug("%s: server %d declined shared memory (%s)", self.name, index, reply.get("reason"))

    def _call(self, index: int, op: str, staged: Staged | None = None, **args: Any) -> tuple[Any, Any]:
        """One request to server `index`, reconnecting and re-sending (same arguments, same seq, same staged
        tensor bytes) on failure."""
        staged_on = self.channels[index]
        for attempt in range(self.retries + 1):
            channel = self.channels[index]
            try:
                assert channel is not None
                if staged is not None and channel is not staged_on:
                    staged, staged_on = channel.restage(staged), channel
                value, reply = call(channel, op, self.timeout_s, staged, wid=self.wid, **args)
                return as_mapping(value, op), self._read_params(index, channel, value, reply)
            except (EOFError, OSError, TimeoutError, PermissionError) as error:
                if attempt == self.retries or isinstance(error, ServerUnreachable):
                    raise
                log.warning("%s: %s to server %d failed (%s); reconnecting", self.name, op, index, error)
                self._join(index)
        raise AssertionError("unreachable")

    def _stage_grads(self, index: int) -> Staged:
        """Copy shard ``index``'s gradients into its channel's send buffer, in the calling (main) thread: the
        gradients may be recomputed (a refused shard) while this shard's exchange is still under way."""
        channel = self.channels[index]
        assert channel is not None

        def grad(name: str) -> Tensor:
            param = self.params[name]
            return param.grad if param.grad is not None else torch.zeros_like(param)

        wire = self.push_dtype
        return channel.stage(((name, grad(name)) for name in self.shard_names[index]), wire_dtype=wire)

    def _read_params(self, index: int, channel: Channel, value: Any, reply: Any) -> dict[str, Tensor] | None:
        """The parameters a pull (or a push's ``pulled``) brought, checked against this shard's spec."""
        pulled = value.get("pulled") if isinstance(value, dict) and "pulled" in value else value
        if not isinstance(pulled, dict) or "unchanged" not in pulled:
            return None
        if not isinstance(pulled.get("version"), int):
            raise ProtocolError(f"server {index} sent no version")
        if pulled["unchanged"] is True:
            return {}
        expected = {
            n: (tuple(self.params[n].shape), (dtype_name(self.params[n].dtype),)) for n in self.shard_names[index]
        }
        return channel.tensors(reply, expected)

    def _each(self, fn: Callable[[int], Any], shards: list[int]) -> list[Any]:
        """`fn(index)` for every server in `shards` at once; the results in that order (the first error is raised)."""
        return list(self._io.map(fn, shards))

    def _install(self, index: int, pulled: Any, tensors: dict[str, Tensor] | None) -> None:
        if tensors:
            with torch.no_grad():
                for name, value in tensors.items():
                    self.params[name].copy_(value)
        self.versions[index] = int(pulled["version"])

    # ---- pull / push ----------------------------------------------------------------------------------------
    def pull(self, shards: list[int] | None = None) -> list[int]:
        """Copy the shards of `shards` (default: every server) into the local model; returns all shard versions."""
        shards = list(range(len(self.addresses))) if shards is None else shards

        def one(index: int) -> None:
            value, tensors = self._call(index, "pull", have=self.versions[index])
            self._install(index, value, tensors)

        self._each(one, shards)
        return list(self.versions)

    def _push_one(self, index: int, seq: int, staged: Staged) -> Pushed:
        """Push shard ``index``'s staged gradients; (applied, the reply's version, the parameters it brought)."""
        value, tensors = self._call(
            index, "push", staged, seq=seq, version=self.versions[index], items=self.items, pull=True
        )
        pulled = value.get("pulled")
        if not isinstance(pulled, dict):
            raise ProtocolError(f"server {index} answered a push without parameters")
        if isinstance(value.get("tau"), int):
            self.last_tau.append(value["tau"])
        return value.get("applied") is True, pulled, tensors

    def step(self, seq: int, loss_of: Callable[[nn.Module], LossOf]) -> tuple[float, bool]:
        """loss -> backward -> push (each shard as soon as its gradients are ready, with ``overlap``) -> the
        parameters of the next step; returns (loss, applied by every server). Pulls first if it has nothing.
        ``loss_of`` returns the loss, or (sum, count) for a token mean: the sum is differentiated and pushed with
        its count (``items``), so a BSP round divides the workers' summed gradients by their summed counts; the
        loss returned is then sum / count.

        A shard whose server refuses the push is recomputed and pushed again as soon as that refusal arrives,
        without waiting for the other shards' replies: under BSP those may wait in rounds that need this
        worker's other gradients (after a server restart, one shard's rounds can lag the other's), so waiting for
        every reply first would deadlock."""
        missing = [index for index, version in enumerate(self.versions) if version < 0]
        if missing:
            self.pull(missing)
        shards = list(range(len(self.addresses)))
        first_loss = None
        pending: dict[int, Future[Pushed]] = {}
        replies: dict[int, Pushed] = {}
        for attempt in range(self.retries + 1):
            self.model.zero_grad(set_to_none=True)
            pending.update(self._backward_and_push(seq, shards, loss_of))
            first_loss = float(self._last_loss) if first_loss is None else first_loss
            started = time.perf_counter()
            refused: list[int] = []
            while pending and not refused:
                done, _ = wait(list(pending.values()), return_when=FIRST_COMPLETED)
                for index in [index for index, future in pending.items() if future in done]:
                    applied, pulled, tensors = pending.pop(index).result()
                    if applied:
                        replies[index] = (applied, pulled, tensors)
                    else:  # recompute on this shard's current parameters (the refusal brought them)
                        self._install(index, pulled, tensors)
                        refused.append(index)
            self.exchange_s += time.perf_counter() - started
            if not refused:
                for index, (_, pulled, tensors) in replies.items():
                    self._install(index, pulled, tensors)
                self.acked += 1
                return first_loss, True
            shards = refused
            log.warning(
                "%s: step %d was not applied by servers %s (attempt %d); computing it again on their parameters",
                self.name,
                seq,
                shards,
                attempt + 1,
            )
        for future in pending.values():  # let the other shards' exchanges finish before giving up
            future.result()
        return first_loss if first_loss is not None else float("nan"), False

    def _backward_and_push(
        self, seq: int, shards: list[int], loss_of: Callable[[nn.Module], LossOf]
    ) -> dict[int, Future[Pushed]]:
        """Forward and backward; each shard of ``shards`` is handed to its I/O thread once its gradients are all
        there: during backward with ``overlap`` (after the first step, which counts how many times backward
        accumulates into each parameter: once, tied ones included, unless e.g. reentrant recomputation runs inner
        backward passes), else after it."""
        futures: dict[int, Future[Pushed]] = {}
        fired: dict[str, int] = {}
        remaining = {index: set(self.shard_names[index]) for index in shards}
        lock = threading.Lock()
        uses = self._uses

        def hook_for(name: str) -> Callable[[Tensor], None]:
            index = self._shard_of[name]

            def hook(_: Tensor) -> None:
                with lock:
                    fired[name] = fired.get(name, 0) + 1
                    if uses is None or fired[name] != uses.get(name):
                        return
                    names = remaining.get(index)
                    if names is None:
                        return
                    names.discard(name)
                    if not names:
                        del remaining[index]
                        futures[index] = self._io.submit(self._push_one, index, seq, self._stage_grads(index))

            return hook

        hooks = []
        if self.overlap and len(self.addresses) > 1:
            hooks = [
                self.params[name].register_post_accumulate_grad_hook(hook_for(name))
                for index in shards
                for name in self.shard_names[index]
            ]
        try:
            loss = loss_of(self.model)
            if isinstance(loss, tuple):  # a token mean's (sum, count)
                total, count = loss
                self.items = int(count)
                total.backward()
                self._last_loss = total.detach() / self.items  # 0 / 0: NaN for a batch without a scored item
            else:
                self.items = 1
                loss.backward()
                self._last_loss = loss.detach()
        finally:
            for handle in hooks:
                handle.remove()
        if hooks and uses is None:
            self._uses = dict(fired)
        elif hooks and uses is not None and any(count > uses.get(name, 0) for name, count in fired.items()):
            log.error(
                "%s: a parameter was used more often in step %d than in the first step, so a shard may have "
                "been pushed before its gradient was complete; overlap is now off. Fix: overlap=False for "
                "models whose parameter use varies between steps.",
                self.name,
                seq,
            )
            self.overlap = False
        for index in shards:
            if index not in futures:
                futures[index] = self._io.submit(self._push_one, index, seq, self._stage_grads(index))
        return futures

    def push(self, seq: int, shards: list[int] | None = None) -> list[int]:
        """Push the local gradients of `shards` (default: all) tagged with the pulled versions, taking the shards'
        new parameters back; returns the servers that did not apply it."""
        shards = list(range(len(self.addresses))) if shards is None else shards
        staged = {index: self._stage_grads(index) for index in shards}
        replies = self._each(lambda index: self._push_one(index, seq, staged[index]), shards)
        for index, (_, pulled, tensors) in zip(shards, replies):
            self._install(index, pulled, tensors)
        return [index for index, (applied, _, _) in zip(shards, replies) if not applied]

    def _beat(self) -> None:
        beats: list[Channel | None] = [None] * len(self.addresses)
        while not self._stop.wait(self.heartbeat_s):
            for index, address in enumerate(self.addresses):
                try:
                    if beats[index] is None:
                        beats[index] = connect(address, self.key, self.heartbeat_s, 0)
                    beats[index].send({"op": "beat", "args": {"wid": self.wid}})  # type: ignore[union-attr]
                except Exception as error:  # noqa: BLE001 - a heartbeat thread that died would get us declared dead
                    log.debug("%s: heartbeat to server %d failed (%s); retrying", self.name, index, error)
                    beats[index] = None  # the main connection reports the failure; keep trying
        for channel in beats:
            if channel is not None:
                channel.close()

    def close(self) -> None:
        """Leave every server (it stops counting this worker), then close the connections and the heartbeat."""
        for channel in self.channels:
            if channel is None:
                continue
            try:
                request(channel, "leave", self.timeout_s, wid=self.wid)
            except (EOFError, OSError, TimeoutError, ProtocolError):
                pass
            channel.close()
        self._stop.set()
        self._heartbeat.join(timeout=2 * self.heartbeat_s + 1)
        self._io.shutdown(wait=False)


__all__ = ["PUSH_DTYPES", "PSWorker"]
