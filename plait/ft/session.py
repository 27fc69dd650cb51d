"""A replica group's side of per-step fault tolerance: quorum, healing, the cross-group gradient and the commit,
around ``Engine.train_step`` (a layer above the step: the step itself is unchanged).

Each step, on every rank of the group:

1. **Quorum** (torchft's Manager and Lighthouse), asked for as the step starts and formed in torchft's thread while
   the step computes, so its round trips to the quorum service hide behind forward and backward: the live replica
   groups agree on who takes part; torchft re-forms the ``replicate`` process group when that changes. A group
   behind the others (new, restarted, or one that failed to commit) **heals** in that thread: the same rank of a
   live group sends its whole state (``plait.ft.state``, ``plait.ft.transport``), loaded before the update of
   the step (in ``should_commit``). Nothing is read from disk. A healing group's own step adds zeros.
2. **The step**: ``Engine.train_step`` on the batch of the group's data slot at this step (pure in the step:
   ``SlotBatches.batch_at``); once the group's gradients are synchronised, ``Engine.commit_gradients`` waits for
   the quorum and combines the gradients across it (``plait.ft.combine``: the token mean over the trained slots'
   tokens, in slot order).
3. **Commit**: torchft's ``should_commit`` agrees, over the group's ranks, that every collective succeeded and
   enough groups took part; then (and only then) the optimizer steps. A group that lost a peer mid-step does not
   commit: the step is retried, on the same batches, with the next quorum. A lost group's batch share of the
   steps it missed is not trained; the slots of every committed step are logged (``plait.ft.log``).

Under ``train.sync = "localsgd" | "diloco"`` the quorum (synchronous there), the healing and the commit happen once
per window of H inner steps instead, around the outer step (``plait.ft.outer``); ``train_step`` hands each step to
it.

**Data slots and spares.** The quorum lists its groups in order of their index; the group at place s < R among
those at the newest step trains data slot s (``plait.train.replicas.SlotBatches``), so without faults group g
trains slot g. A group computes the slot of the place it expects (its place among all groups of the last
quorum); when the quorum gives it another, it adds zeros for that step, so a change of membership costs the slot
that moves one step. A job may run K *spare* groups beyond the R (``PLAIT_FT_SPARES``, ``plait train --ft-spares
K``): a spare takes part in every step with weight 0 (it computes on slot 0's batch, which keeps it exercised,
and adds exact zeros), so it holds the same state as the others; when a group is lost, the spare moves up to its
place and trains its slot from the next step on, with nothing to heal: the job is back at full strength a
heartbeat timeout and a step after the loss instead of after the lost group's restart. The restarted group
heals, rejoins at its old place (its index sorts first) and the spare steps back.

The first step waits for all R + K groups (a job starts whole); later steps need ``PLAIT_FT_MIN_GROUPS`` (1).
torchft's quorum server (one per group, on its rank 0) listens on ``PLAIT_FT_BIND``, 127.0.0.1 unless set: torchft
itself binds every interface.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import signal
import sys
import time
from datetime import timedelta
from typing import Any

from plait.errors import CommError, PlaitError
from plait.ft import combine as cross
from plait.ft.experts import QuorumExperts
from plait.ft.log import ReplayLog
from plait.ft.options import FTOptions
from plait.ft.outer import QuorumWindows
from plait.ft.quorum import quorum_comm
from plait.ft.state import engine_state, load_engine_state
from plait.ft.transport import PeerTransport
from plait.logging import get_logger
from plait.parallel.semisync import SemiSync

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

    def __init__(
        self, options: FTOptions, engine: Any, world: Any, fingerprint: dict[str, Any], sync: SemiSync | None = None
    ) -> None:
        from torchft import Manager, ProcessGroupGloo

        self.options, self.engine, self.world = options, engine, world
        if engine.runner.owns_updates:
            raise FaultToleranceError(
                f"--ft does not take schedule={engine.layout.schedule!r}: PipeDream steps the optimizer inside its "
                f"schedule, where no quorum can commit it. Fix: schedule='1f1b' (or another synchronous schedule)."
            )
        if getattr(engine, "outer", None) is not None:
            raise FaultToleranceError(
                "--ft got an engine with its own outer step (parallelize(sync=...)): under --ft the quorum runs it. "
                "Fix: build the group's engine with sync=None and pass the SemiSync to FaultTolerantSteps."
            )
        if options.rejoin_delay_s and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0):
            time.sleep(options.rejoin_delay_s)  # the testing aid: a replacement that takes a while to come back
        self.replay = ReplayLog.read(options.replay) if options.replay else None
        if self.replay is not None:
            self.replay.check(fingerprint, options.groups)
        self.windows = QuorumWindows(sync, self) if sync is not None else None  # semi-synchronous: plait.ft.outer
        # a window's quorum comes first (plait.ft.outer); so does an MoE step's, whose balance loss weighs the
        # quorum's tokens before the forward (plait.ft.experts); otherwise it forms while the step computes
        synchronous = self.windows is not None or getattr(engine, "experts", None) is not None
        _bind_manager_server(options.bind)
        timeout = timedelta(seconds=options.timeout_s)
        self.pg = ProcessGroupGloo(timeout=timeout)
        fault = options.fault or {}
        self.transport = PeerTransport(self.pg, fingerprint, die_while_serving=fault.get("where") == "heal")
        self.manager = Manager(
            pg=self.pg,
            min_replica_size=options.members,  # the first step: every group (then min_groups)
            load_state_dict=self.windows.load_state
            if self.windows
            else functools.partial(load_engine_state, engine, source="the live replica group"),
            state_dict=self.windows.state if self.windows else functools.partial(engine_state, engine),
            replica_id=f"plait_group_{options.group:05d}",  # zero-padded: torchft orders the quorum by this text
            lighthouse_addr=options.lighthouse,
            rank=world.rank,
            world_size=world.world_size,
            hostname=options.bind,
            checkpoint_transport=self.transport,
            use_async_quorum=not synchronous,  # the quorum forms while the step computes
            init_sync=synchronous,  # else groups start alike (same configuration and seed; ``combine`` checks)
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
        )
        if engine.step:  # resumed from this group's checkpoint: the quorum starts from there
            committed = engine.step // sync.every if sync is not None else engine.step  # semisync: windows
            self.manager.load_state_dict({"step": committed, "batches_committed": 0})
        self.comm = quorum_comm(self.manager, self.pg, engine.comm.stats, options.timeout_s, engine.comm.device)
        self.experts = None  # Mixture-of-Experts: the balance loss and routing statistics across groups
        if getattr(engine, "experts", None) is not None:
            self.experts = QuorumExperts(engine, self.comm, self._counted, self.manager.report_error)
        self.combined: cross.Combined | None = None
        self.place: int | None = options.group
        """This group's place in the last quorum: the data slot it trains when below R, a spare beyond, None while
        it heals. Without faults group g is at place g."""
        self.next_place = options.group
        """The place this group expects in the next quorum."""
        self.trained = False
        self.computing: int | None = None
        """The data slot this attempt computes (its place in the last quorum), None for a spare's filler batch."""
        self.quorum_error: Exception | None = None
        self.job = int(hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:12], 16)
        """The job's fingerprint as a 48-bit integer (exact in float64): every row of the exchange carries it."""
        self.committed = False
        self.timings = (0.0, 0.0, 0.0)
        """Seconds of the last commit's wait for the quorum, its cross-group exchange and torchft's should_commit."""
        self.lost_steps = 0
        engine.commit_gradients = self._commit if self.windows is None else None  # semisync: inner steps commit
        self._waiting = False
        self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    # ----------------------------------------------------------------- one step
    def _start_quorum(self) -> None:
        """Ask for this attempt's quorum. It forms in torchft's thread while the step computes (the round trip to
        the quorum service hides behind forward and backward); a group behind the others receives a live group's
        state there, and loads it at the commit. A synchronous quorum (MoE) waits here and heals before the step."""
        self.quorum_error = None
        synchronous = not self.manager._use_async_quorum
        self._waiting = synchronous  # SIGTERM while waiting for the quorum exits at once
        try:
            self.manager.start_quorum(timeout=timedelta(seconds=self.options.timeout_s))
        except Exception as error:  # noqa: BLE001 - torchft raises bare RuntimeErrors from its Rust client
            self._quorum_failed(error)
        finally:
            self._waiting = False
        if synchronous and self.quorum_error is None:  # healed already: the place is known before the step
            place = self.manager.participating_rank()
            self.place = place
            self.next_place = place if place is not None else self.next_place

    def _quorum(self, started: float) -> None:
        """A synchronous quorum (semi-synchronous windows, ``plait.ft.outer``): healing this group if it is behind,
        retried while the quorum service answers late; a FaultToleranceError once it has not answered for
        ``QUORUM_PATIENCE`` timeouts. SIGTERM while waiting here exits at once."""
        timeout = timedelta(seconds=self.options.timeout_s)
        while True:
            self._waiting = True
            try:
                self.manager.start_quorum(timeout=timeout)
                self.quorum_error = None
                return
            except Exception as error:  # noqa: BLE001 - torchft raises bare RuntimeErrors from its Rust client
                self._quorum_failed(error)
                self._give_up_after(started, 1, "waiting for the quorum")
            finally:
                self._waiting = False

    def _quorum_failed(self, error: Exception) -> None:
        self.quorum_error = error
        self.manager._quorum_future = None  # consumed: the next start_quorum asks again instead of re-raising it
        log.warning("no quorum (%s)", str(error).splitlines()[0][:160] if str(error) else type(error).__name__)

    def _await_quorum(self) -> bool:
        """Wait for the quorum asked for at the attempt's start (SIGTERM while waiting exits at once); False when
        there is none. A refused peer (another job) raises here."""
        if self.quorum_error is None:
            try:
                self.manager.wait_quorum()
            except Exception as error:  # noqa: BLE001 - as above
                self._quorum_failed(error)
        if self.transport.refused is not None:
            raise self.transport.refused
        if self.quorum_error is not None:
            self.manager.report_error(self.quorum_error)
            return False
        return True

    def _give_up_after(self, started: float, attempts: int, doing: str) -> None:
        waited = time.perf_counter() - started
        if waited <= QUORUM_PATIENCE * self.options.timeout_s:
            return
        if self.quorum_error is not None:
            raise FaultToleranceError(
                f"rank {self.world.rank} of replica group {self.options.group}: no quorum from the quorum "
                f"service at {self.options.lighthouse} for {waited:.0f} s "
                f"({str(self.quorum_error).splitlines()[0][:200] if str(self.quorum_error) else 'timed out'}). The "
                f"last checkpoint is intact. Fix: check that the quorum service (plait lighthouse) runs and every "
                f"group can reach it, then resume."
            ) from self.quorum_error
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

    def _counted(self, step: int) -> bool:
        """Whether this group's rows count at ``step``: the quorum placed it at the data slot it computed (not a
        spare, not healing, not moved) and, in a replay, the log committed that slot."""
        if self.place is None or self.place >= self.options.groups or self.place != self.computing:
            return False
        return self.replay is None or self.place in self.replay.groups(step)

    def _commit(self, engine: Any) -> bool:
        """``Engine.commit_gradients``: wait for the quorum, combine over it, then agree whether to commit (a
        healing group loads the live group's state inside torchft's ``should_commit``, before the update)."""
        self.combined = None
        started = time.perf_counter()
        self._waiting = True  # from here to the vote this group waits on others: SIGTERM exits at once
        try:
            return self._combine_and_vote(engine, started)
        finally:
            self._waiting = False

    def _combine_and_vote(self, engine: Any, started: float) -> bool:
        in_quorum = None
        if self._await_quorum():
            if self.manager._healing and self.replay is None:  # joining a job already running: no waiting for all
                self.manager._min_replica_size = self.options.min_groups
            self.place = self.manager.participating_rank()  # among the groups at the newest step; None: healing
            in_quorum = self.comm.mesh.rank  # among every group of this quorum: the next one's place if it commits
            trained = self.trained = self._counted(engine.step + 1)
            key = self.place if self.place is not None else self.options.members + in_quorum
            waited = time.perf_counter()
            try:  # a group of another job fails its exchange here (a ConfigError names it)
                weight, loss = cross.group_weight(engine)
                grads = engine.strategy.owned_grads()
                extra = self.experts.statistics() if self.experts is not None else None  # zeros unless trained
                self.combined = cross.combine(
                    grads, self.comm, key, weight, loss, self._die_inside, trained=trained, job=self.job, extra=extra
                )
            except (CommError, RuntimeError) as error:
                log.warning("step %d: the cross-group exchange failed: %s", engine.step + 1, str(error).splitlines()[0])
                self.manager.report_error(error)
            if self.combined is not None and not any(self.combined.trained):  # every group moved or heals: retry
                self.manager.report_error(RuntimeError("no data slot trained at this step"))
                self.combined = None
        else:
            waited, self.trained = time.perf_counter(), False
        if self.experts is not None:
            self.experts.combined(self.combined)
        exchanged = time.perf_counter()
        self.committed = bool(self.manager.should_commit())
        if self.committed and in_quorum is not None:  # a failed attempt's quorum (a group alone, say) says nothing
            self.next_place = in_quorum
        self.timings = (waited - started, exchanged - waited, time.perf_counter() - exchanged)
        return self.committed

    def train_step(self, loader: Any) -> tuple[Any, dict[str, Any]]:
        """One committed step (retried until a quorum commits it): the engine's StepStats, with the quorum's loss,
        and what the quorum did, for the step's record.

        The group computes the data slot of the place it expects in this step's quorum (its place among every group
        of the last one, which a group that has just healed holds too; a spare computes slot 0's batch as filler).
        If the quorum gives it another place, or it heals in this step, it adds zeros and that slot is not trained
        at this step: a membership change costs the slot it moves one step (the records say so)."""
        if self.windows is not None:  # semi-synchronous: a quorum per window (plait.ft.outer)
            return self.windows.train_step(loader)
        started, attempts, quorum_s, healed_from = time.perf_counter(), 0, 0.0, None
        while True:
            attempts += 1
            before = self.engine.step
            self._start_quorum()
            step = self.engine.step  # a synchronous quorum (MoE) may have healed this group already
            guess = self.next_place
            self.computing = guess if guess < self.options.groups else None
            stats = self.engine.train_step(loader.batch_at(self.computing or 0, step))
            if healed_from is None and self.engine.step != before + 1:  # healed (in this attempt's quorum)
                healed_from = before
            quorum_s += self.timings[0]
            if self.committed and self.combined is not None:
                break
            self.engine.step -= 1  # not committed: the optimizer did not step (a healed state keeps its own step)
            self.lost_steps += 1
            log.warning("step %d was not committed (attempt %d); retrying with the next quorum", step + 1, attempts)
            self._give_up_after(started, attempts, "retrying")
            if self.quorum_error is None and self.manager.num_participants() < self.manager._min_replica_size:
                time.sleep(0.2)  # waiting for groups to join: do not spin
        if self.replay is None:
            self.manager._min_replica_size = self.options.min_groups  # a job starts whole; then min_groups commit
        combined = self.combined
        step = stats.step - 1
        cross.report(stats, combined)
        info = {
            "ft_groups": [s for s, t in zip(combined.slots, combined.trained) if t],  # the slots trained (log)
            "ft_slot": self.place if self.trained else None,  # None: a spare, healing, or moved at this step
            "ft_members": len(combined.slots),
            "ft_attempts": attempts,
            "ft_step_s": round(time.perf_counter() - started, 4),  # every attempt: what the step cost
            "ft_quorum_s": round(quorum_s, 4),  # of it, waiting for the quorum (after forward and backward)
            "ft_exchange_s": round(self.timings[1], 4),
            "ft_commit_s": round(self.timings[2], 4),
            "ft_time": round(time.time(), 3),  # when the step committed (the time lost to a fault is read from it)
        }
        if healed_from is not None:
            info["ft_healed_from_step"] = healed_from
        if self.options.step_delay_s:  # the testing aid's pause, after the step's figures
            time.sleep(self.options.step_delay_s)
        return stats, info

    def close(self) -> None:
        """Hand the engine back. Leaving on an error with a quorum request in flight (a rank of the group died
        mid-step) exits the process at once, the error logged: torchft's quorum thread would hold the exit until
        its request times out, and the group's agent restarts it sooner (it heals from a live group)."""
        pending = self.manager._quorum_future
        error = sys.exc_info()[1]
        if error is not None and pending is not None and not pending.done():
            log.error(
                "rank %d of replica group %d failed (%s: %s); leaving at once, its agent restarts the group",
                self.world.rank,
                self.options.group,
                type(error).__name__,
                str(error).splitlines()[0][:300] if str(error) else "",
            )
            logging.shutdown()
            os._exit(1)
        signal.signal(signal.SIGTERM, self._previous_sigterm)
        self.engine.commit_gradients = None
        if self.experts is not None:
            self.experts.detach()
        self.manager.shutdown(wait=False)


__all__ = ["FaultToleranceError", "FaultTolerantSteps"]
