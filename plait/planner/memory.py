"""Memory per rank: ``estimate_memory`` (what plait's own implementation holds) and the planner's per-stage
model, both from the published formulas below.

Model states: ``zero_paper_bytes`` (Rajbhandari et al. 2020, Figure 1: 2 + 2 + K bytes per
parameter, K = 12 for mixed-precision Adam, split by ZeRO stage over the N = dp x cp ranks that share a
replica), or ``estimate_memory`` for plait's own fp32 implementation. Offload (ZeRO-Offload, Ren et al.
2021) moves the optimizer states (and fp32 master) to host memory.

Activations: ``activation_bytes`` (Korthikanti et al. 2022, eq. 2): s b h (34 + 5 a s / h) per
block, s b h (10 + 24/t + 5 a s / (h t)) with tensor parallel t, and the whole of it / t with sequence
parallelism (their eq. 4); 2 s b h (/ t with sequence parallelism) under full recomputation, plus one block's
full activations while it is being recomputed. Context parallel divides s. Flash attention removes the
5 a s^2 b score term. The last stage also keeps the fp32 logits, 4 s b V / t bytes (Korthikanti sec. 4.3).
A pipeline stage holds the activations of as many stage-micro-batches as the schedule keeps in flight
(``plait.parallel.pipeline.simulate``'s ``peak_activations``).

Model states, ZeRO paper (Rajbhandari et al. 2020, sec. 3-5), for Psi parameters on N data-parallel ranks,
mixed-precision Adam (2 bytes params + 2 bytes grads + K = 12 bytes of fp32 master, momentum, variance):

    stage 0: (2 + 2 + K) Psi      stage 1: (2 + 2) Psi + K Psi / N
    stage 2: 2 Psi + (2 + K) Psi / N      stage 3: (2 + 2 + K) Psi / N

``zero_paper_bytes`` is exactly that. ``estimate_memory`` applies the same accounting to plait's own
implementation, which keeps parameters and gradients in fp32 (autocast computes in bf16/fp16 from fp32 weights):
params 4 Psi, grads 4 Psi, optimizer states S Psi (S = 8 for Adam/AdamW, 4 for SGD with momentum, 0 without),
and, under ZeRO 1-2, a separate fp32 master shard of 4 Psi / N (under ZeRO-3 the shard *is* the master, unless
it is offloaded: then a host copy of 4 Psi / N is the master).

Every figure is the most a rank holds of that kind over a training step, which is also what it holds at the
optimizer step and between steps, except for gradients: ZeRO-1 holds the full local gradient (4 Psi) from the
backward pass until ``finish_backward`` reduce-scatters it, and then only its shard's sum (4 Psi / N). So
``gradients`` is the peak (4 Psi under stages 0-1, 4 Psi / N under 2-3) and ``gradients_at_step`` what is left
when the optimizer steps; between steps no gradient is held. Communication buffers in flight (a ZeRO-2 bucket
being reduce-scattered, ZeRO-3's gathered units) are working memory, not model states, and are not counted.
Activations per transformer layer (Korthikanti et al. 2022, eq. 2): s b h (34 + 5 a s / h) bytes with 2-byte
activations, s b h (10 + 24/t + 5 a s / (h t)) with tensor parallelism t (eq. 3), s b h (34 + 5 a s / h) / t with
tensor and sequence parallelism (eq. 4: the norm/dropout/residual regions split along the sequence too; plait's
SP keeps the gathered inputs of q/k/v and of the MLP whole instead of re-gathering them in backward, which adds
4 s b h (1 - 1/t): see docs/tensor_parallel.md), and 2 s b h (2 s b h / t with SP) with full
recomputation (only the layer input is kept); scaled by (activation bytes / 2) for fp32.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from plait.layout import Layout
from plait.planner.costs import Implementation, act_bytes
from plait.planner.models import ModelSpec

STATE_FLOATS = {"adam": 2, "adamw": 2, "sgd": 0, "sgd_momentum": 1, "adagrad": 1, "rmsprop": 1}
"""fp32 state tensors each optimizer keeps per parameter element."""


def zero_paper_bytes(psi: float, n: int, stage: int, k: int = 12) -> float:
    """Model-state bytes per rank for ``psi`` parameters, ``n`` ranks, ZeRO ``stage`` (the paper's Figure 1)."""
    if stage == 0:
        return (2 + 2 + k) * psi
    if stage == 1:
        return (2 + 2) * psi + k * psi / n
    if stage == 2:
        return 2 * psi + (2 + k) * psi / n
    if stage == 3:
        return (2 + 2 + k) * psi / n
    raise ValueError(f"ZeRO stage {stage} does not exist; use 0, 1, 2 or 3")


def optimizer_kind(optimizer: str | torch.optim.Optimizer) -> str:
    """Map an optimizer (or its name) to a ``STATE_FLOATS`` key."""
    if isinstance(optimizer, torch.optim.Optimizer):
        name = type(optimizer).__name__.lower()
        if name == "sgd":
            return "sgd_momentum" if optimizer.defaults.get("momentum", 0) else "sgd"
        optimizer = name
    if optimizer not in STATE_FLOATS:
        raise ValueError(f"optimizer {optimizer!r} is unknown to the estimator; use one of {', '.join(STATE_FLOATS)}")
    return optimizer


@dataclass
class MemoryEstimate:
    """Bytes per rank, by kind; ``host`` is the part offloaded to CPU/NVMe (not on the device)."""

    parameters: float
    gradients: float
    optimizer_states: float
    master_weights: float
    activations: float = 0.0
    host: float = 0.0
    gradients_at_step: float = 0.0
    """Gradient bytes left when the optimizer steps (equal to ``gradients`` except under ZeRO-1: 4 Psi / N)."""

    @property
    def model_states(self) -> float:
        return self.parameters + self.gradients + self.optimizer_states + self.master_weights

    @property
    def total(self) -> float:
        return self.model_states + self.activations

    @property
    def device(self) -> float:
        return self.total - self.host


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
    """Activations held for backward by ``layers`` transformer layers (Korthikanti et al. 2022)."""
    sbh = seq * batch * hidden
    per_layer = (
        sbh * (10 + 24 / tp + 5 * heads * seq / (hidden * tp)) if tp > 1 else sbh * (34 + 5 * heads * seq / hidden)
    )
    if sequence_parallel and tp > 1:
        per_layer = sbh * (34 + 5 * heads * seq / hidden) / tp
        sbh = sbh / tp  # a recomputed layer keeps only its input, split along the sequence
    kept = (layers - recompute_layers) * per_layer + recompute_layers * 2 * sbh
    return kept * act_bytes / 2


def estimate_memory(
    model: nn.Module | int,
    layout: Layout,
    optimizer: str | torch.optim.Optimizer = "adamw",
    world_size: int | None = None,
    activations: dict[str, int] | None = None,
) -> MemoryEstimate:
    """Per-rank bytes of plait's model states (and activations, given ``seq, batch, hidden, heads, layers``).

    ``model`` is a module (its trainable parameters are counted: call this before ``parallelize``, since ZeRO-3
    leaves the model's own parameters empty between uses) or a parameter count; the data-parallel
    degree comes from ``layout`` (resolved with ``world_size`` when it holds a -1)."""
    psi = model if isinstance(model, int) else sum(p.numel() for p in model.parameters() if p.requires_grad)
    if not layout.is_resolved:
        layout = layout.resolve(world_size or 1)
    n = layout.dp * layout.cp
    states = STATE_FLOATS[optimizer_kind(optimizer)] * 4 * psi
    stage = layout.zero
    offloaded = layout.offload != "none" and stage >= 1
    estimate = MemoryEstimate(
        parameters=4 * psi if stage < 3 else 4 * psi / n,
        gradients=4 * psi if stage < 2 else 4 * psi / n,  # ZeRO-1: the full local gradient, until reduced
        optimizer_states=states if stage == 0 else states / n,
        master_weights=4 * psi / n if stage in (1, 2) or (stage == 3 and offloaded) else 0.0,
        gradients_at_step=4 * psi if stage == 0 else 4 * psi / n,
    )
    if offloaded:
        estimate.host = estimate.optimizer_states + estimate.master_weights
    if activations:
        recompute = layout.recompute
        layers = activations["layers"]
        recomputed = layers if recompute == "full" else (0 if recompute == "none" else len(recompute))
        estimate.activations = activation_bytes(
            activations["seq"],
            activations["batch"],
            activations["hidden"],
            activations["heads"],
            layers,
            tp=layout.tp,
            recompute_layers=recomputed,
            act_bytes=2 if layout.precision != "fp32" else 4,
            sequence_parallel=layout.sequence_parallel,
        )
    return estimate


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one device, by kind (``host``: offloaded, not counted in ``device``)."""

    parameters: float
    gradients: float
    optimizer_states: float
    activations: float
    buffers: float
    reserved: float
    host: float = 0.0

    @property
    def device(self) -> float:
        return (
            self.parameters + self.gradients + self.optimizer_states + self.activations + self.buffers + self.reserved
        )

    def as_dict(self) -> dict[str, float]:
        return {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer": self.optimizer_states,
            "activations": self.activations,
            "buffers": self.buffers,
            "reserved": self.reserved,
            "host": self.host,
            "device": self.device,
        }


def model_state_bytes(psi: float, layout: Layout, impl: Implementation) -> tuple[float, float, float, float]:
    """(parameters, gradients, optimizer states, host) bytes per rank for ``psi`` parameters on this rank
    before ZeRO sharding, split over N = dp x cp ranks by ``layout.zero``."""
    n, stage = layout.dp * layout.cp, layout.zero
    if impl.state_accounting == "plait":
        est = estimate_memory(int(psi), layout)
        params, grads, states = est.parameters, est.gradients, est.optimizer_states + est.master_weights
        return params, grads, states, est.host
    params_and_grads = zero_paper_bytes(psi, n, stage, k=0)
    params = 2 * psi / n if stage == 3 else 2 * psi
    states = zero_paper_bytes(psi, n, stage) - params_and_grads
    host = states if (layout.offload != "none" and stage >= 1) else 0.0
    return params, params_and_grads - params, states, host


def block_activation_bytes(
    spec: ModelSpec, layout: Layout, micro_batch: int, seq: int, impl: Implementation, recomputed: bool
) -> float:
    """Bytes one block keeps for backward for one micro-batch (module docstring)."""
    s_local, t, e = seq // layout.cp, layout.tp, act_bytes(layout.precision)
    sp = layout.sequence_parallel
    if recomputed:
        return activation_bytes(s_local, micro_batch, spec.hidden, spec.heads, 1, recompute_layers=1, act_bytes=e) / (
            t if sp else 1
        )
    full = activation_bytes(s_local, micro_batch, spec.hidden, spec.heads, 1, tp=1 if sp else t, act_bytes=e)
    if sp:
        full /= t
    if impl.flash_attention:
        full -= 5 * spec.heads * s_local * s_local * micro_batch * (e / 2) / t
    return full


def stage_memory(
    spec: ModelSpec,
    layout: Layout,
    impl: Implementation,
    micro_batch: int,
    seq: int,
    stage_params: float,
    stage_blocks: int,
    in_flight: int,
    last_stage: bool,
    block_params: float,
) -> MemoryBreakdown:
    """Per-device bytes of one pipeline stage holding ``stage_params`` parameters (before tp) and
    ``stage_blocks`` blocks, with ``in_flight`` stage-micro-batches of activations alive at the peak (counted in
    units of the stage's blocks / virtual stages)."""
    psi = stage_params / layout.tp
    params, grads, states, host = model_state_bytes(psi, layout, impl)
    if layout.pp > 1 and layout.zero >= 2:  # micro-batches accumulate unsharded gradients (no_sync) before the
        grads = model_state_bytes(psi, dataclasses.replace(layout, zero=1), impl)[1]  # one reduce-scatter per step
    recompute = layout.recompute == "full"
    per_block = block_activation_bytes(spec, layout, micro_batch, seq, impl, recompute)
    blocks_per_chunk = stage_blocks / layout.virtual_stages
    activations = in_flight * blocks_per_chunk * per_block
    if recompute:  # the block being recomputed holds its full activations for a moment
        activations += block_activation_bytes(spec, layout, micro_batch, seq, impl, False)
    if last_stage:
        activations += 4 * (seq // layout.cp) * micro_batch * spec.vocab / layout.tp
    e = act_bytes(layout.precision)
    buffers = 2 * layout.bucket_mb * 2**20 if layout.zero < 3 and layout.dp * layout.cp > 1 else 0.0
    if layout.zero == 3:  # the gathered block being used and the one prefetched
        buffers = 2 * block_params / layout.tp * e
        if layout.pp > 1 and layout.schedule == "zero-bubble":  # I and W gather the whole stage chunk
            buffers = max(buffers, psi / layout.virtual_stages * e)
    return MemoryBreakdown(params, grads, states - host, activations, buffers, impl.reserved_bytes, host)


__all__ = ["MemoryBreakdown", "block_activation_bytes", "model_state_bytes", "stage_memory"]
