"""Inter-operator planning: cut a chain of layers into pipeline stages and give each stage a device sub-mesh.

Alpa (Zheng et al. 2022, sec. 5.2) minimises the latency of a synchronous pipeline with B micro-batches,
T = sum_i t_i + (B - 1) max_j t_j (their eq. 2), where t_i is stage i's time on its sub-mesh. For each candidate
t_max it runs the dynamic program F(k, d) = min over a first stage (layers k..i on a sub-mesh of n devices,
time <= t_max) of t(k..i, n) + F(i + 1, d - n), with F(L, 0) = 0, using every device; the answer is the best
sum + (B - 1) t_max over the t_max tried (ascending, stopping once (B - 1) t_max alone exceeds the best).

``balanced_stages`` is the special case the layout search needs (p stages, equal sub-meshes): the contiguous
partition minimising the slowest stage, found by bisection on the bound with a greedy feasibility check.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache

from plait.errors import ConfigError


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
    times = {
        (k, i, n): stage_time(k, i, n) for k in range(num_layers) for i in range(k + 1, num_layers + 1) for n in sizes
    }
    candidates = sorted({t for t in times.values() if math.isfinite(t)})
    best: InterOpPlan | None = None
    for t_max in candidates:
        if best is not None and (microbatches - 1) * t_max >= best.latency:
            break

        @cache
        def first(k: int, d: int) -> tuple[float, tuple[tuple[int, int, int], ...]]:
            if k == num_layers:
                return (0.0, ()) if d == 0 else (math.inf, ())
            found: tuple[float, tuple[tuple[int, int, int], ...]] = (math.inf, ())
            for i in range(k + 1, num_layers + 1):
                for n in sizes:
                    t = times[(k, i, n)]
                    if n > d or t > t_max:  # noqa: B023 - called within this iteration
                        continue
                    rest, stages = first(i, d - n)
                    if t + rest < found[0]:
                        found = (t + rest, ((k, i, n), *stages))
            return found

        total, stages = first(0, num_devices)
        if math.isfinite(total):
            latency = total + (microbatches - 1) * max(times[s] for s in stages)
            if best is None or latency < best.latency:
                best = InterOpPlan(stages, tuple(times[s] for s in stages), latency)
        first.cache_clear()
    if best is None:
        raise ConfigError(
            f"no way to place {num_layers} layers on {num_devices} devices with sub-meshes of "
            f"{list(sizes)} devices: every stage is too slow or too big. Fix: add devices or allow "
            f"larger sub-meshes."
        )
    return best


def balanced_stages(costs: Sequence[float], stages: int) -> list[tuple[int, int]]:
    """Split ``costs`` (one per layer, in order) into ``stages`` contiguous non-empty parts minimising the
    largest part's sum; returns ``[(start, end_exclusive), ...]``."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ConfigError(f"cannot cut {n} layers into {stages} pipeline stages. Fix: use pp between 1 and {n}.")
    low, high = max(costs), sum(costs)
    for _ in range(60):
        if high - low <= 1e-12 * max(high, 1e-30):
            break
        mid = (low + high) / 2
        if len(_greedy(costs, mid)) <= stages:
            high = mid
        else:
            low = mid
    parts = _greedy(costs, high)
    while len(parts) < stages:  # split the longest part: no part grows, so the bound still holds
        index = max(range(len(parts)), key=lambda j: parts[j][1] - parts[j][0])
        start, end = parts[index]
        parts[index : index + 1] = [(start, end - 1), (end - 1, end)]
    return parts


def _greedy(costs: Sequence[float], bound: float) -> list[tuple[int, int]]:
    parts, start, total = [], 0, 0.0
    for i, cost in enumerate(costs):
        if total + cost > bound * (1 + 1e-12) and i > start:
            parts.append((start, i))
            start, total = i, 0.0
        total += cost
    parts.append((start, len(costs)))
    return parts


__all__ = ["InterOpPlan", "balanced_stages", "inter_op_plan"]
