"""Expert parallelism: the experts of every Mixture-of-Experts layer split over the ``ep`` sub-axis of the data
ranks, tokens exchanged with uneven all-to-alls (docs/expert_parallel.md)."""

from plait.parallel.expert.apply import apply_expert_parallel, local_moe_layers, split_experts
from plait.parallel.expert.dispatch import ExpertParallelDispatch, SequenceSum
from plait.parallel.expert.plan import ExpertPlan, moe_modules, plan_expert_parallel
from plait.parallel.expert.stats import MoEStepStats, RouterStats

__all__ = [
    "ExpertParallelDispatch",
    "ExpertPlan",
    "MoEStepStats",
    "RouterStats",
    "SequenceSum",
    "apply_expert_parallel",
    "local_moe_layers",
    "moe_modules",
    "plan_expert_parallel",
    "split_experts",
]
