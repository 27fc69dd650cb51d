"""2.5D tensor parallelism: Tesseract on a q x q x d grid (Wang et al. 2021, "2.5-dimensional distributed model
training").

The batch is cut into d*q blocks: depth layer l (``tp_dep``) takes blocks l*q .. l*q + q-1, and inside each depth
layer the q x q ranks run 2D SUMMA on them (``plait.parallel.tensor.linear2d``): row i of layer l holds batch
block l*q + i, column j feature block j. The weights are the same q x q blocks in every depth layer (replicated
d times), so the gradient of a weight block is the sum over depth of each layer's partial: one all-reduce over
``tp_dep`` (``copy_to``'s backward). Per rank: weights in*out/q^2 = d/tp of the layer, activations b*h/(d q^2)
= 1/tp; wire bytes per layer (fwd + bwd) 2 (q-1)/q x (b*in/(d q) + in*out/q + out/q) + 2 (d-1)/d x
(in*out + out)/q^2 elements. More depth trades weight memory for less activation traffic than 2D on tp ranks.
"""

from __future__ import annotations

from torch import Tensor, nn

from plait.comm import Comm
from plait.parallel.tensor.grid import TP_DEP, GridMLP
from plait.parallel.tensor.linear2d import Linear2D, summa_linear


class Linear2p5D(Linear2D):
    """nn.Linear as Tesseract: the batch split over depth, a SUMMA per depth layer, weights replicated over depth
    (placed as 2D's, ``summa_placements("2.5d")``)."""

    MODES = ("2.5d",)
    NAME = "2.5D Tesseract"

    def multiply(self, x: Tensor) -> Tensor:
        return summa_linear(x, self.weight, self.bias, self.comm, replicated_over=TP_DEP, entered=self.entered)


class MLP2p5D(GridMLP):
    """Linear2p5D -> GELU -> Linear2p5D."""

    @classmethod
    def from_linears(cls, up: nn.Linear, down: nn.Linear, comm: Comm, activation: nn.Module | None = None) -> MLP2p5D:
        return cls(Linear2p5D.from_linear(up, comm, "up"), Linear2p5D.from_linear(down, comm, "down"), activation)


__all__ = ["Linear2p5D", "MLP2p5D"]
