"""Mixture-of-Experts in the cost model: what expert parallelism splits, what its token exchange costs on the
hardware's links, and what an MoE block keeps a device busy for.

**Parameters.** ``ModelSpec`` counts an MoE block's parameters (``plait.models.spec``): attention, norms, router
(h E), shared experts and E routed experts of p_e = (2|3) h f parameters each. Expert parallelism splits only the
routed experts: a rank of ``Layout(ep=P)`` holds E / P of them in every MoE block (and, where the implementation
splits experts over tp too, ``Implementation.expert_tp``, / t of that), while everything else is split by tp and
pipeline stage as in a dense model. The routed experts' model states are sharded over edp = dp x cp / P (the data
ranks that hold the same experts), the rest over dp x cp (``routed_layout``).

**FLOPs.** A token goes through attention, the router and its k routed experts (plus the shared ones):
``ModelSpec.block_matmul_parameters``. Routing is assumed uniform (every expert gets n k / E of n tokens' k
choices; Megatron-Core's benchmarks force it, ``--moe-router-force-load-balancing``), so a rank's experts compute
n k rows per micro-batch whatever P is. plait keeps the router and the routed experts whole on every tp rank:
without sequence parallelism each tp rank routes and computes every token (the expert FLOPs are not divided by t);
with it each routes its own n / t (``routed_split``).

**The token exchange** (docs/expert_parallel.md): per MoE block and micro-batch a rank sends each of its
S = n_r k h e bytes of routed rows (n_r its routed tokens, e bytes an element) to the rank holding the chosen
expert and gets them back: two all-to-alls forward (dispatch, combine), two backward, and, under full or
per-operator recomputation, the forward two again; plus a count exchange of the P x E / P split sizes (int64)
each forward. An all-to-all over P ranks (``all_to_all_time``) keeps S / P and sends S / P to each peer. In plait's
rank order (pp, dp, cp, tp innermost) an ep group is P consecutive data ranks, stride tp (``exchange_group``;
Megatron-Core's parallel folding lays them out over the tp ranks too: ep x tp consecutive ranks, each with its own
sequence-parallel share of the tokens). Its bytes to peers in the same node ride the node's links, those to other nodes the device's own NIC,
those beyond a leaf switch its share of the spine, all at once:

    t = (P - 1) alpha + max over levels L of  S (P - m_L) / P / (B_L x efficiency)

with m_L the group's ranks inside one domain of the level below L (for the innermost level, the node's own links,
P - m_L is replaced by the rank's other peers in its node), B_L the level's per-device bandwidth over its
oversubscription, and alpha the latency of the outermost level the group crosses (``costs.group_link``'s rule).
On a DGX H100 (450 GB/s NVLink per direction, 50 GB/s per NIC), P = 8 in a node: 7/8 S over NVLink; P = 16 over
two nodes: 7/16 S over NVLink and 8/16 S through the NIC at the same time, the NIC the bound.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from plait.layout import Layout
from plait.models.spec import ModelSpec
from plait.planner.costs import (
    BlockTime,
    Implementation,
    act_bytes,
    axis_span,
    block_time,
    collective_time,
    peak_rate,
    recompute_mode,
)
from plait.planner.hardware import Hardware

COUNT_BYTES = 8
"""One split size of the count exchange (int64)."""


# ---------------------------------------------------------------------- parameters
def routed_parameters(spec: ModelSpec) -> int:
    """Parameters of one MoE block's routed experts (what expert parallelism splits; 0 for a dense block)."""
    return spec.experts * spec.expert_parameters


def block_parameters(spec: ModelSpec, index: int) -> tuple[int, int]:
    """(parameters outside the routed experts, routed expert parameters) of block ``index``."""
    if not spec.is_moe_block(index):
        return spec.block_parameters, 0
    routed = routed_parameters(spec)
    return spec.moe_block_parameters - routed, routed


def stage_parameters(spec: ModelSpec, blocks: Iterable[int], first: bool, last: bool) -> tuple[int, int]:
    """(dense, routed expert) parameters of a stage holding ``blocks`` (and the embeddings on the ``first``, the
    final norm and head on the ``last``), before any split."""
    dense = routed = 0
    for index in blocks:
        d, r = block_parameters(spec, index)
        dense, routed = dense + d, routed + r
    dense += (spec.embedding_parameters if first else 0) + (spec.head_parameters if last else 0)
    return dense, routed


def expert_split(layout: Layout, impl: Implementation) -> int:
    """How many ways a rank's routed experts are split: ep, and tp where the implementation splits experts over it
    too (``Implementation.expert_tp``, or folds them over the tp ranks: ``fold_experts``)."""
    return layout.ep * (layout.tp if (impl.expert_tp or impl.fold_experts) else 1)


def routed_layout(layout: Layout) -> Layout:
    """The layout whose data ranks are ``edp`` = dp x cp / ep: what the routed experts' states are sharded over
    (``stage_memory.model_state_bytes`` and ``memory._states`` read dp x cp, the ZeRO stage and offload)."""
    if layout.ep == 1:
        return layout
    return dataclasses.replace(layout, dp=layout.dp * layout.cp // layout.ep, cp=1, ep=1, pipeline_cuts=())


# ---------------------------------------------------------------------- the token exchange
def routed_split(layout: Layout, impl: Implementation) -> int:
    """How many ways a tp group splits the routed tokens: t under sequence parallelism (each rank routes its own
    chunk) or where the implementation splits or folds experts over tp, else 1 (plait: each tp rank routes every
    token)."""
    return layout.tp if (layout.sequence_parallel or impl.expert_tp or impl.fold_experts) else 1


def exchange_bytes(spec: ModelSpec, layout: Layout, impl: Implementation, micro_batch: int, seq: int) -> float:
    """S: the bytes of routed rows one rank holds per MoE block and micro-batch (one all-to-all's buffer):
    n_r k h e with n_r = b (s / cp) / ``routed_split``."""
    tokens = micro_batch * (seq // layout.cp) / routed_split(layout, impl)
    return tokens * spec.top_k * spec.hidden * act_bytes(layout.precision)


def exchange_group(layout: Layout, impl: Implementation) -> tuple[int, int]:
    """(ranks, stride) of the group a token exchange runs in: plait's ep data ranks, tp apart (module docstring);
    Megatron-Core's folded ep x tp consecutive ranks (``Implementation.fold_experts``)."""
    if impl.fold_experts:
        return layout.ep * layout.tp, 1
    return layout.ep, layout.tp


def all_to_all_time(hw: Hardware, nbytes: float, n: int, stride: int, comm_efficiency: float) -> float:
    """Seconds of an all-to-all of ``nbytes`` per rank over ``n`` ranks ``stride`` apart (module docstring). A
    calibrated machine's measured all-to-all fit replaces the link model inside a node, as in
    ``costs.collective_time``."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    span = n * stride
    if "all_to_all" in hw.measured and span <= hw.devices_per_node:
        return collective_time(hw, "all_to_all", nbytes, n, span, comm_efficiency)
    top = hw.level(span)
    levels = hw.network()
    slowest, below = 0.0, 0
    for level in levels:
        members = n if level.devices == 0 else min(n, max(1, level.devices // stride))  # in one of its domains
        if level is levels[0]:  # the node's own links: the bytes to its other ranks in the node
            crossing = nbytes * (members - 1) / n
        else:  # this level's uplinks: the bytes to ranks outside the domain of the level below
            crossing = nbytes * (n - below) / n
        slowest = max(slowest, crossing / (level.effective_bandwidth * comm_efficiency))
        if level is top:
            break
        below = members
    return (n - 1) * top.latency + slowest


def exchange_time(
    spec: ModelSpec, hw: Hardware, impl: Implementation, layout: Layout, micro_batch: int, seq: int
) -> tuple[float, float]:
    """(forward, backward) seconds of one MoE block's token exchange for one micro-batch: forward the count
    exchange and two all-to-alls of S, backward two."""
    ranks, stride = exchange_group(layout, impl)
    if ranks == 1:
        return 0.0, 0.0
    eff = impl.comm_efficiency
    one = all_to_all_time(hw, exchange_bytes(spec, layout, impl, micro_batch, seq), ranks, stride, eff)
    counts = all_to_all_time(hw, COUNT_BYTES * spec.experts, ranks, stride, eff)
    return 2 * one + counts, 2 * one


# ---------------------------------------------------------------------- one MoE block
def moe_traffic(spec: ModelSpec, layout: Layout, impl: Implementation, micro_batch: int, seq: int, e: int) -> float:
    """HBM bytes the memory-bound work of one MoE block's forward moves on one device beyond its attention half
    (``costs.block_traffic`` with the MLP replaced): the experts' activation functions over the routed rows
    ((2|3) f e per row), the permutation (each row read and written, 2 h e), the weighted combine in fp32 (12 h per
    row), the router's fp32 scores (8 E per token) and the shared experts as a dense MLP."""
    tokens = micro_batch * (seq // layout.cp)
    rows = tokens * spec.top_k / routed_split(layout, impl)
    f = spec.expert_ffn or spec.ffn
    gate = 3 if spec.gated else 2
    routed = rows * (gate * f * e + 2 * spec.hidden * e + 12 * spec.hidden)
    router = tokens / routed_split(layout, impl) * 8 * spec.experts
    shared = tokens * gate * spec.shared_experts * f * e / layout.tp
    return routed + router + shared


def moe_block_time(
    spec: ModelSpec, hw: Hardware, impl: Implementation, layout: Layout, micro_batch: int, seq: int
) -> BlockTime:
    """An MoE block's ``BlockTime``: the dense block's attention half (``costs.block_time``), its MLP's FLOPs and
    traffic replaced by the router's, the routed experts' (/ ``routed_split``) and the shared experts' (/ t), the
    tp collectives of attention (and of the shared experts' MLP), and the token exchange (``exchange_time``) in the
    comm fields and in ``ep``. Recomputation "full" / "op" runs the forward exchange again."""
    dense = block_time(spec, hw, impl, layout, micro_batch, seq)
    t, e = layout.tp, act_bytes(layout.precision)
    tokens = micro_batch * (seq // layout.cp)
    peak = peak_rate(hw, impl, layout.precision)
    bandwidth = hw.memory_bandwidth * impl.memory_efficiency
    gate = 3 if spec.gated else 2
    mlp_flops = 2 * tokens * gate * spec.hidden * spec.ffn / t
    mlp_traffic = tokens * gate * spec.ffn * e / t
    split = routed_split(layout, impl)
    routed_flops = 2 * tokens / split * (spec.hidden * spec.experts + spec.top_k * spec.expert_parameters)
    shared_flops = 2 * tokens * spec.shared_experts * spec.expert_parameters / t
    delta = (routed_flops + shared_flops - mlp_flops) / peak
    delta += (moe_traffic(spec, layout, impl, micro_batch, seq, e) - mlp_traffic) / bandwidth
    forward = dense.forward + delta
    tp_one = dense.tp / 2  # one of the dense block's two tp collectives per pass
    tp = tp_one * (1 + (1 if spec.shared_experts else 0))
    ep_fwd, ep_bwd = exchange_time(spec, hw, impl, layout, micro_batch, seq)
    if impl.overlap_ep:  # hidden behind another micro-batch's compute as far as the block's own compute lasts
        ep_fwd, ep_bwd = max(0.0, ep_fwd - forward), max(0.0, ep_bwd - 2 * forward)
    mode = recompute_mode(layout)
    recompute, recompute_comm = dense.recompute, dense.recompute_comm
    if mode in ("full", "blocks"):
        recompute, recompute_comm = forward, dense.recompute_comm - dense.tp + tp + ep_fwd
    elif mode == "op":
        recompute, recompute_comm = dense.recompute + delta / 2, dense.recompute_comm + ep_fwd
    return BlockTime(
        forward=forward,
        backward=2 * forward,
        recompute=recompute,
        forward_comm=dense.forward_comm - dense.tp + tp + ep_fwd,
        backward_comm=dense.backward_comm - dense.tp + tp + ep_bwd,
        recompute_comm=recompute_comm,
        flops=dense.flops - mlp_flops + routed_flops + shared_flops,
        tp=tp,
        ep=ep_fwd + ep_bwd,
        ep_recompute=ep_fwd if mode in ("full", "blocks", "op") else 0.0,
    )


def block_times(
    spec: ModelSpec, hw: Hardware, impl: Implementation, layout: Layout, micro_batch: int, seq: int
) -> tuple[BlockTime, BlockTime]:
    """(a dense block's ``BlockTime``, an MoE block's); the same object twice for a dense model."""
    dense = block_time(spec, hw, impl, layout, micro_batch, seq)
    if not spec.experts:
        return dense, dense
    return dense, moe_block_time(spec, hw, impl, layout, micro_batch, seq)


def gradient_groups(layout: Layout) -> tuple[tuple[int, int], tuple[int, int]]:
    """((ranks, span) of the dense parameters' data-parallel group dp x cp, (ranks, span) of the routed experts'
    edp group): the spans in consecutive ranks of plait's order (an edp group is every ep-th data rank). Under
    HSDP with ZeRO (``Layout.dp_replicate`` = R) the groups ZeRO works in are one replica group's: dp x cp / R
    consecutive data ranks (and every ep-th of them); ``replica_group`` links the R groups."""
    replicas = replica_group(layout)[0]
    data = layout.dp * layout.cp // replicas
    span = axis_span(layout, "dp_cp") // replicas
    return (data, span), (data // layout.ep, span)


def replica_group(layout: Layout) -> tuple[int, int]:
    """(ranks, span) of HSDP's ``replicate`` group, over which each rank's reduced gradient shard is all-reduced:
    R ranks, one per replica group, spanning every data rank (the outermost fold of dp: across nodes once a
    replica group fills one). (1, 1) without HSDP, or with zero=0 (one all-reduce over dp x cp)."""
    if layout.dp_replicate == 1 or layout.zero == 0:
        return 1, 1
    return layout.dp_replicate, axis_span(layout, "dp_cp")


def check_experts(spec: ModelSpec, layout: Layout, impl: Implementation | None = None) -> str | None:
    """Why ``layout``'s ep cannot split ``spec``'s experts under ``impl`` (None when it can): the message of a
    LayoutError."""
    if impl is not None and impl.fold_experts and spec.experts and spec.experts % expert_split(layout, impl):
        return (
            f"ep={layout.ep} x tp={layout.tp} (experts folded over the tp ranks) does not divide the {spec.experts} "
            f"experts of {spec.name}. Fix: an ep x tp dividing {spec.experts}."
        )
    if layout.ep == 1:
        return None
    if not spec.experts:
        return (
            f"ep={layout.ep} splits the experts of Mixture-of-Experts layers, but {spec.name} has none. Fix: ep=1, or "
            f"a model with experts."
        )
    if spec.experts % layout.ep:
        near = max(d for d in range(1, layout.ep + 1) if spec.experts % d == 0 and (layout.dp * layout.cp) % d == 0)
        return (
            f"ep={layout.ep} does not divide the {spec.experts} experts of {spec.name}: each ep rank holds the same "
            f"number of whole experts. Fix: an ep dividing {spec.experts} (e.g. ep={near})."
        )
    return None


def ep_options(spec: ModelSpec, data_ranks: int) -> list[int]:
    """The expert-parallel degrees ``plan()`` tries for ``data_ranks`` = dp x cp: 1 and every power of two
    dividing both the experts and the data ranks (1 only for a dense model)."""
    if not spec.experts:
        return [1]
    limit = math.gcd(spec.experts, data_ranks)
    options, p = [], 1
    while p <= limit:
        if limit % p == 0:
            options.append(p)
        p *= 2
    return options


__all__ = [
    "COUNT_BYTES",
    "all_to_all_time",
    "block_parameters",
    "block_times",
    "check_experts",
    "ep_options",
    "exchange_group",
    "exchange_bytes",
    "exchange_time",
    "expert_split",
    "gradient_groups",
    "replica_group",
    "moe_block_time",
    "moe_traffic",
    "routed_layout",
    "routed_parameters",
    "routed_split",
    "stage_parameters",
]
