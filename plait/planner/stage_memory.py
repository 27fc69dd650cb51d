"""The planner's memory per pipeline stage (``stage_memory``: model states, activations in flight, buffers and the
allocator's reserve of one device), from the same formulas as ``plait.planner.memory.estimate_memory``: model
states by ``model_state_bytes`` (the ZeRO paper's accounting, or plait's own for ``plait``), activations per block by
``plait.planner.activations`` under the implementation's accounting. Mixture-of-Experts stages add their routed
experts' states, split over ep and sharded over edp (``plait.planner.experts``), and their MoE blocks keep what
``plait.planner.expert_activations`` counts.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from plait.layout import SPLIT_BACKWARD, Layout, Offload, PipelineSchedule
from plait.models.spec import ModelSpec
from plait.planner.activations import Forward, block_bytes, ends_bytes, loss_buffer_bytes
from plait.planner.costs import Implementation, act_bytes
from plait.planner.expert_activations import layer_bytes
from plait.planner.experts import expert_split, routed_layout
from plait.planner.memory import CUDA_CACHING_OVERHEAD, _states, shard_ranks
from plait.planner.model_states import zero_paper_bytes


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


def _states_of(psi: float, layout: Layout, impl: Implementation) -> tuple[float, float, float, float]:
    """``model_state_bytes``, with the gradients of a pipeline under ZeRO-2/3 held whole: micro-batches accumulate
    unsharded gradients (no_sync) before the one reduce-scatter of the step."""
    params, grads, states, host = model_state_bytes(psi, layout, impl)
    if layout.pp > 1 and layout.zero >= 2:
        grads = model_state_bytes(psi, dataclasses.replace(layout, zero=1), impl)[1]
    return params, grads, states, host


def model_state_bytes(psi: float, layout: Layout, impl: Implementation) -> tuple[float, float, float, float]:
    """(parameters, gradients, optimizer states, host) bytes per rank for ``psi`` parameters on this rank
    before ZeRO sharding, split over N = dp x cp ranks (HSDP: dp x cp / R, ``shard_ranks``) by ``layout.zero``."""
    n, stage = shard_ranks(layout), layout.zero
    if impl.state_accounting == "plait":
        est = _states(psi, layout, "adamw")
        params, grads, states = est.parameters, est.gradients, est.optimizer_states + est.master_weights
        return params, grads, states, est.host
    params_and_grads = zero_paper_bytes(psi, n, stage, k=0)
    params = 2 * psi / n if stage == 3 else 2 * psi
    states = zero_paper_bytes(psi, n, stage) - params_and_grads
    host = states if (layout.offload != Offload.NONE and stage >= 1) else 0.0
    return params, params_and_grads - params, states, host


def accounting(impl: Implementation) -> str:
    """The activation accounting of an implementation: plait's own runtime ("plait") or Megatron-style
    ("korthikanti"), following its model-state accounting."""
    return "plait" if impl.state_accounting == "plait" else "korthikanti"


def _layout_forward(spec: ModelSpec, layout: Layout, impl: Implementation, micro_batch: int, seq: int) -> Forward:
    """How the planner's GPUs run one micro-batch's forward under ``layout``: activations at the precision's
    element size, the implementation's attention kernel, the model's dropout with 1-byte masks (CUDA's), this
    rank's share of the sequence and per-sample positions under context parallelism (a frozen dataclass: the
    cache key of ``_activation_terms``)."""
    return Forward(
        micro_batch,
        seq // layout.cp,
        "fp32" if act_bytes(layout.precision) == 4 else "bf16",
        layout.tp,
        layout.sequence_parallel,
        attention="flash" if impl.flash_attention else "math",
        dropout=spec.dropout,
        mask_bytes=1,
        per_sample_positions=layout.cp > 1,
    )


def block_activation_bytes(
    spec: ModelSpec,
    layout: Layout,
    micro_batch: int,
    seq: int,
    impl: Implementation,
    recomputed: bool | str,
) -> float:
    """Bytes one block keeps for backward for one micro-batch: ``recomputed`` True / "full" (whole block),
    "selective", or False / "none" (``plait.planner.activations``, by the implementation's accounting)."""
    mode = "full" if recomputed is True else ("none" if recomputed is False else str(recomputed))
    return block_bytes(spec, _layout_forward(spec, layout, impl, micro_batch, seq), mode, accounting(impl))


@functools.lru_cache(maxsize=65536)
def _activation_terms(
    spec: ModelSpec, fwd: Forward, kind: str, recomputed: bool
) -> tuple[tuple[tuple[str, float], ...], float, float, float]:
    """One block's bytes under each recompute mode ((mode, bytes) pairs: none, selective, op, full), the first and
    the last stage's ends and the loss buffers (plait accounting only), for one micro-batch: what
    ``stage_memory`` combines (cached: the search asks for the same shapes many times)."""
    per_block = tuple((m, block_bytes(spec, fwd, m, kind)) for m in ("none", "selective", "op", "full"))
    first = ends_bytes(spec, fwd, True, False, kind, recomputed)
    last = ends_bytes(spec, fwd, False, True, kind, recomputed)
    loss = loss_buffer_bytes(spec, fwd) if kind == "plait" else 0.0
    return per_block, first, last, loss


@functools.lru_cache(maxsize=65536)
def _moe_terms(spec: ModelSpec, fwd: Forward, kind: str, ep: int) -> tuple[tuple[str, float], ...]:
    """One MoE block's bytes under each recompute mode, for one micro-batch (cached as ``_activation_terms``)."""
    return tuple((m, layer_bytes(spec, fwd, spec.moe_start, m, kind, ep)) for m in ("none", "selective", "op", "full"))


def _largest_matrix(spec: ModelSpec) -> float:
    """Parameters of a block's largest weight matrix (the MLP's, or q/k/v's when they are wider)."""
    return float(max(spec.hidden * spec.ffn, spec.hidden * (spec.q_width + 2 * spec.kv * spec.head_dim)))


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
    *,
    first_block: int | None = None,
    first_stage: bool = False,
    routed_params: float = 0.0,
    moe_blocks: int = 0,
) -> MemoryBreakdown:
    """Per-device bytes of one pipeline stage holding ``stage_params`` parameters (before tp) and
    ``stage_blocks`` blocks, with ``in_flight`` stage-micro-batches of activations alive at the peak (counted in
    units of the stage's blocks / virtual stages). ``recompute`` as a tuple of blocks: the listed blocks among
    ``first_block`` .. (when given), else that share of the model's blocks. ``reserved``: the implementation's
    fixed reserve plus, on GPUs, the caching allocator's ``CUDA_CACHING_OVERHEAD`` of the rest. A
    Mixture-of-Experts stage: ``routed_params`` routed expert parameters besides ``stage_params`` (before ep splits
    them), ``moe_blocks`` of its blocks MoE blocks."""
    psi = stage_params / layout.tp
    params, grads, states, host = _states_of(psi, layout, impl)
    if routed_params:  # the routed experts: split over ep (and tp), their states sharded over edp
        more = _states_of(routed_params / expert_split(layout, impl), routed_layout(layout), impl)
        params, grads, states, host = (a + b for a, b in zip((params, grads, states, host), more))
    mode, kind = layout.recompute, accounting(impl)
    fwd = _layout_forward(spec, layout, impl, micro_batch, seq)
    pairs, first, last, loss = _activation_terms(spec, fwd, kind, mode != "none")
    per_block = dict(pairs)
    moe_block = dict(_moe_terms(spec, fwd, kind, layout.ep)) if moe_blocks else per_block
    kinds = [per_block, moe_block] if moe_blocks else [per_block]
    blocks_per_chunk = stage_blocks / layout.virtual_stages
    moe_per_chunk = moe_blocks / layout.virtual_stages
    none, full = per_block["none"], per_block["full"]
    if moe_blocks:  # the stage's average block
        none = ((blocks_per_chunk - moe_per_chunk) * none + moe_per_chunk * moe_block["none"]) / blocks_per_chunk
    if isinstance(mode, tuple):
        if first_block is None:
            recomputed = blocks_per_chunk * len(set(mode)) / spec.layers
        else:
            recomputed = (
                sum(1 for i in set(mode) if first_block <= i < first_block + stage_blocks) / layout.virtual_stages
            )
        chunk = recomputed * full + (blocks_per_chunk - recomputed) * none
    else:
        key = str(mode)
        chunk = (blocks_per_chunk - moe_per_chunk) * per_block[key] + moe_per_chunk * moe_block[key]
    activations = in_flight * chunk
    if mode == "full" or (isinstance(mode, tuple) and chunk < blocks_per_chunk * none):
        activations += max(k["none"] - k["full"] for k in kinds)  # a recomputed block's activations, for a moment
    elif mode in ("selective", "op"):  # what the block recomputes, while its backward runs
        activations += max(k["none"] - k[str(mode)] for k in kinds)
    ends_held = (
        in_flight if layout.schedule == PipelineSchedule.GPIPE else 1
    )  # 1F1B-like: the last stage's F is followed by its B
    activations += ends_held * ((first if first_stage else 0.0) + (last if last_stage else 0.0))
    if last_stage:
        activations += loss
    e = act_bytes(layout.precision)
    buffers = 2 * layout.bucket_mb * 2**20 if layout.zero < 3 and layout.dp * layout.cp > 1 else 0.0
    if layout.zero == 3:  # the gathered block being used and the one prefetched (or, module by module, at most
        gathered = min(2 * block_params, max(impl.zero3_live_limit, _largest_matrix(spec)))  # the live limit)
        buffers = gathered / layout.tp * e
        if layout.pp > 1 and layout.schedule in SPLIT_BACKWARD:  # I and W gather the whole stage chunk
            buffers = max(buffers, psi / layout.virtual_stages * e)
    allocated = params + grads + states - host + activations + buffers
    reserved = impl.reserved_bytes + (CUDA_CACHING_OVERHEAD * allocated if impl.reserved_bytes > 0 else 0.0)
    return MemoryBreakdown(params, grads, states - host, activations, buffers, reserved, host)


__all__ = [
    "MemoryBreakdown",
    "accounting",
    "block_activation_bytes",
    "model_state_bytes",
    "stage_memory",
]
