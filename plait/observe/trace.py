"""``Tracer``: a timeline of every rank of a training run, merged into one Chrome/Perfetto trace.

Usage (every rank runs the same lines; ``save`` is a collective over the "world" axis)::

    tracer = plait.observe.trace.Tracer(engine)
    with tracer:                        # start(): a barrier over "world", then recording
        for batch in batches:
            engine.train_step(batch)
    summary = tracer.save("trace.json")  # rank 0 writes trace.json, trace.summary.json and trace.png

What is recorded, per rank, as ``time.perf_counter_ns`` intervals:

- ``Engine.train_step``: the step, each micro-batch's forward and backward, the gradient sync and the optimizer
  step; with pp > 1 the pipeline runtime's own per-action timeline (``PipelineRunner.timeline``: F, B, I, W of
  each stage and micro-batch), added after the step.
- ``Comm``: every collective that communicates, with op, axis, payload and wire bytes (``comm/collectives.py``).
  A blocking call is one span from launch to the end of its wait. An ``async_op=True`` call is an in-flight
  async slice (launch -> end of wait) plus a blocking "wait" span for the time the rank spent in ``wait()``.
- Idle: the part of each step on a rank covered by no span (the complement of the union of its spans),
  written as "idle" spans; per step, compute + communication + idle = the step's wall time
  (``trace_summary.split_step``).

Clocks: ranks on one host share ``perf_counter`` (CLOCK_MONOTONIC), so their spans are placed exactly. Hosts
differ in origin: each host's time 0 is the moment its lowest rank left the start barrier, so hosts agree up
to the barrier's exit skew (tens of microseconds on a fast network; more on a loaded one).

On CUDA each span boundary synchronises the device (``cuda_sync=True``), so spans time the kernels, not
their launches; that also serialises host and device while tracing. The pipeline runtime's actions are timed
on the host (launch time on CUDA). Cost with no tracer: one attribute check per collective launch and wait
and per ``train_step`` (measured in docs/observability.md). While a ``torch.profiler`` run is active the
spans are also emitted as ``record_function`` ranges, so they appear in its trace too.
"""

from __future__ import annotations

import contextlib
import json
import resource
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from plait.comm import Comm
from plait.comm.stats import wire_bytes
from plait.logging import get_logger

log = get_logger(__name__)

COMPUTE, COMM = 0, 1
"""Thread ids of a rank's tracks: compute (steps, forward, backward, optimizer, idle) and blocking comm."""
KIND_CATEGORY = {"F": "forward", "B": "backward", "I": "backward", "W": "backward"}
"""Pipeline action kind -> span category (I and W: the input and weight halves of a zero-bubble backward)."""
COMM_CATEGORY = "comm"
_NO_SPAN = contextlib.nullcontext()


def no_span(name: str, cat: str, **args: Any) -> contextlib.AbstractContextManager[None]:
    """What ``Engine`` uses for a span when nothing traces: a shared do-nothing context manager."""
    return _NO_SPAN


def max_rss_bytes() -> int:
    """This process's peak resident set size since it started (``getrusage``; monotonic, not per step)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


class Tracer:
    """Records spans of this rank while started; ``save``/``gather`` merge every rank's on rank 0."""

    def __init__(self, engine_or_comm: Any, cuda_sync: bool = True) -> None:
        comm = engine_or_comm if isinstance(engine_or_comm, Comm) else getattr(engine_or_comm, "comm", None)
        if not isinstance(comm, Comm):
            raise TypeError(
                f"Tracer needs a plait Engine or Comm, got {type(engine_or_comm).__name__}. Fix: pass "
                f"the engine plait.parallelize returned."
            )
        self.comm = comm
        self.rank = comm.mesh.rank
        self.cuda = comm.device.type == "cuda" and cuda_sync
        self.spans: list[tuple[int, str, str, int, int, dict[str, Any]]] = []
        """(thread, category, name, start_ns, end_ns, args) in this process's perf_counter_ns."""
        self.flights: list[tuple[str, int, int, dict[str, Any]]] = []
        """Async collectives: (name, launch_ns, wait_end_ns, args)."""
        self.steps: list[tuple[int, int, int, int]] = []
        """(step, start_ns, end_ns, peak memory bytes) of every traced ``train_step``."""
        self.origin_ns = 0
        self.active = False

    # ----------------------------------------------------------------- start / stop
    def start(self) -> Tracer:
        """Begin recording (a collective over "world": every rank calls it at the same point)."""
        if self.comm.tracer is not None and self.comm.tracer is not self:
            raise RuntimeError("another Tracer is already recording this engine's Comm. Fix: stop it first.")
        self.comm.barrier("world")
        self.origin_ns = time.perf_counter_ns()
        if self.comm.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.comm.device)
        self.comm.tracer, self.active = self, True
        return self

    def stop(self) -> None:
        """Stop recording (no collective); the spans stay for ``gather``/``save``."""
        if self.comm.tracer is self:
            self.comm.tracer = None
        self.active = False

    def __enter__(self) -> Tracer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ----------------------------------------------------------------- recording
    def now(self) -> int:
        """perf_counter_ns, after the device finished its queued work when tracing on CUDA."""
        if self.cuda:
            torch.cuda.synchronize(self.comm.device)
        return time.perf_counter_ns()

    @contextlib.contextmanager
    def span(self, name: str, cat: str, **args: Any) -> Iterator[None]:
        """Record the enclosed code as one compute-track span of category ``cat``."""
        ranged = torch.autograd.profiler.record_function(name) if torch.autograd._profiler_enabled() else _NO_SPAN
        with ranged:
            start = self.now()
            try:
                yield
            finally:
                self.spans.append((COMPUTE, cat, name, start, self.now(), args))

    def collective(
        self, op: str, axis: str, group_size: int, sent: int, received: int, launched: int, waited: int, is_async: bool
    ) -> None:
        """Called by ``Pending.wait`` once a traced collective finished (``sent``: payload bytes)."""
        ended = self.now()
        wire = sent if op == "send_recv" else wire_bytes(op, sent, group_size)
        args = {"op": op, "axis": axis, "bytes": sent, "wire_bytes": int(wire), "ranks": group_size}
        if received:
            args["received_bytes"] = received
        name = f"{op} {axis}"
        if is_async:
            self.flights.append((name, launched, ended, args))
            self.spans.append((COMM, COMM_CATEGORY, f"wait {name}", waited, ended, args))
        else:
            self.spans.append((COMM, COMM_CATEGORY, name, launched, ended, args))

    def pipeline(self, timeline: Sequence[tuple[Any, float, float]]) -> None:
        """Add a pipeline runtime's last-step actions ((action, start_s, end_s), perf_counter seconds)."""
        for action, start, end in timeline:
            self.spans.append(
                (
                    COMPUTE,
                    KIND_CATEGORY.get(action.kind, "compute"),
                    str(action),
                    int(start * 1e9),
                    int(end * 1e9),
                    {"stage": action.stage, "microbatch": action.microbatch, "kind": action.kind},
                )
            )

    def step(self, step: int, start: int) -> None:
        """Close the span of ``train_step`` number ``step`` begun at ``start`` (from ``now()``)."""
        end = self.now()
        if self.comm.device.type == "cuda":
            memory = torch.cuda.max_memory_allocated(self.comm.device)
        else:
            memory = max_rss_bytes()
        self.steps.append((step, start, end, int(memory)))

    # ----------------------------------------------------------------- merge and write
    def local_record(self) -> dict[str, Any]:
        """This rank's recording as plain data (what ``gather`` sends to rank 0)."""
        mesh = self.comm.mesh
        axes = [a for a in ("pp", "dp", "cp", "tp") if mesh.size(a) > 1]
        return {
            "rank": self.rank,
            "host": socket.gethostname(),
            "origin_ns": self.origin_ns,
            "coords": {a: mesh.index(a) for a in axes},
            "memory_kind": "cuda_max_allocated" if self.comm.device.type == "cuda" else "cpu_max_rss",
            "spans": [list(s) for s in self.spans],
            "flights": [list(f) for f in self.flights],
            "steps": [list(s) for s in self.steps],
        }

    def gather(self) -> list[dict[str, Any]] | None:
        """Every rank's ``local_record`` on rank 0 (None elsewhere). A collective over "world"; stops recording."""
        self.stop()
        records = self.comm.all_gather_bytes(json.dumps(self.local_record()).encode(), "world")
        return [json.loads(r) for r in records] if self.rank == 0 else None

    def save(self, path: str | Path, png: str | Path | bool = True) -> dict[str, Any] | None:
        """Gather (collective) and, on rank 0, write the merged trace to ``path``, the summary (time split and
        idle share per rank and step, peak memory) to ``<stem>.summary.json`` and, with ``png``, the picture
        (``<stem>.png`` when True). Returns the summary on rank 0, None elsewhere."""
        from plait.observe import trace_summary

        records = self.gather()
        if records is None:
            return None
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        events, summary = trace_summary.merge(records)
        path.write_text(
            json.dumps(
                {
                    "traceEvents": events,
                    "displayTimeUnit": "ms",
                    "otherData": {"producer": "plait.observe.trace", "clock": summary["clock"]},
                }
            )
        )
        summary_path = path.with_name(path.stem + ".summary.json")
        summary_path.write_text(json.dumps(summary, indent=1))
        if png:
            picture = path.with_suffix(".png") if png is True else Path(png)
            trace_summary.draw(summary, picture)
            summary["png"] = str(picture)
        log.info(
            "trace of %d steps on %d ranks -> %s (open in ui.perfetto.dev); idle share per rank: %s",
            len(summary["steps"]),
            len(records),
            path,
            trace_summary.idle_line(summary),
        )
        return summary


__all__ = ["COMM", "COMPUTE", "Tracer", "max_rss_bytes", "no_span"]
