"""What ``plan_expert_parallel`` checks before any collective: the model's Mixture-of-Experts layers against the
layout (``Layout.ep`` must divide every layer's experts, ep needs MoE layers, capacity with a split sequence, the
asynchronous PipeDream schedule, tensor-parallel grids, a whole-tensor optimizer choosing expert slices under
ZeRO), and what expert parallelism will do (``ExpertPlan``). Pure: the same LayoutError on every rank."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from plait.errors import LayoutError
from plait.layout import Layout, PipelineSchedule, TpMode
from plait.models.hf import is_hf_model
from plait.models.hf_moe import FAMILIES
from plait.models.moe import MoE
from plait.parallel.whole_tensor import WholeTensorOptimizer


@dataclass(frozen=True)
class ExpertPlan:
    """What ``apply_expert_parallel`` does: split each MoE layer's ``experts`` experts over ``ep`` ranks, and sum
    routing counts over ``sequence_axes`` (the axes that split one sequence: cp, and tp under sequence
    parallelism); ``layers``: the global block indices of the MoE layers (the rows of the step statistics)."""

    ep: int
    experts: int
    layers: tuple[int, ...]
    sequence_axes: tuple[str, ...]


def moe_modules(model: nn.Module) -> list[tuple[str, MoE]]:
    """Every ``MoE`` layer of ``model`` with its path, in module order."""
    return [(path, module) for path, module in model.named_modules() if isinstance(module, MoE)]


def plan_expert_parallel(model: nn.Module, layout: Layout, optimizer: object = None) -> ExpertPlan | None:
    """Check ``model``'s MoE layers against ``layout`` (and the ``optimizer`` given to parallelize), purely; None
    when the model has none (then ep must be 1)."""
    layers = moe_modules(model)
    if not layers:
        if layout.ep > 1 and is_hf_model(model):
            model_type = getattr(getattr(model, "config", None), "model_type", None)
            raise LayoutError(
                f"ep={layout.ep} splits the experts of Mixture-of-Experts layers, but {type(model).__name__} "
                f"(model_type={model_type!r}) has none plait can split: plait runs the experts of the transformers "
                f"families {', '.join(FAMILIES)} (plait.models.hf_moe). Fix: ep=1 (dp, tp and ZeRO train the model "
                f"as it is), or a model of one of those families."
            )
        if layout.ep > 1:
            raise LayoutError(
                f"ep={layout.ep} splits the experts of Mixture-of-Experts layers, but {type(model).__name__} has none "
                f"(plait.models.moe.MoE). Fix: set ep=1, or build the model with experts (GPTConfig(n_experts=...))."
            )
        return None
    counts = {module.n_experts for _, module in layers}
    for path, module in layers:
        if module.n_experts % layout.ep:
            raise LayoutError(
                f"ep={layout.ep} does not divide the {module.n_experts} experts of {path}: each of the ep ranks holds "
                f"the same number of whole experts. Fix: choose ep dividing {module.n_experts} (e.g. ep="
                f"{max(d for d in range(1, layout.ep + 1) if module.n_experts % d == 0)}), or change n_experts."
            )
        if module.experts.local_experts != module.n_experts:
            raise LayoutError(f"{path} holds a slice of its experts already. Fix: pass a fresh model to parallelize.")
        split = layout.cp > 1 or layout.sequence_parallel
        if module.capacity_factor is not None and split:
            raise LayoutError(
                f"{path} has capacity_factor={module.capacity_factor}: an expert's capacity is counted per sequence, "
                f"but cp={layout.cp} / sequence_parallel={layout.sequence_parallel} split each sequence over ranks "
                f"that would each drop tokens on their own. Fix: capacity_factor=None (dropless), or cp=1 and "
                f"sequence_parallel=False."
            )
    if len(counts) > 1:
        raise LayoutError(f"the MoE layers have different expert counts {sorted(counts)}: plait's statistics need one.")
    if layout.pp > 1 and layout.schedule == PipelineSchedule.PIPEDREAM:
        raise LayoutError(
            "Mixture-of-Experts layers with schedule='pipedream' are not implemented: the balance loss is "
            "normalised per optimizer step, and PipeDream updates per micro-batch window. Fix: use a synchronous "
            "schedule (e.g. schedule='1f1b')."
        )
    if layout.tp > 1 and layout.tp_mode != TpMode.ONE_D:
        raise LayoutError(
            f"Mixture-of-Experts layers with tp_mode={layout.tp_mode!r} are not implemented (the grid layers do not "
            f"know the router and experts). Fix: tp_mode='1d' (attention and dense layers split, experts whole)."
        )
    if layout.ep > 1 and layout.zero >= 1 and isinstance(optimizer, WholeTensorOptimizer):
        chosen = optimizer.chosen(model)
        experts = [n for n, p in model.named_parameters() if id(p) in chosen and ".experts." in f".{n}"]
        if experts:
            raise LayoutError(
                f"the whole-tensor optimizer chooses expert weights ({', '.join(experts[:2])}): ZeRO-{layout.zero} "
                f"owns each whole tensor on one rank of dp_cp, but with ep={layout.ep} each rank holds a slice of "
                f"the experts, sharded over edp. Fix: select only dense matrices for it (the default "
                f"hidden_matrices), or use zero=0 with ep > 1."
            )
    sequence_axes = (("cp",) if layout.cp > 1 else ()) + (("tp",) if layout.sequence_parallel else ())
    return ExpertPlan(layout.ep, layers[0][1].n_experts, tuple(m.layer for _, m in layers), sequence_axes)


__all__ = ["ExpertPlan", "moe_modules", "plan_expert_parallel"]
