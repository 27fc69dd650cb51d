"""Tensor parallelism: Megatron 1D layers (``layers``), vocab-parallel cross-entropy (``loss``), plans as data
(``plan``) and what ``parallelize`` does with them (``apply``). 2D/2.5D/3D variants will live here too."""

from plait.parallel.tensor.apply import apply_tensor_parallel, plan_tensor_parallel
from plait.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_parameters,
    is_tp_sharded,
)
from plait.parallel.tensor.loss import VocabParallelLoss, vocab_parallel_cross_entropy
from plait.parallel.tensor.plan import PLANS, STYLES, apply_plan, default_plan, register_plan, resolve_plan

__all__ = [
    "PLANS",
    "STYLES",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "VocabParallelLoss",
    "apply_plan",
    "apply_tensor_parallel",
    "default_plan",
    "gather_parameters",
    "is_tp_sharded",
    "plan_tensor_parallel",
    "register_plan",
    "resolve_plan",
    "vocab_parallel_cross_entropy",
]
