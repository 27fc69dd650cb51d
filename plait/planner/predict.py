"""Predict one layout: step time (with its breakdown), FLOPs, throughput, MFU and memory per device.

A step is a pipeline of m micro-batches of b samples over pp stages (pp = 1: plain gradient accumulation):

    step = makespan(schedule simulated on per-stage F, B and p2p times) + exposed data-parallel reduction
           + optimizer step (+ offload traffic)

and, where the ranks share fewer processors than there are ranks (CPU ranks, ``Hardware.compute_units``), at
least world / processors x (a rank's compute + optimizer step) + its collectives: the work-conserving bound of
processor sharing (idle ranks give their processor to others).

F and B of a stage sum its blocks' ``costs.block_time`` (compute, tensor/context parallel collectives, ZeRO-3's
parameter gathers where compute cannot hide them) and the embedding / output layer on the first / last stage.
Layers are cut into pp x v chunks at the layout's ``pipeline_cuts``, or by the inter-op pass (``stage_chunks``:
``inter_op.rank_balanced_stages`` balances each rank's total over its chunks). The makespan comes from
``plait.parallel.pipeline.simulate``: the schedule is simulated for m' = min(m, 2 pp) micro-batches (rounded to
a multiple of pp) and extended by (m - m') x the slowest rank's work per micro-batch, which is exact for these
schedules once m' >= pp (their idle time no longer grows with m).

Definitions (Chowdhery et al. 2022, app. B): model FLOPs exclude recomputation, hardware FLOPs include it;
MFU = model FLOPs / (devices x peak x step time); TFLOP/s per device counts hardware FLOPs (as Megatron-LM does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Any

from plait.errors import LayoutError
from plait.layout import SPLIT_BACKWARD, V_SHAPED, Layout, Offload, PipelineSchedule, Recompute
from plait.parallel.pipeline import build_schedule, simulate
from plait.parallel.pipeline.schedule import placement_of, rank_stages, stage_rank
from plait.parallel.pipeline.simulate import Costs
from plait.planner.costs import (
    ADAM_BYTES_PER_PARAM,
    IMPLEMENTATIONS,
    BlockTime,
    Implementation,
    act_bytes,
    axis_span,
    collective_time,
    head_time,
    recompute_mode,
)
from plait.planner.experts import (
    block_times,
    check_experts,
    expert_split,
    gradient_groups,
    replica_group,
    routed_parameters,
    stage_parameters,
)
from plait.planner.hardware import Hardware, get_hardware
from plait.planner.inter_op import rank_balanced_stages
from plait.planner.models import ModelSpec, resolve_model
from plait.planner.sharing import shared_makespan
from plait.planner.stage_memory import MemoryBreakdown, stage_memory

TIME_PARTS = (
    "compute",
    "tp_comm",
    "cp_comm",
    "ep_comm",
    "zero3_comm",
    "pp_bubble",
    "dp_comm",
    "optimizer",
    "offload",
    "shared_processors",
)


@dataclass
class Prediction:
    """What one layout should do per step. Times in seconds, memory in bytes per device, FLOPs per step."""

    model: str
    layout: Layout
    hardware: str
    global_batch: int
    micro_batch: int
    seq: int
    step_time: float
    time: dict[str, float]
    model_flops: float
    hardware_flops: float
    peak_flops: float
    memory: MemoryBreakdown
    memory_limit: float
    stages: list[tuple[int, int]] = field(default_factory=list)
    layer_costs: tuple[float, ...] = ()
    """Seconds each block keeps its rank busy per micro-batch (forward, backward, recomputation, tp/cp
    communication; the embedding on block 0, the output layer on the last): what the inter-op pass balanced."""

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def fits(self) -> bool:
        return self.memory.device <= self.memory_limit

    @property
    def tokens_per_s(self) -> float:
        return self.global_batch * self.seq / self.step_time

    @property
    def tflops_per_device(self) -> float:
        """Achieved hardware TFLOP/s per device (recomputation included, as Megatron-LM reports)."""
        return self.hardware_flops / (self.world_size * self.step_time) / 1e12

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.world_size * self.peak_flops * self.step_time)

    @property
    def hfu(self) -> float:
        return self.hardware_flops / (self.world_size * self.peak_flops * self.step_time)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "hardware": self.hardware,
            "layout": self.layout.to_dict(),
            "global_batch": self.global_batch,
            "micro_batch": self.micro_batch,
            "seq": self.seq,
            "step_time_s": self.step_time,
            "time_s": dict(self.time),
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_device": self.tflops_per_device,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "memory_bytes": self.memory.as_dict(),
            "memory_limit_bytes": self.memory_limit,
            "fits": self.fits,
            "stages": [list(s) for s in self.stages],
        }


def check_layout(spec: ModelSpec, layout: Layout, global_batch: int, impl: Implementation | None = None) -> int:
    """Raise LayoutError (problem + fix) for a layout this model cannot use; return the micro-batch size."""
    if spec.heads % layout.tp or (spec.kv % layout.tp and layout.tp % spec.kv):
        raise LayoutError(
            f"tp={layout.tp} does not split {spec.heads} heads / {spec.kv} kv heads of {spec.name}. "
            f"Fix: use a tp that divides {spec.heads}."
        )
    if spec.seq % layout.cp:
        raise LayoutError(
            f"cp={layout.cp} does not divide the sequence length {spec.seq}. Fix: use a cp that divides {spec.seq}."
        )
    chunks = layout.pp * layout.virtual_stages
    if chunks > spec.layers:
        raise LayoutError(
            f"pp x virtual_stages = {chunks} chunks, but {spec.name} has {spec.layers} layers. "
            f"Fix: use pp x virtual_stages <= {spec.layers}."
        )
    if layout.schedule == PipelineSchedule.INTERLEAVED and layout.pp > 1 and layout.microbatches % layout.pp:
        raise LayoutError(
            f"the interleaved schedule needs microbatches ({layout.microbatches}) to be a multiple of "
            f"pp={layout.pp}. Fix: change microbatches or use schedule '1f1b'."
        )
    if layout.schedule == PipelineSchedule.DUALPIPEV and layout.pp > 1 and layout.microbatches < 2 * layout.pp:
        raise LayoutError(
            f"dualpipev needs microbatches >= 2 x pp = {2 * layout.pp}, got {layout.microbatches}. Fix: use more "
            f"micro-batches, or schedule 'zb-v' (any number)."
        )
    if layout.zero and layout.dp * layout.cp == 1:
        raise LayoutError(f"zero={layout.zero} shards over dp x cp = 1 rank. Fix: use zero=0 or dp > 1.")
    if layout.pipeline_cuts and layout.pipeline_cuts[-1] >= spec.layers:
        raise LayoutError(
            f"pipeline_cuts={list(layout.pipeline_cuts)} cut past the last of {spec.name}'s {spec.layers} blocks. "
            f"Fix: cuts between 1 and {spec.layers - 1}, or none for the planner's split."
        )
    if isinstance(layout.recompute, tuple) and layout.recompute and max(layout.recompute) >= spec.layers:
        raise LayoutError(
            f"recompute={list(layout.recompute)} names block {max(layout.recompute)}, but {spec.name} has "
            f"{spec.layers} blocks. Fix: block indices below {spec.layers}."
        )
    problem = check_experts(spec, layout, impl)
    if problem:
        raise LayoutError(problem)
    return layout.check_batch(global_batch)


@lru_cache(maxsize=4096)
def _pipeline(
    schedule: str,
    p: int,
    m: int,
    v: int,
    forward: tuple[float, ...],
    backward: tuple[float, ...],
    p2p: float,
    split: float = 1.0,
    units: float = 0.0,
    replicas: int = 1,
) -> tuple[float, float, int]:
    """(makespan, slowest rank's busy time, peak in-flight chunk-micro-batches on any rank) for m micro-batches.
    ``split``: a split backward's I + W over B (``Hardware.split_backward``; ZB-H1, ZB-V and DualPipeV's I + W
    actions); ``units`` > 0: the ``replicas`` x p ranks share that many processors (``plait.planner.sharing``)."""
    if p == 1:
        return m * (forward[0] + backward[0]), m * (forward[0] + backward[0]), 1
    sim_m = m if m <= 2 * p else 2 * p  # >= 2p - 1 fills a V: its idle time no longer grows with m either
    halves = [b / 2 * split for b in backward]
    costs = Costs(F=list(forward), B=list(backward), I=halves, W=halves, p2p=p2p)
    plan = build_schedule(schedule, p, sim_m, v)
    result = simulate(plan, costs)
    per_mb = max(
        sum(forward[s] + (backward[s] * split if schedule in SPLIT_BACKWARD else backward[s]) for s in stages)
        for stages in rank_stages(p, v, plan.placement)
    )
    extra = (m - sim_m) * per_mb
    makespan = result.makespan + extra
    if units and units < replicas * p:  # in the steady state all p stages of every replica are busy
        makespan = max(makespan, shared_makespan(plan, costs, units, replicas) + extra * replicas * p / units)
    return makespan, max(result.busy) + extra, max(result.peak_activations)


@lru_cache(maxsize=4096)
def _balanced(costs: tuple[float, ...], p: int, v: int, placement: str) -> tuple[tuple[int, int], ...]:
    """``rank_balanced_stages`` of rounded block costs (rounded by the caller, so that the search's many layouts
    share one partition)."""
    return tuple(rank_balanced_stages(costs, p, v, placement))


def stage_chunks(
    spec: ModelSpec, layout: Layout, blk: BlockTime, embed: float, head: float, moe: BlockTime | None = None
) -> list[tuple[int, int]]:
    """Blocks [start, end) of each of the pp x v chunks: the layout's ``pipeline_cuts`` when it has them, else the
    inter-op pass (``inter_op.rank_balanced_stages``: each rank's total of forward, backward, recomputation and
    tensor/context parallel communication, the embedding on the first chunk and the output layer on the last,
    balanced across ranks; ``moe``: an MoE block's times, for the model's MoE blocks)."""
    chunks = layout.pp * layout.virtual_stages
    if chunks == 1:
        return [(0, spec.layers)]
    if layout.pipeline_cuts:
        bounds = [0, *layout.pipeline_cuts, spec.layers]
        return list(zip(bounds, bounds[1:]))
    unit = blk.forward + blk.backward + blk.forward_comm + blk.backward_comm or 1.0
    costs = _layer_costs(spec, layout, blk, embed, head, moe)
    rounded = {c: round(c / unit, 2) for c in set(costs)}  # few distinct values: the blocks are equal but the ends
    placement = placement_of(layout.schedule)
    return list(_balanced(tuple(rounded[c] for c in costs), layout.pp, layout.virtual_stages, placement))


def pipeline_closed_form(
    schedule: str, p: int, m: int, v: int, rank_f: float, rank_b: float, p2p: float
) -> tuple[float, float, int]:
    """(makespan, busy, peak in-flight chunk-micro-batches) of a pipeline whose slowest rank spends ``rank_f`` and
    ``rank_b`` per micro-batch (over its v chunks): 1F1B and GPipe (m + p - 1)(F + B) (Narayanan et al. 2021,
    sec. 2.2), interleaved m (F + B) + (p - 1)(F + B) / v (their sec. 2.2.2), ZB-H1 m (F + B) + (p - 1) F when
    I = W = B / 2 (Qi et al. 2023), ZB-V and DualPipeV m (F + B) + (p - 1) F / 2 (ZB-H1's on chunks of half a
    rank's share, tests/test_pipeline_vshape.py; for m >= 2p - 1: below, the V never fills and this is low); plus
    2 (p - 1) p2p transfers on the critical path (4 (p - 1) in a V: down and back up). In-flight
    chunk activations: ZB-V min(2p, 2m) (1F1B's p whole stages), DualPipeV 2p + 1. Used by the search;
    ``predict(exact=True)`` runs the simulator instead (tests hold them to each other)."""
    busy = m * (rank_f + rank_b)
    if p == 1:
        return busy, busy, 1
    if schedule == "zero-bubble":
        bubble = (p - 1) * rank_f
    elif schedule in V_SHAPED:
        bubble = (p - 1) * rank_f / 2
    elif schedule == "interleaved":
        bubble = (p - 1) * (rank_f + rank_b) / v
    else:
        bubble = (p - 1) * (rank_f + rank_b)
    in_flight = {
        "gpipe": m * v,
        "naive": 1,
        "interleaved": min(m * v, 2 * (p - 1) + (v - 1) * p + 1),
        "zb-v": min(2 * p, 2 * m),
        "dualpipev": 2 * p + 1,
    }.get(schedule, min(p, m))
    hops = 4 * (p - 1) if schedule in V_SHAPED else 2 * (p - 1)  # a V goes down and back up, both ways
    return busy + bubble + hops * p2p, busy, in_flight


def _rounded(values: list[float], unit: float) -> tuple[float, ...]:
    return tuple(round(x / unit, 4) for x in values)


def predict(
    model: Any,
    layout: Layout,
    hardware: str | Hardware = "h100",
    global_batch: int | None = None,
    seq: int | None = None,
    world_size: int | None = None,
    implementation: str | Implementation = "plait",
    exact: bool = True,
) -> Prediction:
    """Predict ``layout`` for ``model`` (name, config.json, GPTConfig, GPT or ModelSpec) on ``hardware``.
    ``global_batch`` is in samples (default: dp x microbatches, one sample per micro-batch). ``exact=False``
    times the pipeline with closed forms on the slowest rank instead of the simulator (the search's fast pass)."""
    spec = resolve_model(model, seq)
    if not isinstance(spec, ModelSpec):
        raise LayoutError(
            "predict() needs a transformer ModelSpec; a profiled model is planned by plan(). "
            "Fix: pass a model name, config.json, GPTConfig or ModelSpec."
        )
    hw = get_hardware(hardware)
    impl = IMPLEMENTATIONS[implementation] if isinstance(implementation, str) else implementation
    if world_size is None and not layout.is_resolved:
        raise LayoutError(
            f"{layout.short()} has a -1 degree and no world size was given. Fix: pass world_size (the number of "
            f"devices), or give every degree."
        )
    layout = layout.resolve(world_size) if world_size is not None else layout
    if global_batch is None:
        global_batch = layout.dp * layout.microbatches
    b = check_layout(spec, layout, global_batch, impl)
    s, t, p, v, m = spec.seq, layout.tp, layout.pp, layout.virtual_stages, layout.microbatches
    e = act_bytes(layout.precision)
    n_shard = layout.dp * layout.cp
    collective = partial(collective_time, hw, comm_efficiency=impl.comm_efficiency, rails=impl.rail_collectives)

    blk, moe = block_times(spec, hw, impl, layout, b, s)
    head_f, head_b, head_flops, embed_f = head_time(spec, hw, impl, layout, b, s)
    chunks = stage_chunks(spec, layout, blk, embed_f, head_f + head_b, moe)

    fwd, bwd, compute, recomputed = [], [], [], []
    for start, end in chunks:
        nd, nm, rd, rm = _block_counts(spec, layout, start, end)
        f = (
            nd * (blk.forward + blk.forward_comm)
            + nm * (moe.forward + moe.forward_comm)
            + (embed_f if start == 0 else 0.0)
        )
        bw = nd * (blk.backward + blk.backward_comm) + nm * (moe.backward + moe.backward_comm)
        bw += rd * (blk.recompute + blk.recompute_comm) + rm * (moe.recompute + moe.recompute_comm)
        if end == spec.layers:
            f, bw = f + head_f, bw + head_b
        fwd.append(f)
        bwd.append(bw)
        recomputed.append((rd, rm))
        compute.append(
            nd * (blk.forward + blk.backward)
            + nm * (moe.forward + moe.backward)
            + rd * blk.recompute
            + rm * moe.recompute
            + (head_f + head_b if end == spec.layers else 0)
        )
    # per rank: (blocks, dense parameters, routed expert parameters), before tp / ep split them
    placement = placement_of(layout.schedule) if p > 1 else "interleaved"
    held_chunks = rank_stages(p, v, placement)  # each rank's chunks: r, r + p, ... or, in a V, r and 2p - 1 - r
    last = stage_rank(p * v - 1, p, placement)
    stage_params = []
    expert_ways = expert_split(layout, impl)
    for r in range(p):
        indices = [i for c in held_chunks[r] for i in range(*chunks[c])]
        dense, routed = stage_parameters(spec, indices, r == 0, r == last)
        stage_params.append((len(indices), dense, routed))
    fullest = max(stage_params, key=lambda item: item[1] / t + item[2] / expert_ways)
    psi_dense, psi_routed = fullest[1] / t, fullest[2] / expert_ways
    psi_max = psi_dense + psi_routed
    (n_dense, dense_span), (n_routed, routed_span) = gradient_groups(layout)

    def over_data(op: str, bytes_per_parameter: float) -> float:
        """``op`` on the dense parameters over dp x cp and on the routed experts over edp (HSDP: inside one replica
        group, ``gradient_groups``)."""
        return collective(op, psi_dense * bytes_per_parameter, n_dense, dense_span) + collective(
            op, psi_routed * bytes_per_parameter, n_routed, routed_span
        )

    # ZeRO-3: each micro-batch gathers this rank's parameters forward and backward and reduce-scatters gradients
    zero3 = slack = 0.0  # slack: backward time left after ZeRO-3's own traffic (hides HSDP's all-reduce)
    if layout.zero == 3:
        gather = over_data("all_gather", e)
        # a block recomputed under ZeRO-3 is gathered for the recomputation; one too big to be kept until its backward
        # (``Implementation.zero3_reuse_limit``) is gathered once more
        regather = (
            gather if recompute_mode(layout) == "full" and spec.block_parameters / t > impl.zero3_reuse_limit else 0.0
        )
        # with pp > 1 every micro-batch's backward runs under no_sync: gradients accumulate unsharded and are
        # reduce-scattered once per step (plait.parallel.zero.fsdp_pipeline), charged with the dp reduction below
        scatter = over_data("reduce_scatter", impl.grad_bytes) if p == 1 else 0.0
        rank_f = max(sum(fwd[c] for c in held_chunks[r]) for r in range(p))
        rank_b = max(sum(bwd[c] for c in held_chunks[r]) for r in range(p))
        hide_f, hide_b = (rank_f, rank_b) if impl.overlap_dp else (0.0, 0.0)  # prefetch behind compute, or not
        zero3 = max(0.0, gather - hide_f) + max(0.0, gather + regather + scatter - hide_b)
        slack = max(0.0, hide_b - gather - regather - scatter) if p == 1 else 0.0
        fwd = [f * (1 + max(0.0, gather - hide_f) / rank_f) for f in fwd]
        bwd = [x * (1 + max(0.0, gather + regather + scatter - hide_b) / rank_b) for x in bwd]

    message = b * (s // layout.cp) * spec.hidden * e / (t if impl.scatter_gather else 1)
    p2p = collective("send_recv", message, 2, axis_span(layout, "pp")) if p > 1 else 0.0
    # (the simulator below charges ``p2p`` only between stages on two ranks: a V's turn is local)
    if p > 1 and not impl.overlap_p2p:  # blocking p2p: a chunk also waits for its output's transfer (none at a
        # V's turn, where chunks p - 1 and p share a rank)

        def crosses(c: int, d: int) -> bool:
            return 0 <= d < p * v and stage_rank(c, p, placement) != stage_rank(d, p, placement)

        fwd = [f + (p2p if crosses(c, c + 1) else 0.0) for c, f in enumerate(fwd)]
        bwd = [x + (p2p if crosses(c, c - 1) else 0.0) for c, x in enumerate(bwd)]
    unit = max(fwd) or 1.0
    schedule = layout.schedule if p > 1 else "1f1b"
    split = hw.split_backward if schedule in SPLIT_BACKWARD else 1.0
    shared = hw.compute_units if hw.compute_units and layout.world_size > hw.compute_units else 0.0
    slow = max(range(p), key=lambda r: sum(fwd[c] + bwd[c] for c in held_chunks[r]))
    if exact:
        makespan, busy, in_flight = _pipeline(
            schedule,
            p,
            m,
            v,
            _rounded(fwd, unit),
            _rounded(bwd, unit),
            round(p2p / unit, 4),
            split,
            shared,
            layout.world_size // p,
        )
        makespan, busy = makespan * unit, busy * unit
    else:
        rank_fwd = sum(fwd[c] for c in held_chunks[slow])
        rank_bwd = sum(bwd[c] for c in held_chunks[slow])
        makespan, busy, in_flight = pipeline_closed_form(schedule, p, m, v, rank_fwd, rank_bwd * split, p2p)
    slow_chunks = held_chunks[slow]
    counts = [_block_counts(spec, layout, *chunks[c]) for c in slow_chunks]
    rank_dense, rank_moe = sum(c[0] for c in counts), sum(c[1] for c in counts)
    full = recompute_mode(layout) in ("full", "blocks")
    full_dense = sum(c[2] for c in counts) if full else 0
    full_moe = sum(c[3] for c in counts) if full else 0
    tp_time = m * (2 * (rank_dense * blk.tp + rank_moe * moe.tp) + full_dense * blk.tp + full_moe * moe.tp)
    ep_time = m * sum(c[1] * moe.ep + c[3] * moe.ep_recompute for c in counts)

    # data parallel gradient reduction (ZeRO 0: all-reduce; 1-2: reduce-scatter + parameter all-gather), the dense
    # parameters' over dp x cp, the routed experts' over edp
    grads = psi_max * impl.grad_bytes
    dp_time = 0.0
    if n_shard > 1 and layout.zero == 3 and p > 1:
        dp_time = over_data("reduce_scatter", impl.grad_bytes)
    if n_shard > 1 and layout.zero < 3:
        op = "all_reduce" if layout.zero == 0 else "reduce_scatter"
        reduce = over_data(op, impl.grad_bytes)
        if impl.overlap_dp:
            window = sum(bwd[c] for c in slow_chunks)
            tail = reduce * min(1.0, layout.bucket_mb * 2**20 / max(grads, 1.0))
            reduce = max(reduce - window, tail)
        gather = over_data("all_gather", e) if layout.zero else 0.0
        dp_time = reduce + gather
    owned = (psi_dense / n_dense + psi_routed / n_routed) if layout.zero >= 1 else psi_max
    # HSDP: each rank's reduced gradient shard all-reduced over the R replica groups, on the links that group
    # crosses (between nodes once a replica group fills a node). ZeRO-3 issues it unit by unit during the backward
    # (hidden behind what the backward leaves after its own traffic); ZeRO-1/2 after the reduce-scatters
    replicas, replica_span = replica_group(layout)
    dp_time += max(0.0, collective("all_reduce", owned * impl.grad_bytes, replicas, replica_span) - slack)
    optimizer, offload = owned * ADAM_BYTES_PER_PARAM / (hw.memory_bandwidth * impl.memory_efficiency), 0.0
    if layout.offload != Offload.NONE and layout.zero >= 1:
        optimizer = owned * ADAM_BYTES_PER_PARAM / hw.host_memory_bandwidth
        offload = owned * (impl.grad_bytes + e) / hw.host_bandwidth
        if layout.offload == Offload.NVME:
            offload += owned * 2 * 16 / hw.nvme_bandwidth  # read and write the fp32 states
    step = makespan + dp_time + optimizer + offload
    rank_comm = m * sum(
        nd * (blk.forward_comm + blk.backward_comm)
        + nm * (moe.forward_comm + moe.backward_comm)
        + rd * blk.recompute_comm
        + rm * moe.recompute_comm
        for nd, nm, rd, rm in counts
    )
    time = {
        "compute": 0.0,
        "tp_comm": tp_time if t > 1 else 0.0,
        "cp_comm": max(0.0, rank_comm - (tp_time if t > 1 else 0.0) - ep_time),
        "ep_comm": ep_time,
        "zero3_comm": m * zero3,
        "pp_bubble": max(0.0, makespan - busy),
        "dp_comm": dp_time,
        "optimizer": optimizer,
        "offload": offload,
        "shared_processors": 0.0,
    }
    exposed = time["tp_comm"] + time["cp_comm"] + time["ep_comm"] + time["zero3_comm"]
    time["compute"] = max(0.0, makespan - time["pp_bubble"] - exposed)
    # ranks sharing ``compute_units`` processors (CPU ranks from ``plait calibrate``): a rank's idle time (bubble)
    # frees a processor for another, so a step lasts at least all ranks' compute spread over the processors, plus
    # the collectives (their calibrated times already include the sharing: measured with that many ranks)
    if hw.compute_units and layout.world_size > hw.compute_units:
        comm = time["tp_comm"] + time["cp_comm"] + time["ep_comm"] + time["zero3_comm"] + dp_time
        shared_bound = layout.world_size / hw.compute_units * (time["compute"] + optimizer) + comm
        time["shared_processors"] = max(0.0, shared_bound - step)
        step += time["shared_processors"]

    model_flops = global_batch * s * spec.flops_per_token(s)
    hardware_flops = model_flops + global_batch * s * spec.recompute_flops_per_token(
        layout.recompute, s, impl.flash_attention
    )

    worst: MemoryBreakdown | None = None
    # every rank holds ``held`` micro-batches at the peak here, so the fullest is one of: the most blocks, the most
    # parameters, or the last (fp32 logits)
    candidates = {
        last,
        max(range(p), key=lambda r: (stage_params[r][0], stage_params[r][1] / t + stage_params[r][2] / expert_ways)),
        max(range(p), key=lambda r: stage_params[r][1] / t + stage_params[r][2] / expert_ways),
    }
    gathered = max(spec.block_parameters, spec.moe_block_parameters - routed_parameters(spec) * (1 - 1 / expert_ways))
    for r in sorted(candidates):
        blocks, dense, routed = stage_params[r]
        held = in_flight if p > 1 else 1
        if p > 1 and layout.schedule in (PipelineSchedule.GPIPE, PipelineSchedule.NAIVE):
            held = m * v if layout.schedule == PipelineSchedule.GPIPE else 1
        moe_blocks = sum(spec.is_moe_block(i) for c in held_chunks[r] for i in range(*chunks[c]))
        mem = stage_memory(
            spec, layout, impl, b, s, dense, blocks, held, r == last, gathered,
            routed_params=routed, moe_blocks=moe_blocks,
        )  # fmt: skip
        if worst is None or mem.device > worst.device:
            worst = mem
    assert worst is not None
    return Prediction(
        spec.name,
        layout,
        hw.name,
        global_batch,
        b,
        s,
        step,
        time,
        model_flops,
        hardware_flops,
        hw.flops(layout.precision),
        worst,
        hw.memory_bytes,
        chunks,
        tuple(_layer_costs(spec, layout, blk, embed_f, head_f + head_b, moe)),
    )


def _block_counts(spec: ModelSpec, layout: Layout, start: int, end: int) -> tuple[int, int, int, int]:
    """(dense blocks, MoE blocks, recomputed dense blocks, recomputed MoE blocks) among blocks [start, end)."""
    moe = sum(1 for i in range(start, end) if spec.is_moe_block(i)) if spec.experts else 0
    if isinstance(layout.recompute, tuple):
        listed = [i for i in set(layout.recompute) if start <= i < end]
        rec_moe = sum(1 for i in listed if spec.is_moe_block(i))
        return end - start - moe, moe, len(listed) - rec_moe, rec_moe
    if recompute_mode(layout) == "none":
        return end - start - moe, moe, 0, 0
    return end - start - moe, moe, end - start - moe, moe


def _layer_costs(
    spec: ModelSpec, layout: Layout, blk: BlockTime, embed: float, head: float, moe: BlockTime | None = None
) -> list[float]:
    """``Prediction.layer_costs`` (see there)."""

    def cost(kind: BlockTime, recomputed: bool) -> float:
        base = kind.forward + kind.backward + kind.forward_comm + kind.backward_comm
        return base + (kind.recompute + kind.recompute_comm if recomputed else 0.0)

    listed = set(layout.recompute) if isinstance(layout.recompute, tuple) else None
    everywhere = listed is None and layout.recompute != Recompute.NONE
    costs = [
        cost(
            moe if moe is not None and spec.is_moe_block(i) else blk, everywhere or (listed is not None and i in listed)
        )
        for i in range(spec.layers)
    ]
    costs[0] += embed
    costs[-1] += head
    return costs


def fmt_bytes(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def fmt_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.1f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} us"


__all__ = [
    "Prediction",
    "TIME_PARTS",
    "check_layout",
    "fmt_bytes",
    "pipeline_closed_form",
    "fmt_time",
    "math",
    "predict",
]
