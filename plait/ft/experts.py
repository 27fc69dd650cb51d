"""Mixture-of-Experts models under per-step fault tolerance: the balance loss weighed exactly across the replica
groups of a quorum, and one routing-statistics table (so one aux-free bias move) for all the committed groups.

**The balance loss.** One device trained on the union of the committed groups' batches minimises
CE_sum / N + (1/B) sum_layers S_aux (N scored tokens, B sequences, S_aux each layer's balance loss summed over
the sequences; ``plait.parallel.expert.stats``). Inside group g the engine computes G_g = dCE_sum_g / N_g +
a_g dS_aux_g (after its own data-parallel average), and the quorum combines sum_g w_g G_g / W with w_g = N_g
(W = sum_g w_g; ``plait.ft.combine``). The cross-entropy part is then exact for any a_g; the balance part is
sum_g (w_g a_g / W) dS_aux_g, which is sum_g dS_aux_g / B exactly when

    a_g = W / (w_g B).

The engine's own choice a_g = 1 / B_g is right only when N_g / B_g is the same in every group, which uneven loss
masks break. So before the step's forwards every group all-gathers (w_g, B_g) over the quorum (two numbers per
rank) and sets its layers' balance-loss gradient to W / (w_g B) (``RouterStats.begin``'s weight). A group that
must not count (a spare, or a slot outside the committed set in a replay, ``plait.ft.log``) sends (0, 0), so W and
B are the committed slots' totals. A group whose batch scores no token (w_g = 0) is weighed 0 by the combine, so its
balance gradient cannot be carried (one device would train on it): it is logged, and its balance term left out.

**Statistics and the aux-free bias.** The routing statistics (tokens routed and dropped per expert, the balance
loss's sum; ``RouterStats.gather``, summed inside the group) ride the commit's exchange (``combine``'s
``extra``), summed over the quorum in slot order, zeros from a group that must not count; every group then moves
its aux-free biases by the same summed loads, computed before the commit, so a group lost after the commit
cannot leave the groups with different biases. A step that does not commit moves no bias.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from plait.comm import Comm
from plait.errors import CommError
from plait.ft.combine import Combined, token_weight
from plait.ft.quorum import AXIS
from plait.logging import get_logger
from plait.parallel.expert.stats import MoEStepStats, RouterStats

log = get_logger(__name__)


class QuorumExperts:
    """``Engine.experts`` of a replica group under ``--ft``: wraps the group's ``RouterStats`` (module docstring).

    ``counted(step)``: whether this group's rows count at ``step``; ``on_error``: reports a failed exchange to the
    quorum's manager (the step then does not commit and is retried)."""

    def __init__(
        self, engine: Any, comm: Comm, counted: Callable[[int], bool], on_error: Callable[[Exception], None]
    ) -> None:
        inner = engine.experts
        if not isinstance(inner, RouterStats):
            raise TypeError(f"QuorumExperts wraps an engine's RouterStats, not {type(inner).__name__}")
        self.inner, self.engine, self.comm = inner, engine, comm
        self.counted, self.on_error = counted, on_error
        self.sequences = 0
        """B: the sequences of the counted groups' batches this step."""
        self.local: Tensor | None = None
        self.summed: Tensor | None = None
        engine.experts = self

    def detach(self) -> None:
        """Give the engine its own ``RouterStats`` back."""
        self.engine.experts = self.inner

    def begin(self, sequences: int, loss_scale: float | None) -> None:
        """Before the step's forwards (``Engine.train_step``): exchange (w_g, B_g), weigh the balance loss."""
        self.local = self.summed = None
        counted = self.counted(self.engine.step + 1)
        weight = token_weight(self.engine.step_loss) if counted else 0.0
        mine = torch.tensor([weight, float(sequences) if counted else 0.0], dtype=torch.float64)
        try:
            rows = self.comm.all_gather(mine.to(self.comm.device), AXIS).cpu().view(-1, 2)
        except (CommError, RuntimeError) as error:  # a group lost: this attempt will not commit
            log.warning("step %d: the balance-loss exchange failed: %s", self.engine.step + 1, str(error)[:200])
            self.on_error(error)
            self.sequences = sequences
            self.inner.begin(sequences, loss_scale)
            return
        total, self.sequences = float(rows[:, 0].sum()), int(rows[:, 1].sum())
        if weight == 0.0:
            if counted:
                log.warning(
                    "step %d: this replica group's batch scores no token: the combine weighs it 0, so its balance "
                    "loss is left out of the step",
                    self.engine.step + 1,
                )
            self.inner.begin(max(self.sequences, 1), loss_scale, weight=0.0)
            return
        self.inner.begin(self.sequences, loss_scale, weight=total / weight)

    def statistics(self) -> Tensor:
        """In the commit (``FaultTolerantSteps._commit``): this group's statistics table for the exchange, zeros
        when the group does not count."""
        self.local = self.inner.gather()
        return self.local if self.counted(self.engine.step + 1) else torch.zeros_like(self.local)

    def combined(self, combined: Combined | None) -> None:
        """The commit's exchange is done (None: it failed): keep the quorum's summed table."""
        self.summed = combined.extra if combined is not None else None

    def end(self, sequences: int, update_biases: bool) -> MoEStepStats:
        """After the step: the quorum's statistics, the biases moved by its loads (not for a step that did not
        commit, whose statistics are this group's alone)."""
        if self.summed is None:
            local = self.local if self.local is not None else self.inner.gather()
            return self.inner.finish(local, sequences, update_biases=False)
        return self.inner.finish(self.summed.to(self.comm.device), max(self.sequences, 1), update_biases)


__all__ = ["QuorumExperts"]
