"""Differentiable collectives: small autograd Functions whose backward is the conjugate collective.

Megatron-LM's conjugate pair (Shoeybi et al. 2019, sec. 3): ``copy_to`` is the identity forward and an
all-reduce backward ("f"); ``reduce_from`` is an all-reduce forward and the identity backward ("g").
Sequence parallelism (Korthikanti et al. 2022) swaps the all-reduce for all-gather / reduce-scatter pairs;
Ulysses (Jacobs et al. 2023) uses an all-to-all whose backward is the inverse all-to-all; expert parallelism an
uneven one (``all_to_all_v``) whose backward sends the gradients back with the split sizes swapped.
Each function takes the ``Comm`` and the mesh axis explicitly, so nothing global is consulted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from plait.comm.collectives import Comm


def _split(x: torch.Tensor, comm: Comm, axis: str, dim: int) -> torch.Tensor:
    """This rank's 1/N chunk of ``x`` along ``dim``."""
    n = comm.size(axis)
    if x.shape[dim] % n:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} over {n} ranks of axis '{axis}'")
    return x.chunk(n, dim=dim)[comm.mesh.index(axis)].contiguous()


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:
        ctx.comm, ctx.axis = comm, axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return ctx.comm.all_reduce(grad.contiguous().clone(), ctx.axis), None, None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:
        return comm.all_reduce(x.contiguous().clone(), axis)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad, None, None


class _GatherFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, axis: str, dim: int) -> torch.Tensor:
        ctx.comm, ctx.axis, ctx.dim = comm, axis, dim
        return comm.all_gather(x, axis, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _split(grad, ctx.comm, ctx.axis, ctx.dim), None, None, None


class _ScatterTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, axis: str, dim: int) -> torch.Tensor:
        ctx.comm, ctx.axis, ctx.dim = comm, axis, dim
        return _split(x, comm, axis, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return ctx.comm.all_gather(grad, ctx.axis, dim=ctx.dim), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, axis: str, dim: int) -> torch.Tensor:
        ctx.comm, ctx.axis, ctx.dim = comm, axis, dim
        return comm.reduce_scatter(x, axis, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return ctx.comm.all_gather(grad, ctx.axis, dim=ctx.dim), None, None, None


class _AllGatherSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, axis: str, dim: int) -> torch.Tensor:
        ctx.comm, ctx.axis, ctx.dim = comm, axis, dim
        return comm.all_gather(x, axis, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return ctx.comm.reduce_scatter(grad, ctx.axis, dim=ctx.dim), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, axis: str, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.comm, ctx.axis, ctx.dims = comm, axis, (scatter_dim, gather_dim)
        return comm.all_to_all(x, axis, scatter_dim=scatter_dim, gather_dim=gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        scatter_dim, gather_dim = ctx.dims
        return (
            ctx.comm.all_to_all(grad, ctx.axis, scatter_dim=gather_dim, gather_dim=scatter_dim),
            None,
            None,
            None,
            None,
        )


class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        comm: Comm,
        axis: str,
        send: list[int],
        recv: list[int],
        in_flight: Callable[[], None] | None,
    ) -> torch.Tensor:
        ctx.comm, ctx.axis, ctx.splits = comm, axis, (send, recv)
        if in_flight is None:
            return comm.all_to_all_v(x, axis, send, recv)
        pending = comm.all_to_all_v(x, axis, send, recv, async_op=True)
        in_flight()
        return pending.wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        send, recv = ctx.splits
        comm, overlap = ctx.comm, ctx.comm.overlap
        if overlap is None:
            return comm.all_to_all_v(grad.contiguous(), ctx.axis, recv, send), None, None, None, None, None
        pending = comm.all_to_all_v(grad.contiguous(), ctx.axis, recv, send, async_op=True)
        overlap()  # an overlapped pipeline pair: the other chunk computes while the gradients travel
        return pending.wait(), None, None, None, None, None


def copy_to(x: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:
    """Identity forward, all-reduce (sum) of the gradient backward: enter a tensor-parallel region."""
    return x if comm.size(axis) == 1 else _CopyTo.apply(x, comm, axis)


def reduce_from(x: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:
    """All-reduce (sum) forward, identity backward: leave a tensor-parallel region."""
    return x if comm.size(axis) == 1 else _ReduceFrom.apply(x, comm, axis)


def gather_from(x: torch.Tensor, comm: Comm, axis: str, dim: int = -1) -> torch.Tensor:
    """All-gather along ``dim`` forward; backward keeps this rank's slice of the gradient."""
    return x if comm.size(axis) == 1 else _GatherFrom.apply(x, comm, axis, dim)


def scatter_to(x: torch.Tensor, comm: Comm, axis: str, dim: int = -1) -> torch.Tensor:
    """Keep this rank's slice along ``dim`` forward; backward all-gathers the gradient."""
    return x if comm.size(axis) == 1 else _ScatterTo.apply(x, comm, axis, dim)


def reduce_scatter(x: torch.Tensor, comm: Comm, axis: str, dim: int = 0) -> torch.Tensor:
    """Reduce-scatter along ``dim`` forward, all-gather backward (leaving a sequence-parallel row-linear)."""
    return x if comm.size(axis) == 1 else _ReduceScatter.apply(x, comm, axis, dim)


def all_gather(x: torch.Tensor, comm: Comm, axis: str, dim: int = 0) -> torch.Tensor:
    """All-gather along ``dim`` forward, reduce-scatter backward (entering a sequence-parallel column-linear)."""
    return x if comm.size(axis) == 1 else _AllGatherSum.apply(x, comm, axis, dim)


def all_to_all(x: torch.Tensor, comm: Comm, axis: str, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """All-to-all forward, the inverse all-to-all backward (Ulysses: [seq/N, heads] <-> [seq, heads/N])."""
    return x if comm.size(axis) == 1 else _AllToAll.apply(x, comm, axis, scatter_dim, gather_dim)


def all_to_all_v(
    x: torch.Tensor,
    comm: Comm,
    axis: str,
    send: list[int],
    recv: list[int],
    in_flight: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Uneven all-to-all of rows forward (``Comm.all_to_all_v``), the reverse exchange of the gradients backward.

    ``in_flight``: work to run while the rows travel (forward): the exchange is issued asynchronously, the
    callable runs (with autograd recording, as the caller's forward would), then the exchange is waited for; with
    one rank it runs at once. The bytes are counted as for the blocking call; a tracer shows the launch-to-wait
    flight and, as blocking, only the wait. Backward: asynchronous too while ``comm.overlap`` is set (an overlapped
    pipeline pair), which runs before the wait."""
    if comm.size(axis) == 1:
        if in_flight is not None:
            in_flight()
        return x
    hook = None
    if in_flight is not None:  # a Function's forward runs without autograd: the caller's mode, restored for it
        grad_mode, work = torch.is_grad_enabled(), in_flight

        def hook() -> None:
            with torch.set_grad_enabled(grad_mode):
                work()

    return _AllToAllV.apply(x, comm, axis, list(send), list(recv), hook)
