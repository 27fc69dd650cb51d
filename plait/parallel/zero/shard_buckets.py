"""Buckets of parameters whose flat gradient is reduce-scattered in one call, each with its own ``FlatLayout``.

A bucket holds parameters of one dtype laid end to end in a flat buffer padded to a multiple of N
(``FlatLayout``). Rank r owns elements [r S, (r+1) S) of every bucket (S = the bucket's shard size), so one
reduce-scatter of the bucket's flat gradient hands each rank the summed gradient of exactly the elements whose
fp32 master copy and optimizer state it keeps (ZeRO, Rajbhandari et al. 2020, sec. 5.1-5.2).

- ZeRO-1 uses one bucket per dtype: the whole flat parameter space, reduced once after backward.
- ZeRO-2 cuts each dtype's parameters, in reverse registration order (roughly the order backward produces
  their gradients), into buckets of about ``bucket_mb`` MiB, so that a bucket can be reduced, and its full
  gradient freed, while backward goes on (as DDP buckets, Li et al. 2020, sec. 3.2.3).

Padding is per bucket: sum over buckets of padded sizes is at most P + (N - 1) x buckets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from plait.comm.collectives import Pending
from plait.parallel.buckets import check_reducible  # noqa: F401 - re-exported for the ZeRO strategy
from plait.parallel.param_groups import order_by_group
from plait.parallel.zero.flat import FlatLayout, owned_layout


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the master copy: fp32 for 16-bit parameters, the parameter's own dtype from fp32 up."""
    return torch.promote_types(dtype, torch.float32)


@dataclass
class ShardBucket:
    """Parameters of one dtype in one flat buffer; this rank's shard of it; the gradient while it is reduced."""

    index: int
    names: list[str]
    params: list[nn.Parameter]
    layout: FlatLayout
    rank: int
    """This rank's index in the sharding axis: it owns ``layout.shard_range(rank)``."""
    master: nn.Parameter = None  # type: ignore[assignment]  # set by the strategy right after planning
    """The fp32 master copy of this rank's shard (what the optimizer steps)."""
    flat: torch.Tensor | None = None
    """The full padded gradient while it is being filled (ZeRO-2 hooks or finish_backward)."""
    arrived: set[int] = field(default_factory=set)
    pending: Pending | None = None
    aliased: bool = False
    """The parameters are views of ``master`` (one rank, same dtype, no offload): nothing to write back."""
    axis: str | None = None
    """The mesh axis it is reduce-scattered and all-gathered over (None: the strategy's; expert slices: edp)."""

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    @property
    def shard_size(self) -> int:
        return self.layout.shard_size

    @property
    def complete(self) -> bool:
        return len(self.arrived) == len(self.params)

    def shard_values(self, dtype: torch.dtype) -> torch.Tensor:
        """This rank's shard of the parameter values as ``dtype`` (zeros in the padding), via ``slices``."""
        shard = torch.zeros(self.shard_size, dtype=dtype, device=self.params[0].device)
        for piece in self.layout.slices(self.rank):
            values = self.params[piece.index].detach().reshape(-1)[piece.start : piece.end]
            shard[piece.at : piece.at + piece.end - piece.start].copy_(values)
        return shard

    def add_grad(self, position: int, grad: torch.Tensor) -> None:
        """Copy parameter ``position``'s gradient into the flat buffer (allocated, zeroed, on first use)."""
        if self.flat is None:
            self.flat = torch.zeros(self.layout.padded, dtype=self.dtype, device=grad.device)
        offset = self.layout.offsets[position]
        self.flat[offset : offset + grad.numel()].copy_(grad.reshape(-1))
        self.arrived.add(position)

    def take_flat(self, device: torch.device) -> torch.Tensor:
        """The filled flat gradient (zeros for parameters without one), handed over: the bucket drops it."""
        flat = self.flat if self.flat is not None else torch.zeros(self.layout.padded, dtype=self.dtype, device=device)
        self.flat = None
        return flat

    def alias_params(self) -> None:
        """Make the parameters views of the master (the whole flat buffer: one shard, no padding, same dtype), so
        that the master is the only copy of the weights. Their values are already the master's."""
        assert self.layout.shards == 1 and self.master.dtype == self.dtype, "only one unpadded shard can alias"
        for param, view in zip(self.params, self.layout.views(self.master.detach())):
            param.data = view
        self.aliased = True

    @torch.no_grad()
    def write_params(self, full: torch.Tensor) -> None:
        """Copy the gathered padded flat parameter buffer ``full`` into the model's parameters (nothing when the
        parameters are views of the master and ``full`` is the master itself)."""
        if self.aliased and full.data_ptr() == self.master.data_ptr():
            return
        for param, view in zip(self.params, self.layout.views(full)):
            param.copy_(view)

    def reset(self) -> None:
        self.flat, self.pending = None, None
        self.arrived.clear()


def plan_buckets(
    named_params: list[tuple[str, nn.Parameter]],
    shards: int,
    rank: int,
    cap_bytes: float | None,
    group_ids: list[int] | None = None,
    axes: list[str | None] | None = None,
    sharding: dict[str, tuple[int, int]] | None = None,
) -> list[ShardBucket]:
    """Group parameters into buckets of one dtype (and one reduction axis) each.

    ``cap_bytes=None``: one bucket per dtype, parameters in registration order (ZeRO-1). Otherwise visit the
    parameters in reverse order and close a dtype's open bucket when the next parameter would push it past
    ``cap_bytes`` (a parameter larger than the cap gets a bucket of its own) (ZeRO-2). With ``group_ids`` (each
    parameter's optimizer param group) a bucket's parameters are laid out group after group (stable), so that
    each group is one contiguous run of the bucket (``plait.parallel.param_groups``). With ``axes`` (each
    parameter's reduction axis, ``plait.parallel.strategy.reduce_axis``) a bucket holds one axis, sharded over
    ``sharding[axis]`` = (shards, this rank's index) where the axis is not None.
    """
    axes = axes if axes is not None else [None] * len(named_params)
    groups: list[list[int]] = []
    if cap_bytes is None:
        by_dtype: dict[tuple[torch.dtype, str | None], list[int]] = {}
        for i, (_name, param) in enumerate(named_params):
            by_dtype.setdefault((param.dtype, axes[i]), []).append(i)
        groups = list(by_dtype.values())
    else:
        if not cap_bytes > 0:
            raise ValueError(f"bucket cap {cap_bytes} bytes must be positive")
        open_bucket: dict[tuple[torch.dtype, str | None], tuple[int, float]] = {}
        for i in reversed(range(len(named_params))):
            param = named_params[i][1]
            size = param.numel() * param.element_size()
            key = (param.dtype, axes[i])
            at = open_bucket.get(key)
            if at is None or (groups[at[0]] and at[1] + size > cap_bytes):
                groups.append([])
                at = (len(groups) - 1, 0.0)
            groups[at[0]].append(i)
            open_bucket[key] = (at[0], at[1] + size)
    buckets = []
    for index, members in enumerate(groups):
        if group_ids is not None:
            members = order_by_group(members, [group_ids[i] for i in members])
        named = [named_params[i] for i in members]
        axis = axes[members[0]]
        count, where = sharding[axis] if axis is not None and sharding is not None else (shards, rank)
        layout = FlatLayout.of(named, count)
        buckets.append(ShardBucket(index, [n for n, _ in named], [p for _, p in named], layout, where, axis=axis))
    return buckets


def owned_buckets(named_params: list[tuple[str, nn.Parameter]], strategy: Any, first: int) -> list[ShardBucket]:
    """One tensor-atomic bucket per dtype (``owned_layout``: each parameter whole on one rank of the strategy's data
    axis, owners balanced by size), indexed from ``first``: the reduce-scatter of its padded flat gradient hands
    each owner the whole gradients of its parameters, and the all-gather of the stepped shards returns them."""
    by_dtype: dict[torch.dtype, list[tuple[str, nn.Parameter]]] = {}
    for name, param in named_params:
        by_dtype.setdefault(param.dtype, []).append((name, param))
    return [
        ShardBucket(
            first + index,
            [n for n, _ in named],
            [p for _, p in named],
            owned_layout(named, strategy.world),
            strategy.index,
        )
        for index, named in enumerate(by_dtype.values())
    ]
