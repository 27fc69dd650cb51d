"""Memory per rank: ``estimate_memory`` (the peak of one of plait's training steps, with its breakdown); the
planner's per-stage model, ``plait.planner.stage_memory``, uses the same formulas.

**Model states.** ``zero_paper_bytes`` (Rajbhandari et al. 2020, Figure 1): for Psi parameters on N = dp x cp
data-parallel ranks (under HSDP, ``Layout.dp_replicate`` = R, N = dp x cp / R: ZeRO shards inside a replica group,
``shard_ranks``), mixed-precision Adam (2 bytes params + 2 bytes grads + K = 12 bytes of fp32 master, momentum,
variance)

    stage 0: (2 + 2 + K) Psi      stage 1: (2 + 2) Psi + K Psi / N
    stage 2: 2 Psi + (2 + K) Psi / N      stage 3: (2 + 2 + K) Psi / N

``estimate_memory`` applies the same accounting to plait's own implementation, which keeps parameters and
gradients in fp32 (autocast computes in bf16/fp16 from fp32 weights): params 4 Psi, grads 4 Psi, optimizer states
S Psi (S = 8 for Adam/AdamW, 4 for SGD with momentum, 0 without), and, under ZeRO 1-2, a separate fp32 master shard
of 4 Psi / N (none for N = 1 without offload: the parameters are then views of the master; under ZeRO-3 the shard
*is* the master, unless it is offloaded: then a host copy of 4 Psi / N is the master). Offload (ZeRO-Offload, Ren et al. 2021) moves optimizer states and masters to the host. Each figure is
the most a rank holds of that kind over a step; gradients differ: ZeRO-1 holds the full local gradient (4 Psi)
from backward until ``finish_backward`` reduce-scatters it, then its shard's sum (4 Psi / N), so ``gradients`` is
the peak and ``gradients_at_step`` what is left at the optimizer step; between steps no gradient is held. With
micro-batches (gradient accumulation, and every pipeline) the full local gradient accumulates under ``no_sync``
at every stage (4 Psi, and the 4 Psi / N shard beside it under ZeRO-2/3). With pp > 1 a rank's Psi is its stages'.

**Activations** (``plait.planner.activations``, where the per-block formulas are written out): plait's model
tensor by tensor ("plait" accounting, equal to ``SavedActivations`` to the byte for plait's GPT; another model is
estimated as plait's GPT of its shape), or Korthikanti et al. 2022 for Megatron-style implementations; recomputation none / selective / op / full / per block; attention kernel flash (no
s^2 term) or math; activations in the compute dtype; a pipeline rank holds the activations of the micro-batches
its schedule keeps in flight, walked action by action over its stages (F adds a stage's bytes, B or W frees them).

**The peak** is the largest of the step's phases (device bytes; what ``torch.cuda.max_memory_allocated`` reports):

- "loss": the backward of a micro-batch begins on the last stage: model states, the gradients accumulated so far,
  every saved activation in flight and the loss buffers (``loss_buffer_bytes``: the log-softmax's gradient and its
  input's gradient, 8 s b V / t bytes in fp32), plus ZeRO-3's gathered root unit and one block. For a language
  model with a large vocabulary this is the peak (issue 14's H100 figures: 17.0 / 17.4 / 29.5 GiB predicted against
  17.1 / 17.4 / 29.6 measured, see docs/zero.md);
  The forward's end (the logits, their fp32 copy and the log-softmax: (e + 4) s b V / t besides the same saved
  activations) never exceeds it, so it is not a phase of its own;
- "recompute": the last recomputed block runs again: its full activations beside the rest (full / per-block);
- "backward end": the gradients at their peak plus what the reduction copies (ZeRO-1 reduce-scatters a flat copy
  of the whole gradient; ZeRO-3 one unit's full gradient);
- "step": the gradients left at the optimizer step plus the optimizer's temporaries (torch's foreach Adam/AdamW,
  the CUDA default, allocates one fp32 temporary the size of the stepped elements; CPU steps one tensor at a time).

**Start-up** (issue 25, ``benchmarks/startup_memory.py``), before the first step: a model built on the meta device
(``plait train`` builds so) and materialised by ``parallelize`` holds, per rank, its share of the parameters at rest
and the master shard its strategy makes (``startup``), plus one whole tensor of host scratch while it initialises
or reads (``startup_host``: the largest parameter; the replay and the reads hold one at a time, glibc may keep one
more freed). A model built whole on every rank first holds all of it (``startup_eager`` = 4 Psi of the whole
model). ``phases["start-up"]`` is ``startup``; it never exceeds the step's phases, so it is not the peak.

On CUDA the caching allocator rounds blocks up and fragments: ``reserved`` = peak x (1 + ``CUDA_CACHING_OVERHEAD``),
a documented prior (5%), not a fit; issue 14 quotes one reserved/allocated pair (17.4 / 17.1 GiB, +1.8%).
Communication buffers of DDP's buckets and offload staging are not modelled beyond the gradients they hold.

**Mixture-of-Experts** (``plait.planner.experts``, ``expert_activations``): the routed experts' parameters (a
module's ``GroupedExperts`` weights, or the spec's count) are split over ``Layout.ep`` and their states sharded over
edp = dp x cp / ep (the data ranks holding the same experts), the rest as above; MoE blocks keep what
``expert_activations`` counts (a rank's experts get n k rows under uniform routing: the mean over the ep group's
ranks, exact; each rank's own figure moves with its routing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from plait.layout import Layout, Offload, Recompute
from plait.models.spec import ModelSpec
from plait.parallel.pipeline.schedule import Kind, placement_of, rank_stages
from plait.planner.activations import Forward, block_bytes, ends_bytes, loss_buffer_bytes, positions_bytes
from plait.planner.expert_activations import PLAIT_ROUTING, Routing, layer_bytes
from plait.planner.experts import routed_layout, routed_parameters, stage_parameters
from plait.planner.model_states import FOREACH_TEMPORARIES, STATE_FLOATS, optimizer_kind, zero_paper_bytes

CUDA_CACHING_OVERHEAD = 0.05
"""Reserved over allocated bytes of PyTorch's CUDA caching allocator (block rounding, fragmentation): a prior."""


@dataclass
class MemoryEstimate:
    """Bytes per rank, by kind; ``host`` is the part offloaded to CPU/NVMe (not on the device). With activations
    (``estimate_memory(..., activations=...)``), ``peak`` is the device bytes at the step's highest phase
    (``peak_phase``), ``breakdown`` what it is made of, ``phases`` every phase's device bytes."""

    parameters: float
    gradients: float
    optimizer_states: float
    master_weights: float
    activations: float = 0.0
    """Saved for backward at the peak: every micro-batch in flight (plait's model: == SavedActivations)."""
    host: float = 0.0
    gradients_at_step: float = 0.0
    """Gradient bytes left when the optimizer steps (equal to ``gradients`` except under ZeRO-1: 4 Psi / N)."""
    peak: float = 0.0
    peak_phase: str = "step"
    breakdown: dict[str, float] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)
    allocator_overhead: float = 0.0
    """Reserved minus allocated at the peak (CUDA's caching allocator, ``CUDA_CACHING_OVERHEAD``; 0 on CPU)."""
    startup: float = 0.0
    """Device bytes when a meta-built model is materialised: the parameters at rest and the masters on the device."""
    startup_host: float = 0.0
    """Host scratch while materialising: one whole tensor, the largest (0 when only a parameter count is known)."""
    startup_eager: float = 0.0
    """A model built whole on each rank before parallelize: 4 Psi of the whole model."""

    @property
    def model_states(self) -> float:
        return self.parameters + self.gradients + self.optimizer_states + self.master_weights

    @property
    def total(self) -> float:
        """Model states at their peaks plus the saved activations (a sum of kinds, not a moment: see ``peak``)."""
        return self.model_states + self.activations

    @property
    def device(self) -> float:
        return self.total - self.host

    @property
    def reserved(self) -> float:
        """What the allocator holds from the device at the peak: ``peak`` plus its overhead."""
        return self.peak + self.allocator_overhead


# ---------------------------------------------------------------------- model states
def shard_ranks(layout: Layout) -> int:
    """N, the ranks ZeRO shards over: dp x cp, or under HSDP (``Layout.dp_replicate`` = R, zero >= 1) one replica
    group's dp x cp / R (the R groups hold the same shards)."""
    return layout.dp * layout.cp // (layout.dp_replicate if layout.zero >= 1 else 1)


def _states(psi: float, layout: Layout, kind: str) -> MemoryEstimate:
    n, stage = shard_ranks(layout), layout.zero
    states = STATE_FLOATS[kind] * 4 * psi
    offloaded = layout.offload != Offload.NONE and stage >= 1
    estimate = MemoryEstimate(
        parameters=4 * psi if stage < 3 else 4 * psi / n,
        gradients=4 * psi if stage < 2 else 4 * psi / n,  # ZeRO-1: the full local gradient, until reduced
        optimizer_states=states if stage == 0 else states / n,
        # ZeRO-1/2 keep an fp32 master shard, except on one rank without offload: the parameters are views of it
        master_weights=4 * psi / n if (stage in (1, 2) and (n > 1 or offloaded)) or (stage == 3 and offloaded) else 0.0,
        gradients_at_step=4 * psi if stage == 0 else 4 * psi / n,
    )
    if offloaded:
        estimate.host = estimate.optimizer_states + estimate.master_weights
    return estimate


def _with_experts(psi: float, routed: float, layout: Layout, kind: str) -> MemoryEstimate:
    """``_states`` of ``psi`` parameters beside ``routed`` routed expert parameters (already split over ep), whose
    states are sharded over edp (``experts.routed_layout``)."""
    estimate = _states(psi, layout, kind)
    if routed:
        more = _states(routed, routed_layout(layout), kind)
        for name in ("parameters", "gradients", "optimizer_states", "master_weights", "host", "gradients_at_step"):
            setattr(estimate, name, getattr(estimate, name) + getattr(more, name))
    return estimate


def _routed_count(model: Any, spec: ModelSpec | None) -> int:
    """The routed expert parameters of ``model`` (what ep splits): a module's ``GroupedExperts`` weights, a
    description's count (0 for a bare parameter count)."""
    if isinstance(model, nn.Module):
        from plait.models.moe import GroupedExperts

        experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
        return sum(w.numel() for m in experts for w in m.weights() if w.requires_grad)
    if spec is None or isinstance(model, int):
        return 0
    return spec.moe_blocks * routed_parameters(spec)


def _accumulates(layout: Layout) -> bool:
    """Whether full local gradients accumulate under no_sync before the reduction (micro-batches, pipelines)."""
    return layout.microbatches > 1 or layout.pp > 1


# ---------------------------------------------------------------------- the shape of the run
def _spec(model: Any, psi: int, shape: dict[str, Any]) -> ModelSpec:
    """The model description for the activation formulas: from ``shape``'s sizes (a parameter count was given),
    a ``ModelSpec``, a plait ``GPT``/``GPTConfig`` or a transformers model (through the planner's reader)."""
    if all(key in shape for key in ("hidden", "heads", "layers")):
        hidden = int(shape["hidden"])
        return ModelSpec(
            "given",
            int(shape["layers"]),
            hidden,
            int(shape["heads"]),
            int(shape.get("ffn", 4 * hidden)),
            int(shape.get("vocab", 1)),
            int(shape.get("seq", 1)),
            kv_heads=shape.get("kv_heads"),
            gated=bool(shape.get("gated", False)),
            learned_positions=bool(shape.get("learned_positions", True)),
        )
    if isinstance(model, int):
        raise ValueError(
            f"activations={shape} for a parameter count ({psi}) needs the model's sizes too. Fix: pass the model "
            f"(a GPT, GPTConfig, ModelSpec or transformers model), or add hidden, heads, layers (and vocab) to it."
        )
    from plait.planner.models import resolve_model

    spec = resolve_model(model)
    if not isinstance(spec, ModelSpec):
        raise ValueError("activations need a transformer model description, not measured layer profiles.")
    return spec


def _block_ranges(layers: int, stages: int, cuts: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) blocks of each pipeline stage: the layout's cuts, else an even split (the first stages take
    one more block each when ``stages`` does not divide ``layers``, as ``plan_split`` does)."""
    if cuts:
        bounds = [0, *cuts, layers]
    else:
        size, extra = divmod(layers, stages)
        bounds = [0]
        for stage in range(stages):
            bounds.append(bounds[-1] + size + (1 if stage < extra else 0))
    return list(zip(bounds, bounds[1:]))


def rank_in_flight_peaks(schedule: Any, stage_bytes: Sequence[float]) -> list[float]:
    """Per rank of a pipeline ``Schedule``: the most activation bytes it holds at once, walking its actions in
    order (F of stage s adds ``stage_bytes[s]``, B or W of it frees them). Where the backward is split, plait's I
    keeps the whole graph for W (``PipelineStage.backward_input``: ``retain_graph``), so a micro-batch's saved
    tensors stay until its W, not only the layer inputs W needs (Qi et al. 2023's accounting): on ZB-H1 every rank
    holds p micro-batches at its peak, not 1F1B's p - r (tests/test_vshape_memory.py measures it)."""
    peaks = []
    for actions in schedule.actions:
        held = peak = 0.0
        for action in actions:
            if action.kind == Kind.FORWARD:
                held += stage_bytes[action.stage]
            elif action.kind in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT):
                held -= stage_bytes[action.stage]
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def _recompute_of(layout: Layout, block: int) -> str:
    if isinstance(layout.recompute, tuple):
        return "full" if block in layout.recompute else "none"
    return str(layout.recompute)


def estimate_memory(
    model: nn.Module | int | Any,
    layout: Layout,
    optimizer: str | torch.optim.Optimizer = "adamw",
    world_size: int | None = None,
    activations: dict[str, Any] | None = None,
    device: str = "cuda",
) -> MemoryEstimate:
    """Per-rank bytes of plait's model states and, given ``activations``, of a whole training step's peak.

    ``model``: a module (its trainable parameters are counted: call this before ``parallelize``, since ZeRO-3
    leaves the model's own parameters empty between uses), a parameter count, a ``ModelSpec`` or a ``GPTConfig``.
    The data-parallel degree comes from ``layout`` (resolved with ``world_size`` when it holds a -1); tensor and
    pipeline parallelism divide the parameters by tp and by stage.

    ``activations``: ``{"batch": samples per micro-batch on a rank, "seq": tokens per sample}`` and optionally
    ``attention`` ("flash", the default, or "math"), ``dropout`` (default: a plait GPT's or GPTConfig's, else 0) and,
    for a parameter count, the sizes ``hidden``, ``heads``, ``layers`` (``vocab``, ``ffn``, ``kv_heads``, ``gated``,
    ``learned_positions``), and ``loss_chunk``: tokens per chunk of a chunked cross-entropy
    (``plait.models.loss.ChunkedCrossEntropy``; 0, the default: whole logits). ``device``: "cuda" (dropout masks of
    1 byte, foreach optimizer temporaries, the caching allocator's overhead) or "cpu"."""
    if not layout.is_resolved:
        layout = layout.resolve(world_size or 1)
    kind = optimizer_kind(optimizer)
    if isinstance(model, int):
        psi_model = model
    elif isinstance(model, nn.Module):
        psi_model = sum(p.numel() for p in model.parameters() if p.requires_grad)
    else:
        psi_model = -1  # a description: counted from the spec below
    shape = dict(activations or {})
    config = getattr(model, "config", model)  # a plait GPT's GPTConfig (or the GPTConfig itself): its dropout
    dropout = getattr(config, "dropout", None)
    if "dropout" not in shape and isinstance(dropout, float):
        shape["dropout"] = dropout
    spec = _spec(model, psi_model, shape) if activations or psi_model < 0 else None
    if psi_model < 0:
        assert spec is not None
        psi_model = spec.parameters
    routed = _routed_count(model, spec)
    if not activations:
        dense = (psi_model - routed) / layout.tp / layout.pp
        estimate = _with_experts(dense, routed / layout.ep / layout.pp, layout, kind)
        estimate.peak = _step_phase(estimate, layout, kind, device)
        estimate.phases = {"step": estimate.peak}
    else:
        assert spec is not None
        estimate = _estimate_step(spec, psi_model, layout, kind, shape, device, routed, Routing.of(config))
    return _with_startup(estimate, psi_model, _largest_tensor(model, spec))


def _largest_tensor(model: Any, spec: ModelSpec | None) -> int:
    """Elements of the model's largest parameter: a module's own, a description's largest matrix (the embedding
    or the head for a language model, else an MLP matrix), 0 for a bare parameter count."""
    if isinstance(model, nn.Module):
        return max((p.numel() for p in model.parameters()), default=0)
    if spec is None and not isinstance(model, int):
        from plait.planner.models import resolve_model

        resolved = resolve_model(model)
        spec = resolved if isinstance(resolved, ModelSpec) else None
    if spec is None:
        return 0
    return max(spec.vocab * spec.hidden, spec.ffn * spec.hidden, spec.hidden * spec.hidden)


def _with_startup(estimate: MemoryEstimate, psi_model: float, largest: int) -> MemoryEstimate:
    """The start-up terms (module docstring): the share at rest with its on-device masters, one host tensor."""
    on_device_masters = estimate.master_weights if not estimate.host else 0.0
    estimate.startup = estimate.parameters + on_device_masters
    estimate.startup_host = 4.0 * largest
    estimate.startup_eager = 4.0 * psi_model
    estimate.phases["start-up"] = estimate.startup
    return estimate


def _step_phase(states: MemoryEstimate, layout: Layout, kind: str, device: str) -> float:
    base = states.parameters + states.optimizer_states + states.master_weights - states.host
    temporaries = 0.0
    if device == "cuda" and not (layout.offload != Offload.NONE and layout.zero >= 1):
        stepped = states.optimizer_states / max(1, 4 * STATE_FLOATS[kind]) if STATE_FLOATS[kind] else 0.0
        temporaries = 4 * stepped * FOREACH_TEMPORARIES.get(kind, 0)
    return base + states.gradients_at_step + temporaries


def _run_forward(spec: ModelSpec, layout: Layout, shape: dict[str, Any], device: str) -> Forward:
    return Forward(
        batch=int(shape["batch"]),
        seq=int(shape.get("seq", spec.seq)) // layout.cp,
        precision=layout.precision,
        tp=layout.tp,
        sequence_parallel=layout.sequence_parallel,
        attention=str(shape.get("attention", "flash")),
        dropout=float(shape.get("dropout", 0.0)),
        mask_bytes=1 if device == "cuda" else None,
        per_sample_positions=layout.cp > 1,
        loss_chunk=int(shape.get("loss_chunk", 0)),
    )


def stage_activations(
    spec: ModelSpec, layout: Layout, fwd: Forward, ends: bool = True, routing: Routing = PLAIT_ROUTING
) -> tuple[list[float], list[tuple[int, int]]]:
    """Per pipeline stage, the saved-activation bytes of one micro-batch (plait accounting; ``ends``: with the
    embeddings and the head; MoE blocks by ``routing``), and the [start, end) blocks of every stage."""
    stages = layout.pp * layout.virtual_stages
    ranges = _block_ranges(spec.layers, stages, layout.pipeline_cuts)
    recomputed_any = layout.recompute in (Recompute.FULL, Recompute.OP) or isinstance(layout.recompute, tuple)
    stage_bytes = []
    for s, (start, end) in enumerate(ranges):
        blocks = sum(
            layer_bytes(spec, fwd, i, _recompute_of(layout, i), "plait", layout.ep, routing) for i in range(start, end)
        )
        outside = ends_bytes(spec, fwd, s == 0, s == stages - 1, "plait", recomputed_any) if ends else 0.0
        if ends and s > 0 and any(_recompute_of(layout, i) in ("full", "op") for i in range(start, end)):
            outside += positions_bytes(fwd)  # a later stage's own positions, its checkpointed blocks' input
        stage_bytes.append(blocks + outside)
    return stage_bytes, ranges


def rank_activations(
    spec: ModelSpec, layout: Layout, fwd: Forward, ends: bool = True, routing: Routing = PLAIT_ROUTING
) -> tuple[list[float], list[tuple[int, int]]]:
    """Per pipeline rank, the most saved-activation bytes it holds at once (every micro-batch its schedule keeps
    in flight: ``stage_activations`` walked over the schedule, ``rank_in_flight_peaks``), and the [start, end)
    blocks of every stage."""
    stage_bytes, ranges = stage_activations(spec, layout, fwd, ends, routing)
    if layout.pp == 1:
        return [stage_bytes[0]], ranges
    from plait.parallel.pipeline.schedule import build_schedule

    schedule = build_schedule(layout.schedule, layout.pp, layout.microbatches, layout.virtual_stages)
    return rank_in_flight_peaks(schedule, stage_bytes), ranges


def _estimate_step(
    spec: ModelSpec,
    psi_model: int,
    layout: Layout,
    kind: str,
    shape: dict[str, Any],
    device: str,
    routed_model: int = 0,
    routing: Routing = PLAIT_ROUTING,
) -> MemoryEstimate:
    fwd = _run_forward(spec, layout, shape, device)
    stages = layout.pp * layout.virtual_stages
    whole = "layers" not in shape or "vocab" in shape  # sizes without a vocabulary: the blocks only
    in_flight, ranges = rank_activations(spec, layout, fwd, ends=whole, routing=routing)
    best: MemoryEstimate | None = None
    for rank, saved in enumerate(in_flight):
        owned = rank_stages(layout.pp, layout.virtual_stages, placement_of(layout.schedule))[rank]
        blocks = [i for s in owned for i in range(*ranges[s])]
        has_first, has_last = 0 in owned, stages - 1 in owned
        psi: float = psi_model - routed_model
        routed: float = routed_model
        if layout.pp > 1 and psi_model == spec.parameters:  # the stages' own parameters
            psi, routed = stage_parameters(spec, blocks, has_first, has_last)
        elif layout.pp > 1:  # a module the spec does not count exactly: an even share
            psi, routed = psi / layout.pp, routed / layout.pp
        estimate = _rank_peak(
            spec, psi / layout.tp, layout, kind, fwd, saved, blocks, has_last and whole, device, routed / layout.ep
        )
        if best is None or estimate.peak > best.peak:
            best = estimate
    assert best is not None
    return best


def _rank_peak(
    spec: ModelSpec,
    psi: float,
    layout: Layout,
    kind: str,
    fwd: Forward,
    saved: float,
    blocks: list[int],
    last: bool,
    device: str,
    routed: float = 0.0,
) -> MemoryEstimate:
    """The phases of one rank's step (module docstring) and their maximum; ``routed``: this rank's routed expert
    parameters besides ``psi``."""
    estimate = _with_experts(psi, routed, layout, kind)
    n = shard_ranks(layout)
    if _accumulates(layout) and layout.zero >= 2:  # no_sync: the full local gradient beside the shard
        estimate.gradients = 4 * psi + 4 * psi / n + (4 * routed + 4 * routed * layout.ep / n if routed else 0.0)
    estimate.activations = saved
    base = estimate.parameters + estimate.optimizer_states + estimate.master_weights - estimate.host
    accumulated = estimate.gradients if _accumulates(layout) else 0.0
    gathered = 0.0
    if layout.zero == 3:  # the root unit (embeddings, final norm, head) and one block, whole, in fp32
        root = (spec.embedding_parameters + spec.head_parameters) if layout.pp == 1 else 0.0
        gathered = 4 * (root + spec.block_parameters) / layout.tp
    loss = loss_buffer_bytes(spec, fwd) if last else 0.0
    phases = {"loss": base + accumulated + saved + loss + gathered}
    on_device = 0.0 if estimate.host else 1.0  # offload moves optimizer states and masters together
    parts = {
        "parameters": estimate.parameters,
        "optimizer_states": on_device * estimate.optimizer_states,
        "master_weights": on_device * estimate.master_weights,
        "gradients": accumulated,
        "activations": saved,
        "loss_buffers": loss,
        "gathered": gathered,
    }
    breakdowns = {"loss": parts}
    recomputed = [i for i in blocks if _recompute_of(layout, i) == "full"]
    if recomputed or layout.recompute in (Recompute.SELECTIVE, Recompute.OP):
        mode = "full" if recomputed else str(layout.recompute)
        again = max(  # the largest block's (an MoE block's where the rank has one)
            layer_bytes(spec, fwd, i, "none", "plait", layout.ep) - layer_bytes(spec, fwd, i, mode, "plait", layout.ep)
            for i in (recomputed or blocks or [0])
        )
        head = 4 * spec.hidden * spec.vocab / layout.tp if last else 0.0  # the head's gradient, by then
        phases["recompute"] = base + max(accumulated, head) + saved + again + gathered
        breakdowns["recompute"] = {**parts, "gradients": max(accumulated, head), "loss_buffers": 0.0, "again": again}
    unit = 4 * spec.block_parameters / layout.tp
    copy = 4 * (psi + routed) if layout.zero == 1 else (unit if layout.zero == 3 else 0.0)
    phases["backward end"] = base + estimate.gradients + copy
    breakdowns["backward end"] = {**parts, "gradients": estimate.gradients, "activations": 0.0, "loss_buffers": 0.0}
    breakdowns["backward end"]["gathered"] = copy
    phases["step"] = _step_phase(estimate, layout, kind, device)
    breakdowns["step"] = {**parts, "gradients": estimate.gradients_at_step, "activations": 0.0, "loss_buffers": 0.0}
    breakdowns["step"]["gathered"] = phases["step"] - base - estimate.gradients_at_step
    estimate.peak_phase = max(phases, key=lambda name: phases[name])
    estimate.peak, estimate.phases = phases[estimate.peak_phase], phases
    estimate.breakdown = breakdowns[estimate.peak_phase]
    estimate.allocator_overhead = CUDA_CACHING_OVERHEAD * estimate.peak if device == "cuda" else 0.0
    return estimate


def activation_bytes(
    seq: int,
    batch: int,
    hidden: int,
    heads: int,
    layers: int,
    tp: int = 1,
    recompute_layers: int = 0,
    act_bytes: int = 2,
    sequence_parallel: bool = False,
) -> float:
    """Activations held for backward by ``layers`` transformer layers by Korthikanti et al. 2022 (eqs. 2-4; 2 s b h
    per recomputed layer, / t with SP), scaled by ``act_bytes`` / 2: their GPT, which trains with dropout."""
    spec = ModelSpec("korthikanti", max(1, layers), hidden, heads, 4 * hidden, 1, seq, dropout=0.1)
    fwd = Forward(
        batch, seq, "fp32" if act_bytes == 4 else "bf16", tp, sequence_parallel, attention="math", dropout=0.1
    )
    kept = (layers - recompute_layers) * block_bytes(spec, fwd, "none", "korthikanti")
    return kept + recompute_layers * block_bytes(spec, fwd, "full", "korthikanti")


__all__ = [
    "CUDA_CACHING_OVERHEAD",
    "STATE_FLOATS",
    "optimizer_kind",
    "MemoryEstimate",
    "activation_bytes",
    "estimate_memory",
    "rank_activations",
    "rank_in_flight_peaks",
    "stage_activations",
    "shard_ranks",
    "zero_paper_bytes",
]
