"""From the ranks' raw traces to one row (a flat dict) per contender: medians, spreads, ratios, theory.

A step of a distributed job takes as long as its slowest rank, so a step's time is the max over ranks of that
step's time. Throughput is the global batch's tokens over the median step time. Ratios to the baseline (the
suite's torch-native peer) come two ways: from the medians over every timed step, and paired round by round
(plait's round r against the peer's round r, which ran next to it), whose min..max is the spread.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from benchmarks.contenders import CONTENDERS, Suite
from benchmarks.worker import RankResult

LOSS_TOLERANCE = 1e-5
"""Contenders start from the same weights and see the same batches: their losses must agree to this."""


@dataclass
class Series:
    """One contender's measurements gathered over every launch (rounds) and rank."""

    name: str
    rounds: list[list[float]] = field(default_factory=list)
    """Per round, the step times (seconds, max over ranks)."""
    final_losses: list[float] = field(default_factory=list)
    """Per launch, the loss of the last timed step (mean over ranks: each rank's share is equal)."""
    wire: list[float] = field(default_factory=list)
    peak_rss_kb: list[int] = field(default_factory=list)
    growth_rss_kb: list[int] = field(default_factory=list)
    params: np.ndarray | None = None
    info: dict[str, Any] = field(default_factory=dict)
    model_state: list[dict[str, int]] = field(default_factory=list)
    """Per launch and rank, the model-state bytes by kind at the probe step's optimizer step."""

    @property
    def seconds(self) -> list[float]:
        return [s for block in self.rounds for s in block]


def collect(suite: Suite, launches: list[list[RankResult]]) -> dict[str, Series]:
    """Gather each contender's series from the launches, in the order they ran."""
    series = {name: Series(name) for name in suite.contenders}
    for ranks in launches:
        first = ranks[0]
        for name, trace in first.traces.items():
            s = series[name]
            per_rank = [r.traces[name] for r in ranks]
            step_max = np.max([t.seconds for t in per_rank], axis=0)
            for block in sorted(set(trace.blocks)):
                s.rounds.append([float(x) for x, b in zip(step_max, trace.blocks) if b == block])
            s.final_losses.append(float(np.mean([t.losses[-1] for t in per_rank])))
            s.wire.extend(float(w) for w in trace.wire_bytes if w is not None)
            if trace.params is not None:
                s.params = trace.params
            s.info = {**trace.info}
            s.model_state.extend(r.traces[name].info.get("model_state_bytes") or {} for r in ranks)
            if len(first.traces) == 1:  # a process of its own: its memory is this contender's
                s.peak_rss_kb.extend(r.peak_rss_kb for r in ranks)
                s.growth_rss_kb.extend(r.peak_rss_kb - r.start_rss_kb for r in ranks)
    return series


def _quantile(values: list[float], q: float) -> float:
    return float(np.quantile(np.asarray(values), q))


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b not in (None, 0) else None


def model_state(s: Series) -> tuple[float | None, dict[str, int]]:
    """The most model-state bytes any rank held (total) and, by kind, the most any rank held of that kind."""
    held = [m for m in s.model_state if m]
    if not held:
        return None, {}
    return float(max(sum(m.values()) for m in held)), {kind: max(m.get(kind, 0) for m in held) for kind in held[0]}


def summarise(suite: Suite, world: int, launches: list[list[RankResult]]) -> list[dict[str, Any]]:
    """One row per contender of ``suite``, in its order, with ratios against that contender's baseline
    (``Suite.baseline_of``: the last contender, or the peer it is paired with)."""
    series = collect(suite, launches)
    workload = suite.workload
    num_params = workload.num_parameters()
    tokens = workload.tokens_per_step
    rows = []
    for name in suite.contenders:
        s = series[name]
        baseline = series[suite.baseline_of(name)]
        base_median = statistics.median(baseline.seconds)
        base_state, _ = model_state(baseline)
        contender = CONTENDERS[name]
        if contender.theory is not None:
            theory, theory_text = contender.theory(workload, world), contender.theory_text
        else:
            theory, theory_text = suite.theory(num_params, world), suite.theory_text
        median = statistics.median(s.seconds)
        paired = [
            statistics.median(mine) / statistics.median(theirs) for mine, theirs in zip(s.rounds, baseline.rounds)
        ]
        wire, wire_source = None, None
        if s.wire:
            wire, wire_source = statistics.mean(s.wire), "measured (plait CommStats, ring model)"
        elif "wire_bytes_per_step" in s.info:
            wire, wire_source = float(s.info["wire_bytes_per_step"]), "modelled from the peer's structure (ring model)"
        loss_diff = abs(s.final_losses[-1] - baseline.final_losses[-1])
        param_diff = (
            float(np.max(np.abs(s.params - baseline.params)))
            if s.params is not None and baseline.params is not None
            else None
        )
        state, state_parts = model_state(s)
        peak = max(s.peak_rss_kb) / 1024 if s.peak_rss_kb else None
        base_peak = max(baseline.peak_rss_kb) / 1024 if baseline.peak_rss_kb else None
        rows.append(
            {
                "suite": suite.name,
                "contender": name,
                "role": "baseline" if suite.is_baseline(name) else "plait",
                "baseline": baseline.name,
                "what": CONTENDERS[name].what,
                "world": world,
                "params": num_params,
                "tokens_per_step": tokens,
                "workload": workload.describe(),
                "interleave": suite.interleave,
                "rounds": len(s.rounds),
                "timed_steps": len(s.seconds),
                "step_ms": median * 1e3,
                "step_ms_p25": _quantile(s.seconds, 0.25) * 1e3,
                "step_ms_p75": _quantile(s.seconds, 0.75) * 1e3,
                "tokens_per_s": tokens / median,
                "tokens_per_s_p25": tokens / _quantile(s.seconds, 0.75),
                "tokens_per_s_p75": tokens / _quantile(s.seconds, 0.25),
                "round_tokens_per_s": [tokens / statistics.median(r) for r in s.rounds],
                "speed_vs_baseline": base_median / median,
                "overhead_pct": (median / base_median - 1.0) * 100.0,
                "paired_overhead_pct": (statistics.median(paired) - 1.0) * 100.0,
                "paired_overhead_pct_min": (min(paired) - 1.0) * 100.0,
                "paired_overhead_pct_max": (max(paired) - 1.0) * 100.0,
                "peak_rss_mb": peak,
                "rss_growth_mb": max(s.growth_rss_kb) / 1024 if s.growth_rss_kb else None,
                "rss_vs_baseline": _ratio(peak, base_peak),
                "model_state_mb": None if state is None else state / 2**20,
                "model_state_parts": state_parts,
                "model_state_vs_baseline": _ratio(state, base_state),
                "saved_activation_mb": (
                    s.info["saved_activation_bytes"] / 2**20 if "saved_activation_bytes" in s.info else None
                ),
                "wire_bytes_per_step": wire,
                "wire_source": wire_source,
                "theory_bytes_per_step": theory,
                "theory": theory_text,
                "wire_vs_theory": _ratio(wire, theory) if theory else None,
                "final_loss": s.final_losses[-1],
                "loss_diff_vs_baseline": loss_diff,
                "param_max_diff_vs_baseline": param_diff,
                "same_loss": loss_diff <= LOSS_TOLERANCE,
                "repeat_loss_spread": max(s.final_losses) - min(s.final_losses),
                "info": s.info,
            }
        )
    return rows
