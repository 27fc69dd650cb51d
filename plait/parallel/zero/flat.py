"""Flat parameter buffers split into N equal shards: the bookkeeping every ZeRO stage shares.

Parameters p_0 .. p_k are laid end to end in one 1-D buffer of length L = sum numel(p_i), padded with zeros
to a multiple of N, so rank r owns elements [r L'/N, (r+1) L'/N) of the padded length L'. Reduce-scatter of a
flat gradient buffer then gives each rank exactly the gradient of the elements it owns, and all-gather of
the shards rebuilds the whole buffer (Rajbhandari et al. 2020, ZeRO, sec. 5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ParamSlice:
    """The part of parameter ``index`` that lies in a shard: param elements [start, end) at shard offset ``at``."""

    index: int
    start: int
    end: int
    at: int


@dataclass(frozen=True)
class FlatLayout:
    """Offsets of parameters in a flat buffer of ``padded`` elements split into ``shards`` equal shards."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numel: int
    shards: int

    @classmethod
    def of(cls, named_params: list[tuple[str, nn.Parameter]], shards: int) -> FlatLayout:
        if shards < 1:
            raise ValueError(f"shards={shards} must be >= 1")
        offsets, total = [], 0
        for _name, param in named_params:
            offsets.append(total)
            total += param.numel()
        return cls(
            names=tuple(name for name, _ in named_params),
            shapes=tuple(param.shape for _, param in named_params),
            offsets=tuple(offsets),
            numel=total,
            shards=shards,
        )

    @property
    def shard_size(self) -> int:
        return math.ceil(self.numel / self.shards) if self.numel else 0

    @property
    def padded(self) -> int:
        return self.shard_size * self.shards

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of rank's shard in the padded flat buffer."""
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def numels(self) -> list[int]:
        return [math.prod(shape) for shape in self.shapes]

    def flatten(self, tensors: list[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        """Concatenate ``tensors`` (one per parameter, in order) into a new zero-padded flat buffer."""
        first = tensors[0]
        flat = torch.zeros(self.padded, dtype=dtype or first.dtype, device=first.device)
        for tensor, offset in zip(tensors, self.offsets):
            flat[offset : offset + tensor.numel()].copy_(tensor.reshape(-1))
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views into ``flat`` shaped like each parameter (writing them writes the buffer)."""
        return [flat[o : o + n].view(s) for o, n, s in zip(self.offsets, self.numels(), self.shapes)]

    def slices(self, rank: int) -> list[ParamSlice]:
        """For each parameter overlapping rank's shard: which of its elements, and where they sit in the shard."""
        lo, hi = self.shard_range(rank)
        result = []
        for index, (offset, numel) in enumerate(zip(self.offsets, self.numels())):
            start, end = max(lo, offset), min(hi, offset + numel)
            if start < end:
                result.append(ParamSlice(index, start - offset, end - offset, start - lo))
        return result


@dataclass(frozen=True)
class GroupLayout:
    """Parameters [first, last) of ``base``, laid end to end (one optimizer parameter group), seen from the
    group's own run of a shard: rank r's shard holds the group's elements at shard offsets ``span(r)``, and
    ``slices(r)`` gives the pieces with ``at`` relative to that run (``plait.parallel.param_groups``)."""

    base: FlatLayout
    first: int
    last: int

    @property
    def names(self) -> tuple[str, ...]:
        return self.base.names[self.first : self.last]

    @property
    def shapes(self) -> tuple[torch.Size, ...]:
        return self.base.shapes[self.first : self.last]

    def numels(self) -> list[int]:
        return self.base.numels()[self.first : self.last]

    def span(self, rank: int) -> tuple[int, int]:
        """[lo, hi) of the group's elements in rank's shard, as shard offsets (lo == hi when it holds none)."""
        start = self.base.offsets[self.first]
        end = self.base.offsets[self.last - 1] + self.base.numels()[self.last - 1]
        shard_lo, _ = self.base.shard_range(rank)
        size = self.base.shard_size
        lo = min(max(start - shard_lo, 0), size)
        hi = min(max(end - shard_lo, 0), size)
        return lo, max(lo, hi)

    def slices(self, rank: int) -> list[ParamSlice]:
        """``base.slices(rank)`` of this group's parameters, indexed within the group, ``at`` within its run."""
        lo, _ = self.span(rank)
        return [
            ParamSlice(piece.index - self.first, piece.start, piece.end, piece.at - lo)
            for piece in self.base.slices(rank)
            if self.first <= piece.index < self.last
        ]


@dataclass(frozen=True)
class OwnedLayout(FlatLayout):
    """Tensor-atomic sharding (docs/optimizers.md): every parameter lies whole in the shard of one rank, its
    ``owner``, so that the owner can step it with an optimizer that needs whole tensors. Shards have ``shard``
    elements each (the largest owner's load; the others are padded with zeros), and each FlatLayout operation
    (flatten, views, slices, reduce-scatter and all-gather of the padded buffer) works unchanged on it."""

    shard: int = 0
    owners: tuple[int, ...] = ()

    @property
    def shard_size(self) -> int:
        return self.shard

    def owned(self, rank: int) -> list[int]:
        """The indices of the parameters that ``rank`` owns, in layout order."""
        return [index for index, owner in enumerate(self.owners) if owner == rank]


def owned_layout(named_params: list[tuple[str, nn.Parameter]], shards: int) -> OwnedLayout:
    """Assign each parameter whole to one of ``shards`` ranks, greedy largest first onto the least-loaded rank
    (ties: the lowest rank; as Megatron-Core's layer-wise distributed optimizer balances whole tensors), then lay
    each rank's parameters out in registration order from the start of its shard. The maximal load is at most the
    mean plus the largest parameter (Graham's LPT bound: at most 4/3 of the best possible)."""
    if shards < 1:
        raise ValueError(f"shards={shards} must be >= 1")
    numels = [param.numel() for _, param in named_params]
    loads = [0] * shards
    owners = [0] * len(named_params)
    for index in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        owner = min(range(shards), key=lambda r: (loads[r], r))
        owners[index] = owner
        loads[owner] += numels[index]
    shard = max(loads) if numels else 0
    offsets, used = [], [0] * shards
    for index, numel in enumerate(numels):
        offsets.append(owners[index] * shard + used[owners[index]])
        used[owners[index]] += numel
    return OwnedLayout(
        names=tuple(name for name, _ in named_params),
        shapes=tuple(param.shape for _, param in named_params),
        offsets=tuple(offsets),
        numel=sum(numels),
        shards=shards,
        shard=shard,
        owners=tuple(owners),
    )
