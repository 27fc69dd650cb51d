"""The rest of a transformer on a 2D / 2.5D / 3D tp grid: norms and embeddings whose activations stay cut as the
grid's linears want them (``grid.ACTIVATION_PLACEMENT``: batch over ``BATCH_AXES``, features over
``FEATURE_AXES``), as in Colossal-AI's LayerNorm2D / Embedding2D and their 2.5D / 3D counterparts.

- ``GridNorm`` (LayerNorm or RMSNorm) normalises features that are split over the feature axes: each rank sums
  its block's x (and then (x - mean)^2, or x^2 for RMSNorm), one all-reduce over the feature axes gives the
  statistics of the whole feature vector, with an all-reduce backward too (every rank's statistic gradient
  reaches every block: ``grid.sum_over``). Its weight / bias are cut over all tp ranks (``vector_placement``).
- ``GridEmbedding``: the table [V, d] cut on the features (columns), so the lookup of this rank's batch block of
  ids gives its activation block directly, with no communication but the all-gather of the table's column block
  over the batch axes (its backward sums the batch blocks' partial gradients). A 1-D input (positions [T], shared
  by the whole batch) is not batch-split.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from plait.comm import Comm
from plait.errors import LayoutError
from plait.models.layers import RMSNorm
from plait.parallel.tensor.grid import (
    BATCH_AXES,
    FEATURE_AXES,
    Placement,
    batch_block,
    check_mode,
    gather_blocks,
    shard_parameter,
    sum_over,
    vector_placement,
)

GRID_MODES = ("2d", "2.5d", "3d")


class GridNorm(nn.Module):
    """LayerNorm (y = (x - mean) / sqrt(var + eps) * w + b) or RMSNorm (y = x / sqrt(mean(x^2) + eps) * w) over
    features split across the grid's feature axes: statistics summed over them, weight / bias gathered to this
    rank's feature block."""

    def __init__(self, norm: nn.LayerNorm | RMSNorm, comm: Comm, name: str = "norm") -> None:
        super().__init__()
        check_mode(comm, GRID_MODES, f"GridNorm ({name})")
        self.comm, self.mode = comm, comm.mesh.layout.tp_mode
        self.rms = isinstance(norm, RMSNorm)
        self.eps = norm.eps
        if isinstance(norm, nn.LayerNorm):  # its weight is None with elementwise_affine=False
            self.features = norm.normalized_shape[0]
        else:
            self.features = norm.weight.shape[0]
        placement = vector_placement(self.mode)
        self.weight = None if norm.weight is None else shard_parameter(norm.weight, comm, placement, f"{name}.weight")
        bias = getattr(norm, "bias", None)
        self.bias = None if bias is None else shard_parameter(bias, comm, placement, f"{name}.bias")

    @classmethod
    def from_norm(cls, norm: nn.LayerNorm | RMSNorm, comm: Comm, name: str = "norm") -> GridNorm:
        return cls(norm, comm, name)

    def _feature_block(self, param: Tensor) -> Tensor:
        return gather_blocks(param, self.comm, BATCH_AXES[self.mode], dim=0)

    def forward(self, x: Tensor) -> Tensor:
        axes = FEATURE_AXES[self.mode]
        if self.rms:
            xf = x.float()
            mean_square = sum_over(xf.pow(2).sum(dim=-1, keepdim=True), self.comm, axes) / self.features
            y = (xf * torch.rsqrt(mean_square + self.eps)).type_as(x)
        else:
            mean = sum_over(x.sum(dim=-1, keepdim=True), self.comm, axes) / self.features
            centered = x - mean
            variance = sum_over(centered.pow(2).sum(dim=-1, keepdim=True), self.comm, axes) / self.features
            y = centered * torch.rsqrt(variance + self.eps)
        if self.weight is not None:
            y = y * self._feature_block(self.weight)
        if self.bias is not None:
            y = y + self._feature_block(self.bias)
        return y

    def parameter_placement(self) -> Placement:
        return vector_placement(self.mode)

    def extra_repr(self) -> str:
        return f"{'rmsnorm' if self.rms else 'layernorm'}, features={self.features}, mode={self.mode!r}"


class GridEmbedding(nn.Module):
    """nn.Embedding with its table's columns (features) split over the grid: ids [B, ...] -> this rank's batch
    block of ids -> its activation block [B/b, ..., d/f]; a 1-D input [T] (positions) -> [T, d/f] for every rank."""

    def __init__(self, embedding: nn.Embedding, comm: Comm, name: str = "embedding") -> None:
        super().__init__()
        check_mode(comm, GRID_MODES, f"GridEmbedding ({name})")
        if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
            raise LayoutError(
                f"{name}: a grid embedding supports neither max_norm, scale_grad_by_freq nor sparse=True. Fix: build "
                f"the embedding without them, or use tp_mode='1d'."
            )
        self.comm, self.mode, self.name = comm, comm.mesh.layout.tp_mode, name
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx = embedding.padding_idx
        self.weight = shard_parameter(embedding.weight, comm, vector_placement(self.mode, dim=1), f"{name}.weight")

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, comm: Comm, name: str = "embedding") -> GridEmbedding:
        return cls(embedding, comm, name)

    def forward(self, ids: Tensor) -> Tensor:
        if ids.dim() >= 2:  # [B, ...]: this rank's batch block (checked before any collective)
            ids = batch_block(ids, self.comm, BATCH_AXES[self.mode], self.name)
        columns = gather_blocks(self.weight, self.comm, BATCH_AXES[self.mode], dim=1)  # [V, d / features]
        return F.embedding(ids, columns, self.padding_idx)

    def parameter_placement(self) -> Placement:
        return vector_placement(self.mode, dim=1)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, local={tuple(self.weight.shape)}, mode={self.mode!r}"


__all__ = ["GRID_MODES", "GridEmbedding", "GridNorm"]
