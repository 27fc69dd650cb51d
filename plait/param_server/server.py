"""`ShardServer`: one server's shard of the parameters, its optimizer, and the consistency/fault rules.

The state machine is independent of the transport (``service.py`` feeds it requests from sockets, tests call it
directly). Every method takes one lock, so a push is applied atomically: a reader sees the shard either before or
after the whole optimizer step. Pushes carry ``(worker id, seq)``; a worker pushes its seqs in increasing order, so
``seq <= last applied seq`` identifies a retry, which is acknowledged but never applied twice.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from plait.errors import ConfigError
from plait.logging import get_logger
from plait.param_server.agreement import JobSettings, mismatch_message
from plait.param_server.consistency import Consistency, StalenessStats
from plait.param_server.sharding import ParamSpec, assign_shards, model_spec, spec_mismatch

log = get_logger(__name__)


@dataclass(frozen=True)
class OptimizerSpec:
    """Any ``torch.optim`` optimizer by class name, e.g. OptimizerSpec("AdamW", {"lr": 1e-3}); picklable."""

    name: str = "SGD"
    kwargs: dict[str, Any] = field(default_factory=lambda: {"lr": 0.1})

    def build(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        cls = getattr(torch.optim, self.name, None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise ConfigError(f"optimizer {self.name!r} is not a torch.optim optimizer. Fix: e.g. 'SGD' or 'AdamW'.")
        return cls(params, **self.kwargs)


@dataclass
class WorkerRecord:
    """What a server knows of one worker incarnation."""

    name: str
    clock: int
    last_seen: float
    alive: bool = True
    left: bool = False
    last_seq: int = -1
    applied: int = 0


@dataclass(frozen=True)
class ServerSettings:
    """One server's place in the job and its rules."""

    index: int = 0
    num_servers: int = 1
    consistency: Consistency = field(default_factory=Consistency)
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    dead_after_s: float = 5.0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    record_history: bool = False
    min_workers: int = 1
    """BSP's start barrier: no round closes before this many workers have joined. Without it, a worker that joins
    server 0 first could close round 0 there alone, while server 1's round 0 waits for everyone: a deadlock."""
    steps: int = 0
    """Steps per worker of the job (compared with joining workers'; 0: not checked)."""

    @property
    def job(self) -> JobSettings:
        """What a joining worker must agree with (agreement.py)."""
        return JobSettings(
            self.consistency.mode, self.consistency.staleness, self.steps, self.min_workers, self.num_servers
        )


Snapshot = Callable[[dict[str, nn.Parameter]], Any]
"""Called under the server's lock with the live parameters: copies them somewhere (a send buffer, clones)."""


def clone_params(params: dict[str, nn.Parameter]) -> dict[str, Tensor]:
    return {name: param.detach().clone() for name, param in params.items()}


class ShardServer:
    """Owns the parameters `assign_shards` gives server `settings.index`, applies pushed gradients to them."""

    def __init__(self, model: nn.Module, settings: ServerSettings) -> None:
        self.settings = settings
        self.spec: tuple[ParamSpec, ...] = model_spec(model)
        shards = assign_shards(self.spec, settings.num_servers)
        if not 0 <= settings.index < settings.num_servers:
            raise ConfigError(f"server index {settings.index} is outside [0, {settings.num_servers}).")
        names = set(shards[settings.index])
        self.params = {name: nn.Parameter(p.detach().clone()) for name, p in model.named_parameters() if name in names}
        self.optimizer = settings.optimizer.build(list(self.params.values()))
        self.version = 0
        self.workers: dict[str, WorkerRecord] = {}
        self.pending: dict[str, tuple[int, dict[str, Tensor], int]] = {}  # wid -> (seq, gradients, items)
        self.staleness = StalenessStats()
        self.pushes_applied = self.duplicates = self.dropped = self.joined = 0
        self.history: list[dict[str, Tensor]] = []
        self.resumed_from: int | None = None
        self.started = time.monotonic()
        self.round_opened: float | None = None
        """When the open BSP round received its first gradient (for the 'waits for' log line)."""
        self.cond = threading.Condition()
        self._resume()

    # ---- membership -------------------------------------------------------------------------------------------
    def join(
        self, wid: str, name: str, spec: tuple[ParamSpec, ...], settings: JobSettings | None = None
    ) -> dict[str, Any]:
        """Admit a worker (its settings and model must match the servers'); a new one starts at the slowest live
        clock (a live one, e.g. restored from a checkpoint, keeps its record)."""
        differences = [] if settings is None else self.settings.job.differences(settings)
        if differences:
            raise ConfigError(mismatch_message(name, differences))  # the service logs every refusal
        problem = spec_mismatch(self.spec, tuple(spec))
        if problem:
            raise ConfigError(
                f"worker {name!r} has a different model from the servers': {problem}. Fix: build the "
                f"workers' model with the same configuration as the servers'."
            )
        with self.cond:
            record = self.workers.get(wid)
            if record is None or not record.alive:
                self.joined += record is None
                self.workers[wid] = WorkerRecord(name, self._slowest_clock(), time.monotonic())
                if record is not None:  # rejoining after being declared dead: keep its seq so retries still dedup
                    self.workers[wid].last_seq, self.workers[wid].applied = record.last_seq, record.applied
            else:
                record.last_seen = time.monotonic()
            self.cond.notify_all()
            log.info(
                "server %d: worker %s joined (%d of %d expected have joined, %d live)",
                self.settings.index,
                name,
                self.joined,
                self.settings.min_workers,
                self.live_count(),
            )
            return {
                "names": list(self.params),
                "version": self.version,
                "clock": self.workers[wid].clock,
                "index": self.settings.index,
                "servers": self.settings.num_servers,
            }

    def beat(self, wid: str) -> None:
        with self.cond:
            record = self.workers.get(wid)
            if record is not None:
                record.last_seen = time.monotonic()

    def leave(self, wid: str) -> None:
        """A worker that finished: it no longer counts for BSP rounds or the SSP bound."""
        with self.cond:
            record = self.workers.get(wid)
            if record is not None and record.alive:
                record.alive, record.left = False, True
                self._retire(wid)

    def lost(self, wid: str, reason: str) -> None:
        """A worker's connection broke (EOF) or its heartbeat stopped: it is dead; rounds stop waiting for it."""
        with self.cond:
            record = self.workers.get(wid)
            if record is not None and record.alive:
                record.alive = False
                log.warning(
                    "server %d: worker %s is dead (%s); %d live workers remain",
                    self.settings.index,
                    record.name,
                    reason,
                    self.live_count(),
                )
                self._retire(wid)

    def sweep(self) -> None:
        """Declare dead every worker silent for longer than `dead_after_s`."""
        now = time.monotonic()
        silent = [wid for wid, r in self.workers.items() if r.alive and now - r.last_seen > self.settings.dead_after_s]
        for wid in silent:
            self.lost(wid, f"no heartbeat for {self.settings.dead_after_s:g} s")

    def _retire(self, wid: str) -> None:
        self.pending.pop(wid, None)  # a round averages only the gradients of workers live when it closes
        self._close_round_if_complete()
        self.cond.notify_all()

    def live_count(self) -> int:
        return sum(record.alive for record in self.workers.values())

    def _slowest_clock(self) -> int:
        return min((r.clock for r in self.workers.values() if r.alive), default=0)

    # ---- pull / push ------------------------------------------------------------------------------------------
    def pull(self, wid: str, timeout_s: float, have: int = -1, snapshot: Snapshot = clone_params) -> dict[str, Any]:
        """The shard (``snapshot`` of it, taken under the lock) and its version; nothing but the version when the
        worker already has it (``have``). Under SSP waits until this worker is within s clocks of the slowest."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            record = self._member(wid)
            while not self.settings.consistency.may_pull(record.clock, self._slowest_clock()):
                if (
                    not self.cond.wait(timeout=min(0.1, max(0.0, deadline - time.monotonic())))
                    and time.monotonic() >= deadline
                ):
                    raise TimeoutError(f"pull by {record.name} waited {timeout_s:g} s for the slowest worker")
                record = self._member(wid)
            if have == self.version:
                return {"version": self.version, "unchanged": True, "params": None}
            return {"version": self.version, "unchanged": False, "params": snapshot(self.params)}

    def push(
        self,
        wid: str,
        seq: int,
        version: int,
        grads: dict[str, Tensor],
        timeout_s: float,
        then_pull: bool = False,
        snapshot: Snapshot = clone_params,
        items: int = 1,
    ) -> dict[str, Any]:
        """Apply (ASP/SSP) or enqueue for the round (BSP) one gradient computed on `version`; exactly once per seq.
        ``items``: how many items the gradient sums over (a token mean's count; 1 for a mean): a round applies the
        sum of its gradients divided by the sum of their items.
        With ``then_pull`` the reply also carries what a pull right after it returns ("pulled"): one round trip
        per step instead of two. The gradients may be views of a receive buffer: they are used before returning."""
        reply = self._push(wid, seq, version, grads, timeout_s, items)
        if then_pull:
            reply["pulled"] = self.pull(wid, timeout_s, snapshot=snapshot)
        return reply

    def _push(
        self, wid: str, seq: int, version: int, grads: dict[str, Tensor], timeout_s: float, items: int = 1
    ) -> dict[str, Any]:
        if set(grads) != set(self.params):
            raise ConfigError(f"push names {sorted(set(grads) ^ set(self.params))[:3]} do not match this shard.")
        with self.cond:
            record = self._member(wid)
            if seq <= record.last_seq or (wid in self.pending and self.pending[wid][0] == seq):
                self.duplicates += 1
                if seq <= record.last_seq:
                    return {"applied": True, "duplicate": True, "version": self.version}
            elif self.settings.consistency.mode != "bsp":
                tau = self.version - version
                self._apply([(record, seq, version, grads, items)])
                return {"applied": True, "duplicate": False, "version": self.version, "tau": tau}
            elif version != self.version:
                self.dropped += 1
                return {"applied": False, "reason": f"stale: computed on version {version}, round is {self.version}"}
            else:
                if not self.pending:
                    self.round_opened = time.monotonic()
                self.pending[wid] = (seq, grads, items)
                self._close_round_if_complete()
            deadline = time.monotonic() + timeout_s
            while record.last_seq < seq:
                if wid not in self.pending or not record.alive:
                    return {"applied": False, "reason": "the worker was declared dead before the round closed"}
                self.cond.wait(timeout=0.1)
                if time.monotonic() >= deadline:
                    if self.pending.get(wid, (None,))[0] == seq:
                        del self.pending[wid]  # its gradients are views of a buffer the caller reuses
                    raise TimeoutError(f"BSP round {self.version} waited {timeout_s:g} s for the other workers")
            return {"applied": True, "duplicate": False, "version": self.version, "tau": 0}

    def _member(self, wid: str) -> WorkerRecord:
        record = self.workers.get(wid)
        if record is None or not record.alive:
            raise PermissionError(f"worker {wid} is not a live member of server {self.settings.index}; rejoin")
        record.last_seen = time.monotonic()
        return record

    def _close_round_if_complete(self) -> None:
        live = {wid for wid, record in self.workers.items() if record.alive}
        started = self.joined >= self.settings.min_workers
        if self.settings.consistency.mode == "bsp" and started and self.pending and live <= set(self.pending):
            entries = [
                (self.workers[wid], seq, self.version, grads, items)
                for wid, (seq, grads, items) in self.pending.items()
            ]
            self.pending.clear()
            self._apply(entries)

    def _apply(self, entries: list[tuple[WorkerRecord, int, int, dict[str, Tensor], int]]) -> None:
        """One optimizer step on the sum of `entries`' gradients over the sum of their items (one entry outside
        BSP; a round of means, one item each, is their mean), under the lock. A round without an item applies
        its (zero) gradients undivided."""
        items = max(sum(entry[4] for entry in entries), 1)
        for name, param in self.params.items():
            if len(entries) > 1:
                param.grad = torch.stack([entry[3][name].to(param.dtype) for entry in entries]).sum(dim=0) / items
            else:  # a view of the receive buffer, used before the reply: divided into a new tensor
                param.grad = entries[0][3][name].to(param.dtype) / items
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for record, seq, version, *_ in entries:
            self.staleness.record(self.version - version)
            record.last_seq, record.clock, record.applied = seq, record.clock + 1, record.applied + 1
        self.pushes_applied += len(entries)
        self.version += 1
        self.round_opened = None
        if self.settings.record_history:
            self.history.append({n: p.detach().clone() for n, p in self.params.items()})
        every = self.settings.checkpoint_every
        if self.settings.checkpoint_dir and every and self.version % every == 0:
            self.save_checkpoint()
        self.cond.notify_all()

    # ---- checkpoints and reports ------------------------------------------------------------------------------
    def checkpoint_path(self) -> str:
        return os.path.join(self.settings.checkpoint_dir or ".", f"server-{self.settings.index}.pt")

    def save_checkpoint(self) -> str:
        """Write the shard, optimizer state, version and applied seqs to a temporary file, then os.replace it."""
        path = self.checkpoint_path()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        state = {
            "version": self.version,
            "params": {n: p.detach().clone() for n, p in self.params.items()},
            "optimizer": self.optimizer.state_dict(),
            "pushes_applied": self.pushes_applied,
            "last_seq": {wid: (r.name, r.last_seq, r.applied, r.alive) for wid, r in self.workers.items()},
            "staleness": dict(self.staleness.counts),
        }
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
        return path

    def _resume(self) -> None:
        if not self.settings.checkpoint_dir or not os.path.exists(self.checkpoint_path()):
            return
        state = torch.load(self.checkpoint_path(), weights_only=True)  # tensors and plain containers: no code runs
        with torch.no_grad():
            for name, value in state["params"].items():
                self.params[name].copy_(value)
        self.optimizer.load_state_dict(state["optimizer"])
        self.version, self.pushes_applied = state["version"], state["pushes_applied"]
        self.staleness.counts.update(state["staleness"])
        # The checkpoint's live workers are presumed alive (a server restart is no worker's death): a BSP round waits
        # for each of them until it reconnects or its heartbeat stays silent for dead_after_s (`sweep`). Restoring
        # them as dead would let a round close on the first worker to reconnect alone, one round ahead of the
        # others on this shard only. They also count for BSP's start barrier (joined).
        for wid, (name, last_seq, applied, alive) in state["last_seq"].items():
            self.workers[wid] = WorkerRecord(name, 0, time.monotonic(), alive=alive, last_seq=last_seq, applied=applied)
        self.joined, self.resumed_from = len(self.workers), self.version
        log.warning(
            "server %d resumed from %s at version %d", self.settings.index, self.checkpoint_path(), self.version
        )

    def waiting(self, after_s: float) -> str | None:
        """What BSP waits for, when it has waited: workers not yet joined (start barrier), or the live workers
        whose gradient the round open for ``after_s`` seconds lacks; None when nothing waits."""
        with self.cond:
            if self.settings.consistency.mode != "bsp":
                return None
            if self.joined < self.settings.min_workers:
                return (
                    f"waiting for workers: {self.joined} of {self.settings.min_workers} have joined (BSP starts "
                    f"when all {self.settings.min_workers} have; start the others, or run with --workers "
                    f"{max(1, self.joined)})"
                )
            opened = self.round_opened
            if opened is None or time.monotonic() - opened < after_s:
                return None
            missing = sorted(r.name for wid, r in self.workers.items() if r.alive and wid not in self.pending)
            return (
                f"round {self.version} has waited {time.monotonic() - opened:.0f} s for workers {missing} "
                f"({len(self.pending)} of {self.live_count()} live workers have pushed)"
            )

    def report(self, with_params: bool = False) -> dict[str, Any]:
        """Counters for progress and tests; with the shard (and history) when asked."""
        with self.cond:
            elapsed = max(1e-9, time.monotonic() - self.started)
            report: dict[str, Any] = {
                "index": self.settings.index,
                "version": self.version,
                "updates_per_s": self.version / elapsed,
                "pushes_applied": self.pushes_applied,
                "duplicates": self.duplicates,
                "dropped": self.dropped,
                "live_workers": self.live_count(),
                "joined": self.joined,
                "expected_workers": self.settings.min_workers,
                "staleness": self.staleness.as_dict(),
                "resumed_from": self.resumed_from,
                "applied_by_worker": {r.name: r.applied for r in self.workers.values()},
            }
            if with_params:
                report["params"] = {n: p.detach().clone() for n, p in self.params.items()}
                report["history"] = self.history
            return report


__all__ = ["OptimizerSpec", "ServerSettings", "ShardServer", "WorkerRecord"]
