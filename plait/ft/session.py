"""A replica group's side of per-step fault tolerance: quorum, healing, the cross-group gradient and the commit,
around ``Engine.train_step`` (a layer above the step: the step itself is unchanged).

Each step, on every rank of the group:

1. **Quorum** (torchft's Manager and Lighthouse): the live replica groups agree on who takes part; torchft
   re-forms the ``replicate`` process group when that changes. A group behind the others (new, restarted, or
   one that failed to commit) **heals** here: the same rank of a live group sends its whole state
   (``plait.ft.state``, ``plait.ft.transport``) and the step continues from it. Nothing is read from disk.
2. **The step**: ``Engine.train_step`` on the batch of this step (pure in the step: ``loader.batch_at``); once
   the group's gradients are synchronised, ``Engine.commit_gradients`` combines them across the quorum
   (``plait.ft.combine``: the token mean over the committed groups' tokens, in a fixed order).
3. **Commit**: torchft's ``should_commit`` agrees, over the group's ranks, that every collective succeeded and
   enough groups took part; then (and only then) the optimizer steps. A group that lost a peer mid-step does not
   commit: the step is retried, on the same batches, with the next quorum. A lost group's batch share of the
   steps it missed is not trained; the groups of every committed step are logged (``plait.ft.log``).

**Data slots and spares.** The quorum lists its groups in order of their index; the group at place s < R trains
data slot s (``plait.train.replicas.SlotBatches``), so without faults group g trains slot g. A job may run K
*spare* groups beyond the R (``PLAIT_FT_SPARES``, ``plait train --ft-spares K``): a spare takes part in every step
with weight 0 (it computes on slot 0's batch, which keeps it exercised, and adds exact zeros), so it holds the
same state as the others; when a group is lost, the spare moves up to its place and trains its slot at the next
step, with nothing to heal: the job is back at full strength one heartbeat timeout after the loss instead of
after the lost group's restart. The restarted group rejoins at its old place (its index sorts first) and the
spare steps back.

The first step waits for all R + K groups (a job starts whole); later steps need ``PLAIT_FT_MIN_GROUPS`` (1).
torchft's quorum server (one per group, on its rank 0) listens on ``PLAIT_FT_BIND``, 127.0.0.1 unless set: torchft
itself binds every interface.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from datetime import timedelta
from typing import Any

from plait.errors import CommError, PlaitError
from plait.ft import combine as cross
from plait.ft.log import ReplayLog
from plait.ft.options import FTOptions
from plait.ft.quorum import quorum_comm
from plait.ft.state import engine_state, load_engine_state
from plait.ft.transport import PeerTransport
from plait.logging import get_logger

log = get_logger(__name__)


QUORUM_PATIENCE = 3
"""Timeouts (PLAIT_FT_TIMEOUT_S) a group waits for a quorum before it gives up (the service is gone)."""


class FaultToleranceError(PlaitError):
    """The job cannot go on under fault tolerance (no quorum, a refused peer, a step that never commits)."""


def _bind_manager_server(host: str) -> None:
    """torchft's Manager starts its quorum server on ``[::]:port`` (every interface); serve on ``host`` instead."""
    import torchft.manager as manager_module
    from torchft._torchft import ManagerServer

    def on_host(*args: Any, bind: str, **kwargs: Any) -> Any:
        return ManagerServer(*args, bind=f"{host}:{bind.rsplit(':', 1)[1]}", **kwargs)

    manager_module.ManagerServer = on_host


class FaultTolerantSteps:
    """Runs a replica group's steps under a quorum (module docstring)."""

    def __init__(self, options: FTOptions, engine: Any, world: Any, fingerprint: dict[str, Any]) -> None:
        from torchft import Manager, ProcessGroupGloo

        self.options, self.engine, self.world = options, engine, world
        if engine.runner.owns_updates:
            raise FaultToleranceError(
                f"--ft does not take schedule={engine.layout.schedule!r}: PipeDream steps the optimizer inside its "
                f"schedule, where no quorum can commit it. Fix: schedule='1f1b' (or another synchronous schedule)."
            )
        if getattr(engine, "experts", None) is not None:
            raise FaultToleranceError(
                "--ft does not take Mixture-of-Experts models yet (their balance statistics "
                "span the groups). Fix: train them without --ft (restart-and-resume)."
            )
        if getattr(engine, "outer", None) is not None:
            raise FaultToleranceError(
                "--ft with train.sync='localsgd'/'diloco' is not supported yet (its outer step spans the groups "
                "outside the quorum). Fix: train.sync='sync' with --ft, or semi-synchronous training without --ft."
            )
        if engine.precision.loss_scale is not None:
            raise FaultToleranceError("--ft does not take fp16 loss scaling (its scale is per group). Fix: bf16.")
        self.replay = ReplayLog.read(options.replay) if options.replay else None
        if self.replay is not None:
            self.replay.check(fingerprint, options.groups)
        _bind_manager_server(options.bind)
        timeout = timedelta(seconds=options.timeout_s)
        self.pg = ProcessGroupGloo(timeout=timeout)
        fault = options.fault or {}
        self.transport = PeerTransport(self.pg, fingerprint, die_while_serving=fault.get("where") == "heal")
        self.manager = Manager(
            pg=self.pg,
            min_replica_size=options.members,  # the first step: every group (then min_groups)
            load_state_dict=functools.partial(load_engine_state, engine, source="the live replica group"),
            state_dict=functools.partial(engine_state, engine),
            replica_id=f"plait_group_{options.group:05d}",  # zero-padded: torchft orders the quorum by this text
            lighthouse_addr=options.lighthouse,
            rank=world.rank,
            world_size=world.world_size,
            hostname=options.bind,
            checkpoint_transport=self.transport,
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
        )
        if engine.step:  # resumed from this group's checkpoint: the quorum starts from there
            self.manager.load_state_dict({"step": engine.step, "batches_committed": 0})
        self.comm = quorum_comm(self.manager, self.pg, engine.comm.stats, options.timeout_s, engine.comm.device)
        self.combined: cross.Combined | None = None
        self.place = options.group
        """This group's place in the current quorum: the data slot it trains when below R, else a spare."""
        self.committed = False
        self.timings = (0.0, 0.0)
        """Seconds of the last commit's cross-group exchange and of torchft's should_commit."""
        self.lost_steps = 0
        engine.commit_gradients = self._commit
        self._waiting = False
        self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    # ----------------------------------------------------------------- one step
    def _quorum(self, started: float) -> None:
        """torchft's quorum for the next attempt (healing this group if it is behind), retried while the quorum
        service answers late; a FaultToleranceError once it has not answered for ``QUORUM_PATIENCE`` timeouts.
        SIGTERM while waiting here exits at once: the group's agent stops it because a rank of the group died,
        and nothing of its state is lost (the live groups hold it)."""
        timeout = timedelta(seconds=self.options.timeout_s)
        while True:
            self._waiting = True
            try:
                self.manager.start_quorum(timeout=timeout)
                return
            except Exception as error:  # noqa: BLE001 - torchft raises bare RuntimeErrors from its Rust client
                if time.perf_counter() - started > QUORUM_PATIENCE * self.options.timeout_s:
                    raise FaultToleranceError(
                        f"rank {self.world.rank} of replica group {self.options.group}: no quorum from the quorum "
                        f"service at {self.options.lighthouse} for {time.perf_counter() - started:.0f} s "
                        f"({str(error).splitlines()[0][:200]}). The last checkpoint is intact. Fix: check that the "
                        f"quorum service (plait lighthouse) runs and every group can reach it, then resume."
                    ) from error
                log.warning("no quorum yet (%s); asking again", str(error).splitlines()[0][:120])
            finally:
                self._waiting = False

    def _give_up_after(self, started: float, attempts: int, doing: str) -> None:
        waited = time.perf_counter() - started
        if waited > QUORUM_PATIENCE * self.options.timeout_s:
            raise FaultToleranceError(
                f"replica group {self.options.group}: step {self.engine.step + 1} not committed after {attempts} "
                f"attempts and {waited:.0f} s ({doing}; {self.manager.num_participants()} group(s) in the quorum, "
                f"{self.manager._min_replica_size} needed). Fix: check the other replica groups' errors; a job whose "
                f"groups are all lost resumes from its last checkpoint."
            )

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self._waiting:
            os.write(
                2,
                f"plait: replica group {self.options.group} rank {self.world.rank}: stopped while waiting "
                f"for the quorum; the live groups go on\n".encode(),
            )
            os._exit(128 + signum)
        if callable(self._previous_sigterm):
            self._previous_sigterm(signum, frame)

    def _die_inside(self) -> bool:
        fault = self.options.fault or {}
        return fault.get("where") == "sync" and int(fault.get("step", -1)) == self.engine.step + 1

    def _commit(self, engine: Any) -> bool:
        """``Engine.commit_gradients``: combine over the quorum, then agree whether to commit."""
        self.combined = None
        started = time.perf_counter()
        try:
            weight, loss = cross.group_weight(engine)
            if self.place >= self.options.groups:  # a spare: its step adds exact zeros
                weight = 0.0
            elif self.replay is not None and self.place not in self.replay.groups(engine.step + 1):
                weight = 0.0
            grads = engine.strategy.owned_grads()
            self.combined = cross.combine(grads, self.comm, self.place, weight, loss, self._die_inside)
        except (CommError, RuntimeError) as error:
            log.warning("step %d: the cross-group exchange failed: %s", engine.step + 1, str(error).splitlines()[0])
            self.manager.report_error(error)
        exchanged = time.perf_counter()
        self.committed = bool(self.manager.should_commit())
        self.timings = (exchanged - started, time.perf_counter() - exchanged)
        return self.committed

    def _take_place(self) -> None:
        """This group's place in the quorum just formed (torchft's replica rank: the quorum ordered by group)."""
        place = self.manager.participating_rank()
        if place is None:
            raise FaultToleranceError(f"replica group {self.options.group}: the quorum did not give it a place")
        if place != self.place:
            what = f"data slot {place}" if place < self.options.groups else "a spare"
            log.info("replica group %d now trains as %s (place %d in the quorum)", self.options.group, what, place)
        self.place = place

    def train_step(self, loader: Any) -> tuple[Any, dict[str, Any]]:
        """One committed step (retried until a quorum commits it): the engine's StepStats, with the quorum's loss,
        and what the quorum did, for the step's record."""
        started, attempts, healed_from = time.perf_counter(), 0, None
        while True:
            attempts += 1
            before = self.engine.step
            self._quorum(started)
            if self.transport.refused is not None:
                raise self.transport.refused
            if self.manager.num_participants() < self.manager._min_replica_size:  # cannot commit: do not compute
                self._give_up_after(started, attempts, "waiting for enough replica groups to join")
                time.sleep(0.2)
                continue
            if self.engine.step != before:
                healed_from = before
                log.info(
                    "replica group %d healed: step %d -> %d from a live group",
                    self.options.group,
                    before,
                    self.engine.step,
                )
            step = self.engine.step
            self._take_place()
            slot = self.place if self.place < self.options.groups else 0  # a spare computes on slot 0's batch
            stats = self.engine.train_step(loader.batch_at(slot, step))
            if self.committed and self.combined is not None:
                break
            self.engine.step = step  # not committed: the optimizer did not step; retry this step
            self.lost_steps += 1
            log.warning("step %d was not committed (attempt %d); retrying with the next quorum", step + 1, attempts)
            self._give_up_after(started, attempts, "retrying")
        if self.replay is None:
            self.manager._min_replica_size = self.options.min_groups  # a job starts whole; then min_groups commit
        combined = self.combined
        cross.report(stats, combined)
        info = {
            "ft_groups": [  # the data slots committed (the batches trained; plait.ft.log)
                s
                for s, w in zip(combined.slots, combined.weights)
                if s < self.options.groups and (self.replay is None or w or self.replay.committed(step + 1, s))
            ],
            "ft_slot": self.place if self.place < self.options.groups else None,  # None: a spare at this step
            "ft_members": len(combined.slots),
            "ft_attempts": attempts,
            "ft_quorum_s": round(time.perf_counter() - started - stats.seconds, 4),
            "ft_exchange_s": round(self.timings[0], 4),  # inside the step's seconds, as should_commit's
            "ft_commit_s": round(self.timings[1], 4),
            "ft_time": round(time.time(), 3),  # when the step committed (the time lost to a fault is read from it)
        }
        if healed_from is not None:
            info["ft_healed_from_step"] = healed_from
        if self.options.step_delay_s:  # the testing aid's pause, after the step's figures
            time.sleep(self.options.step_delay_s)
        return stats, info

    def close(self) -> None:
        signal.signal(signal.SIGTERM, self._previous_sigterm)
        self.engine.commit_gradients = None
        self.manager.shutdown(wait=False)


__all__ = ["FaultToleranceError", "FaultTolerantSteps"]
