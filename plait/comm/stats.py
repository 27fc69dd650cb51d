"""Byte accounting for every collective, per mesh axis and operation.

Two figures per call:
- ``payload``: the bytes of the tensor handed to the collective (the input; for all-gather, the output).
- ``wire``: the bytes this rank sends under the bandwidth-optimal ring algorithm for a group of N ranks
  (Patarasuk & Yuan 2009; Thakur et al. 2005): all-reduce 2(N-1)/N x S, all-gather and reduce-scatter
  (N-1)/N x S for the full tensor S, all-to-all (N-1)/N x S, broadcast S, send S. An uneven all-to-all
  (``all_to_all_v``: expert parallelism's token exchange) records what it really sends to the other ranks: the
  rows of its input that leave this rank.
Theory in the issues and papers (e.g. DDP moves 2(N-1)/N x P bytes per step) is stated in wire bytes.

While ``Comm.timed`` is set (``plait.observe.stragglers``), each call's host seconds inside ``Pending.wait`` are
added too (``seconds``): for a blocking call the whole call after its launch, for an ``async_op=True`` call the
part the rank spent blocked in ``wait()``. They are kept out of ``to_dict`` (bytes and calls are deterministic,
seconds are not).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

RING_FACTOR = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "all_to_all_v": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0 if n > 1 else 0.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 0.0,
}


def wire_bytes(op: str, payload: int, group_size: int) -> float:
    """Bytes one rank sends for ``op`` on ``payload`` bytes in a ring of ``group_size`` ranks."""
    return RING_FACTOR[op](group_size) * payload


@dataclass
class OpCount:
    """Totals for one (axis, op) pair."""

    calls: int = 0
    payload_bytes: int = 0
    wire_bytes: float = 0.0
    seconds: float = 0.0
    """Host seconds spent waiting for these calls (only while ``Comm.timed``; module docstring)."""


@dataclass
class CommStats:
    """Counts of collectives keyed by (axis, op); take ``snapshot()`` and ``since()`` for per-step deltas."""

    counts: dict[tuple[str, str], OpCount] = field(default_factory=dict)

    def record(self, axis: str, op: str, payload: int, group_size: int, wire: float | None = None) -> None:
        """Count one call; ``wire``: the bytes it sends when known exactly (else the ring model's)."""
        entry = self.counts.setdefault((axis, op), OpCount())
        entry.calls += 1
        entry.payload_bytes += payload
        entry.wire_bytes += wire_bytes(op, payload, group_size) if wire is None else wire

    def add_seconds(self, axis: str, op: str, seconds: float) -> None:
        """Add the host seconds one call of ``op`` on ``axis`` spent waiting (``Pending.wait``)."""
        self.counts.setdefault((axis, op), OpCount()).seconds += seconds

    def snapshot(self) -> CommStats:
        return CommStats({key: replace(count) for key, count in self.counts.items()})

    def since(self, earlier: CommStats) -> CommStats:
        """What was recorded after ``earlier`` (a snapshot of this object)."""
        delta: dict[tuple[str, str], OpCount] = {}
        for key, now in self.counts.items():
            before = earlier.counts.get(key, OpCount())
            if now.calls != before.calls or now.seconds != before.seconds:
                delta[key] = OpCount(
                    now.calls - before.calls,
                    now.payload_bytes - before.payload_bytes,
                    now.wire_bytes - before.wire_bytes,
                    now.seconds - before.seconds,
                )
        return CommStats(delta)

    def reset(self) -> None:
        self.counts.clear()

    def wire_by_axis(self) -> dict[str, float]:
        """Bytes sent per mesh axis (ring model)."""
        totals: dict[str, float] = {}
        for (axis, _op), entry in self.counts.items():
            totals[axis] = totals.get(axis, 0.0) + entry.wire_bytes
        return totals

    def wire(self, axis: str | None = None, op: str | None = None) -> float:
        """Bytes sent, optionally filtered by axis and/or op."""
        return sum(
            e.wire_bytes for (a, o), e in self.counts.items() if (axis is None or a == axis) and (op is None or o == op)
        )

    @property
    def total_wire_bytes(self) -> float:
        return self.wire()

    @property
    def seconds(self) -> float:
        """Host seconds spent waiting for collectives, all axes and ops (0 unless ``Comm.timed``)."""
        return sum(e.seconds for e in self.counts.values())

    def to_dict(self) -> dict[str, dict[str, float]]:
        """``{"dp/all_reduce": {"calls": .., "payload_bytes": .., "wire_bytes": ..}}`` for metrics files."""
        return {
            f"{axis}/{op}": {"calls": e.calls, "payload_bytes": e.payload_bytes, "wire_bytes": e.wire_bytes}
            for (axis, op), e in sorted(self.counts.items())
        }

    def summary(self) -> str:
        """One line, e.g. ``dp 1.2 MB (3 calls)``."""
        if not self.counts:
            return "no communication"
        parts = []
        for axis, wire in sorted(self.wire_by_axis().items()):
            calls = sum(e.calls for (a, _), e in self.counts.items() if a == axis)
            parts.append(f"{axis} {wire / 1e6:.3g} MB ({calls} calls)")
        return ", ".join(parts)
