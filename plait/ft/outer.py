"""Semi-synchronous training (LocalSGD, DiLoCo: ``plait.parallel.semisync``) under per-step fault tolerance: the
quorum is held once per window of H inner steps, and the outer step runs over it.

A window of replica group g, steps w+1 .. w+H (w a multiple of H), on every rank of the group:

1. **Quorum** at the window's start (torchft's Manager, ``plait.ft.session``). A group that is behind (restarted,
   late, or one that did not commit the last window) **heals** here from a live group, whose state is the window's
   start: theta (parameters or ZeRO masters: the same in every group after an outer step), DiLoCo's outer momentum
   b, the step, the lr schedule and the random generators (``plait.ft.state``). Its **inner optimizer state starts
   afresh** (empty, as a new optimizer's): each group's inner state is its own (DiLoCo's paper), the peer's would
   make the result depend on which peer torchft picked, and a fresh one does not (so ``--ft-replay`` reproduces
   it: below). The group then keeps a copy of the window's start (theta, inner optimizer and lr state, RNG, step).
2. **Inner steps**: ``Engine.train_step`` inside the group, no quorum and no traffic across groups, on the
   group's own data slot g (whatever its place in the quorum: its inner optimizer state is that slot's; no spares);
   each step's reported loss is the group's own token mean L_gt (its records say ``"ft_loss_of": "group"``).
3. **Outer step** after step w+H, over the window's quorum Q (``plait.ft.quorum``): an all-gather of
   (g, w_g, then N_gt and N_gt L_gt for the H steps) and of w_g theta_g, summed in group order, so

       avg = sum over g in Q of w_g theta_g / sum over g in Q of w_g           w_g = 1: equal weights

   as the synchronous HSDP outer step (``OuterLoop``: an all-reduce mean over the groups) and the one-process
   simulation (tests/helpers/semisync_reference.py) average the copies; LocalSGD keeps avg, DiLoCo steps theta with
   Nesterov SGD on Delta = theta - avg (``semisync.nesterov``). Tokens do not weigh: each group's H inner steps
   are a trajectory, not one gradient. The window's losses are the quorum's token means
   sum_g N_gt L_gt / sum_g N_gt, one per step (``ft_window_loss`` on the window's last record, whose ``loss`` is
   the last step's).
4. **Commit**: torchft's ``should_commit``. Committed: every group of Q holds the outer result. Not committed (a
   group lost mid-window: the exchange fails): every group rolls back to the window's start and trains the window
   again, on the same batches, with the next quorum. A lost group costs the others that window's inner steps.

Memory: each rank keeps the window's start, a copy of what it holds (theta: DiLoCo needs it anyway) and of its
inner optimizer state, and DiLoCo's b (4 bytes per held element). Traffic: one all-gather of the held tensors per
window, (n-1) x 4 P_rank bytes per rank over n groups (``plait.ft.combine``'s trade: a fixed order).

The committed log (``plait.ft.log``) names, per window, the groups that were averaged (``ft_groups`` with
``ft_window`` = H on the window's last step). ``--ft-replay`` runs every group, gives the groups outside a
window's logged set w_g = 0 (an exact zero: the same bits), and starts the inner optimizer afresh in a group that
rejoins (logged in a window, not in the one before): a heal's effect. Bitwise the logged run.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any

import torch

from plait.errors import CommError, ConfigError
from plait.ft import combine as cross
from plait.ft.quorum import AXIS
from plait.ft.state import engine_state, load_engine_state, rng_state, set_rng_state
from plait.logging import get_logger
from plait.parallel.semisync import SemiSync, SyncMode, held_tensors, nesterov

log = get_logger(__name__)

OUTER = "outer"
"""The key of DiLoCo's outer momentum in a healing message (beside ``plait.ft.state``'s entries)."""


@dataclass
class WindowStart:
    """What a rollback restores: the group's state when its window began."""

    step: int
    held: list[torch.Tensor]
    """theta: copies of this rank's held tensors (``semisync.held_tensors``)."""
    optimizer: dict[str, Any]
    scheduler: dict[str, Any] | None
    rng: dict[str, Any]


class QuorumWindows:
    """A replica group's windows under a quorum (module docstring); ``FaultTolerantSteps`` dispatches to it."""

    def __init__(self, config: SemiSync, session: Any) -> None:
        if session.options.spares:
            raise ConfigError(
                f"--ft-spares {session.options.spares} with train.sync={config.kind.value!r}: a spare takes a lost "
                f"group's data slot, but a group's inner optimizer state and window belong to its own slot. Fix: "
                f"--ft-spares 0 (a lost group costs the others its window's inner steps either way)."
            )
        self.config, self.session, self.engine = config, session, session.engine
        self.every = config.every
        self.momentum: list[torch.Tensor] | None = None
        """DiLoCo's b, one tensor per held tensor (None before the first outer step)."""
        self.start: WindowStart | None = None
        """The open window's start (None between windows)."""
        self.window: list[tuple[float, torch.Tensor]] = []
        """(N_gt, L_gt) of the open window's inner steps."""
        self.healed = False
        self.healed_from: int | None = None

    # ----------------------------------------------------------------- healing (torchft's state callbacks)
    def state(self) -> dict[str, Any]:
        """What a healing group receives: ``plait.ft.state``'s, and DiLoCo's b (an empty list before it exists)."""
        return {**engine_state(self.engine), OUTER: list(self.momentum or [])}

    def load_state(self, state: dict[str, Any]) -> None:
        load_engine_state(self.engine, state, source="the live replica group")
        received = state.get(OUTER) or []
        self.momentum = [tensor.clone() for tensor in received] or None
        self.healed = True

    # ----------------------------------------------------------------- one step
    def train_step(self, loader: Any) -> tuple[Any, dict[str, Any]]:
        """The next step: an inner step, and at a window's end the outer step, retried (the whole window, from its
        start) until a quorum commits it. Returns the step's StepStats and its record's fault-tolerance fields."""
        started, attempts, owed = time.perf_counter(), 0, self.engine.step + 1
        while True:
            if self.start is None:
                self._begin_window(started)
            while self.engine.step + 1 < owed and (self.engine.step + 1) % self.every:  # a retried window's steps
                self._inner(loader)
            stats = self._inner(loader)
            if stats.step % self.every:
                self._delay()
                return stats, {"ft_loss_of": "group"}
            attempts += 1
            done = self._outer(stats.step)
            if done is not None:
                break
            self.session.lost_steps += self.every
            log.warning(
                "window of steps %d-%d was not committed (attempt %d); every group redoes it with the next quorum",
                stats.step - self.every + 1,
                stats.step,
                attempts,
            )
            self.session._give_up_after(started, attempts, "retrying the window")
        groups, losses, members = done
        stats._loss = losses[-1]
        info: dict[str, Any] = {
            "ft_loss_of": "quorum",
            "ft_groups": groups,  # the data slots averaged: slot g is group g's under semisync
            "ft_slot": self.session.options.group,
            "ft_members": members,
            "ft_window": self.every,
            "ft_window_loss": losses,
            "ft_attempts": attempts,
            "ft_quorum_s": round(time.perf_counter() - started - stats.seconds, 4),
            "ft_time": round(time.time(), 3),
        }
        if self.healed_from is not None:
            info["ft_healed_from_step"], self.healed_from = self.healed_from, None
        if self.session.replay is None:
            self.session.manager._min_replica_size = self.session.options.min_groups  # the first window: all
        self._delay()
        return stats, info

    def _delay(self) -> None:
        if self.session.options.step_delay_s:  # the testing aid's pause (plait.ft.options)
            time.sleep(self.session.options.step_delay_s)

    def _begin_window(self, started: float) -> None:
        """The quorum (healing this group if it is behind), a fresh inner optimizer where the group rejoins, and a
        copy of the window's start."""
        session, engine = self.session, self.engine
        while True:
            before, self.healed = engine.step, False
            session._quorum(started)
            if session.transport.refused is not None:
                raise session.transport.refused
            if session.manager.num_participants() >= session.manager._min_replica_size:
                break
            session._give_up_after(started, 1, "waiting for enough replica groups to join")
            time.sleep(0.2)
        rejoins = self.healed  # torchft also heals every group from one at step 0 (the same start): harmless
        if self.healed and engine.step != before:
            self.healed_from = before
            log.info(
                "replica group %d healed: step %d -> %d from a live group", session.options.group, before, engine.step
            )
        elif session.replay is not None and engine.step >= self.every:
            window = engine.step + self.every  # a group outside the last window's logged set rejoins here
            rejoins = self._logged(window) and not self._logged(engine.step)
        if rejoins:
            engine.strategy.optimizer.state.clear()  # the inner optimizer starts afresh (module docstring)
        scheduler = engine.lr_scheduler
        self.start = WindowStart(
            step=engine.step,
            held=[tensor.detach().clone() for tensor in held_tensors(engine.strategy)],
            optimizer=copy.deepcopy(engine.strategy.optimizer.state_dict()),
            scheduler=copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None,
            rng=rng_state(),
        )
        self.window = []

    def _logged(self, step: int) -> bool:
        replay = self.session.replay
        return replay is not None and replay.committed(step, self.session.options.group)

    def _inner(self, loader: Any) -> Any:
        stats = self.engine.train_step(loader.batch_at(self.session.options.group, self.engine.step))
        self.window.append(cross.group_weight(self.engine))
        return stats

    @torch.no_grad()
    def _rollback(self) -> None:
        """Back to the window's start: theta, the inner optimizer and lr states, the RNG and the step."""
        start, engine = self.start, self.engine
        assert start is not None
        for tensor, value in zip(held_tensors(engine.strategy), start.held):
            tensor.copy_(value)
        self._publish()
        engine.strategy.optimizer.load_state_dict(copy.deepcopy(start.optimizer))  # a copy: it may alias
        if engine.lr_scheduler is not None and start.scheduler is not None:
            engine.lr_scheduler.load_state_dict(copy.deepcopy(start.scheduler))
        set_rng_state(start.rng)
        engine.step = start.step

    def _publish(self) -> None:
        publish = getattr(self.engine.strategy, "_publish", None)
        if publish is not None:  # ZeRO: the masters into the parameters forward reads
            publish()

    @torch.no_grad()
    def _outer(self, step: int) -> tuple[list[int], list[float], int] | None:
        """The outer step over the quorum and the commit: (the groups averaged, the window's quorum losses, the
        groups in the quorum), or None after a rollback."""
        session, start = self.session, self.start
        assert start is not None
        weight = 0.0 if session.replay is not None and not self._logged(step) else 1.0
        result = None
        try:
            result = self._exchange(weight, start)
        except (CommError, RuntimeError) as error:
            log.warning("step %d: the outer step's exchange failed: %s", step, str(error).splitlines()[0])
            session.manager.report_error(error)
        committed = bool(session.manager.should_commit())
        if not committed or result is None:
            self._rollback()
            self.start = None
            return None
        self.start = None
        groups, losses, theta, momentum, members = result
        for tensor, value in zip(held_tensors(self.engine.strategy), theta):
            tensor.copy_(value)
        self._publish()
        self.momentum = momentum
        return groups, losses, members

    def _exchange(
        self, weight: float, start: WindowStart
    ) -> tuple[list[int], list[float], list[torch.Tensor], list[torch.Tensor] | None, int]:
        comm, group = self.session.comm, self.session.options.group
        values = [group, weight]
        for tokens, loss in self.window:
            values += [weight * tokens, weight * tokens * float(loss)] if weight else [0.0, 0.0]
        row = torch.tensor(values, dtype=torch.float64)
        rows = comm.all_gather(row.to(comm.device), AXIS).cpu().view(-1, len(values))
        order = sorted(range(rows.shape[0]), key=lambda i: float(rows[i, 0]))
        total = float(rows[:, 1].sum())
        held = held_tensors(self.engine.strategy)
        averages: list[torch.Tensor] = [torch.empty(0)] * len(held)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for index, tensor in enumerate(held):
            by_dtype.setdefault(tensor.dtype, []).append(index)
        for indices in by_dtype.values():
            flat = torch.cat([held[i].detach().reshape(-1).to(comm.device) for i in indices])
            flat = flat.mul_(weight) if weight else torch.zeros_like(flat)
            summed = cross.in_group_order(comm.all_gather(flat, AXIS).view(rows.shape[0], -1), order, total)
            offset = 0
            for i in indices:
                averages[i] = summed[offset : offset + held[i].numel()].view_as(held[i]).to(held[i].device)
                offset += held[i].numel()
        momentum = None
        if self.config.kind == SyncMode.DILOCO:
            mu, eta = self.config.outer_momentum, self.config.outer_lr
            averages, momentum = nesterov(start.held, averages, self.momentum, mu, eta)
        groups = [int(rows[i, 0]) for i in order if float(rows[i, 1])]
        losses = []
        for t in range(len(self.window)):
            tokens = sum(float(rows[i, 2 + 2 * t]) for i in order)
            losses.append(sum(float(rows[i, 3 + 2 * t]) for i in order) / tokens if tokens else float("nan"))
        return groups, losses, averages, momentum, len(order)


__all__ = ["OUTER", "QuorumWindows", "WindowStart"]
