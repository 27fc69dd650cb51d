"""The Engine's side of Mixture-of-Experts training: the balance loss's gradient scale set before each step, and
the routing statistics of the step summed over every rank (and the aux-free bias moved) after it.

**The balance loss's weight.** Each MoE layer adds its balance loss summed over its sequences, S_aux, with the
gradient ``aux_grad_scale`` (``plait.models.moe``). One device trains on CE + (1/B) sum_layers S_aux for B
sequences in the global batch. Data parallelism averages gradients over the G = dp x cp ranks, so each rank
backpropagates its share with G / B (times the fp16 loss scale, as the loss itself): the average over G of
G S_aux,r / B is sum_r S_aux,r / B. A cp (or sequence-parallel tp) rank's S_aux is its share of the sequence's
L_seq (linear given the whole sequence's counts), so the sum over those ranks is the sequence's L_seq.

**Statistics.** Per MoE layer (``ExpertPlan.layers``, rows of one [layers, 2E + 1] tensor: routed tokens per
expert, dropped per expert, balance-loss sum), each rank's rows are summed over the axes whose ranks see
different tokens or hold different layers: ``dp_cp`` (data, context and the ep ranks within them), ``pp`` (each
stage fills its own layers' rows) and ``tp`` under sequence parallelism (each tp rank routes its sequence chunk);
tp ranks without it route the same tokens and are not summed. One all-reduce per such axis and step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from plait.comm import Comm
from plait.models.moe import MoE
from plait.parallel.expert.plan import ExpertPlan

GRAD_AXIS = "dp_cp"


@dataclass
class MoEStepStats:
    """What the MoE layers did in one step, summed over every rank (the same on every rank). Tensors stay on the
    device until read (``StepStats``' lazy reading)."""

    layers: tuple[int, ...]
    """The block index of each row."""
    load_tensor: Tensor
    """[layers, E]: tokens routed to each expert (each token counts once per chosen expert; before drops)."""
    dropped_tensor: Tensor
    """[layers, E]: choices dropped by the capacity cap."""
    aux_loss_tensor: Tensor
    """0-dim: the balance loss of the step, summed over layers (the mean over the global batch's sequences)."""

    @property
    def load(self) -> list[list[int]]:
        return [[int(v) for v in row] for row in self.load_tensor.tolist()]

    @property
    def dropped(self) -> list[int]:
        """Dropped choices per layer."""
        return [int(v) for v in self.dropped_tensor.sum(dim=1).tolist()]

    @property
    def aux_loss(self) -> float:
        return float(self.aux_loss_tensor)

    @property
    def imbalance(self) -> list[float]:
        """Per layer, the most-loaded expert's tokens over the mean (1.0: perfectly balanced)."""
        load = self.load_tensor.double()
        return (load.max(dim=1).values / load.mean(dim=1).clamp_min(1e-12)).tolist()

    @property
    def dropped_fraction(self) -> float:
        """Dropped choices over routed choices, all layers together."""
        routed = float(self.load_tensor.sum())
        return float(self.dropped_tensor.sum()) / routed if routed else 0.0


class RouterStats:
    """Per step: ``begin`` sets every local MoE layer's balance-loss gradient scale, ``end`` gathers the statistics
    (module docstring) and moves the aux-free biases: ``gather`` then ``finish``, which per-step fault tolerance
    calls apart, to sum the table over the replica groups in between (``plait.ft.experts``)."""

    def __init__(self, plan: ExpertPlan, layers: Sequence[MoE], comm: Comm, sequence_parallel: bool) -> None:
        self.plan, self.comm = plan, comm
        self.rows = {layer: row for row, layer in enumerate(plan.layers)}
        self.local = list(layers)
        self.axes = [GRAD_AXIS] + [a for a in ("pp",) if comm.size(a) > 1] + (["tp"] if sequence_parallel else [])

    def begin(self, sequences: int, loss_scale: float | None, weight: float = 1.0) -> None:
        """Before the step's forwards: the global batch has ``sequences`` sequences. Each local layer's balance-loss
        gradient becomes G x ``weight`` / ``sequences`` (x the fp16 loss scale): the objective's d/d(S_aux) of one
        sequence, G times over for the average over the G data ranks (module docstring). Per-step fault tolerance
        passes the quorum's sequences and a weight of its own (``plait.ft.experts``)."""
        scale = self.comm.size(GRAD_AXIS) * weight / sequences * (loss_scale or 1.0)
        for layer in self.local:
            layer.aux_grad_scale = scale

    def gather(self) -> Tensor:
        """The step's [layers, 2E + 1] statistics table summed over every rank of this layout (every rank:
        collectives); each layer's counts are taken (reset) here."""
        experts = self.plan.experts
        table = torch.zeros(len(self.rows), 2 * experts + 1, dtype=torch.float64, device=self.comm.device)
        for layer in self.local:
            stats = layer.take_statistics()
            if stats is not None:
                table[self.rows[layer.layer]] = stats.to(table.device)
        for axis in self.axes:
            self.comm.all_reduce(table, axis)
        return table

    def finish(self, table: Tensor, sequences: int, update_biases: bool) -> MoEStepStats:
        """The step's statistics from a ``gather``ed table (of this layout, or summed over several: ``plait.ft``)
        of ``sequences`` sequences; moves the aux-free biases by its loads unless ``update_biases`` is False."""
        experts = self.plan.experts
        load = table[:, :experts]
        if update_biases:
            for layer in self.local:
                layer.update_bias(load[self.rows[layer.layer]])
        return MoEStepStats(
            self.plan.layers, load, table[:, experts : 2 * experts], table[:, 2 * experts].sum() / sequences
        )

    def end(self, sequences: int, update_biases: bool) -> MoEStepStats:
        """After the step (every rank: collectives). ``update_biases``: False for a step fp16 skipped."""
        return self.finish(self.gather(), sequences, update_biases)


__all__ = ["MoEStepStats", "RouterStats"]
