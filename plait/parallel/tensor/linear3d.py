"""3D tensor parallelism on a q x q x q cube (Bian et al. 2021, "Maximizing Parallelism in Distributed Training
for Huge Neural Networks"; Agarwal et al. 1995's 3D matrix multiplication).

Write the layer as Y = X A with A = W^T [K=in, N=out], X [M=batch, K]. Rank (i, j, k) of the cube computes
the partial product X_ik A_kj of the output block Y_ij, and the sum over k finishes it. Each layer names the
cube axis it reduces over (``reduce_axis``, k) and the axis its output features are split over (``out_axis``,
j); the batch blocks i are always ``tp_row``. Every operand lives on one face of the cube, cut once more over
the third axis, so no rank holds a copy of anything:

- input X_ik on the (row, reduce) face, its batch block cut over ``out_axis``: all-gathered over ``out_axis``;
- weight A_kj on the (reduce, out) face, cut over ``tp_row``: all-gathered over ``tp_row``;
- output Y_ij on the (row, out) face: the partial products reduce-scattered over ``reduce_axis`` (batch dim).

Backward is the conjugate (plait.comm's differentiable all_gather / reduce_scatter): dY all-gathered over
``reduce_axis``, dX reduce-scattered over ``out_axis`` (sum over the output blocks j), dA reduce-scattered over
``tp_row`` (sum over the batch blocks i). The output's layout is the input's with ``reduce_axis`` and
``out_axis`` swapped, so consecutive layers alternate the two (Bian et al.): an MLP's up-projection reduces over
``tp_dep`` and its down-projection over ``tp_col``, and the MLP's output has its input's layout.
Per rank: weights, activations and bias are 1/q^3 of the whole; wire bytes per layer (fwd + bwd)
2 (q-1)/q x (M K + K N + M N)/q^2 + 2 (q-1)/q x (N/q + N/q^2) elements (the last term: the bias).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from plait.comm import Comm, all_gather, reduce_scatter
from plait.errors import LayoutError
from plait.parallel.tensor.grid import TP_COL, TP_DEP, TP_ROW, GridLinear, GridMLP, Placement


def cube_placements(reduce_axis: str, out_axis: str) -> dict[str, Placement]:
    """Where a 3D layer's weight W [out, in], bias, input and output live, given its reduce and out axes."""
    return {
        "weight": [(0, (out_axis, TP_ROW)), (1, (reduce_axis,))],  # W[out_j, in_k] = A_kj^T, cut over rows
        "bias": [(0, (out_axis, reduce_axis, TP_ROW))],
        "input": [(0, (TP_ROW, out_axis)), (-1, (reduce_axis,))],
        "output": [(0, (TP_ROW, reduce_axis)), (-1, (out_axis,))],
    }


class Linear3D(GridLinear):
    """nn.Linear on the 3D cube: all-gather input (over ``out_axis``) and weight (over ``tp_row``), local matmul,
    reduce-scatter of the output over ``reduce_axis``."""

    MODES = ("3d",)
    NAME = "3D"

    def __init__(
        self,
        linear: nn.Linear,
        comm: Comm,
        name: str = "linear",
        reduce_axis: str = TP_DEP,
        out_axis: str = TP_COL,
        entered: bool = False,
        gather_output: bool | str = False,
    ) -> None:
        if {reduce_axis, out_axis} != {TP_DEP, TP_COL}:
            raise LayoutError(
                f"{name}: a 3D layer reduces over one of tp_dep / tp_col and splits its output over the "
                f"other (got reduce_axis={reduce_axis!r}, out_axis={out_axis!r}). Fix: use "
                f"reduce_axis='tp_dep', out_axis='tp_col' or the reverse."
            )
        self.reduce_axis, self.out_axis = reduce_axis, out_axis
        super().__init__(linear, comm, name, entered, gather_output)

    def weight_placement(self) -> Placement:
        return cube_placements(self.reduce_axis, self.out_axis)["weight"]

    def bias_placement(self) -> Placement:
        return cube_placements(self.reduce_axis, self.out_axis)["bias"]

    def input_placement(self) -> Placement:
        return cube_placements(self.reduce_axis, self.out_axis)["input"]

    def output_placement(self) -> Placement:
        return cube_placements(self.reduce_axis, self.out_axis)["output"]

    def multiply(self, x: Tensor) -> Tensor:
        # batch block i whole, features k (``entered``: a parent module gathered it once for several layers)
        x_ik = x if self.entered else all_gather(x, self.comm, self.out_axis, dim=0)
        w_jk = all_gather(self.weight, self.comm, TP_ROW, dim=0)  # W[out_j, in_k]
        y = reduce_scatter(F.linear(x_ik, w_jk), self.comm, self.reduce_axis, dim=0)  # sum over k, batch cut over k
        if self.bias is not None:
            bias = all_gather(self.bias, self.comm, TP_ROW, dim=0)
            y = y + all_gather(bias, self.comm, self.reduce_axis, dim=0)  # b_j
        return y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, reduce_axis={self.reduce_axis!r}, out_axis={self.out_axis!r}"


class MLP3D(GridMLP):
    """Linear3D (reduce over tp_dep) -> GELU -> Linear3D (reduce over tp_col): input and output both have the
    batch cut over (tp_row, tp_col) and the features over tp_dep (``ACTIVATION_PLACEMENT["3d"]``)."""

    @classmethod
    def from_linears(cls, up: nn.Linear, down: nn.Linear, comm: Comm, activation: nn.Module | None = None) -> MLP3D:
        return cls(
            Linear3D(up, comm, "up", reduce_axis=TP_DEP, out_axis=TP_COL),
            Linear3D(down, comm, "down", reduce_axis=TP_COL, out_axis=TP_DEP),
            activation,
        )


__all__ = ["Linear3D", "MLP3D", "cube_placements"]
