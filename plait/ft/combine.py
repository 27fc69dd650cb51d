"""One step's gradient across the replica groups of its quorum: the token mean over the committed groups' tokens,
summed in a fixed order so that any run of the same committed log gives the same bits.

Inside group g the engine has already reduced the gradient over the group's own data ranks, normalised by the
group's scored tokens N_g (``plait.parallel.loss_normalization``): G_g = dL_g/dtheta with L_g = S_g / N_g. One
device trained on the union of the committed groups' batches computes L = sum_g S_g / sum_g N_g, so

    G = sum over g in Q of  N_g G_g  /  sum over g in Q of N_g        (Q: the groups committed at this step)

and the reported loss is sum_g N_g L_g / sum_g N_g (``report``; NaN, 0/0, when the committed groups scored no
token: the gradient is then zero, as one device's, and the run goes on). Every rank all-gathers a row (s, w_g, w_g L_g, trained, job)
and its owned gradients times w_g = N_g from the same rank of every group in the quorum, then sums them in the
order of s, the group's place in the quorum (its data slot; spares past the R slots, groups still healing and a
group that computed another slot than its place contribute w = 0 and ``trained`` 0). ``job`` is a 48-bit code of
the job's fingerprint: a group of another job in the quorum is refused before any gradient moves. Adding an exact zero
never changes a floating-point sum, so a replay (``plait.ft.log``) in which every slot is trained but those
outside Q contribute w = 0 (zeros, not 0 x G_g: a non-finite G_g stays out) reproduces G bitwise, whichever
groups trained the slots. A loss that is not a token mean (``MicroMeanStep``) weighs each group 1.

Cost: an all-gather of the owned gradients moves (n-1)/n x n x P_owned bytes per rank (P_owned: this rank's
gradient bytes, a shard under ZeRO), n/2 times a ring all-reduce's 2(n-1)/n x P_owned; for the two to eight
replica groups of a job it buys an order that does not depend on which groups are alive.

A caller may add a float64 vector of its own to the row (``extra``: a Mixture-of-Experts model's routing statistics,
``plait.ft.experts``), summed over the quorum in the same slot order: one exchange, before the commit.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from plait.comm import Comm
from plait.errors import ConfigError
from plait.ft.quorum import AXIS
from plait.logging import get_logger
from plait.parallel.loss_normalization import TokenMeanStep

if TYPE_CHECKING:
    from plait.engine import StepStats

log = get_logger(__name__)
HEAD = 5
"""A row's own columns (slot, w, w L, trained, job); a caller's ``extra`` follows."""


@dataclass
class Combined:
    """What the quorum computed for one step."""

    slots: list[int]
    """The places in the quorum whose rows were summed, in order (data slots 0..R-1, then any spares)."""
    weights: list[float]
    trained: list[bool]
    """Whether the row's slot trained its batch at this step (what the committed log records)."""
    loss: float
    extra: torch.Tensor | None = None
    """The callers' ``extra`` vectors summed in slot order (None without one)."""


def token_weight(loss: object) -> float:
    """w_g of a step's loss normalisation (``Engine.step_loss``): its scored tokens N_g (1 for a loss that is not a
    token mean)."""
    return float(loss.counts.sum()) if isinstance(loss, TokenMeanStep) else 1.0


def group_weight(engine: object) -> tuple[float, torch.Tensor]:
    """(w_g, L_g): this group's scored tokens (1 for a loss that is not a token mean) and its reported loss."""
    loss, total = getattr(engine, "step_loss", None), getattr(engine, "step_total", None)
    if loss is None or total is None:
        raise RuntimeError("commit_gradients ran outside Engine.train_step")
    reported = loss.report(total).detach().reshape(()).double().cpu()
    return token_weight(loss), reported


def in_group_order(gathered: torch.Tensor, order: list[int], total: float) -> torch.Tensor:
    """The rows of ``gathered`` summed in ``order`` (group order: the same bits whatever order the quorum lists the
    groups in), divided by ``total`` (at least 1)."""
    summed = gathered[order[0]].clone()
    for index in order[1:]:
        summed += gathered[index]
    return summed.div_(max(total, 1.0))


def combine(
    grads: list[torch.Tensor],
    comm: Comm,
    slot: int,
    weight: float,
    loss: torch.Tensor,
    die_inside: Callable[[], bool] = lambda: False,
    trained: bool = True,
    job: int = 0,
    extra: torch.Tensor | None = None,
) -> Combined:
    """Replace ``grads`` (this rank's owned gradients) by the quorum's token mean (module docstring); ``weight``
    is 0 unless ``trained``; ``extra`` (float64, the same length in every group; zeros from a group that must not
    count) is summed in slot order."""
    weight = weight if trained else 0.0
    values = [float(slot), weight, weight * float(loss) if weight else 0.0, float(trained), float(job)]
    head = torch.tensor(values, dtype=torch.float64)
    width = HEAD + (extra.numel() if extra is not None else 0)
    row = torch.cat([head, extra.detach().reshape(-1).double().cpu()]) if extra is not None else head
    rows = comm.all_gather(row.to(comm.device), AXIS).cpu().view(-1, width)
    if any(int(code) != job for code in rows[:, 4].tolist()):
        raise ConfigError(
            "a replica group in the quorum trains another job (its fingerprint differs). Fix: start every replica "
            "group with the same configuration."
        )
    order = sorted(range(rows.shape[0]), key=lambda i: float(rows[i, 0]))
    total = float(rows[:, 1].sum())
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for members in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in members])
        flat = flat.mul_(weight) if weight else torch.zeros_like(flat)
        pending = comm.all_gather(flat, AXIS, async_op=True)
        if die_inside():  # PLAIT_FT_FAULT=where=sync: die with the exchange in flight
            log.error("PLAIT_FT_FAULT: dying inside the cross-group exchange")
            os._exit(9)
        summed = in_group_order(pending.wait().view(rows.shape[0], -1), order, total)
        offset = 0
        for grad in members:
            grad.copy_(summed[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()
    loss_sum = float(sum(float(rows[i, 2]) for i in order))
    extras = None
    if extra is not None:
        extras = rows[order[0], HEAD:].clone()
        for index in order[1:]:
            extras += rows[index, HEAD:]
    return Combined(
        slots=[int(rows[i, 0]) for i in order],
        weights=[float(rows[i, 1]) for i in order],
        trained=[bool(rows[i, 3]) for i in order],
        loss=loss_sum / total if total else float("nan"),
        extra=extras.view_as(extra) if extras is not None and extra is not None else None,
    )


def report(stats: StepStats, combined: Combined) -> None:
    """The quorum's loss in the group's ``StepStats`` (``Engine.train_step`` reported the group's own): the token
    mean over the committed groups' tokens, with the count it is a mean over (``StepStats.scored``, so a step whose
    committed groups scored nothing is no divergence, even in a group that scored tokens but was not committed)."""
    stats._loss = combined.loss
    if stats.scored is not None:  # a token mean: the weights are the groups' scored tokens (0 outside a replay's Q)
        stats._scored = sum(combined.weights)


__all__ = ["Combined", "combine", "group_weight", "in_group_order", "report", "token_weight"]
