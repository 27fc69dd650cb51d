"""Inter-operator planning: cut a chain of layers into pipeline stages (and give each stage a device sub-mesh).

One dynamic program does every cut in the planner (``split_chain``). Over a chain of n layers and a budget of
units (devices, or stages when every stage takes one unit), ``best[d][j]`` is the best value of covering layers
[0, j) with stages that use d units, and

    best[d + s][j] = min over i < j of  combine(best[d][i], cost_(d, s)[i, j])        best[0][0] = 0

where ``cost_(d, s)[i, j]`` is the cost of layers [i, j) as the stage that starts after d units and takes s
(infinite where it is not allowed: too slow, too big), and ``combine`` is ``max`` (a pipeline's throughput
is set by its slowest stage: PipeDream, Narayanan et al. 2019, sec. 3.1) or ``+`` (Alpa's latency terms). Each
(d, s) step is a min-plus (or min-max) product of a row by an (n+1) x (n+1) matrix, done with numpy: O(budget x
|sizes| x n^2) work. Ties keep the earliest cut (``argmin`` takes the first).

Its callers:

- ``inter_op_plan``, Alpa's inter-op pass (Zheng et al. 2022, sec. 5.2): the latency of a synchronous pipeline
  with B micro-batches is T = sum_i t_i + (B - 1) max_j t_j (their eq. 2), t_i stage i's time on its sub-mesh.
  For each candidate t_max (ascending) the core minimises sum_i t_i over stages with t_i <= t_max using every
  device; the answer is the best sum + (B - 1) t_max, stopping once (B - 1) t_max alone exceeds it.
- ``partition.partition`` (PipeDream's planner over measured layers, with memory limits and links).
- ``balanced_stages``: p stages of a chain, minimising the slowest. When every stage gets the same sub-mesh the
  sum in Alpa's objective is the same for every split, so Alpa's DP reduces to exactly this min-max problem:
  it is what ``plan()`` runs for each layout's stage boundaries.
- ``rank_balanced_stages``: with an interleaved schedule rank r runs chunks r, r + p, ..., r + (v - 1) p (in a V,
  ZB-V and DualPipeV: r and 2p - 1 - r, so rank 0 holds both the embedding and the output layer), so what must be
  balanced is each rank's total, not each chunk (a rank with two heavy chunks is the bottleneck of every
  steady-state cycle). Starting from the chunk-balanced cuts, single cuts move by one layer while the ranks'
  loads, sorted from the heaviest, decrease lexicographically.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from plait.errors import ConfigError
from plait.parallel.pipeline.schedule import Placement, rank_stages, stage_rank

StageCost = Callable[[int, int], np.ndarray]
"""``(units used before the stage, units the stage takes) -> cost[i, j]`` of layers [i, j) as that stage."""


def split_chain(
    num_layers: int, budget: int, sizes: Sequence[int], stage_cost: StageCost, combine: str = "max"
) -> tuple[float, list[tuple[int, int, int]]] | None:
    """The DP of the module docstring: ``(value, [(start, end, units), ...])`` of the best split of
    ``num_layers`` layers into stages whose units (from ``sizes``) add up to ``budget``, or None when every split
    has an infinite stage."""
    if combine not in ("max", "sum"):
        raise ValueError(f"combine={combine!r}: use 'max' or 'sum'")
    n = num_layers
    upper = np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1)  # i < j: a stage holds at least one layer
    columns = np.arange(n + 1)
    best = np.full((budget + 1, n + 1), math.inf)
    best[0, 0] = 0.0
    came_from = np.full((budget + 1, n + 1), -1)  # units used before the last stage
    started_at = np.full((budget + 1, n + 1), -1)  # the last stage's first layer
    for d in range(budget):
        row = best[d]
        if not np.isfinite(row).any():
            continue
        for size in sizes:
            if d + size > budget:
                continue
            cost = np.where(upper, np.asarray(stage_cost(d, size), dtype=float), math.inf)
            merged = np.maximum(row[:, None], cost) if combine == "max" else row[:, None] + cost
            start = np.argmin(merged, axis=0)
            value = merged[start, columns]
            better = value < best[d + size]
            best[d + size] = np.where(better, value, best[d + size])
            came_from[d + size] = np.where(better, d, came_from[d + size])
            started_at[d + size] = np.where(better, start, started_at[d + size])
    if not math.isfinite(best[budget, n]):
        return None
    stages, d, j = [], budget, n
    while j > 0:
        d_before, i = int(came_from[d, j]), int(started_at[d, j])
        stages.append((i, j, d - d_before))
        d, j = d_before, i
    return float(best[budget, n]), stages[::-1]


def prefix_costs(costs: Sequence[float]) -> np.ndarray:
    """cost[i, j] = sum(costs[i:j]) for every i <= j (a stage's time as the sum of its layers')."""
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(costs, dtype=float))])
    return prefix[None, :] - prefix[:, None]


@dataclass(frozen=True)
class InterOpPlan:
    """Stages as ``(first_layer, end_layer_exclusive, devices)``, their times, and the pipeline latency."""

    stages: tuple[tuple[int, int, int], ...]
    stage_times: tuple[float, ...]
    latency: float


def inter_op_plan(
    num_layers: int,
    num_devices: int,
    submesh_sizes: Sequence[int],
    stage_time: Callable[[int, int, int], float],
    microbatches: int,
) -> InterOpPlan:
    """Alpa's inter-op DP (module docstring). ``stage_time(start, end, devices)`` is the time of layers
    [start, end) on a sub-mesh of ``devices`` (math.inf where it does not fit)."""
    if num_layers < 1 or num_devices < 1:
        raise ConfigError(f"inter-op planning needs layers and devices >= 1 (got {num_layers}, {num_devices}).")
    sizes = sorted({n for n in submesh_sizes if 1 <= n <= num_devices})
    times = {n: np.full((num_layers + 1, num_layers + 1), math.inf) for n in sizes}
    for n in sizes:
        for k in range(num_layers):
            for i in range(k + 1, num_layers + 1):
                times[n][k, i] = stage_time(k, i, n)
    candidates = sorted({float(t) for n in sizes for t in times[n][np.isfinite(times[n])]})
    best: InterOpPlan | None = None
    for t_max in candidates:
        if best is not None and (microbatches - 1) * t_max >= best.latency:
            break
        capped = {n: np.where(times[n] <= t_max, times[n], math.inf) for n in sizes}
        found = split_chain(num_layers, num_devices, sizes, lambda _d, n: capped[n], combine="sum")  # noqa: B023
        if found is None:
            continue
        total, stages = found
        slowest = max(times[n][i, j] for i, j, n in stages)
        latency = total + (microbatches - 1) * slowest
        if best is None or latency < best.latency:
            best = InterOpPlan(tuple(stages), tuple(float(times[n][i, j]) for i, j, n in stages), latency)
    if best is None:
        raise ConfigError(
            f"no way to place {num_layers} layers on {num_devices} devices with sub-meshes of "
            f"{list(sizes)} devices: every stage is too slow or too big. Fix: add devices or allow "
            f"larger sub-meshes."
        )
    return best


def balanced_stages(costs: Sequence[float], stages: int) -> list[tuple[int, int]]:
    """Split ``costs`` (one per layer, in order) into ``stages`` contiguous non-empty parts minimising the
    largest part's sum (``split_chain`` with max); returns ``[(start, end_exclusive), ...]``."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ConfigError(f"cannot cut {n} layers into {stages} pipeline stages. Fix: use pp between 1 and {n}.")
    matrix = prefix_costs(costs)
    found = split_chain(n, stages, (1,), lambda _d, _s: matrix)
    assert found is not None  # finite costs: every split is allowed
    return [(i, j) for i, j, _ in found[1]]


def rank_loads(
    costs: Sequence[float], chunks: Sequence[tuple[int, int]], p: int, placement: str = Placement.INTERLEAVED
) -> list[float]:
    """Each rank's total cost when chunk c runs on rank ``stage_rank(c, p, placement)`` (c mod p interleaved)."""
    loads = [0.0] * p
    for c, (i, j) in enumerate(chunks):
        loads[stage_rank(c, p, placement)] += sum(costs[i:j])
    return loads


def rank_balanced_stages(
    costs: Sequence[float], p: int, v: int = 1, placement: str = Placement.INTERLEAVED
) -> list[tuple[int, int]]:
    """``p x v`` contiguous chunks of ``costs``, chunk c on rank ``stage_rank(c, p, placement)`` (c mod p when
    interleaved), balancing the ranks' totals (module
    docstring); v = 1 is ``balanced_stages``. Equal layers with heavier ends (a transformer: the embedding on the
    first block, the output layer on the last) are split exactly by ``_equal_layers_split``; other costs by
    coordinate descent from the chunk-balanced cuts (each cut moved to its best place between its neighbours while
    the ranks' loads, sorted from the heaviest, decrease lexicographically): never worse than balancing chunks,
    not always the optimum."""
    n = len(costs)
    if v == 1 or p == 1:
        return balanced_stages(costs, p * v)
    if not 1 <= p * v <= n:
        raise ConfigError(f"cannot cut {n} layers into {p * v} chunks. Fix: use pp x virtual_stages <= {n}.")
    if n > 2 and all(c == costs[1] for c in costs[1:-1]):
        return _equal_layers_split(costs, p, v, placement)
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    bounds = [0, *(j for _, j in balanced_stages(costs, p * v))]

    def key(b: list[int]) -> list[float]:
        loads = [0.0] * p
        for c in range(len(b) - 1):
            loads[stage_rank(c, p, placement)] += prefix[b[c + 1]] - prefix[b[c]]
        return sorted(loads, reverse=True)

    current = key(bounds)
    improved = True
    while improved:
        improved = False
        for k in range(1, len(bounds) - 1):
            for moved in range(bounds[k - 1] + 1, bounds[k + 1]):
                trial = [*bounds[:k], moved, *bounds[k + 1 :]]
                value = key(trial)
                if value < current:
                    bounds, current, improved = trial, value, True
    return list(zip(bounds, bounds[1:]))


def _equal_layers_split(
    costs: Sequence[float], p: int, v: int, placement: str = Placement.INTERLEAVED
) -> list[tuple[int, int]]:
    """The exact rank balance when every layer but the first and last costs the same: a rank's load is its block
    count times that cost plus its extras (rank 0 holds the first layer's, the last chunk's rank the last's: rank
    p - 1 interleaved, rank 0 in a V), so blocks are handed out one at a time to the rank whose load stays lowest
    (optimal for a min-max of increasing loads), each rank keeping at least v; within a rank the chunk that carries
    an extra gets the smaller share (in a V rank 0 carries both: chunk 0 gets it)."""
    n, base = len(costs), costs[1]
    last = p * v - 1
    extra = [0.0] * p
    extra[0] += costs[0] - base
    extra[stage_rank(last, p, placement)] += costs[-1] - base
    blocks = [v] * p
    for _ in range(n - p * v):
        r = min(range(p), key=lambda q: ((blocks[q] + 1) * base + extra[q], q))
        blocks[r] += 1
    sizes = [0] * (p * v)
    for r, chunks in enumerate(rank_stages(p, v, placement)):
        share = [blocks[r] // v + (1 if q < blocks[r] % v else 0) for q in range(v)]  # larger first: the last
        if 0 in chunks:  # chunk (with the output layer) gets the smaller share; chunk 0 (the embedding) too
            share.sort()
        for chunk, size in zip(chunks, share):
            sizes[chunk] = size
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return list(zip(bounds, bounds[1:]))


__all__ = [
    "InterOpPlan",
    "balanced_stages",
    "inter_op_plan",
    "prefix_costs",
    "rank_balanced_stages",
    "rank_loads",
    "split_chain",
]
