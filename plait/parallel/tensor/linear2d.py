"""2D tensor parallelism: SUMMA on a q x q grid (Optimus; Xu et al. 2021, "An Efficient 2D Method for Training
Super-Large Deep Learning Models"; van de Geijn & Watts 1997).

Write the layer as Y = X A with A = W^T [in, out]. Rank (i, j) (i = ``tp_row``, j = ``tp_col``) holds the blocks
X_ij (batch block i, feature block j), A_ij (in-block i, out-block j, i.e. W[out_j, in_i]) and computes

    Y_ij = sum_k X_ik A_kj.

SUMMA takes the q terms in q broadcast steps (X_ik along row i, A_kj along column j). plait does the same
exchange as two all-gathers, which move the same bytes per rank in a single call each: X_i* along the row
(``tp_col`` group) and A_*j along the column (``tp_row`` group); then Y_ij = X_i* A_*j is one local matmul.
Backward is the conjugate: dX_i* = dY_ij A_*j^T is a partial sum over j, reduce-scattered over ``tp_col``;
dA_*j = X_i*^T dY_ij a partial sum over i, reduce-scattered over ``tp_row`` (plait.comm's differentiable
``all_gather``). The output has the input's layout, so layers chain with elementwise ops between them.
The bias b_j is cut once more over the rows (each rank holds 1/q^2 of it) and all-gathered over ``tp_row``.
Per rank: weights in*out/q^2, activations b*h/q^2; wire bytes per layer (fwd + bwd, ring model)
2 (q-1)/q x (b*in/q + in*out/q + out/q) elements.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from plait.comm import Comm, all_gather, copy_to
from plait.parallel.tensor.grid import ACTIVATION_PLACEMENT, TP_COL, TP_ROW, GridLinear, GridMLP, Placement


def summa_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    comm: Comm,
    replicated_over: str | None = None,
    entered: bool = False,
) -> Tensor:
    """Y_ij = X_i* A_*j (+ b_j) from this rank's blocks; ``replicated_over``: an axis over which the weights are
    copies whose gradients must be summed (2.5D's depth); ``entered``: ``x`` is already X_i* (gathered once by a
    parent module for several layers)."""
    x_row = x if entered else all_gather(x, comm, TP_COL, dim=-1)  # X_i*: this row's whole input features
    if replicated_over is not None:
        weight = copy_to(weight, comm, replicated_over)  # identity forward, all-reduce of dW backward
    w_col = all_gather(weight, comm, TP_ROW, dim=1)  # W[out_j, :] = A_*j^T
    y = F.linear(x_row, w_col)
    if bias is not None:
        if replicated_over is not None:
            bias = copy_to(bias, comm, replicated_over)
        y = y + all_gather(bias, comm, TP_ROW, dim=0)
    return y


def summa_placements(mode: str = "2d") -> dict[str, Placement]:
    """Where a SUMMA layer's weight W [out, in], bias, input and output live (2D; 2.5D: the same in every depth
    layer, the activations' batch cut over depth too)."""
    return {
        "weight": [(0, (TP_COL,)), (1, (TP_ROW,))],  # W[out_j, in_i] = A_ij^T
        "bias": [(0, (TP_COL, TP_ROW))],
        "input": ACTIVATION_PLACEMENT[mode],
        "output": ACTIVATION_PLACEMENT[mode],
    }


class Linear2D(GridLinear):
    """nn.Linear as SUMMA on the q x q (tp_row x tp_col) grid: input, weight and output in q x q blocks."""

    MODES = ("2d",)
    NAME = "2D SUMMA"

    def weight_placement(self) -> Placement:
        return summa_placements(self.MODES[0])["weight"]

    def bias_placement(self) -> Placement:
        return summa_placements(self.MODES[0])["bias"]

    def input_placement(self) -> Placement:
        return summa_placements(self.MODES[0])["input"]

    def output_placement(self) -> Placement:
        return summa_placements(self.MODES[0])["output"]

    def multiply(self, x: Tensor) -> Tensor:
        return summa_linear(x, self.weight, self.bias, self.comm, entered=self.entered)


class MLP2D(GridMLP):
    """Linear2D -> GELU -> Linear2D: an MLP whose input and output are in SUMMA's q x q blocks."""

    @classmethod
    def from_linears(cls, up: nn.Linear, down: nn.Linear, comm: Comm, activation: nn.Module | None = None) -> MLP2D:
        return cls(Linear2D.from_linear(up, comm, "up"), Linear2D.from_linear(down, comm, "down"), activation)


__all__ = ["Linear2D", "MLP2D", "summa_linear", "summa_placements"]
