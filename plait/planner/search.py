"""Search: every layout of a device count, pruned by memory, ranked by predicted step time.

Enumerated: tp and cp in powers of two (tp within a node and dividing the heads; cp dividing the sequence),
pp over the divisors of what is left (at most the layer count), dp the rest (dividing the global batch);
micro-batch size in powers of two; the schedule (1F1B, interleaved with 2 chunks, ZB-H1) when pp > 1; ZeRO
stage; recomputation; CPU offload; Megatron sequence parallelism whenever tp > 1 (it only removes replicated
work and memory). Pruning that loses nothing under this cost model: a layout whose model states alone exceed
the device is skipped before it is timed; full recomputation is tried only where keeping activations does not
fit, and offload only where nothing else fits (both only add time here). Candidates are timed with the
pipeline's closed forms (``predict(exact=False)``); the best layout of each shape (tp, cp, pp, dp, micro-batches,
schedule) is kept, its ZeRO stage chosen by time then memory, and the shortlist is re-timed with the schedule
simulator before the final ranking.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from plait.errors import ConfigError, LayoutError
from plait.layout import Layout
from plait.logging import get_logger
from plait.planner.costs import IMPLEMENTATIONS, Implementation
from plait.planner.hardware import Hardware, get_hardware
from plait.planner.memory import model_state_bytes
from plait.planner.models import ModelSpec, resolve_model
from plait.planner.predict import Prediction, fmt_bytes, predict

logger = get_logger(__name__)


@dataclass
class PlanResult:
    """The ranked layouts (best first) and what the search looked at."""

    model: ModelSpec
    hardware: Hardware
    world_size: int
    global_batch: int
    candidates: list[Prediction]
    evaluated: int
    pruned: int
    seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Prediction:
        return self.candidates[0]

    def why_runner_up_loses(self) -> str:
        """The largest difference between the best layout's step-time parts and the runner-up's."""
        if len(self.candidates) < 2:
            return "no runner-up: only one layout fits"
        best, second = self.candidates[0], self.candidates[1]
        gap = second.step_time / best.step_time - 1
        part = max(best.time, key=lambda k: second.time[k] - best.time[k])
        delta = second.time[part] - best.time[part]
        if delta <= 0:
            return f"runner-up is {gap:.1%} slower overall (no single part dominates)"
        return (
            f"runner-up ({second.layout.short()}) is {gap:.1%} slower: its {part.replace('_', ' ')} takes "
            f"{second.time[part]:.3g} s vs {best.time[part]:.3g} s"
        )


def _powers_of_two(limit: int) -> list[int]:
    values, v = [], 1
    while v <= limit:
        values.append(v)
        v *= 2
    return values


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order, from its prime factorisation (sympy: trial division up to
    sqrt(n) and better), so a large prime device count costs milliseconds, not a loop over n."""
    from sympy import divisors

    return [int(d) for d in divisors(n)]


def _shapes(
    spec: ModelSpec, hw: Hardware, world_size: int, batch: int | None, max_cp: int
) -> list[tuple[int, int, int, int]]:
    """Every (tp, cp, pp, dp) with tp x cp x pp x dp = ``world_size`` that the search may use: tp a power of two
    within a node dividing the heads (and the kv heads, or divided by them), cp a power of two dividing the
    sequence with >= 512 tokens per rank, pp up to the layer count, and dp dividing ``batch`` (None: any dp)."""
    shapes = []
    for tp, cp in _tp_cp(spec, hw, max_cp):
        if world_size % (tp * cp) == 0:
            rest = world_size // (tp * cp)
            for pp in _divisors(rest):
                if pp <= spec.layers and (batch is None or batch % (rest // pp) == 0):
                    shapes.append((tp, cp, pp, rest // pp))
    return shapes


def _tp_cp(spec: ModelSpec, hw: Hardware, max_cp: int) -> list[tuple[int, int]]:
    """The (tp, cp) pairs ``_shapes`` allows for this model on this hardware, whatever the device count."""
    return [
        (tp, cp)
        for tp in _powers_of_two(hw.devices_per_node)
        if spec.heads % tp == 0 and (spec.kv % tp == 0 or tp % spec.kv == 0)
        for cp in _powers_of_two(max_cp)
        if spec.seq % cp == 0 and (cp == 1 or spec.seq // cp >= 512)
    ]


def _no_shape_error(spec: ModelSpec, hw: Hardware, world_size: int, batch: int, max_cp: int) -> ConfigError:
    """Why no (tp, cp, pp, dp) splits ``world_size`` devices for a global batch of ``batch``, and the nearest
    global batches and device counts that do split."""
    dps = sorted({dp for *_, dp in _shapes(spec, hw, world_size, None, max_cp)})
    batches = sorted(
        {b for dp in dps for b in (batch // dp * dp, -(-batch // dp) * dp) if b > 0}, key=lambda b: (abs(b - batch), b)
    )[:3]
    counts: set[int] = set()
    for dp in _divisors(batch):  # world = tp x cp x pp x dp with dp dividing the batch
        for tp, cp in _tp_cp(spec, hw, max_cp):
            counts.update(tp * cp * pp * dp for pp in range(1, spec.layers + 1))
    below = max((c for c in counts if c < world_size), default=None)
    above = min((c for c in counts if c > world_size), default=None)
    near = " or ".join(str(c) for c in (below, above) if c is not None)
    batch_fix = (
        f"a global batch that dp splits: {' or '.join(map(str, batches))} (dp can be "
        f"{', '.join(map(str, dps[:6]))}{'...' if len(dps) > 6 else ''} on {world_size} devices)"
        if batches
        else "another device count"
    )
    return ConfigError(
        f"no layout of {world_size} devices splits a global batch of {batch} for {spec.name}: dp must divide the "
        f"batch, tp ({hw.devices_per_node} per node at most) and cp are powers of two, and pp <= {spec.layers} "
        f"layers. Fix: use {batch_fix}, or {near} devices with global batch {batch}."
    )


def plan(
    model: Any,
    world_size: int,
    gpu: str | Hardware = "h100",
    seq: int | None = None,
    global_batch: int | None = None,
    top: int = 5,
    precision: str = "bf16",
    implementation: str | Implementation = "plait",
    max_micro_batch: int = 8,
    schedules: tuple[str, ...] = ("1f1b", "interleaved", "zero-bubble"),
    max_cp: int = 16,
) -> PlanResult:
    """Rank every layout of ``world_size`` devices for ``model`` (see module doc); raises ConfigError when
    nothing fits, naming the smallest memory any layout needs and what would help."""
    started = time.perf_counter()
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ConfigError(f"cannot plan for {world_size!r} devices. Fix: give --gpus as a positive whole number.")
    spec = resolve_model(model, seq)
    if not isinstance(spec, ModelSpec):
        raise ConfigError(
            "plan() ranks layouts of a transformer ModelSpec. Fix: pass a model name, config.json, "
            "GPTConfig or GPT (profiled models: use inter_op_plan on their layer costs)."
        )
    hw = get_hardware(gpu)
    impl = IMPLEMENTATIONS[implementation] if isinstance(implementation, str) else implementation
    batch = global_batch or max(1, world_size)
    found: list[Prediction] = []
    evaluated = pruned = 0
    least_states = float("inf")
    shapes = _shapes(spec, hw, world_size, batch, max_cp)
    if not shapes:
        raise _no_shape_error(spec, hw, world_size, batch, max_cp)
    for tp, cp, pp, dp in shapes:
        per_dp = batch // dp
        stage_psi = (spec.parameters / pp + spec.embedding_parameters) / tp
        for mbs in [b for b in _powers_of_two(min(max_micro_batch, per_dp)) if per_dp % b == 0]:
            m = per_dp // mbs
            for schedule, v in _schedules(pp, m, spec.layers, schedules):
                for zero in (0, 1, 2, 3) if dp * cp > 1 else (0,):
                    base = Layout(
                        dp=dp,
                        tp=tp,
                        pp=pp,
                        cp=cp,
                        zero=zero,
                        microbatches=m,
                        schedule=schedule,
                        virtual_stages=v,
                        precision=precision,
                        sequence_parallel=tp > 1,
                    )
                    params, grads, states, host = model_state_bytes(stage_psi, base, impl)
                    floor = params + grads + states - (states if zero else 0.0)  # with offload
                    least_states = min(least_states, floor + impl.reserved_bytes)
                    if floor + impl.reserved_bytes > hw.memory_bytes:
                        pruned += 1
                        continue
                    for option in (
                        {},
                        {"recompute": "full"},
                        {"offload": "cpu"},
                        {"recompute": "full", "offload": "cpu"},
                    ):
                        if "offload" in option and not zero:
                            continue
                        layout = Layout(**{**base.to_dict(), **option})
                        try:
                            prediction = predict(spec, layout, hw, batch, implementation=impl, exact=False)
                        except LayoutError:
                            pruned += 1
                            break
                        evaluated += 1
                        if prediction.fits:
                            found.append(prediction)
                            break
    if not found:
        raise ConfigError(
            f"{spec.name} ({spec.parameters / 1e9:.1f}B parameters) fits no layout of {world_size} x {hw.name} "
            f"({fmt_bytes(hw.memory_bytes)} each) at global batch {batch}, seq {spec.seq}: the smallest model-state "
            f"footprint any layout reaches is {fmt_bytes(least_states)} per device before activations. Fix: use "
            f"more devices ({_more_devices(least_states, hw.memory_bytes, world_size)}), a GPU with "
            f"more memory, a shorter --seq or a smaller --global-batch."
        )
    best_of: dict[tuple[Any, ...], Prediction] = {}
    for candidate in found:  # one entry per structure: its fastest (then smallest) ZeRO / recompute / offload
        lay = candidate.layout
        key = (lay.tp, lay.cp, lay.pp, lay.dp, lay.microbatches, lay.schedule, lay.virtual_stages)
        rank = (round(candidate.step_time, 12), candidate.memory.device)
        if key not in best_of or rank < (round(best_of[key].step_time, 12), best_of[key].memory.device):
            best_of[key] = candidate
    shortlist = sorted(best_of.values(), key=lambda p: (round(p.step_time, 12), p.memory.device))[: max(3 * top, 8)]
    exact = [predict(spec, c.layout, hw, batch, implementation=impl, exact=True) for c in shortlist]
    exact = [c for c in exact if c.fits] or exact
    exact.sort(key=lambda p: (round(p.step_time, 12), p.memory.device))
    result = PlanResult(spec, hw, world_size, batch, exact[:top], evaluated, pruned, time.perf_counter() - started)
    logger.info(
        "planned %s on %d x %s: %d layouts timed, %d pruned, %.2f s",
        spec.name,
        world_size,
        hw.name,
        evaluated,
        pruned,
        result.seconds,
    )
    return result


def _more_devices(least_states: float, memory: float, world_size: int) -> str:
    """Roughly how many devices would hold the model states, scaling the smallest footprint seen by device count."""
    if least_states == float("inf"):
        return "a count that gives the search a layout to time"
    return f"roughly {max(2, int(least_states / memory * world_size) + 1)}+"


def _schedules(pp: int, m: int, layers: int, allowed: tuple[str, ...]) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    options = [(name, 1) for name in allowed if name in ("1f1b", "zero-bubble", "gpipe")]
    if "interleaved" in allowed and m % pp == 0 and layers >= 2 * pp:
        options.append(("interleaved", 2))
    return options


__all__ = ["PlanResult", "plan"]
