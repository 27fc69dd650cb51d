"""The rank grids of 2D / 2.5D / 3D tensor parallelism: which tp sub-axes split which tensor dimension.

The tp group of a mesh built with ``Layout(tp_mode=...)`` is split into the sub-axes ``tp_dep``, ``tp_row``,
``tp_col`` (``plait.mesh.TP_SUB_AXES``). A tensor's placement is a list of ``(dim, axes)`` pairs: ``dim`` is
cut into ``prod(size(a) for a in axes)`` contiguous blocks, the first axis outermost, and the rank at
sub-coordinates c holds block ``(c[axes[0]] * size(axes[1]) + c[axes[1]]) ...``; dims and axes not named are
whole / replicated. Activations enter and leave a grid region with ``scatter_activation`` (keep this rank's
block; backward all-gathers the gradient) and ``gather_activation`` (all-gather; backward keeps the block).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from plait.comm import Comm, gather_from, scatter_to
from plait.errors import LayoutError

TP_ROW, TP_COL, TP_DEP = "tp_row", "tp_col", "tp_dep"

Placement = Sequence[tuple[int, Sequence[str]]]
"""``[(tensor dim, (sub-axis, ...)), ...]``: how a tensor is cut over the grid."""

ACTIVATION_PLACEMENT: dict[str, list[tuple[int, tuple[str, ...]]]] = {
    # SUMMA: row i of the q x q grid holds batch block i, column j feature block j
    "2d": [(0, (TP_ROW,)), (-1, (TP_COL,))],
    # Tesseract: the batch split over depth first, then each depth layer is a 2D SUMMA grid
    "2.5d": [(0, (TP_DEP, TP_ROW)), (-1, (TP_COL,))],
    # 3D (Bian et al.): batch over the row x column face, features over depth (the first layer reduces over depth)
    "3d": [(0, (TP_ROW, TP_COL)), (-1, (TP_DEP,))],
}
"""Where a layer's input (and, for every layer stack of plait's nD modules, its output) lives, per tp_mode."""


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
    """This rank's block of ``tensor`` as a parameter tagged with its placement (``param.tp_grid_placement``)."""
    param = nn.Parameter(local_block(tensor, comm, placement, what), requires_grad=tensor.requires_grad)
    param.tp_grid_placement = [(dim, tuple(axes)) for dim, axes in placement]  # type: ignore[attr-defined]
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
    input and the output, and the forward. Built ``from_linear`` by slicing the single-device layer."""

    MODES: tuple[str, ...] = ()
    NAME = "grid linear"

    def __init__(self, linear: nn.Linear, comm: Comm, name: str = "linear") -> None:
        super().__init__()
        check_mode(comm, self.MODES, f"{type(self).__name__} ({name})")
        self.comm = comm
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = shard_parameter(linear.weight, comm, self.weight_placement(), f"{name}.weight ({self.NAME})")
        self.bias = None if linear.bias is None else shard_parameter(
            linear.bias, comm, self.bias_placement(), f"{name}.bias ({self.NAME})")

    @classmethod
    def from_linear(cls, linear: nn.Linear, comm: Comm, name: str = "linear", **kwargs: object) -> GridLinear:
        return cls(linear, comm, name, **kwargs)  # type: ignore[arg-type]

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
        return (f"in={self.in_features}, out={self.out_features}, local_weight={tuple(self.weight.shape)}, "
                f"bias={self.bias is not None}")


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
