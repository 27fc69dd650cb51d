"""Search: every layout of a device count, pruned by memory, ranked by predicted step time, with Alpa's two passes
(Zheng et al. 2022) inside.

Enumerated: tp and cp in powers of two (tp within a node and dividing the heads; cp dividing the sequence),
pp over the divisors of what is left (at most the layer count), dp the rest (dividing the global batch);
micro-batch size in powers of two; the schedule when pp > 1: 1F1B, ZB-H1 (the zero-bubble schedule plait's
runtime runs), interleaved 1F1B with v = 2, 3, 4, 6 or 8 chunks per rank, and the V-shaped ZB-V and DualPipeV
(two chunks per rank); ZeRO stage; recomputation
(selective where the runtime has it, full); CPU offload; for a Mixture-of-Experts model, expert parallelism ep: 1 and
every power of two dividing both the experts and the data ranks dp x cp (``experts.ep_options``; ep folds into the
data ranks, so it multiplies the layouts timed, not the shapes).

Alpa's passes:
- intra-op (``intra_op.solve_intra_op``, an ILP solved by HiGHS): for each tensor-parallel degree and micro-batch
  size, the per-operator sharding of a block in its tp group. Its norm choice sets ``sequence_parallel`` (sharding
  norms along the sequence is Megatron-SP); the chosen sharding is reported with the plan. plait's runtime runs
  Megatron's column / row pairs: where the ILP prefers another sharding of the linear layers, the plan keeps
  Megatron's and says so in its notes.
- inter-op (``inter_op``): every timed layout's stage boundaries, balancing each rank's total cost (uneven stages:
  the embedding and the output layer make the first and last stages lighter in blocks; interleaving balances
  ranks, not chunks). With one sub-mesh shape Alpa's objective sum t_i + (B - 1) max t_j is a constant plus
  (B - 1) max t_j, so its DP is the min-max split; ``PlanResult.notes`` reports the cross-check of the best plan's
  cuts against ``inter_op_plan`` itself. The cuts go into the layout (``Layout.pipeline_cuts``), so a written plan
  reaches ``plait train`` with them.

Pruning that loses nothing under this cost model: a layout whose model states alone exceed the device is skipped
before it is timed; recomputation is tried only where keeping activations does not fit, and offload only where
nothing else fits (both only add time here). Candidates are timed with the pipeline's closed forms
(``predict(exact=False)``, the fast path); the best layout of each shape (tp, cp, pp, dp, micro-batches, schedule,
chunks) is kept, its ZeRO stage chosen by time then memory, and the shortlist is re-timed with the schedule
simulator before the final ranking.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from plait.errors import ConfigError, LayoutError
from plait.layout import RECOMPUTE_MODES, SPLIT_BACKWARD, Layout
from plait.logging import get_logger
from plait.planner.costs import IMPLEMENTATIONS, Implementation, act_bytes
from plait.planner.experts import ep_options, expert_split, routed_layout, routed_parameters
from plait.planner.hardware import EFFICIENCY_FITTED_ON, Hardware, get_hardware
from plait.planner.inter_op import inter_op_plan
from plait.planner.intra_op import IntraOpPlan, block_operators, solve_intra_op
from plait.planner.models import ModelSpec, resolve_model
from plait.planner.predict import Prediction, fmt_bytes, predict
from plait.planner.stage_memory import model_state_bytes

logger = get_logger(__name__)

MIN_CP_TOKENS = 4096
"""The shortest sequence share per context-parallel rank the search considers. The cost model times ring attention's
K/V exchange as hidden behind the attention compute, which holds for long blocks; published runs use context
parallelism from 4K tokens per rank up (Megatron-Bridge's Llama 3 recipes: CP=2 at 8K tokens; Llama 3 405B: CP=16
at 128K), and below that the model would favour cp for what it does not cost (many small attention kernels)."""


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
    sequence with >= ``MIN_CP_TOKENS`` tokens per rank, pp up to the layer count, and dp dividing ``batch`` (None:
    any dp)."""
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
        if spec.seq % cp == 0 and (cp == 1 or spec.seq // cp >= MIN_CP_TOKENS)
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


def replica_options(dp: int, cp: int, zero: int, ep: int) -> list[int]:
    """HSDP's replica-group counts R to try (``Layout.dp_replicate``): every divisor of dp that leaves ZeRO more
    than one rank to shard over (dp x cp / R > 1) and an ep group inside a replica group; just 1 with zero=0,
    where nothing is sharded and R changes nothing."""
    if zero == 0:
        return [1]
    return [r for r in _divisors(dp) if r == 1 or (dp * cp // r > 1 and dp * cp // r % ep == 0)]


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
    schedules: tuple[str, ...] = ("1f1b", "interleaved", "zero-bubble", "zb-v", "dualpipev"),
    max_cp: int = 16,
    interleave_depths: tuple[int, ...] = (2, 3, 4, 6, 8),
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
    recomputes = [mode for mode in ("selective", "op", "full") if mode in RECOMPUTE_MODES]  # cheapest first
    intra: dict[tuple[int, int], IntraOpChoice] = {}  # (tp, tokens) -> the intra-op pass's choice
    routed = spec.moe_blocks * routed_parameters(spec)  # what ep splits
    for tp, cp, pp, dp in shapes:
        per_dp = batch // dp
        stage_psi = ((spec.parameters - routed) / pp + spec.embedding_parameters) / tp
        for mbs in [b for b in _powers_of_two(min(max_micro_batch, per_dp)) if per_dp % b == 0]:
            m = per_dp // mbs
            sequence_parallel = (
                tp > 1 and _intra_op(intra, spec, hw, tp, mbs * spec.seq // cp, precision).sequence_parallel
            )
            for schedule, v in _schedules(pp, m, spec.layers, schedules, interleave_depths):
                # with pp > 1 plait accumulates unsharded gradients under ZeRO-2 (one reduce-scatter per step), so
                # ZeRO-2 holds and sends what ZeRO-1 does: timing it again would only duplicate ZeRO-1
                zeros = (0, 1, 2, 3) if pp == 1 else (0, 1, 3)
                choices = [(z, ep) for z in (zeros if dp * cp > 1 else (0,)) for ep in ep_options(spec, dp * cp)]
                for zero, ep, replicas in [(z, e, r) for z, e in choices for r in replica_options(dp, cp, z, e)]:
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
                        sequence_parallel=sequence_parallel,
                        ep=ep,
                        dp_replicate=replicas,
                    )
                    params, grads, states, host = model_state_bytes(stage_psi, base, impl)
                    if routed:  # the routed experts: split over ep (and tp), their states sharded over edp
                        psi = routed / pp / expert_split(base, impl)
                        more = model_state_bytes(psi, routed_layout(base), impl)
                        params, grads, states = params + more[0], grads + more[1], states + more[2]
                    floor = params + grads + states - (states if zero else 0.0)  # with offload
                    least_states = min(least_states, floor + impl.reserved_bytes)
                    if floor + impl.reserved_bytes > hw.memory_bytes:
                        pruned += 1
                        continue
                    options: list[dict[str, Any]] = [{}, *({"recompute": r} for r in recomputes)]
                    options += [{"offload": "cpu"}, *({"recompute": r, "offload": "cpu"} for r in recomputes)]
                    for option in options:
                        if "offload" in option and not zero:
                            continue
                        if option.get("recompute") == "op" and base.schedule in SPLIT_BACKWARD and pp > 1:
                            continue  # one backward per selective-checkpoint region: not a split backward's I and W
                        layout = dataclasses.replace(base, **option)
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
        key = (lay.tp, lay.cp, lay.pp, lay.dp, lay.microbatches, lay.schedule, lay.virtual_stages, lay.ep)
        rank = (round(candidate.step_time, 12), candidate.memory.device)
        if key not in best_of or rank < (round(best_of[key].step_time, 12), best_of[key].memory.device):
            best_of[key] = candidate
    shortlist = sorted(best_of.values(), key=lambda p: (round(p.step_time, 12), p.memory.device))[: max(3 * top, 8)]
    exact = [with_pipeline_cuts(predict(spec, c.layout, hw, batch, implementation=impl, exact=True)) for c in shortlist]
    exact = [c for c in exact if c.fits] or exact
    exact.sort(key=lambda p: (round(p.step_time, 12), p.memory.device))
    result = PlanResult(spec, hw, world_size, batch, exact[:top], evaluated, pruned, time.perf_counter() - started)
    result.notes.extend(_pass_notes(intra, spec, hw, result.best, precision))
    owner = EFFICIENCY_FITTED_ON.get(hw.generation)
    if owner and owner != impl.family:
        result.notes.append(
            f"compute efficiency {hw.compute_efficiency:.3f}: the {hw.generation} generation's, fitted on {owner}'s "
            f"published runs, not {impl.family}'s (an efficiency belongs to an implementation on a hardware); "
            f"plait's own is what plait calibrate measures on the machine it runs on (--gpu this-machine; CPU ranks "
            f"today)"
        )
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


@dataclass(frozen=True)
class IntraOpChoice:
    """The intra-op ILP's sharding of one block at a tp degree: whether it shards the norms along the sequence
    (Megatron-SP) and whether its linear layers are Megatron's column / row pairs (what plait's runtime runs)."""

    plan: IntraOpPlan
    sequence_parallel: bool
    megatron: bool


MEGATRON_LINEARS = {"qkv": "column", "out": "row", "up": "column", "down": "row"}


def _intra_op(
    cache: dict[tuple[int, int], IntraOpChoice], spec: ModelSpec, hw: Hardware, tp: int, tokens: int, precision: str
) -> IntraOpChoice:
    """Alpa's intra-op pass for one block of ``tokens`` tokens at ``tp`` (module docstring), solved once per tp
    degree and token count of a search (``cache``)."""
    if (tp, tokens) not in cache:
        ops = block_operators(spec, tp, tokens, hw, act_bytes(precision), precision=precision)
        solved = solve_intra_op(ops, tp, hw)
        megatron = all(solved.choice[op] == style for op, style in MEGATRON_LINEARS.items())
        norms_sharded = solved.choice["norm1"] == "sequence" and solved.choice["norm2"] == "sequence"
        cache[(tp, tokens)] = IntraOpChoice(solved, norms_sharded and megatron, megatron)
    return cache[(tp, tokens)]


def with_pipeline_cuts(prediction: Prediction) -> Prediction:
    """The prediction with its stage boundaries written into its layout (``Layout.pipeline_cuts``)."""
    if prediction.layout.pp == 1 or prediction.layout.pipeline_cuts:
        return prediction
    cuts = tuple(start for start, _ in prediction.stages[1:])
    return dataclasses.replace(prediction, layout=dataclasses.replace(prediction.layout, pipeline_cuts=cuts))


def _pass_notes(
    intra: dict[tuple[int, int], IntraOpChoice], spec: ModelSpec, hw: Hardware, best: Prediction, precision: str
) -> list[str]:
    """What Alpa's two passes chose for the best layout, and the inter-op cross-check against ``inter_op_plan``."""
    lay, notes = best.layout, []
    if lay.tp > 1:
        choice = _intra_op(intra, spec, hw, lay.tp, best.micro_batch * spec.seq // lay.cp, precision)
        shown = ", ".join(f"{op} {style}" for op, style in choice.plan.choice.items())
        notes.append(f"intra-op ILP at tp={lay.tp}: {shown}")
        if not choice.megatron:
            notes.append(
                "the ILP prefers another sharding of the linear layers than Megatron's column/row pairs; plait's "
                "runtime runs Megatron's, which the prediction times"
            )
    if lay.pp > 1:
        per_rank = [sum(b - a for a, b in best.stages[r :: lay.pp]) for r in range(lay.pp)]
        notes.append(f"inter-op stages: blocks per rank {per_rank} (cuts {list(lay.pipeline_cuts)})")
    if lay.pp > 1 and lay.virtual_stages == 1 and best.layer_costs:
        alpa, chosen = _alpa_cross_check(best)
        notes.append(
            f"inter-op cross-check: Alpa's DP latency sum t + (m - 1) max t = {alpa:.4g} s, the chosen cuts "
            f"{chosen:.4g} s ({chosen / alpa - 1:+.2%})"
        )
    return notes


def _alpa_latency(costs: list[float], stages: list[tuple[int, int]], m: int) -> float:
    """Alpa's latency sum_i t_i + (m - 1) max_j t_j of these stages."""
    times = [sum(costs[a:b]) for a, b in stages]
    return sum(times) + (m - 1) * max(times)


def _alpa_cross_check(best: Prediction) -> tuple[float, float]:
    """(Alpa's DP optimum, the chosen cuts') latency of the best plan's stages, from its per-block costs."""
    costs, m = list(best.layer_costs), best.layout.microbatches
    alpa = inter_op_plan(len(costs), best.layout.pp, (1,), lambda a, b, _n: sum(costs[a:b]), m)
    return alpa.latency, _alpa_latency(costs, best.stages, m)


def _more_devices(least_states: float, memory: float, world_size: int) -> str:
    """Roughly how many devices would hold the model states, scaling the smallest footprint seen by device count."""
    if least_states == float("inf"):
        return "a count that gives the search a layout to time"
    return f"roughly {max(2, int(least_states / memory * world_size) + 1)}+"


def _schedules(
    pp: int, m: int, layers: int, allowed: tuple[str, ...], depths: tuple[int, ...]
) -> list[tuple[str, int]]:
    """(schedule, chunks per rank) to try for pp stages and m micro-batches: the allowed one-chunk schedules,
    interleaved with each depth v of ``depths`` that leaves every chunk a block (layers >= v x pp) when m is a
    multiple of pp (Megatron-LM's interleaved schedule needs it), and the V-shaped ZB-V (any m) and DualPipeV
    (m >= 2 pp) with their two chunks per rank when layers >= 2 pp."""
    if pp == 1:
        return [("1f1b", 1)]
    options = [(name, 1) for name in allowed if name in ("1f1b", "zero-bubble", "gpipe")]
    if "interleaved" in allowed and m % pp == 0:
        options += [("interleaved", v) for v in depths if v >= 2 and layers >= v * pp]
    if layers >= 2 * pp:
        options += [(name, 2) for name in allowed if name == "zb-v" or (name == "dualpipev" and m >= 2 * pp)]
    return options


__all__ = ["PlanResult", "plan"]
