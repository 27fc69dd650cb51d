"""Tensor parallelism: Megatron 1D layers (``layers``), vocab-parallel cross-entropy (``loss``), plans as data
(``plan``) and what ``parallelize`` does with them (``apply``); 2D SUMMA (``linear2d``), 2.5D Tesseract
(``linear2p5d``) and 3D (``linear3d``) layers on the tp sub-axes of ``grid``, grid norms and embeddings
(``grid_layers``) and grid plans for whole models (``grid_plan``)."""

from plait.parallel.tensor.apply import apply_tensor_parallel, plan_tensor_parallel
from plait.parallel.tensor.grid import GridLinear, GridMLP, gather_activation, scatter_activation
from plait.parallel.tensor.grid_layers import GridEmbedding, GridNorm
from plait.parallel.tensor.grid_plan import GRID_STYLES, builtin_grid_plans, gpt_grid_plan
from plait.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_parameters,
    is_tp_sharded,
)
from plait.parallel.tensor.linear2d import MLP2D, Linear2D
from plait.parallel.tensor.linear2p5d import Linear2p5D, MLP2p5D
from plait.parallel.tensor.linear3d import MLP3D, Linear3D
from plait.parallel.tensor.loss import GridVocabLoss, VocabParallelLoss, vocab_parallel_cross_entropy
from plait.parallel.tensor.plan import STYLES, apply_plan, builtin_plans, default_plan, resolve_plan

__all__ = [
    "builtin_grid_plans",
    "builtin_plans",
    "MLP2D",
    "MLP2p5D",
    "MLP3D",
    "GRID_STYLES",
    "GridEmbedding",
    "GridLinear",
    "GridMLP",
    "GridNorm",
    "GridVocabLoss",
    "gpt_grid_plan",
    "Linear2D",
    "Linear2p5D",
    "Linear3D",
    "gather_activation",
    "scatter_activation",
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
    "resolve_plan",
    "vocab_parallel_cross_entropy",
]
