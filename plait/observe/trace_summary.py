"""Merging the ranks' recordings of ``plait.observe.trace.Tracer`` into one Chrome/Perfetto trace, the time split of
every step on every rank, and the summary picture.

Time split of one step on one rank, over the step's window W (``split_step``)::

    busy  = |W ∩ union(all spans of the rank)|         comm = |W ∩ union(communication spans)|
    compute = busy - comm      idle = |W| - busy        idle share = idle / |W|

so compute + comm + idle = |W|, and communication that overlaps compute (an all-reduce running during a
backward pass) counts as compute: only blocking communication is "comm". Idle is what no span covers: a rank
waiting between pipeline actions for its input, loading the batch, Python between spans.

Trace layout (Chrome trace-event format, microseconds; ui.perfetto.dev and chrome://tracing open it): one
process per rank (pid = global rank) with two threads: "compute" (steps, forward, backward, sync, optimizer,
pipeline actions, idle) and "comm (blocking)"; asynchronous collectives in flight are async slices.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from plait.observe.trace import COMM, COMM_CATEGORY, COMPUTE

Interval = tuple[int, int]
CLOCK = (
    "perf_counter_ns (CLOCK_MONOTONIC); ranks on one host share it; each host's time 0 is its lowest rank "
    "leaving the start barrier, so hosts agree up to that barrier's exit skew"
)
SKIP = ("step", "idle")
"""Categories that are not work: the step itself and the idle spans derived here."""


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering exactly the given ones."""
    merged: list[list[int]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def clip(intervals: list[Interval], start: int, end: int) -> list[Interval]:
    return [(max(a, start), min(b, end)) for a, b in intervals if b > start and a < end]


def measure(intervals: list[Interval]) -> int:
    return sum(b - a for a, b in intervals)


def gaps(covered: list[Interval], start: int, end: int) -> list[Interval]:
    """The parts of [start, end) that ``covered`` (disjoint, sorted, clipped) leaves out."""
    out, cursor = [], start
    for a, b in covered:
        if a > cursor:
            out.append((cursor, a))
        cursor = max(cursor, b)
    if cursor < end:
        out.append((cursor, end))
    return out


def split_step(spans: list[list[Any]], start: int, end: int) -> dict[str, Any]:
    """Compute / comm / idle seconds of the window [start, end) (module doc), and the idle gaps."""
    work = clip(union((s[3], s[4]) for s in spans if s[1] not in SKIP), start, end)
    comm = clip(union((s[3], s[4]) for s in spans if s[1] == COMM_CATEGORY), start, end)
    busy, blocking, total = measure(work), measure(comm), end - start
    return {
        "seconds": total / 1e9,
        "compute_s": (busy - blocking) / 1e9,
        "comm_s": blocking / 1e9,
        "idle_s": (total - busy) / 1e9,
        "idle_share": (total - busy) / total if total > 0 else 0.0,
        "gaps": gaps(work, start, end),
    }


def _origins(records: list[dict[str, Any]]) -> dict[int, int]:
    """Per rank, the perf_counter_ns that is time 0 for it: its host's lowest rank's barrier exit."""
    lead: dict[str, int] = {}
    for record in sorted(records, key=lambda r: r["rank"]):
        lead.setdefault(record["host"], record["origin_ns"])
    return {r["rank"]: lead[r["host"]] for r in records}


def _label(record: dict[str, Any]) -> str:
    coords = " ".join(f"{axis}{index}" for axis, index in record["coords"].items())
    return f"rank {record['rank']}" + (f" ({coords})" if coords else "")


def merge(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Chrome trace events of every rank and the summary (per rank and per step time split, peak memory)."""
    origins = _origins(records)
    events: list[dict[str, Any]] = []
    ranks: list[dict[str, Any]] = []
    per_step: dict[int, list[dict[str, Any]]] = {}
    for record in sorted(records, key=lambda r: r["rank"]):
        rank, zero = record["rank"], origins[record["rank"]]

        def us(ns: int, zero: int = zero) -> float:
            return (ns - zero) / 1e3

        events += [
            {"ph": "M", "pid": rank, "name": "process_name", "args": {"name": _label(record)}},
            {"ph": "M", "pid": rank, "name": "process_sort_index", "args": {"sort_index": rank}},
            {"ph": "M", "pid": rank, "tid": COMPUTE, "name": "thread_name", "args": {"name": "compute"}},
            {"ph": "M", "pid": rank, "tid": COMM, "name": "thread_name", "args": {"name": "comm (blocking)"}},
        ]
        for tid, cat, name, start, end, args in record["spans"]:
            events.append(
                {
                    "ph": "X",
                    "pid": rank,
                    "tid": tid,
                    "cat": cat,
                    "name": name,
                    "ts": us(start),
                    "dur": (end - start) / 1e3,
                    "args": args,
                }
            )
        for index, (name, start, end, args) in enumerate(record["flights"]):
            ident = f"{rank}.{index}"
            events.append(
                {
                    "ph": "b",
                    "pid": rank,
                    "tid": COMM,
                    "cat": "comm_async",
                    "name": name,
                    "id": ident,
                    "ts": us(start),
                    "args": args,
                }
            )
            events.append(
                {"ph": "e", "pid": rank, "tid": COMM, "cat": "comm_async", "name": name, "id": ident, "ts": us(end)}
            )
        totals = {"seconds": 0.0, "compute_s": 0.0, "comm_s": 0.0, "idle_s": 0.0}
        peak = 0
        for step, start, end, memory in record["steps"]:
            split = split_step(record["spans"], start, end)
            gap_list = split.pop("gaps")
            events.append(
                {
                    "ph": "X",
                    "pid": rank,
                    "tid": COMPUTE,
                    "cat": "step",
                    "name": f"step {step}",
                    "ts": us(start),
                    "dur": (end - start) / 1e3,
                    "args": dict(split, peak_memory_bytes=memory),
                }
            )
            events += [
                {
                    "ph": "X",
                    "pid": rank,
                    "tid": COMPUTE,
                    "cat": "idle",
                    "name": "idle",
                    "ts": us(a),
                    "dur": (b - a) / 1e3,
                }
                for a, b in gap_list
            ]
            for key in totals:
                totals[key] += split[key]
            peak = max(peak, memory)
            per_step.setdefault(step, []).append(dict(split, rank=rank, peak_memory_bytes=memory))
        ranks.append(
            {
                "rank": rank,
                "host": record["host"],
                "coords": record["coords"],
                **totals,
                "idle_share": totals["idle_s"] / totals["seconds"] if totals["seconds"] else 0.0,
                "memory_kind": record["memory_kind"],
                "peak_memory_bytes": peak,
                "steps": len(record["steps"]),
            }
        )
    summary = {
        "clock": CLOCK,
        "ranks": ranks,
        "steps": [{"step": step, "ranks": rows} for step, rows in sorted(per_step.items())],
    }
    return events, summary


def idle_line(summary: dict[str, Any]) -> str:
    """``rank 0 12.3%, rank 1 40.1%, ...``: the idle share of every rank over the traced steps."""
    return ", ".join(f"rank {r['rank']} {100 * r['idle_share']:.1f}%" for r in summary["ranks"])


def draw(summary: dict[str, Any], path: str | Path) -> Path:
    """PNG: peak memory per rank (left) and, per step, each rank's compute / comm / idle time (stacked bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = summary["ranks"]
    steps = summary["steps"]
    n = max(1, len(ranks))
    fig, (mem_ax, time_ax) = plt.subplots(1, 2, figsize=(12, 4.2), dpi=110, gridspec_kw={"width_ratios": [1, 3]})
    kind = ranks[0]["memory_kind"] if ranks else ""
    mem_ax.bar([r["rank"] for r in ranks], [r["peak_memory_bytes"] / 2**20 for r in ranks], color="tab:purple")
    mem_ax.set_xticks([r["rank"] for r in ranks])  # whole ranks (matplotlib's own ticks read 0.0, 0.5, 1.0)
    mem_ax.set_xlabel("rank")
    mem_ax.set_ylabel("MiB")
    mem_ax.set_title(f"peak memory ({kind})", fontsize=10)
    width = 0.8 / n
    colours = {"compute_s": "tab:blue", "comm_s": "tab:orange", "idle_s": "lightgrey"}
    for j, entry in enumerate(steps):
        for row in entry["ranks"]:
            x = j + (row["rank"] - (n - 1) / 2) * width
            bottom = 0.0
            for key, colour in colours.items():
                label = key[:-2] if j == 0 and row["rank"] == ranks[0]["rank"] else None
                time_ax.bar(x, 1e3 * row[key], width * 0.95, bottom=bottom, color=colour, label=label)
                bottom += 1e3 * row[key]
    time_ax.set_xticks(range(len(steps)), [str(s["step"]) for s in steps])
    time_ax.set_xlabel(f"step (one bar per rank, ranks {ranks[0]['rank'] if ranks else 0}..{n - 1} left to right)")
    time_ax.set_ylabel("ms")
    time_ax.legend(loc="upper right", fontsize=8)
    time_ax.set_title("time split per step; idle share: " + idle_line(summary), fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


__all__ = ["draw", "idle_line", "merge", "split_step", "union"]
