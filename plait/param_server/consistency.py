"""Consistency models of a parameter server: when a pushed gradient is applied and when a worker may go on.

- BSP (bulk synchronous): round v closes when every live worker has pushed a gradient computed on version v; the
  server applies their mean once, w_{v+1} = opt(w_v, mean_i g_i(w_v)). With all workers alive this *is* synchronous
  data-parallel training on the union of their batches.
- ASP (asynchronous): each push is applied on arrival, w_{v+1} = opt(w_v, g(w_{v-tau})); the staleness tau is
  unbounded (Hogwild!-style, Recht et al. 2011; Downpour SGD, Dean et al. 2012).
- SSP (stale synchronous, Ho et al. 2013): as ASP, but a worker whose clock (pushes completed) is more than
  ``staleness`` ahead of the slowest live worker's waits before pulling; so every gradient misses at most a
  bounded number of the other workers' updates.
Every applied gradient is tagged with the version it was computed on; tau = version at apply - that version.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from plait.errors import ConfigError

MODES = ("bsp", "asp", "ssp")


@dataclass(frozen=True)
class Consistency:
    """A mode and, for SSP, the bound s on how many clocks a worker may run ahead of the slowest live one."""

    mode: str = "bsp"
    staleness: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"consistency mode {self.mode!r} is unknown. Fix: use one of {', '.join(MODES)}.")
        if isinstance(self.staleness, bool) or not isinstance(self.staleness, int) or self.staleness < 0:
            raise ConfigError(
                f"staleness={self.staleness!r} must be an integer >= 0 (the SSP bound s). Fix: e.g. --staleness 2."
            )
        if self.mode != "ssp" and self.staleness != 0:
            raise ConfigError(
                f"staleness={self.staleness} only applies to mode 'ssp' (got {self.mode!r}). "
                f"Fix: use --mode ssp, or drop --staleness."
            )

    def may_pull(self, clock: int, slowest_live_clock: int) -> bool:
        """SSP's gate: a worker at `clock` may read parameters iff clock - slowest <= s (always for ASP/BSP)."""
        return self.mode != "ssp" or clock - slowest_live_clock <= self.staleness


@dataclass
class StalenessStats:
    """Histogram of the staleness tau of applied gradients."""

    counts: Counter = field(default_factory=Counter)

    def record(self, tau: int) -> None:
        self.counts[tau] += 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def mean(self) -> float:
        return sum(tau * count for tau, count in self.counts.items()) / max(1, self.total)

    @property
    def max(self) -> int:
        return max(self.counts, default=0)

    def as_dict(self) -> dict[str, object]:
        return {"mean": self.mean, "max": self.max, "histogram": dict(sorted(self.counts.items()))}


__all__ = ["MODES", "Consistency", "StalenessStats"]
