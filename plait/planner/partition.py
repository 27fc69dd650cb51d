"""Automatic pipeline partitioning: cut a chain of layers into ``p`` contiguous stages (PipeDream's planner).

A pipeline's steady state finishes one micro-batch per *bottleneck* time, the largest of its stages' times
(and, as PipeDream models it, of its links' transfer times, which overlap compute), so the best contiguous
split minimises that maximum (Narayanan et al. 2019, sec. 3.1). For n layers with per-layer times t_i and
p stages, a dynamic program over prefixes finds it exactly:

    A(k, j) = min over i < j of max( A(k-1, i), T(i..j), C_i )      A(0, 0) = 0,  answer A(p, n)

where T(i..j) is the time of layers i..j-1 (with ``comm_overlaps=False`` also the transfers at both of its
ends) and C_i the transfer at the cut before layer i (for the first stage, none). A stage is allowed only if
its memory fits: sum of the layers' static bytes + in_flight[k] x their activation bytes per micro-batch <=
``memory_limit``, where in_flight[k] is how many micro-batches stage k holds at once under the schedule
(1F1B: p - k; GPipe: m; ZB-H1: p, as plait frees a micro-batch at its W), taken from the simulator. O(p n^2) work, done by the planner's one chain DP
(``inter_op.split_chain``, with max as the combining operation; a link is a stage of its own in the max).

``auto_partition`` profiles the layers on this device (``profile.py``), runs the program on the result and
measures each chosen stage forward + backward, so ``Partition.summary()`` shows predicted vs measured times.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from torch import Tensor, nn

from plait.errors import LayoutError
from plait.logging import get_logger
from plait.parallel.pipeline.schedule import build_schedule
from plait.parallel.pipeline.simulate import simulate
from plait.planner.inter_op import prefix_costs, split_chain
from plait.planner.profile import LayerChain, LayerProfile, as_chain, measure_stages, profile_layers

logger = get_logger(__name__)


@dataclass(frozen=True)
class Partition:
    """Stage k runs units ``bounds[k]:bounds[k+1]``; ``cuts = bounds[1:-1]`` (where stages 1..p-1 start) is what
    ``plait.parallelize(..., pipeline_cuts=...)`` and ``split_model(model, p, cuts)`` take."""

    bounds: tuple[int, ...]
    stage_times: tuple[float, ...]
    """Predicted compute time of each stage (plus its transfers when they do not overlap)."""
    stage_memory: tuple[float, ...]
    link_times: tuple[float, ...]
    """Transfer time at each cut (0 without a communication model)."""
    memory_limit: float | None = None
    unit_names: tuple[str, ...] = ()
    measured_times: tuple[float, ...] | None = None
    """Measured forward + backward seconds per stage (``auto_partition``), or None."""
    time_unit: str = ""
    """How ``summary`` prints times: "" as given (any unit), "ms" for times in seconds shown in milliseconds."""

    @property
    def cuts(self) -> list[int]:
        return list(self.bounds[1:-1])

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    @property
    def bottleneck(self) -> float:
        """The objective: the slowest stage or link."""
        return max(self.stage_times + self.link_times)

    @property
    def balance(self) -> float:
        """Mean stage time / slowest stage time: 1.0 is a perfectly even split."""
        return (sum(self.stage_times) / len(self.stage_times)) / self.bottleneck if self.bottleneck > 0 else 1.0

    def summary(self) -> str:
        """A table of the stages (units, predicted and measured time, memory) and what was optimised."""
        unit = self.time_unit
        scale = 1e3 if unit == "ms" else 1.0
        slowest = max(range(self.num_stages), key=lambda k: self.stage_times[k])
        head = (
            f"{self.num_stages} stages over {self.bounds[-1]} units, cuts={self.cuts}: bottleneck "
            f"{self.bottleneck * scale:.4g}{unit} (stage {slowest}), balance {self.balance:.0%} "
            f"(mean / slowest stage)"
        )
        if self.link_times and max(self.link_times) >= max(self.stage_times):
            head += f"; the slowest link ({max(self.link_times) * scale:.4g}{unit}) is the bottleneck"
        lines = [head, f"{'stage':>5}  {'units':<40} {'predicted':>10} {'measured':>10} {'memory':>12}"]
        for k in range(self.num_stages):
            lo, hi = self.bounds[k], self.bounds[k + 1]
            names = self.unit_names[lo:hi] if self.unit_names else ()
            units = f"{lo}..{hi - 1}" + (
                f" ({names[0]}..{names[-1]})" if len(names) > 1 else f" ({names[0]})" if names else ""
            )
            measured = f"{self.measured_times[k] * scale:.4g}{unit}" if self.measured_times else "-"
            lines.append(
                f"{k:>5}  {units:<40} {self.stage_times[k] * scale:>8.4g}{unit:<2} {measured:>10} "
                f"{_bytes(self.stage_memory[k]):>12}"
            )
        limit = "no memory limit" if self.memory_limit is None else f"memory <= {_bytes(self.memory_limit)} per stage"
        lines.append(f"objective: minimise the slowest stage (a pipeline's throughput is 1 / bottleneck), {limit}.")
        return "\n".join(lines)


def _bytes(value: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"


def _check_numbers(name: str, values: Sequence[float], n: int) -> list[float]:
    values = [float(v) for v in values]
    if len(values) != n:
        raise LayoutError(
            f"{name} has {len(values)} entries, but there are {n} layers"
            + (" - 1 cuts" if name == "comm" else "")
            + f". Fix: give {n} values."
        )
    bad = [i for i, v in enumerate(values) if not math.isfinite(v) or v < 0]
    if bad:
        raise LayoutError(f"{name}[{bad[0]}] = {values[bad[0]]} must be a finite number >= 0.")
    return values


def partition(
    times: Sequence[float],
    memory: Sequence[float],
    p: int,
    memory_limit: float | None = None,
    *,
    activations: Sequence[float] | None = None,
    in_flight: Sequence[int] | None = None,
    comm: Sequence[float] | None = None,
    comm_overlaps: bool = True,
    unit_names: Sequence[str] = (),
) -> Partition:
    """The contiguous split of ``len(times)`` layers into ``p`` stages that minimises the slowest stage (module
    doc), each stage's memory ``sum(memory) + in_flight[k] * sum(activations)`` within ``memory_limit``.

    ``comm[i]`` is the transfer time across a cut between layers i and i+1 (forward activation and backward
    gradient together). Raises ``LayoutError`` when no split fits, naming the layer that alone exceeds the
    limit or the smallest limit that would work.
    """
    n = len(times)
    if not isinstance(p, int) or isinstance(p, bool) or p < 1:
        raise LayoutError(f"p={p!r} stages must be an integer >= 1.")
    if n < p:
        raise LayoutError(f"cannot cut {n} layers into p={p} stages (each needs at least one). Fix: p <= {n}.")
    times = _check_numbers("times", times, n)
    memory = _check_numbers("memory", memory, n)
    acts = _check_numbers("activations", activations, n) if activations is not None else [0.0] * n
    links = _check_numbers("comm", comm, n - 1) if comm is not None else [0.0] * (n - 1)
    flight = [int(f) for f in in_flight] if in_flight is not None else [1] * p
    if len(flight) != p or min(flight) < 0:
        raise LayoutError(f"in_flight={list(flight)} must give p={p} counts >= 0 (micro-batches held per stage).")
    if unit_names and len(unit_names) != n:
        raise LayoutError(f"unit_names has {len(unit_names)} entries for {n} layers.")

    t_sum, m_sum, a_sum = _prefix(times), _prefix(memory), _prefix(acts)

    def stage_time(i: int, j: int) -> float:
        extra = 0.0 if comm_overlaps else (links[i - 1] if i > 0 else 0.0) + (links[j - 1] if j < n else 0.0)
        return t_sum[j] - t_sum[i] + extra

    def stage_memory(k: int, i: int, j: int) -> float:
        return m_sum[j] - m_sum[i] + flight[k] * (a_sum[j] - a_sum[i])

    limit = math.inf if memory_limit is None else float(memory_limit)
    time_matrix = prefix_costs(times)
    before = np.array([0.0, *links, 0.0])  # [i]: the transfer at the cut before layer i (none before layer 0)
    after = np.array([0.0, *links, 0.0])  # [j]: the transfer at the cut after layer j - 1 (none after the last)
    if comm_overlaps:
        time_matrix = np.maximum(time_matrix, before[:, None])  # a link is a pipeline stage of its own
    else:
        time_matrix = time_matrix + before[:, None] + after[None, :]

    def memory_matrix(k: int) -> np.ndarray:
        return prefix_costs(memory) + flight[k] * prefix_costs(acts)

    found = split_chain(n, p, (1,), lambda k, _s: np.where(memory_matrix(k) <= limit, time_matrix, math.inf))
    if found is None:
        raise LayoutError(_infeasible(n, p, limit, stage_memory, memory_matrix, unit_names))
    bounds = [0, *(j for _, j, _ in found[1])]
    ranges = list(zip(bounds, bounds[1:]))
    return Partition(
        bounds=tuple(bounds),
        stage_times=tuple(stage_time(i, j) for i, j in ranges),
        stage_memory=tuple(stage_memory(k, i, j) for k, (i, j) in enumerate(ranges)),
        link_times=tuple(links[b - 1] for b in bounds[1:-1]) if comm_overlaps else (),
        memory_limit=memory_limit,
        unit_names=tuple(unit_names),
    )


def _prefix(values: list[float]) -> list[float]:
    sums = [0.0]
    for v in values:
        sums.append(sums[-1] + v)
    return sums


def _infeasible(n: int, p: int, limit: float, stage_memory, memory_matrix, names: Sequence[str]) -> str:
    """Why no split fits: a layer too big even alone (on the stage holding the fewest micro-batches it can be
    on), or else the smallest limit that works (the split minimising the largest stage's memory)."""
    for i in range(n):
        stages = range(max(0, p - (n - i)), min(i, p - 1) + 1)  # stages that layer i can belong to
        alone = min(stage_memory(k, i, i + 1) for k in stages)
        if alone > limit:
            name = f" ({names[i]})" if names else ""
            return (
                f"layer {i}{name} alone needs {_bytes(alone)} (parameters and states plus its activations for "
                f"the micro-batches in flight), more than memory_limit={_bytes(limit)}. Fix: raise the limit "
                f"to at least {_bytes(alone)}, use fewer micro-batches in flight, recompute activations, or "
                f"shard that layer (tensor parallel / ZeRO)."
            )
    found = split_chain(n, p, (1,), lambda k, _s: memory_matrix(k))
    assert found is not None
    fit = [0, *(j for _, j, _ in found[1])]
    smallest = max(stage_memory(k, i, j) for k, (i, j) in enumerate(zip(fit, fit[1:])))
    return (
        f"no split of {n} layers into {p} stages keeps every stage within memory_limit={_bytes(limit)}; the "
        f"smallest limit any split meets is {_bytes(smallest)} ({smallest:.0f} bytes, cuts={fit[1:-1]}). Fix: "
        f"memory_limit >= {smallest:.0f}, or more pipeline stages."
    )


def auto_partition(
    layers: Sequence[nn.Module] | LayerChain,
    sample_input: Tensor,
    p: int,
    memory_limit: float | None = None,
    *,
    schedule: str = "1f1b",
    microbatches: int | None = None,
    state_bytes_per_param_byte: float = 4.0,
    p2p_bytes_per_s: float | None = None,
    repeats: int = 5,
    measure: bool = True,
) -> Partition:
    """Profile ``layers`` on ``sample_input`` (one micro-batch), partition them into ``p`` stages, and (``measure``)
    time the chosen stages. For the reference GPT pass ``gpt_layers(model)``: the cuts are then block indices.

    Memory per stage: parameter bytes x ``state_bytes_per_param_byte`` (4: fp32 weights, gradients and Adam's
    two moments) + activation bytes x the micro-batches stage k holds under ``schedule`` with ``microbatches``
    (default p; the simulator's ``peak_unfinished``: plait's I keeps the graph for W, so a split backward frees
    a micro-batch at its W). ``p2p_bytes_per_s`` models the link: a cut after a layer
    costs 2 x its output bytes / bandwidth (activation forward, gradient back); None ignores transfers.
    """
    chain = as_chain(layers)
    profiles = profile_layers(chain, sample_input, repeats=repeats)
    times, memory, acts, outputs, names = _units(chain, profiles, state_bytes_per_param_byte)
    in_flight = simulate(build_schedule(schedule, p, microbatches or p)).peak_unfinished
    comm = [2 * b / p2p_bytes_per_s for b in outputs[:-1]] if p2p_bytes_per_s else None
    result = partition(
        times, memory, p, memory_limit, activations=acts, in_flight=in_flight, comm=comm, unit_names=names
    )
    result = replace(result, time_unit="ms")
    if measure:
        measured = measure_stages(chain, sample_input, chain.layer_bounds(result.bounds), repeats=repeats)
        result = replace(result, measured_times=tuple(measured))
    logger.info("auto_partition:\n%s", result.summary())
    return result


def _units(
    chain: LayerChain, profiles: list[LayerProfile], state_factor: float
) -> tuple[list[float], list[float], list[float], list[int], list[str]]:
    """Per-unit time, static memory, activation bytes, output bytes and name: lead / trail layers folded into
    the first / last unit."""
    groups = [list(range(chain.lead + 1))]
    groups += [[i] for i in range(chain.lead + 1, len(profiles) - chain.trail - 1)]
    if chain.num_units > 1:
        groups.append(list(range(len(profiles) - chain.trail - 1, len(profiles))))
    else:
        groups[0] = list(range(len(profiles)))
    times = [sum(profiles[i].time_s for i in g) for g in groups]
    memory = [state_factor * sum(profiles[i].param_bytes for i in g) for g in groups]
    acts = [float(sum(profiles[i].activation_bytes for i in g)) for g in groups]
    outputs = [profiles[g[-1]].output_bytes for g in groups]
    names = ["+".join(profiles[i].name for i in g) if len(g) > 1 else profiles[g[0]].name for g in groups]
    return times, memory, acts, outputs, names


__all__ = ["Partition", "auto_partition", "partition"]
