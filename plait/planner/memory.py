"""Memory per rank for the planner, reusing plait.memory's published formulas.

Model states: ``plait.memory.zero_paper_bytes`` (Rajbhandari et al. 2020, Figure 1: 2 + 2 + K bytes per
parameter, K = 12 for mixed-precision Adam, split by ZeRO stage over the N = dp x cp ranks that share a
replica), or ``plait.memory.estimate_memory`` for plait's own fp32 implementation. Offload (ZeRO-Offload, Ren
et al. 2021) moves the optimizer states (and fp32 master) to host memory.

Activations: ``plait.memory.activation_bytes`` (Korthikanti et al. 2022, eq. 2): s b h (34 + 5 a s / h) per
block, s b h (10 + 24/t + 5 a s / (h t)) with tensor parallel t, and the whole of it / t with sequence
parallelism (their eq. 4); 2 s b h (/ t with sequence parallelism) under full recomputation, plus one block's
full activations while it is being recomputed. Context parallel divides s. Flash attention removes the
5 a s^2 b score term. The last stage also keeps the fp32 logits, 4 s b V / t bytes (Korthikanti sec. 4.3).
A pipeline stage holds the activations of as many stage-micro-batches as the schedule keeps in flight
(``plait.parallel.pipeline.simulate``'s ``peak_activations``).
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass

from plait.config import Layout
from plait.memory import activation_bytes, estimate_memory, zero_paper_bytes
from plait.planner.costs import Implementation, act_bytes
from plait.planner.models import ModelSpec


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
        return self.parameters + self.gradients + self.optimizer_states + self.activations + self.buffers + \
            self.reserved

    def as_dict(self) -> dict[str, float]:
        return {"parameters": self.parameters, "gradients": self.gradients, "optimizer": self.optimizer_states,
                "activations": self.activations, "buffers": self.buffers, "reserved": self.reserved,
                "host": self.host, "device": self.device}


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


def block_activation_bytes(spec: ModelSpec, layout: Layout, micro_batch: int, seq: int, impl: Implementation,
                           recomputed: bool) -> float:
    """Bytes one block keeps for backward for one micro-batch (module docstring)."""
    s_local, t, e = seq // layout.cp, layout.tp, act_bytes(layout.precision)
    sp = layout.sequence_parallel
    if recomputed:
        return activation_bytes(s_local, micro_batch, spec.hidden, spec.heads, 1, recompute_layers=1,
                                act_bytes=e) / (t if sp else 1)
    full = activation_bytes(s_local, micro_batch, spec.hidden, spec.heads, 1, tp=1 if sp else t, act_bytes=e)
    if sp:
        full /= t
    if impl.flash_attention:
        full -= 5 * spec.heads * s_local * s_local * micro_batch * (e / 2) / t
    return full


def stage_memory(spec: ModelSpec, layout: Layout, impl: Implementation, micro_batch: int, seq: int,
                 stage_params: float, stage_blocks: int, in_flight: int, last_stage: bool,
                 block_params: float) -> MemoryBreakdown:
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
