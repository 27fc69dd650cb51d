"""The only place that calls torch.distributed collectives.

``Comm`` is bound to a Mesh: every call names a mesh axis (``"dp"``, ``"tp"``, ``"dp_cp"``, ...), is a no-op
when that axis has one rank, is counted in ``CommStats``, and waits with a timeout. A failure or a timeout
raises ``CommError`` naming this rank, the axis, the group's ranks and the operation, so a dead or stuck
peer turns into an error instead of a hang. ``async_op=True`` returns a ``Pending`` whose ``wait()`` does
the same checks later (used to overlap communication with compute).

Tracing (``plait.observe.trace.Tracer``): while ``Comm.tracer`` is set, every collective that communicates is
reported once, when its ``Pending`` is waited for, with its op, axis, payload and wire bytes and three
``perf_counter_ns`` times: launch, wait start, wait end. A blocking call's span is launch -> wait end; an
``async_op=True`` call is shown as in flight from launch to wait end and as blocking only while ``wait()``
runs. With no tracer the cost is one attribute check per launch and per wait.

Timing (``Comm.timed``, set by ``plait.observe.stragglers``): each wait's host seconds go into ``stats``. On CUDA
with NCCL a wait does not block the host (the stream waits), so those seconds are host time, not the device's.

Under ``torch.compile`` every collective (and ``Pending.wait``) runs eagerly once ``run_eagerly_under_compile``
has been called (``Layout(compile=...)`` does): compiled code breaks its graph around it.

gloo with CUDA tensors (several ranks on one GPU, for tests): its collectives take device tensors, its
point-to-point does not, so ``send_recv`` stages them through host memory (``needs_host_staging``). Staging
rather than refusing lets pipeline stages and ring attention run on one GPU under gloo, at the price of two
copies per message, which only such test set-ups pay (NCCL, the GPU backend, sends device memory directly).
"""

from __future__ import annotations

import datetime
import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from plait.comm.stats import CommStats
from plait.errors import CommError
from plait.mesh import Mesh

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "avg": dist.ReduceOp.SUM}


# torch 2.13 renamed the tensor-in/tensor-out collectives; keep working on both sides of the rename.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def needs_host_staging(backend: str | None, device_type: str) -> bool:
    """Whether point-to-point messages of a ``device_type`` tensor must be copied through host memory: gloo sends
    and receives host memory only (a CUDA tensor fails inside gloo with "writev ... Bad address", which surfaces
    as a dead peer). Its collectives accept CUDA tensors, so only ``send_recv`` stages (a device -> host copy
    before sending, host -> device after receiving). Pure."""
    return backend == "gloo" and device_type not in ("cpu", "meta")


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


P2PBatch = tuple[Sequence[tuple[torch.Tensor, int]], Sequence[tuple[torch.Tensor, int]]]
"""One batch of point-to-point transfers: ((tensor, global rank) to send, (buffer, global rank) to receive into)."""


def _nothing() -> None:
    """Finishes a batch whose receives landed in their own buffers."""


def _copy_back(targets: list[tuple[torch.Tensor, int]], staged: list[tuple[torch.Tensor, int]]) -> Callable[[], None]:
    """What finishes a batch whose receives were staged through host buffers: copy them into their targets."""

    def finish() -> None:
        for (target, _), (buffer, _) in zip(targets, staged):
            target.copy_(buffer)

    return finish


class Pending:
    """An issued collective: ``wait()`` blocks (with the timeout), runs the finishing step and returns its result."""

    is_async = False
    """Set when handed to the caller (``async_op=True``); a tracer then shows the launch-to-wait flight."""

    def __init__(
        self,
        comm: Comm,
        axis: str,
        op: str,
        works: Sequence[Any],
        finish: Callable[[], Any],
        sent: int = 0,
        received: int = 0,
    ) -> None:
        self._comm, self._axis, self._op = comm, axis, op
        self._works, self._finish = list(works), finish
        self._done = False
        self._result: Any = None
        self._traced = (sent, received, time.perf_counter_ns()) if comm.tracer is not None else None

    def wait(self) -> Any:
        if not self._done:
            traced = self._traced
            tracer = self._comm.tracer if traced is not None else None
            timed = self._comm.timed
            waited = time.perf_counter_ns() if tracer is not None or timed else 0
            for work in self._works:
                self._comm._guard(self._axis, self._op, functools.partial(work.wait, timeout=self._comm.timeout))
            self._result = self._finish()
            self._done = True
            if timed:
                self._comm.stats.add_seconds(self._axis, self._op, (time.perf_counter_ns() - waited) / 1e9)
            if tracer is not None and traced is not None:
                sent, received, launched = traced
                tracer.collective(
                    self._op, self._axis, self._comm.size(self._axis), sent, received, launched, waited, self.is_async
                )
        return self._result


class Done(Pending):
    """A collective that needed no communication (size-1 group): already finished."""

    def __init__(self, result: Any) -> None:
        self._done, self._result = True, result


class Comm:
    """Collectives over the axes of one Mesh, with byte accounting and timeouts."""

    def __init__(
        self,
        mesh: Mesh,
        stats: CommStats | None = None,
        timeout_s: float = 300.0,
        device: torch.device | str = "cpu",
    ) -> None:
        self.mesh = mesh
        self.device = torch.device(device)
        self.stats = stats if stats is not None else CommStats()
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.tracer: Any = None
        """A ``plait.observe.trace.Tracer`` while one records this Comm's collectives (set by ``Tracer.start``)."""
        self.timed = False
        """While set (``plait.observe.stragglers``), each call's host seconds in ``Pending.wait`` are added to
        ``stats`` (``CommStats.add_seconds``); off, the cost is this one check per wait."""
        self.overlap: Callable[[], None] | None = None
        """Set by the pipeline runtime while it runs an overlapped pair (``pipeline/overlap.py``): called by an
        exchange that may be overlapped (expert parallelism's all-to-alls) after issuing it asynchronously and
        before waiting for it, to let the pair's other chunk compute meanwhile. None: such exchanges block."""
        self.stage_p2p: bool | None = None
        """``send_recv`` through host memory: None decides per call (``needs_host_staging``); True/False force it."""
        self._backends: dict[str, str | None] = {}

    # ----------------------------------------------------------------- helpers
    def size(self, axis: str) -> int:
        return self.mesh.size(axis)

    def _guard(self, axis: str, op: str, call: Callable[[], Any]) -> Any:
        """Run ``call``; turn any failure into a CommError that names rank, axis, group and op."""
        try:
            return call()
        except CommError:
            raise
        except Exception as error:  # noqa: BLE001 - every backend error becomes a named CommError
            text = str(error)
            timed_out = "timed out" in text.lower() or "timeout" in text.lower()
            what = f"timed out after {self.timeout.total_seconds():g} s" if timed_out else "failed"
            raise CommError(
                f"rank {self.mesh.rank}: {op} on mesh axis '{axis}' (group ranks {self.mesh.ranks(axis)}) {what}: "
                f"{text.strip().splitlines()[0] if text.strip() else type(error).__name__}. A peer rank has probably "
                f"died or stopped calling collectives; check the other ranks' errors above.",
                rank=self.mesh.rank,
                axis=axis,
                op=op,
            ) from error

    def _issue(
        self,
        axis: str,
        op: str,
        payload: int,
        start: Callable[[dist.ProcessGroup], Any],
        finish: Callable[[], Any],
        wire: float | None = None,
    ) -> Pending:
        group = self.mesh.group(axis)
        if group is None:  # only size-1 axes have no group, and the collectives return before issuing for those
            raise CommError(
                f"rank {self.mesh.rank}: {op} on mesh axis '{axis}' of {self.size(axis)} ranks, but the mesh has no "
                f"process group for it. Fix: build the mesh with Mesh.build(layout) after "
                f"torch.distributed.init_process_group, on every rank.",
                rank=self.mesh.rank,
                axis=axis,
                op=op,
            )
        self.stats.record(axis, op, payload, self.size(axis), wire)
        work = self._guard(axis, op, lambda: start(group))
        return Pending(self, axis, op, [work] if work is not None else [], finish, sent=payload)

    @staticmethod
    def _result(pending: Pending, async_op: bool) -> Any:
        if async_op:
            pending.is_async = True
            return pending
        return pending.wait()

    # ----------------------------------------------------------------- collectives
    def all_reduce(self, tensor: torch.Tensor, axis: str, op: str = "sum", async_op: bool = False) -> Any:
        """Reduce ``tensor`` in place over ``axis`` (``op``: sum, avg, max, min); returns the tensor."""
        if op not in REDUCE_OPS:
            raise ValueError(f"unknown reduce op {op!r}; use one of {', '.join(REDUCE_OPS)}")
        n = self.size(axis)
        if n == 1:
            return Done(tensor) if async_op else tensor

        def finish() -> torch.Tensor:
            return tensor.div_(n) if op == "avg" else tensor

        pending = self._issue(
            axis,
            "all_reduce",
            _nbytes(tensor),
            lambda g: dist.all_reduce(tensor, op=REDUCE_OPS[op], group=g, async_op=True),
            finish,
        )
        return self._result(pending, async_op)

    def all_gather(self, tensor: torch.Tensor, axis: str, dim: int = 0, async_op: bool = False) -> Any:
        """Concatenate every rank's ``tensor`` along ``dim``, in axis order."""
        n = self.size(axis)
        if n == 1:
            return Done(tensor) if async_op else tensor
        moved = tensor.movedim(dim, 0).contiguous()
        out = torch.empty((n * moved.shape[0],) + tuple(moved.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        pending = self._issue(
            axis,
            "all_gather",
            _nbytes(out),
            lambda g: _all_gather_tensor(out, moved, group=g, async_op=True),
            lambda: out.movedim(0, dim),
        )
        return self._result(pending, async_op)

    def reduce_scatter(
        self, tensor: torch.Tensor, axis: str, dim: int = 0, op: str = "sum", async_op: bool = False
    ) -> Any:
        """Reduce over ``axis`` and keep this rank's 1/N slice along ``dim``."""
        n = self.size(axis)
        if n == 1:
            return Done(tensor) if async_op else tensor
        if tensor.shape[dim] % n:
            raise ValueError(
                f"reduce_scatter on axis '{axis}': dim {dim} of size {tensor.shape[dim]} does not split into {n} ranks"
            )
        moved = tensor.movedim(dim, 0).contiguous()
        out = torch.empty((moved.shape[0] // n,) + tuple(moved.shape[1:]), dtype=tensor.dtype, device=tensor.device)

        def finish() -> torch.Tensor:
            result = out.movedim(0, dim)
            return result.div_(n) if op == "avg" else result

        pending = self._issue(
            axis,
            "reduce_scatter",
            _nbytes(tensor),
            lambda g: _reduce_scatter_tensor(out, moved, op=REDUCE_OPS[op], group=g, async_op=True),
            finish,
        )
        return self._result(pending, async_op)

    def all_to_all(
        self, tensor: torch.Tensor, axis: str, scatter_dim: int, gather_dim: int, async_op: bool = False
    ) -> Any:
        """Split ``tensor`` into N chunks along ``scatter_dim``, send chunk j to rank j, concatenate what arrives
        along ``gather_dim`` (the Ulysses exchange: [seq/N, heads] <-> [seq, heads/N])."""
        n = self.size(axis)
        if n == 1:
            return Done(tensor) if async_op else tensor
        if tensor.shape[scatter_dim] % n:
            raise ValueError(
                f"all_to_all on axis '{axis}': dim {scatter_dim} of size {tensor.shape[scatter_dim]} does not split "
                f"into {n} ranks"
            )
        send = torch.stack(tensor.chunk(n, dim=scatter_dim)).contiguous()
        recv = torch.empty_like(send)
        pending = self._issue(
            axis,
            "all_to_all",
            _nbytes(send),
            lambda g: dist.all_to_all_single(recv, send, group=g, async_op=True),
            lambda: torch.cat(list(recv.unbind(0)), dim=gather_dim),
        )
        return self._result(pending, async_op)

    def all_to_all_v(
        self,
        tensor: torch.Tensor,
        axis: str,
        send_splits: Sequence[int],
        recv_splits: Sequence[int],
        async_op: bool = False,
    ) -> Any:
        """Uneven all-to-all along dim 0: rows [sum(send[:j]), sum(send[:j+1])) of ``tensor`` go to rank j of the
        axis group, and what rank j sends this rank arrives as ``recv_splits[j]`` rows, in rank order (expert
        parallelism's token exchange: each rank routes a different number of tokens to each expert). The split
        sizes must agree across ranks (what i sends j is what j receives from i). Counted with its exact wire
        bytes: the rows that leave this rank."""
        n = self.size(axis)
        if n == 1:
            return Done(tensor) if async_op else tensor
        send, recv = [int(v) for v in send_splits], [int(v) for v in recv_splits]
        if len(send) != n or len(recv) != n or sum(send) != tensor.shape[0] or min(send + recv) < 0:
            raise ValueError(
                f"all_to_all_v on axis '{axis}' ({n} ranks): send splits {send} (of {tensor.shape[0]} rows) and "
                f"receive splits {recv} must have one non-negative entry per rank, the send splits summing to the rows"
            )
        source = tensor.contiguous()
        out = torch.empty((sum(recv),) + tuple(source.shape[1:]), dtype=source.dtype, device=source.device)
        row = _nbytes(source[:1]) if source.shape[0] else math.prod(source.shape[1:]) * source.element_size()
        wire = float((sum(send) - send[self.mesh.index(axis)]) * row)
        pending = self._issue(
            axis,
            "all_to_all_v",
            _nbytes(source),
            lambda g: dist.all_to_all_single(
                out, source, output_split_sizes=recv, input_split_sizes=send, group=g, async_op=True
            ),
            lambda: out,
            wire,
        )
        return self._result(pending, async_op)

    def broadcast(self, tensor: torch.Tensor, axis: str, src: int = 0, async_op: bool = False) -> Any:
        """Copy the ``tensor`` of the rank at index ``src`` of this axis group to every member, in place."""
        n = self.size(axis)
        if n == 1:
            return Done(tensor) if async_op else tensor
        root = self.mesh.ranks(axis)[src]
        pending = self._issue(
            axis,
            "broadcast",
            _nbytes(tensor),
            lambda g: dist.broadcast(tensor, src=root, group=g, async_op=True),
            lambda: tensor,
        )
        return self._result(pending, async_op)

    def send_recv(
        self,
        sends: Sequence[tuple[torch.Tensor, int]] = (),
        recvs: Sequence[tuple[torch.Tensor, int]] = (),
        axis: str = "pp",
        async_op: bool = False,
    ) -> Any:
        """Batched point-to-point: send each ``(tensor, global_rank)`` and receive into each ``(buffer, global_rank)``.
        Device tensors over a gloo group travel through host copies (``stages_p2p_through_host``); the received
        values are in the buffers once the call (or its ``Pending.wait()``) returns."""
        if not sends and not recvs:
            return Done(None) if async_op else None
        return self._result(self.send_recv_batches([(sends, recvs)], axis)[0], async_op)

    def send_recv_batches(self, batches: Sequence[P2PBatch], axis: str = "pp") -> list[Pending]:
        """Post the sends and receives of every ``(sends, recvs)`` batch in one ``batch_isend_irecv`` and return one
        ``Pending`` per batch: waiting for a batch waits for its own transfers only. That needs the transport to
        complete each operation on its own (``p2p_progresses_independently``: gloo); on a backend that reports one
        completion for a whole call (NCCL's coalescing) several batches are refused before anything is posted.
        Empty batches get a finished ``Done``."""
        posting = sum(1 for sends, recvs in batches if sends or recvs)
        if posting > 1 and not self.p2p_progresses_independently(axis):
            raise CommError(
                f"rank {self.mesh.rank}: send_recv_batches on mesh axis '{axis}' got {posting} batches, which needs "
                f"one completion per operation, but the group's backend ({self._backend(axis)}) reports one for a "
                f"whole call. Fix: post one batch per call on this backend.",
                rank=self.mesh.rank,
                axis=axis,
                op="send_recv",
            )
        group = self.mesh.group(axis)
        ops: list[dist.P2POp] = []
        plans: list[tuple[int, int, Callable[[], Any], int, int] | None] = []  # first op, ops, finish, bytes
        for sends, recvs in batches:
            if not sends and not recvs:
                plans.append(None)
                continue
            sent = received = 0
            for tensor, _peer in sends:
                size = _nbytes(tensor)
                self.stats.record(axis, "send", size, 2)
                sent += size
            for tensor, _peer in recvs:
                size = _nbytes(tensor)
                self.stats.record(axis, "recv", size, 2)
                received += size
            finish: Callable[[], Any] = _nothing
            if self.stages_p2p_through_host(axis, [t for t, _ in (*sends, *recvs)]):
                targets = list(recvs)  # staged: the receivers' own buffers
                sends = [(tensor.detach().to("cpu", copy=True), peer) for tensor, peer in sends]
                recvs = [(torch.empty(t.shape, dtype=t.dtype), peer) for t, peer in targets]
                finish = _copy_back(targets, list(recvs))
            plans.append((len(ops), len(sends) + len(recvs), finish, sent, received))
            for tensor, peer in sends:
                ops.append(dist.P2POp(dist.isend, tensor, peer, group=group))
            for tensor, peer in recvs:
                ops.append(dist.P2POp(dist.irecv, tensor, peer, group=group))
        works = list(self._guard(axis, "send_recv", lambda: dist.batch_isend_irecv(ops))) if ops else []
        pendings: list[Pending] = []
        for plan in plans:
            if plan is None:
                pendings.append(Done(None))
                continue
            first, count, finish, sent, received = plan
            mine = works[first : first + count] if len(works) == len(ops) else works  # one batch, coalesced
            pendings.append(Pending(self, axis, "send_recv", mine, finish, sent=sent, received=received))
        return pendings

    def stages_p2p_through_host(self, axis: str, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether ``send_recv`` over ``axis`` copies ``tensors`` through host memory: ``stage_p2p`` when set
        (tests force it on CPU), else ``needs_host_staging`` for the axis group's backend."""
        if self.stage_p2p is not None:
            return self.stage_p2p
        backend = self._backend(axis)
        for tensor in tensors:
            if needs_host_staging(backend, tensor.device.type):
                return True
        return False

    def p2p_progresses_independently(self, axis: str) -> bool:
        """Whether each send and receive posted over ``axis`` completes on its own, whatever was posted before it:
        gloo's I/O threads match and move every message as soon as both ends are posted, so receives may be
        posted ahead of time (``plait.parallel.pipeline.program``). NCCL runs a communicator's operations in
        order on one stream: a receive posted early holds up the sends queued after it."""
        return self._backend(axis) == "gloo"

    def _backend(self, axis: str) -> str | None:
        """The backend of ``axis``'s process group (None without torch.distributed), looked up once."""
        if axis not in self._backends:
            group = self.mesh.group(axis)
            self._backends[axis] = dist.get_backend(group) if dist.is_initialized() else None
        return self._backends[axis]

    def all_gather_bytes(self, data: bytes, axis: str = "world") -> list[bytes]:
        """Every rank's ``data`` (any length), in axis order: the lengths, then the bytes padded to the longest,
        as uint8 tensors (two all-gathers). For small control data (traces, reports), not for tensors."""
        if self.size(axis) == 1:
            return [bytes(data)]
        length = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        lengths = [int(n) for n in self.all_gather(length, axis).tolist()]
        padded = torch.zeros(max(1, *lengths), dtype=torch.uint8)
        if data:
            padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        rows = self.all_gather(padded.to(self.device), axis).cpu().view(len(lengths), -1)
        return [rows[i, :n].numpy().tobytes() for i, n in enumerate(lengths)]

    def barrier(self, axis: str = "world") -> None:
        """Wait until every rank of the axis group arrives (a small all-reduce, so it honours the timeout)."""
        self.all_reduce(torch.zeros(1, device=self.device), axis)


EAGER_METHODS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_v",
    "broadcast",
    "send_recv",
    "barrier",
)
"""The Comm methods that ``run_eagerly_under_compile`` keeps out of dynamo's traces."""


def run_eagerly_under_compile() -> None:
    """Make every collective and ``Pending.wait`` run eagerly when compiled code calls them
    (``torch.compiler.disable``): dynamo then neither traces the byte accounting, timeouts and backend calls nor
    splits them into many graph breaks and recompilations (ring attention's p2p loop did), but breaks its graph
    once around each call. Process-wide and idempotent; called by ``plait.parallel.compile`` when a layout
    compiles, so that importing plait does not import torch._dynamo. Outside compiled code a call costs about a
    microsecond more."""
    if getattr(Comm, "_eager_under_compile", False):
        return
    for name in EAGER_METHODS:
        setattr(Comm, name, torch.compiler.disable(getattr(Comm, name)))
    Pending.wait = torch.compiler.disable(Pending.wait)  # type: ignore[method-assign]
    Comm._eager_under_compile = True  # type: ignore[attr-defined]
