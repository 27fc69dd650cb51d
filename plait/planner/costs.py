"""Time primitives of the cost model: FLOPs of a transformer block, its compute time, and collectives.

FLOPs are the model description's (``plait.models.spec``, re-exported here as ``block_flops`` and
``logits_flops``): Narayanan et al. 2021, eq. 3, a block's forward 2 b s [h (h + 2 k d) + h^2 + (2|3) h f] +
4 b s_q s_k h, the logits 2 b s h V, a backward pass twice the forward; recomputation adds forward FLOPs (full: every
block's forward; selective: the attention core's 4 b s^2 h; Chowdhery et al. 2022, app. B: model FLOPs exclude
it, hardware FLOPs include it).

Compute time is a roofline sum (Williams et al. 2009): matmul FLOPs / (peak x compute efficiency, the fitted
fraction of the GPU generation, ``Hardware.compute_efficiency``, times the implementation's) plus the
bytes that memory-bound operators (norms, residual adds, dropout, activation functions, softmax) move through
HBM / (bandwidth x memory efficiency), plus a fixed per-block cost where the hardware has one
(``Hardware.block_overhead``, CPU ranks: a third forward, two thirds backward). Those bytes follow the operators Korthikanti et al. 2022 (sec. 4.1)
count for activation memory: per token ~15 h replicated across tp (norms, residual adds, dropouts), (2|3) f
split across tp (activation), and, without fused flash attention, 4.5 a s elements of softmax and its dropout.

Communication is the alpha-beta model (Hockney 1994) of bandwidth-optimal algorithms (Thakur, Rabenseifner and
Gropp 2005; Chan et al. 2007): for N ranks and S bytes, ring all-reduce 2(N-1) alpha + 2 (N-1)/N S / beta, tree
all-reduce 2 log2(N) alpha + 2 S / beta (the smaller is taken), all-gather and reduce-scatter (N-1) alpha +
(N-1)/N S / beta, all-to-all (N-1) alpha + (N-1)/N S / beta, broadcast log2(N) alpha + S / beta, p2p alpha +
S / beta. A group of an axis of stride st and size n (ranks are ordered pp, dp, cp, tp with tp innermost) spans
st x n consecutive ranks; alpha is that of the innermost network level that joins that many devices
(``Hardware.level``: NVLink within a node, the network beyond, or a custom cluster's levels with their
oversubscription), beta the narrowest level the group crosses, where a ring collective's crossing traffic is
spread over the NICs of all the group's ranks in a node (``group_link``: k ranks per node, k x a NIC). A
calibrated machine replaces the link model by its measured per-collective fit, taken at ``measured_ranks`` ranks and carried to n ranks by the same formulas' factors (alpha x steps(n) /
steps(n0), beta x fraction(n) / fraction(n0)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from plait.layout import AXES, CpMode, Layout
from plait.models.spec import ModelSpec, block_flops, logits_flops
from plait.planner.hardware import Hardware

MEMORY_EFFICIENCY = 0.8
"""Achievable / datasheet HBM bandwidth for streaming kernels (a prior, not fitted: STREAM-like copies reach 80-90%)."""
COMM_EFFICIENCY = 0.8
"""Achievable / link bandwidth of NCCL collectives (a prior, not fitted: nccl-tests bus bandwidth vs links)."""
ADAM_BYTES_PER_PARAM = 30
"""HBM bytes an Adam step moves per parameter: reads fp32 param, grad, m, v (16); writes param, m, v (12); a
2-byte low-precision copy (2)."""


@dataclass(frozen=True)
class Implementation:
    """How the training system runs, where it changes time or memory (a description of the system, not a fit).

    Attributes:
        name: preset name.
        overlap_dp: data-parallel gradient reduction overlaps the last micro-batch's backward (bucketed, as plait's
            DDP and ZeRO do) and ZeRO-3 prefetches its gathers behind compute; False: they run exposed
            (Megatron-LM 2021's local DDP; CPU ranks, whose collectives take the processors compute needs).
        overlap_cp: ring attention hides its K/V exchange behind the attention compute (Liu et al. 2023).
        flash_attention: attention scores are never stored (Dao et al. 2022): no s^2 memory or traffic.
        scatter_gather: pipeline sends b s h / tp per boundary instead of b s h (Narayanan et al. 2021, sec. 4.1).
        overlap_p2p: pipeline sends and receives run beside compute (asynchronous p2p); False: a stage waits for
            its own sends (blocking p2p: DeepSpeed's pipeline engine, Megatron-LM 2021), so each chunk's forward
            and backward also pay the transfer of their output.
        zero3_reuse_limit: ZeRO-3 keeps a gathered block between the recomputation and the backward pass only when
            it has at most this many parameters (DeepSpeed's stage3_max_reuse_distance, 1e9 by default); a larger
            block is gathered once more for its backward.
        zero3_live_limit: ZeRO-3 gathers parameters module by module and keeps at most this many gathered at once
            (DeepSpeed's stage3_max_live_parameters, 1e9 by default; a single larger matrix is still gathered
            whole); inf: a whole block is gathered with the next one prefetched (plait, FSDP).
        grad_bytes: bytes per gradient element reduced across data parallel ranks.
        state_accounting: "zero-paper" (2 + 2 + 12 bytes per parameter; plait.planner.memory.zero_paper_bytes) or
            "plait" (fp32 parameters and gradients; plait.planner.memory.estimate_memory).
        compute_efficiency: a factor on the hardware's fitted compute efficiency (1.0: none; the fitted value
            belongs to the GPU generation, ``Hardware.compute_efficiency``).
        memory_efficiency, comm_efficiency: see the module constants.
        reserved_bytes: memory the framework and allocator keep (CUDA context, fragmentation).
        rail_collectives: ring collectives (all-reduce, all-gather, reduce-scatter) that cross nodes spread their
            traffic over the NICs of all the group's ranks in a node (NCCL's channels, one per NIC:
            ``group_link``); False: each rank's own link carries it.
        expert_tp: Mixture-of-Experts layers split each routed expert over tp too (Megatron-Core's expert tensor
            parallelism with ETP = TP); False: the routed experts are whole on every tp rank (plait; ETP = 1).
        fold_experts: Megatron-Core's "parallel folding" with ETP = 1 (Liu et al. 2025): the experts are split over
            ep x tp consecutive ranks (the layout's ep data ranks and their tp ranks), each exchanging its own
            sequence-parallel share of the tokens; False: over ep data ranks, tp apart, each tp rank routing every
            token without sequence parallelism (plait's mesh, ``plait.planner.experts.exchange_group``).
        overlap_ep: the token exchange runs beside another micro-batch's compute (Megatron-Core's batch-level
            overlap, ``--overlap-moe-expert-parallel-comm``): only what exceeds the block's own compute is exposed.
        family: whose compute efficiency this is (``hardware.EFFICIENCY_FITTED_ON``): an efficiency belongs to an
            implementation on a hardware generation, fitted on that implementation's own published runs.
    """

    name: str = "plait"
    overlap_dp: bool = True
    overlap_cp: bool = True
    flash_attention: bool = True
    scatter_gather: bool = True
    overlap_p2p: bool = True
    zero3_reuse_limit: float = math.inf
    zero3_live_limit: float = math.inf
    grad_bytes: int = 2
    state_accounting: str = "zero-paper"
    compute_efficiency: float = 1.0
    memory_efficiency: float = MEMORY_EFFICIENCY
    comm_efficiency: float = COMM_EFFICIENCY
    reserved_bytes: float = 2 * 2**30
    rail_collectives: bool = True
    expert_tp: bool = False
    fold_experts: bool = False
    overlap_ep: bool = False
    family: str = "plait"
    extra: dict[str, float] = field(default_factory=dict)


IMPLEMENTATIONS: dict[str, Implementation] = {
    "plait": Implementation(),
    # the systems of the published runs the model is checked against (plait/planner/published.py): what they did,
    # from their papers and code, not fitted
    # Megatron-LM 2021-22 (Narayanan et al. 2021, Korthikanti et al. 2022): local DDP reduces gradients after the
    # backward pass; fused softmax, no flash attention; pipeline scatter/gather
    "megatron-2021": Implementation(
        name="megatron-2021", overlap_dp=False, flash_attention=False, overlap_p2p=False, family="megatron"
    ),
    # Megatron-DeepSpeed (MT-NLG, BLOOM): DeepSpeed's pipeline engine (1F1B, whole activations between stages,
    # gradients reduced after the pipeline drains), Megatron's fused kernels, no flash attention
    "megatron-deepspeed": Implementation(
        name="megatron-deepspeed",
        overlap_dp=False,
        flash_attention=False,
        scatter_gather=False,
        overlap_p2p=False,
        family="megatron-deepspeed",
    ),
    # DeepSpeed ZeRO-3 as Narayanan et al. 2021 Table 2 ran it: parameters gathered module by module with prefetch,
    # at most stage3_max_live_parameters (1e9) alive, released after use unless reused within
    # stage3_max_reuse_distance (1e9) parameters. Its gathers and reductions over all GPUs ran at one NIC per GPU
    # (rail_collectives False): that table's step time is the same on 768 and 1536 GPUs for the same batch
    # (88 and 44 TFLOP/s per GPU), a per-GPU link limit, not 8 NICs shared (set after seeing those rows)
    "deepspeed-zero3": Implementation(
        name="deepspeed-zero3",
        overlap_dp=True,
        flash_attention=False,
        zero3_reuse_limit=1e9,
        zero3_live_limit=1e9,
        rail_collectives=False,
        family="deepspeed",
    ),
    # MosaicML Composer + PyTorch FSDP (llm-foundry): FULL_SHARD with prefetch, triton flash attention; mixed
    # precision DEFAULT reduces fp32 gradients, PURE bf16 ones
    "composer-fsdp": Implementation(name="composer-fsdp", grad_bytes=4, family="composer"),
    "composer-fsdp-pure": Implementation(name="composer-fsdp-pure", grad_bytes=2, family="composer"),
    # Meta's Llama 3 stack (Dubey et al. 2024, sec. 3.3): FSDP over dp (gradients reduce-scattered in fp32),
    # Megatron-style tp with sequence parallelism, interleaved pipeline, all-gather context parallelism, flash attention
    "llama3": Implementation(name="llama3", grad_bytes=4, family="llama3"),
    # torchtitan (Liang et al. 2024): FSDP2 (per-parameter sharding, implicit prefetch), SDPA flash attention,
    # bf16 parameters with gradients reduce-scattered in fp32
    "torchtitan-fsdp2": Implementation(name="torchtitan-fsdp2", grad_bytes=4, family="torchtitan"),
    # Megatron-Core 2024-25 with MoE (its MoE README and Liu et al. 2025, "MoE Parallel Folding"): the distributed
    # optimizer (ZeRO-1) reducing fp32 gradients (bf16 training accumulates and reduces them in fp32) with the
    # reduction and the parameter gather overlapped, TransformerEngine's fused attention, interleaved pipeline with
    # overlapped p2p, experts laid out by parallel folding (ETP = 1: over the ep x tp ranks), all-to-all dispatch
    "megatron-core": Implementation(name="megatron-core", grad_bytes=4, fold_experts=True, family="megatron-core"),
    # the same with the token exchange overlapped with another micro-batch's compute ("1F1B A2A overlap")
    "megatron-core-overlap": Implementation(
        name="megatron-core-overlap", grad_bytes=4, fold_experts=True, overlap_ep=True, family="megatron-core"
    ),
    # plait on CPU ranks in fp32 (``plait calibrate`` measures what is achieved, so no efficiency factors); gloo
    # reduces and copies on the same processors the ranks compute on, so nothing overlaps: not the gradient
    # reduction, not ring attention's K/V passes, and not the pipeline's sends and receives (each chunk pays its
    # own, so more, smaller chunks cost more hand-offs; overlap_p2p set after seeing interleaving ranked first
    # and measured slower on this machine, docs/planner.md)
    "plait-cpu": Implementation(
        name="plait-cpu",
        overlap_dp=False,
        overlap_cp=False,
        overlap_p2p=False,
        grad_bytes=4,
        state_accounting="plait",
        compute_efficiency=1.0,
        memory_efficiency=1.0,
        comm_efficiency=1.0,
        reserved_bytes=0.0,
    ),
}


def act_bytes(precision: str) -> int:
    """Bytes of one activation element: 2 under bf16/fp16 autocast, 4 in fp32."""
    return 4 if precision == "fp32" else 2


# ---------------------------------------------------------------------- rank placement
def axis_stride(layout: Layout, axis: str) -> int:
    """Distance between neighbours of ``axis`` in the rank order (AXES: pp, dp, cp, tp; tp innermost)."""
    stride = 1
    for inner in reversed(AXES):
        if inner == axis:
            return stride
        stride *= layout.degrees[inner]
    raise ValueError(f"unknown axis {axis!r}")


def axis_span(layout: Layout, axis: str) -> int:
    """How many consecutive ranks a group of ``axis`` (or "dp_cp": dp and cp together) spans."""
    if axis == "dp_cp":
        return axis_stride(layout, "cp") * layout.cp * layout.dp
    return axis_stride(layout, axis) * layout.degrees[axis]


def spans_nodes(layout: Layout, axis: str, devices_per_node: int) -> bool:
    """True when a group of ``axis`` (or "dp_cp") has members on more than one node."""
    return axis_span(layout, axis) > devices_per_node


def peak_rate(hw: Hardware, impl: Implementation, precision: str) -> float:
    """Achievable matmul FLOP/s: peak x the generation's fitted efficiency x the implementation's factor."""
    return hw.flops(precision) * hw.compute_efficiency * impl.compute_efficiency


# ---------------------------------------------------------------------- collectives
def collective_time(
    hw: Hardware,
    op: str,
    nbytes: float,
    n: int,
    span: int | bool,
    comm_efficiency: float = COMM_EFFICIENCY,
    rails: bool = True,
) -> float:
    """Seconds for one ``op`` over ``n`` ranks spanning ``span`` consecutive ranks (True / False: beyond / within
    a node) on ``nbytes`` of payload (the whole tensor; for all-to-all and all-gather the full result), by the
    alpha-beta formulas of the module docstring; ``rails`` False: a ring collective gets each rank's own link
    beyond the node (``Implementation.rail_collectives``)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    if isinstance(span, bool):  # no stride known: one rank per node beyond it, all within it
        span = n * (hw.devices_per_node + 1) if span else min(n, hw.devices_per_node)
    if op in hw.measured and span <= hw.devices_per_node:
        alpha, beta = hw.measured[op]
        (steps, fraction), (steps0, fraction0) = _ring_factors(op, n), _ring_factors(op, hw.measured_ranks)
        return alpha * steps / steps0 + beta * nbytes * fraction / fraction0
    alpha, bandwidth = group_link(hw, span, n, ring=rails and op in RING_OPS)
    bandwidth *= comm_efficiency
    frac = (n - 1) / n
    if op == "all_reduce":
        ring = 2 * (n - 1) * alpha + 2 * frac * nbytes / bandwidth
        tree = 2 * math.log2(n) * alpha + 2 * nbytes / bandwidth
        return min(ring, tree)
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) * alpha + frac * nbytes / bandwidth
    if op == "broadcast":
        return math.log2(n) * alpha + nbytes / bandwidth
    if op == "send_recv":
        return alpha + nbytes / bandwidth
    raise ValueError(f"unknown collective {op!r}")


RING_OPS = ("all_reduce", "all_gather", "reduce_scatter")
"""Collectives that NCCL runs as rings (or trees) over several channels, so their traffic between nodes is spread
over every NIC that the group has in a node (``group_link``)."""


def group_link(hw: Hardware, span: int, n: int, ring: bool = True) -> tuple[float, float]:
    """(latency, bandwidth per rank) of a group of ``n`` ranks spanning ``span`` consecutive devices (stride
    span / n). The latency is that of the outermost level the group crosses (``Hardware.level``); the bandwidth is
    the narrowest of the levels it crosses.

    For a ring collective (NCCL's rings and trees alike), let m be the group's ranks in one domain of the level
    below (one node, for the network beyond the nodes). A ring crosses the level once per domain and channel, and
    NCCL opens a channel per NIC (rail), so the crossing traffic rides k = min(m, NICs per node) links together:
    k x the level's per-device bandwidth. Every group of the axis runs at once and the domain's devices all belong
    to some group, so its uplinks, shared ``oversubscription`` : 1, carry m x the per-device share for each group
    (``NetworkLevel.effective_bandwidth``). The level gives min(k x bandwidth, m x effective bandwidth). On a DGX
    A100 (8 x 200 Gb/s) a group of all 8 GPUs of each node reaches 8 x 25 = 200 GB/s (NVIDIA measures 192 GB/s
    all-reduce bus bandwidth there, NVIDIA/nccl#812), a group of one GPU per node (data parallelism beside tp = 8)
    25 GB/s, and halving the GPUs per node halves it (NVIDIA/nccl#1168); a group of one rank per leaf switch meets
    the oversubscribed spine at its share. All-to-all, broadcast and point-to-point (``ring`` False) get one
    device's share of the level."""
    top = hw.level(span)
    stride = max(1, span // n)
    bandwidth, inner = math.inf, 1
    for level in hw.network():
        members = n if level.devices == 0 else min(n, max(1, level.devices // stride))
        if members >= 2 and span > inner:  # the group has ranks in different domains of the level below
            m = min(n, max(1, inner // stride))
            if ring:
                share = min(min(m, hw.devices_per_node) * level.bandwidth, m * level.effective_bandwidth)
            else:
                share = level.effective_bandwidth
            bandwidth = min(bandwidth, share)
        if level is top:
            break
        inner = level.devices
    if bandwidth == math.inf:  # one rank per domain at every level: the outermost link
        bandwidth = top.effective_bandwidth
    return top.latency, bandwidth


def _ring_factors(op: str, n: int) -> tuple[float, float]:
    """(latency steps, bandwidth fraction of the payload) of ``op`` on ``n`` ranks by the ring formulas above."""
    n = max(n, 2)
    if op == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return n - 1, (n - 1) / n
    if op == "broadcast":
        return math.log2(n), 1.0
    return 1.0, 1.0  # send_recv: one message between two ranks


# ---------------------------------------------------------------------- one block
@dataclass(frozen=True)
class BlockTime:
    """Seconds one transformer block keeps a device busy for one micro-batch, by pass; ``*_comm`` are the
    exposed tensor/context-parallel collectives (and expert parallelism's token exchange) inside that pass;
    ``tp`` the tensor-parallel collectives of one forward (or backward) pass, ``ep`` the token exchange's forward +
    backward and ``ep_recompute`` its forward again under recomputation (``plait.planner.experts``), all already
    inside ``*_comm``."""

    forward: float
    backward: float
    recompute: float
    forward_comm: float
    backward_comm: float
    recompute_comm: float
    flops: float  # forward FLOPs of this block on this device
    tp: float = 0.0
    ep: float = 0.0
    ep_recompute: float = 0.0


def block_traffic(spec: ModelSpec, batch: int, seq_q: int, tp: int, sp: bool, e: int, flash: bool) -> float:
    """HBM bytes the memory-bound operators of one block's forward pass move on one device."""
    tokens = batch * seq_q
    replicated = 15 * spec.hidden * e * tokens / (tp if sp else 1)
    split = ((3 if spec.gated else 2) * spec.ffn + 6 * spec.q_width) * e * tokens / tp
    scores = 0.0 if flash else 4.5 * spec.heads * seq_q * seq_q * e * batch / tp
    return replicated + split + scores


def recompute_mode(layout: Layout) -> str:
    """ "none", "full", "selective" (Korthikanti et al. 2022: only the attention core), "op" (per operator: half
    the matmuls and the elementwise work) or "blocks" (a tuple of block indices, each recomputed fully)."""
    return "blocks" if isinstance(layout.recompute, tuple) else str(layout.recompute)


def recomputed_blocks(layout: Layout, start: int, end: int) -> int:
    """How many of blocks [start, end) the layout recomputes (fully or, under "selective", their attention)."""
    mode = recompute_mode(layout)
    if mode == "none":
        return 0
    if mode == "blocks" and isinstance(layout.recompute, tuple):
        return sum(start <= index < end for index in set(layout.recompute))
    return end - start


def block_time(
    spec: ModelSpec, hw: Hardware, impl: Implementation, layout: Layout, micro_batch: int, seq: int
) -> BlockTime:
    """Per-device time of one block on a micro-batch of ``micro_batch`` samples of ``seq`` tokens under
    ``layout`` (its tp, cp, cp_mode, sequence_parallel, recompute, precision). ``recompute`` is what recomputing
    this block costs when the layout recomputes it: a forward pass (full, or a block listed in a tuple), only
    the attention core (selective: scores, softmax and the product with V, Korthikanti et al. 2022), or under
    "op" the matmuls ``ModelSpec.recompute_flops_per_token`` counts and the block's elementwise work (norms,
    rotary, activation functions), with the collectives up to the MLP's input (the attention's all-reduce; under
    sequence parallelism its all-gather and reduce-scatter and the MLP's all-gather)."""
    t, cp, e = layout.tp, layout.cp, act_bytes(layout.precision)
    s_local = seq // cp
    flops = block_flops(spec, micro_batch, s_local, seq) / t
    peak = peak_rate(hw, impl, layout.precision)
    traffic = block_traffic(spec, micro_batch, s_local, t, layout.sequence_parallel, e, impl.flash_attention)
    bandwidth = hw.memory_bandwidth * impl.memory_efficiency
    fwd = flops / peak + traffic / bandwidth + hw.block_overhead / 3
    # tensor parallel (Shoeybi et al. 2019): 2 all-reduces forward, 2 backward, of b (s/cp) h; with sequence
    # parallelism each becomes an all-gather + reduce-scatter of the same total volume (Korthikanti et al. 2022)
    message = micro_batch * s_local * spec.hidden * e
    tp_one = collective_time(
        hw, "all_reduce", message, t, axis_span(layout, "tp"), impl.comm_efficiency, rails=impl.rail_collectives
    )
    cp_fwd, cp_bwd = _context_comm(spec, hw, impl, layout, micro_batch, seq, e)
    attention_fwd = spec.attention_core_flops(micro_batch, s_local, seq) / t / peak
    cp_fwd_exposed = max(0.0, cp_fwd - attention_fwd) if (layout.cp_mode == CpMode.RING and impl.overlap_cp) else cp_fwd
    cp_bwd_exposed = (
        max(0.0, cp_bwd - 2 * attention_fwd) if (layout.cp_mode == CpMode.RING and impl.overlap_cp) else cp_bwd
    )
    mode = recompute_mode(layout)
    if mode == "selective":  # the attention core again (and its softmax traffic without flash attention)
        scores = 0.0 if impl.flash_attention else 4.5 * spec.heads * s_local * seq * e * micro_batch / t
        recompute, recompute_comm = attention_fwd + scores / bandwidth, cp_fwd_exposed
    elif mode == "op":
        per_token = spec.recompute_flops_per_token("op", seq, impl.flash_attention) / spec.layers
        recompute = micro_batch * s_local * per_token / t / peak + traffic / bandwidth
        recompute_comm = (1.5 if layout.sequence_parallel else 1.0) * tp_one + cp_fwd_exposed
    elif mode in ("full", "blocks"):
        recompute, recompute_comm = fwd, 2 * tp_one + cp_fwd_exposed
    else:
        recompute = recompute_comm = 0.0
    return BlockTime(
        forward=fwd,
        backward=2 * fwd,
        recompute=recompute,
        forward_comm=2 * tp_one + cp_fwd_exposed,
        backward_comm=2 * tp_one + cp_bwd_exposed,
        recompute_comm=recompute_comm,
        flops=flops,
        tp=2 * tp_one,
    )


def _context_comm(
    spec: ModelSpec, hw: Hardware, impl: Implementation, layout: Layout, micro_batch: int, seq: int, e: int
) -> tuple[float, float]:
    """Context parallel traffic of one block (forward, backward). Ring attention (Liu et al. 2023): cp - 1 steps
    passing this rank's K and V blocks, b (s/cp) 2 k d bytes each; backward passes K, V and their gradients.
    Ulysses (Jacobs et al. 2023): all-to-alls of q, k, v and the output forward, and of their gradients backward."""
    cp = layout.cp
    if cp == 1:
        return 0.0, 0.0
    s_local = seq // cp
    inter = axis_span(layout, "cp")
    kv_bytes = micro_batch * s_local * 2 * spec.kv * spec.head_dim * e / layout.tp
    if layout.cp_mode == CpMode.RING:
        step = collective_time(hw, "send_recv", kv_bytes, 2, inter, impl.comm_efficiency)
        return (cp - 1) * step, 2 * (cp - 1) * step
    q_bytes = micro_batch * seq * spec.q_width * e / layout.tp  # the full sequence's heads, redistributed
    kv_full = micro_batch * seq * 2 * spec.kv * spec.head_dim * e / layout.tp
    one_way = 2 * collective_time(hw, "all_to_all", q_bytes, cp, inter, impl.comm_efficiency) + collective_time(
        hw, "all_to_all", kv_full, cp, inter, impl.comm_efficiency
    )
    return one_way, one_way


def head_time(
    spec: ModelSpec, hw: Hardware, impl: Implementation, layout: Layout, micro_batch: int, seq: int
) -> tuple[float, float, float, float]:
    """Forward time, backward time and forward FLOPs of the output layer (vocab-parallel across tp) on the last
    stage, and the forward time of the vocab-parallel embedding's tp all-reduce on the first."""
    s_local = seq // layout.cp
    flops = logits_flops(spec, micro_batch, s_local) / layout.tp
    e = act_bytes(layout.precision)
    logits_bytes = 3 * micro_batch * s_local * spec.vocab * 4 / layout.tp  # fp32 logits, softmax, gradient
    fwd = flops / peak_rate(hw, impl, layout.precision) + logits_bytes / (hw.memory_bandwidth * impl.memory_efficiency)
    embed_ar = collective_time(
        hw,
        "all_reduce",
        micro_batch * s_local * spec.hidden * e,
        layout.tp,
        axis_span(layout, "tp"),
        impl.comm_efficiency,
    )
    return fwd, 2 * fwd, flops, embed_ar


__all__ = [
    "ADAM_BYTES_PER_PARAM",
    "BlockTime",
    "COMM_EFFICIENCY",
    "IMPLEMENTATIONS",
    "Implementation",
    "MEMORY_EFFICIENCY",
    "act_bytes",
    "axis_span",
    "axis_stride",
    "block_flops",
    "block_time",
    "block_traffic",
    "collective_time",
    "head_time",
    "logits_flops",
    "peak_rate",
    "recompute_mode",
    "recomputed_blocks",
    "spans_nodes",
]
