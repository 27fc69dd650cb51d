"""Expert parallelism applied to a model: each MoE layer keeps the experts of this rank's ``ep`` index and
exchanges tokens with its ep peers (``dispatch.ExpertParallelDispatch``); a sequence split over ranks sums its
routing counts over them (``dispatch.SequenceSum``).

The expert weights are sliced in place (``param.data``: the Parameter objects, their names and their tags, e.g.
sequence parallelism's ``sequence_partial``, stay), and tagged for the rest of plait:

- ``param.expert_sharded = True``: its gradient is reduced, and under ZeRO sharded, over ``edp`` (the data ranks
  that hold the same experts) instead of ``dp_cp``, and divided by dp x cp like every other gradient
  (``plait.parallel.strategy.reduce_axis``);
- ``param.ep_slice = (dim, offset, whole size)``: which rows of the single-device tensor it holds, so
  checkpoints store the whole tensor (``plait.checkpoint.chunks``) and load into any ep.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from plait.comm import Comm
from plait.logging import get_logger
from plait.models.moe import ExpertGroup, MoE
from plait.parallel.expert.dispatch import AXIS, ExpertParallelDispatch, SequenceSum
from plait.parallel.expert.plan import ExpertPlan

log = get_logger(__name__)


def split_experts(experts: ExpertGroup, parts: int, index: int) -> None:
    """Keep experts [index E/parts, (index+1) E/parts) of ``experts`` (in place) and tag their weights."""
    local = experts.total // parts
    first = index * local
    with torch.no_grad():
        for weight in experts.weights():
            weight.data = weight.data[first : first + local].clone()
            weight.expert_sharded = True  # type: ignore[attr-defined]
            weight.ep_slice = (0, first, experts.total)  # type: ignore[attr-defined]
    experts.first, experts.local_experts = first, local


def local_moe_layers(roots: Iterable[nn.Module]) -> list[MoE]:
    """The MoE layers under ``roots`` (a pipeline rank's model and its stage modules share them), each once."""
    found: dict[int, MoE] = {}
    for root in roots:
        for module in root.modules():
            if isinstance(module, MoE):
                found.setdefault(id(module), module)
    return list(found.values())


def apply_expert_parallel(plan: ExpertPlan, roots: Iterable[nn.Module], comm: Comm) -> list[MoE]:
    """Split the experts of every MoE layer under ``roots`` over ``ep`` and install the token exchange; install the
    count sum where sequences are split. Returns this rank's MoE layers."""
    layers = local_moe_layers(roots)
    ep, index = comm.size(AXIS), comm.mesh.index(AXIS)
    for layer in layers:
        if ep > 1:
            split_experts(layer.experts, ep, index)
            layer.dispatch = ExpertParallelDispatch(comm)
        if plan.sequence_axes:
            layer.sequence_sum = SequenceSum(comm, plan.sequence_axes)
    log.info(
        "expert parallel over ep=%d: %d MoE layer(s) here, %d of %d experts each (experts %d..%d)",
        ep,
        len(layers),
        plan.experts // ep,
        plan.experts,
        index * (plan.experts // ep),
        (index + 1) * (plan.experts // ep) - 1,
    )
    return layers


__all__ = ["apply_expert_parallel", "local_moe_layers", "split_experts"]
