"""Expert parallelism's token exchange: each routed row to the rank holding its expert and back (``MoE.dispatch``),
and the sum of per-sequence routing counts over ranks that split a sequence (``MoE.sequence_sum``).

With P ranks in the ``ep`` group and L = E / P experts each (rank r holds experts [r L, (r+1) L)), a rank whose
routed rows are sorted by expert (``counts[e]`` rows for expert e, as ``plait.models.moe.MoE`` hands them over)
sends rank j the contiguous rows of j's experts:

1. counts: an all-to-all of the [P, L] count matrix (P L int64 per rank): ``recv[s, l]`` = rows source s sends
   for my local expert l. Read on the host once (the split sizes of the next two exchanges).
2. dispatch: an uneven all-to-all (``Comm.all_to_all_v``) of the rows; they arrive source-major ([s0: l0 .. l_L-1],
   [s1: ...]) and are regrouped expert-major ([l0: s0 .. s_P-1], ...) for ``GroupedExperts``.
3. combine: the outputs regrouped source-major and sent back by the reverse uneven all-to-all, so each rank gets
   its rows' outputs in the order it sent them (the MoE then weighs and adds them per token).

Overlap (DeepSeek-V3, sec. 3.2.2, the shared expert computed while the routed tokens travel): the dispatch exchange
of step 2 is issued asynchronously and the caller's ``in_flight`` work runs before it is waited for; ``MoE`` passes
its shared experts' MLP there, so on a rank whose peers are slower to send, that time is computed, not waited.

Within DualPipeV's overlapped pair (``plait.parallel.pipeline.overlap``) the runtime sets ``Comm.overlap``: the
dispatch and the combine, forward and backward, are then all issued asynchronously and the pair's other chunk
computes until its own next exchange before they are waited for.

Backward runs the same exchanges in reverse (``plait.comm.all_to_all_v``'s autograd). Under mixed precision the
rows travel in the compute dtype (the experts' matmuls would cast them to it anyway: the same values, half the
bytes of the fp32 residual stream). Per MoE layer and micro-batch a rank sends, in wire bytes: 8 (P-1) L for the
counts, and 2 x (rows it sends to other ranks + rows other ranks sent it) x d x bytes per element over forward
and backward (docs/expert_parallel.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from plait.comm import Comm, all_to_all_v
from plait.models.moe import ExpertGroup

AXIS = "ep"


def _regroup(rows: Tensor, sizes: list[list[int]], by_expert: bool) -> Tensor:
    """Reorder blocks of ``rows``: ``sizes[s][l]`` rows of (source s, local expert l); source-major -> expert-major
    (``by_expert``) or back."""
    sources, experts = len(sizes), len(sizes[0])
    if by_expert:
        pieces = rows.split([sizes[s][e] for s in range(sources) for e in range(experts)])
        return torch.cat([pieces[s * experts + e] for e in range(experts) for s in range(sources)])
    pieces = rows.split([sizes[s][e] for e in range(experts) for s in range(sources)])
    return torch.cat([pieces[e * sources + s] for s in range(sources) for e in range(experts)])


class ExpertParallelDispatch:
    """``MoE.dispatch`` over the ``ep`` axis of ``comm`` (module docstring)."""

    def __init__(self, comm: Comm, axis: str = AXIS) -> None:
        self.comm, self.axis = comm, axis

    def __call__(
        self, x_perm: Tensor, counts: Tensor, experts: ExpertGroup, in_flight: Callable[[], None] | None = None
    ) -> Tensor:
        """The rows to their experts' ranks and back; ``in_flight`` (``MoE``'s shared experts) runs while the
        rows travel to the experts (the exchange issued asynchronously through ``plait.comm``)."""
        ranks, local = self.comm.size(self.axis), experts.local_experts
        send_counts = counts.to(torch.int64).reshape(ranks * local)
        received = self.comm.all_to_all(send_counts.contiguous(), self.axis, scatter_dim=0, gather_dim=0)
        host = torch.cat([send_counts, received]).tolist()  # the one host sync: split sizes
        sent_rows, recv_rows = host[: ranks * local], host[ranks * local :]
        recv = [recv_rows[s * local : (s + 1) * local] for s in range(ranks)]
        send_splits = [sum(sent_rows[j * local : (j + 1) * local]) for j in range(ranks)]
        recv_splits = [sum(row) for row in recv]
        if torch.is_autocast_enabled(x_perm.device.type):  # what the experts' matmuls cast the rows to anyway
            x_perm = x_perm.to(torch.get_autocast_dtype(x_perm.device.type))
        overlap = self.comm.overlap  # set while an overlapped pipeline pair runs: its other chunk's turn
        arrived = all_to_all_v(x_perm, self.comm, self.axis, send_splits, recv_splits, _both(in_flight, overlap))
        grouped = _regroup(arrived, recv, by_expert=True)
        per_expert = [sum(recv[s][e] for s in range(ranks)) for e in range(local)]
        outputs = _regroup(experts(grouped, per_expert), recv, by_expert=False)
        return all_to_all_v(outputs, self.comm, self.axis, recv_splits, send_splits, overlap)


def _both(first: Callable[[], None] | None, then: Callable[[], None] | None) -> Callable[[], None] | None:
    """One callable running ``first`` then ``then`` (either may be None)."""
    if first is None or then is None:
        return first or then

    def run() -> None:
        first()
        then()

    return run


class SequenceSum:
    """``MoE.sequence_sum``: per-sequence counts summed over the axes that split a sequence (cp; tp under sequence
    parallelism). Counts only: no gradient flows through it (the balance loss is linear in the scores given them)."""

    def __init__(self, comm: Comm, axes: Sequence[str]) -> None:
        self.comm, self.axes = comm, tuple(axes)

    def __call__(self, stats: Tensor) -> Tensor:
        total = stats.detach().clone()
        for axis in self.axes:
            self.comm.all_reduce(total, axis)
        return total


__all__ = ["AXIS", "ExpertParallelDispatch", "SequenceSum"]
