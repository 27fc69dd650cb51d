"""The rank grids of 2D / 2.5D / 3D tensor parallelism: which tp sub-axes split which tensor dimension.

The tp group of a mesh built with ``Layout(tp_mode=...)`` is split into the sub-axes ``tp_dep``, ``tp_row``,
``tp_col`` (``plait.mesh.TP_SUB_AXES``). A tensor's placement is a list of ``(dim, axes)`` pairs: ``dim`` is
cut into ``prod(size(a) for a in axes)`` contiguous blocks, the first axis outermost, and the rank at
sub-coordinates c holds block ``(c[axes[0]] * size(axes[1]) + c[axes[1]]) ...``; dims and axes not named are
whole / replicated. Activations enter and leave a grid region with ``scatter_activation`` (keep this rank's
block; backward all-gathers the gradient) and ``gather_activation`` (all-gather; backward keeps the block).

Every activation of a grid model is [batch, ..., features] with the batch cut over ``BATCH_AXES[mode]`` and the
features over ``FEATURE_AXES[mode]`` (``ACTIVATION_PLACEMENT``). Per-feature parameters (norm weights, embedding
columns) are cut over the feature axes and then once more over the batch axes (``vector_placement``): each rank
holds 1/tp of them and all-gathers its feature block over the batch axes, whose backward (a reduce-scatter) sums
the partial gradients of the batch blocks. ``split_problems`` checks any placement against the grid's sizes
without a mesh, so plans are checked before any collective.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from plait.comm import Comm, all_gather, copy_to, gather_from, reduce_from, scatter_to
from plait.errors import LayoutError

TP_ROW, TP_COL, TP_DEP = "tp_row", "tp_col", "tp_dep"

Placement = Sequence[tuple[int, Sequence[str]]]
"""``[(tensor dim, (sub-axis, ...)), ...]``: how a tensor is cut over the grid."""

BATCH_AXES: dict[str, tuple[str, ...]] = {
    "2d": (TP_ROW,),  # SUMMA: row i of the q x q grid holds batch block i, column j feature block j
    "2.5d": (TP_DEP, TP_ROW),  # Tesseract: the batch split over depth first, then each depth layer is a 2D grid
    "3d": (TP_ROW, TP_COL),  # 3D (Bian et al.): batch over the row x column face, features over depth
}
FEATURE_AXES: dict[str, tuple[str, ...]] = {"2d": (TP_COL,), "2.5d": (TP_COL,), "3d": (TP_DEP,)}
ACTIVATION_PLACEMENT: dict[str, list[tuple[int, tuple[str, ...]]]] = {
    mode: [(0, BATCH_AXES[mode]), (-1, FEATURE_AXES[mode])] for mode in BATCH_AXES
}
"""Where a layer's input (and, for every layer stack of plait's nD modules, its output) lives, per tp_mode."""
HEAD_AXIS = TP_COL
"""The axis that splits attention heads (and the vocabulary of the LM head's logits) in every mode: the output
features of a layer reading the activation placement are cut over ``tp_col`` (2D/2.5D: SUMMA's columns; 3D: the
out axis of the first layer of a pair)."""


def vector_placement(mode: str, dim: int = 0) -> list[tuple[int, tuple[str, ...]]]:
    """A per-feature tensor (norm weight, embedding columns along ``dim``): cut over the feature axes, then the
    batch axes, so that each rank holds 1/tp and all-gathers over the batch axes to its feature block."""
    return [(dim, FEATURE_AXES[mode] + BATCH_AXES[mode])]


def split_problems(shape: Sequence[int], placement: Placement, sizes: dict[str, int]) -> list[str]:
    """Pure: ``"dim D: size S does not split into N blocks (...)"`` for each dim of ``shape`` that ``placement``
    cuts into a number of blocks not dividing it (``sizes``: the sub-axis sizes, ``config.tp_grid_dims``)."""
    problems = []
    for dim, axes in placement:
        blocks = math.prod(sizes[a] for a in axes)
        if shape[dim] % blocks:
            grid = " x ".join(f"{a}={sizes[a]}" for a in axes)
            problems.append(f"dim {dim % len(shape)}: size {shape[dim]} does not split into {blocks} blocks ({grid})")
    return problems


def gather_blocks(x: Tensor, comm: Comm, axes: Sequence[str], dim: int) -> Tensor:
    """Differentiable all-gather of ``x`` along ``dim`` over ``axes`` (innermost first); backward reduce-scatters,
    i.e. sums the gradients of the ranks along ``axes`` and keeps this rank's block."""
    for axis in reversed(list(axes)):
        x = all_gather(x, comm, axis, dim=dim)
    return x


def sum_over(x: Tensor, comm: Comm, axes: Sequence[str]) -> Tensor:
    """All-reduce (sum) over ``axes`` forward and backward (``reduce_from`` of ``copy_to``): a sum of per-rank
    partials that every rank then uses differently, e.g. a norm's statistics over features split over ``axes``."""
    for axis in axes:
        x = reduce_from(copy_to(x, comm, axis), comm, axis)
    return x


def batch_block(x: Tensor, comm: Comm, axes: Sequence[str], what: str) -> Tensor:
    """This rank's block of dim 0 (the batch) of a tensor that is whole on every rank (ids, targets); LayoutError
    naming the fix when the batch does not split, raised the same on every rank before any collective."""
    blocks = parts(comm, axes)
    if x.shape[0] % blocks:
        grid = " x ".join(f"{a}={comm.size(a)}" for a in axes)
        raise LayoutError(
            f"{what}: tp_mode={comm.mesh.layout.tp_mode!r} splits the batch over {grid} = {blocks} blocks, but this "
            f"micro-batch has {x.shape[0]} rows. Fix: use a per-rank micro-batch (global batch / (dp x microbatches)) "
            f"that is a multiple of {blocks}."
        )
    return x.chunk(blocks, dim=0)[block_index(comm, axes)]


def check_mode(comm: Comm, modes: Sequence[str], what: str) -> None:
    """LayoutError unless the mesh was built with one of ``modes`` (the sub-axes exist only then)."""
    mode = comm.mesh.layout.tp_mode
    if mode not in modes:
        raise LayoutError(
            f"{what} needs a mesh with tp_mode in {', '.join(map(repr, modes))}, but this mesh has tp_mode={mode!r}. "
            f"Fix: build the Mesh from Layout(tp=..., tp_mode={modes[0]!r}"
            f"{', tp_depth=...' if modes[0] == '2.5d' else ''})."
        )


def parts(comm: Comm, axes: Sequence[str]) -> int:
    return math.prod(comm.size(a) for a in axes)


def block_index(comm: Comm, axes: Sequence[str]) -> int:
    """This rank's block along ``axes`` (first axis outermost)."""
    index = 0
    for axis in axes:
        index = index * comm.size(axis) + comm.mesh.index(axis)
    return index


def check_divisible(size: int, comm: Comm, axes: Sequence[str], what: str) -> None:
    n = parts(comm, axes)
    if size % n:
        grid = " x ".join(f"{a}={comm.size(a)}" for a in axes)
        raise LayoutError(
            f"{what}: size {size} does not split into {n} blocks ({grid}). Fix: make it a multiple of {n}, or choose a "
            f"smaller tp grid."
        )


def local_block(tensor: Tensor, comm: Comm, placement: Placement, what: str = "tensor") -> Tensor:
    """This rank's block of a whole ``tensor`` (a copy), checked for divisibility (LayoutError naming the fix)."""
    out = tensor
    for dim, axes in placement:
        check_divisible(out.shape[dim], comm, axes, f"{what} dim {dim}")
        out = out.chunk(parts(comm, axes), dim=dim)[block_index(comm, axes)]
    return out.detach().clone().contiguous()


@torch.no_grad()
def whole(local: Tensor, comm: Comm, placement: Placement) -> Tensor:
    """The whole tensor from every rank's ``local`` block (all-gathers, innermost axis first; a collective that
    every rank of the tp group calls). For checks and export: not differentiable."""
    out = local.detach().contiguous()
    for dim, axes in reversed(list(placement)):
        for axis in reversed(list(axes)):
            out = comm.all_gather(out.contiguous(), axis, dim=dim)
    return out.clone()


def shard_parameter(tensor: Tensor, comm: Comm, placement: Placement, what: str) -> nn.Parameter:
    """This rank's block of ``tensor`` as a parameter tagged with its placement (``param.tp_grid_placement``),
    as a tp shard (``tp_sharded``) and with ``tp_replicas``: how many tp ranks hold the same block (1, or 2.5D's
    depth for weights replicated over ``tp_dep``), so the gradient norm counts it once."""
    param = nn.Parameter(local_block(tensor, comm, placement, what), requires_grad=tensor.requires_grad)
    # torch's stubs declare no attributes beyond Tensor's own; a parameter carries plait's tags fine at runtime
    param.tp_grid_placement = [(dim, tuple(axes)) for dim, axes in placement]  # type: ignore[attr-defined]
    param.tp_sharded = True  # type: ignore[attr-defined]
    cut_over = [axis for _, axes in placement for axis in axes]
    param.tp_replicas = comm.size("tp") // parts(comm, cut_over)  # type: ignore[attr-defined]
    return param


def scatter_activation(x: Tensor, comm: Comm, placement: Placement | None = None) -> Tensor:
    """Enter a grid region: keep this rank's block of a replicated ``x`` (backward all-gathers the gradient).
    ``placement`` defaults to ``ACTIVATION_PLACEMENT`` of the mesh's tp_mode."""
    placement = placement if placement is not None else ACTIVATION_PLACEMENT[comm.mesh.layout.tp_mode]
    for dim, axes in placement:
        check_divisible(x.shape[dim], comm, axes, f"activation dim {dim}")
        for axis in axes:
            x = scatter_to(x, comm, axis, dim=dim)
    return x


def gather_activation(x: Tensor, comm: Comm, placement: Placement | None = None) -> Tensor:
    """Leave a grid region: all-gather the blocks into the whole tensor on every rank (backward keeps the block)."""
    placement = placement if placement is not None else ACTIVATION_PLACEMENT[comm.mesh.layout.tp_mode]
    for dim, axes in reversed(list(placement)):
        for axis in reversed(list(axes)):
            x = gather_from(x.contiguous(), comm, axis, dim=dim)
    return x


class GridLinear(nn.Module, abc.ABC):
    """A linear layer Y = X W^T + b cut over a tp grid: subclasses give the placements of W [out, in], b [out], the
    input and the output, and ``multiply``. Built ``from_linear`` by slicing the single-device layer.

    ``entered``: the input arrives already all-gathered over the layer's input-gather axis (``tp_col``), done once
    by a parent module for several layers sharing it (q/k/v, gate/up: the plan's "grid_enter"), so the layer skips
    its own gather and the backward reduce-scatter of dX happens once for all of them. ``gather_output``: True
    all-gathers the output whole, "eval" only in evaluation (an LM head whose loss takes split logits)."""

    MODES: tuple[str, ...] = ()
    NAME = "grid linear"

    def __init__(
        self,
        linear: nn.Linear,
        comm: Comm,
        name: str = "linear",
        entered: bool = False,
        gather_output: bool | str = False,
    ) -> None:
        super().__init__()
        check_mode(comm, self.MODES, f"{type(self).__name__} ({name})")
        if gather_output not in (True, False, "eval"):
            raise ValueError(f"gather_output={gather_output!r}: use True, False or 'eval'")
        self.comm = comm
        self.entered, self.gather_output = entered, gather_output
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = shard_parameter(linear.weight, comm, self.weight_placement(), f"{name}.weight ({self.NAME})")
        self.bias = (
            None
            if linear.bias is None
            else shard_parameter(linear.bias, comm, self.bias_placement(), f"{name}.bias ({self.NAME})")
        )

    @classmethod
    def from_linear(cls, linear: nn.Linear, comm: Comm, name: str = "linear", **kwargs: Any) -> GridLinear:
        """``kwargs``: the keyword arguments of the subclass's constructor (3D: ``reduce_axis``, ``out_axis``)."""
        return cls(linear, comm, name, **kwargs)

    @abc.abstractmethod
    def multiply(self, x: Tensor) -> Tensor:
        """This rank's output block from its input block (or the entered input)."""

    def forward(self, x: Tensor) -> Tensor:
        y = self.multiply(x)
        if self.gather_output is True or (self.gather_output == "eval" and not self.training):
            return gather_activation(y, self.comm, self.output_placement())
        return y

    @abc.abstractmethod
    def weight_placement(self) -> Placement:
        """Where the layer's weight lives on the grid."""

    @abc.abstractmethod
    def bias_placement(self) -> Placement:
        """Where the layer's bias lives on the grid."""

    @abc.abstractmethod
    def input_placement(self) -> Placement:
        """Where the layer's input lives on the grid."""

    @abc.abstractmethod
    def output_placement(self) -> Placement:
        """Where the layer's output lives on the grid."""

    def whole_parameters(self, grads: bool = False) -> dict[str, Tensor]:
        """``{"weight": W, "bias": b}`` whole (or their gradients): a collective over the tp group."""
        out = {}
        for name, placement in (("weight", self.weight_placement()), ("bias", self.bias_placement())):
            param = getattr(self, name)
            if param is not None:
                out[name] = whole(param.grad if grads else param, self.comm, placement)
        return out

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, local_weight={tuple(self.weight.shape)}, "
            f"bias={self.bias is not None}, entered={self.entered}, gather_output={self.gather_output}"
        )


class GridMLP(nn.Module):
    """Linear -> activation -> Linear on a tp grid; the activation is elementwise, so it runs on the blocks."""

    def __init__(self, up: GridLinear, down: GridLinear, activation: nn.Module | None = None) -> None:
        super().__init__()
        self.up, self.down = up, down
        self.activation = activation if activation is not None else nn.GELU()

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.activation(self.up(x)))

    def input_placement(self) -> Placement:
        return self.up.input_placement()

    def output_placement(self) -> Placement:
        return self.down.output_placement()


__all__ = [
    "ACTIVATION_PLACEMENT",
    "BATCH_AXES",
    "FEATURE_AXES",
    "HEAD_AXIS",
    "batch_block",
    "gather_blocks",
    "split_problems",
    "sum_over",
    "vector_placement",
    "GridLinear",
    "GridMLP",
    "TP_COL",
    "TP_DEP",
    "TP_ROW",
    "check_mode",
    "gather_activation",
    "local_block",
    "scatter_activation",
    "shard_parameter",
    "whole",
]
