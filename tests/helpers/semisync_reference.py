"""The one-process simulation of semi-synchronous training (LocalSGD, DiLoCo) that plait's replica groups are
compared with (tests/test_semisync.py): R copies of the tiny composition GPT in one process, copy g trained on the
rows its replica group's data ranks hold (ranks g S .. g S + S - 1 of dp = R S, as ``plait.mesh`` folds them), each
with its own AdamW and its own clipping, and every H steps an outer step written from the papers' formulas:

- LocalSGD: every copy <- the mean of the copies;
- DiLoCo: Delta = theta - mean of the copies; torch.optim.SGD(lr=eta, momentum=mu, nesterov=True) steps theta on
  Delta; every copy <- theta.

Written independently of ``plait.parallel.semisync`` (torch's SGD, not plait's formulas), so that an error in
either shows as a difference.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from helpers.composition import GLOBAL_BATCH, make_model, optimizer
from helpers.reference import snapshot_params

from plait.data import ShardedBatches
from plait.models.loss import apply_total, as_mean_loss


@dataclass
class Simulation:
    """Per step: the reported loss (sum of every group's token losses / every scored token) and every copy's
    parameters after the step (after the outer step at a window's end)."""

    losses: list[float] = field(default_factory=list)
    params: list[list[dict[str, torch.Tensor]]] = field(default_factory=list)
    """params[step][group]: copy ``group``'s parameters after ``step``."""


def group_batch(loaders: list[ShardedBatches], step: int, group: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of replica group ``group`` (data ranks group x size .. + size - 1) at ``step``, in rank order."""
    rows = [loaders[group * size + i].batch_at(step) for i in range(size)]
    return torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])


def simulate(
    mode: str,
    every: int,
    groups: int,
    group_size: int,
    steps: int,
    clip: float | None,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
) -> Simulation:
    """Train ``groups`` copies ``steps`` steps with an outer step every ``every`` (module docstring)."""
    base, task = make_model()
    dp = groups * group_size
    loaders = [ShardedBatches(task, GLOBAL_BATCH, dp_rank=rank, dp_size=dp) for rank in range(dp)]
    loss_fn = as_mean_loss(torch.nn.functional.cross_entropy)
    assert loss_fn is not None
    copies = [copy.deepcopy(base) for _ in range(groups)]
    inner = [optimizer(c.parameters()) for c in copies]
    theta = [p.detach().clone().requires_grad_(True) for p in base.parameters()]
    outer = torch.optim.SGD(theta, lr=outer_lr, momentum=outer_momentum, nesterov=True)
    out = Simulation()
    for step in range(steps):
        total, count = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        for model, opt, g in zip(copies, inner, range(groups)):
            inputs, targets = group_batch(loaders, step, g, group_size)
            summed = apply_total(loss_fn, model(inputs), targets)
            scored = loss_fn.count(targets)
            (summed / scored).backward()  # the group's own token mean
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            total += summed.detach().double()
            count += float(scored)
        out.losses.append(float(total / count))
        if (step + 1) % every == 0:
            outer_step(mode, copies, theta, outer)
        out.params.append([snapshot_params(model) for model in copies])
    return out


@torch.no_grad()
def outer_step(mode: str, copies: list[torch.nn.Module], theta: list[torch.Tensor], outer: torch.optim.SGD) -> None:
    """The papers' outer step over ``copies`` (module docstring); every copy then holds theta. Also the simulation
    of a fault-tolerant run (tests/helpers/ft.py), over the copies of a window's committed groups."""
    per_copy = [list(model.parameters()) for model in copies]
    for index, target in enumerate(theta):
        summed = per_copy[0][index].detach().clone()
        for params in per_copy[1:]:
            summed += params[index]
        mean = summed / len(per_copy)
        if mode == "localsgd":
            target.copy_(mean)
        else:
            target.grad = target.detach() - mean  # the pseudo-gradient
    if mode == "diloco":
        with torch.enable_grad():
            outer.step()
    for params in per_copy:
        for param, value in zip(params, theta):
            param.copy_(value)
