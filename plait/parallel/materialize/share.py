"""What a rank keeps of one single-device tensor, as rectangles of it, and where its values come from.

After the pipeline split and the tensor-parallel swaps, each local parameter is either the whole single-device
tensor (replicated) or its tp slice along ``tp_shard_dim``: the runs ``plait.parallel.tensor.layers.tp_runs``
gives (one per fused block, clipped to a padded vocabulary's real rows, the rest zeros). ``Share`` says which,
and ``Share.boxes(rows)`` turns rows [r0, r1) of the *local* tensor (a ZeRO-3 shard holds a flat range of it,
which rows [r0, r1) cover) into rectangles of the single-device tensor, each with where it lands locally. The
same rectangles are read from a freshly initialised tensor (``materialize.apply``) and from a file
(``WeightSource``: safetensors slices, a plait checkpoint's DCP pieces), so initialising and loading cut alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from plait.parallel.tensor.layers import padded_size, tp_runs

PLACEHOLDER = "_plait_placeholder"
"""Set on a parameter that stands for a meta one until its values are written (``apply.placeholders``)."""
Index = tuple[slice, ...]
Request = tuple[str, Index, torch.Tensor]
"""(single-device name, a rectangle of that tensor, the tensor of the rectangle's shape to fill)."""


class WeightSource(Protocol):
    """Single-device tensors by name that ranks read rectangles of (never a whole file into one rank)."""

    description: str

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the source holds: name -> single-device shape."""
        ...

    def read(self, requests: list[Request]) -> None:
        """Fill each request's tensor with its rectangle (converted to that tensor's dtype)."""
        ...


@dataclass(frozen=True)
class Share:
    """A local tensor of ``local`` shape cut from a single-device tensor of ``full`` shape: whole (``dim`` None),
    or along ``dim`` the ``runs`` (single-device start, length), laid end to end, zeros after them."""

    full: tuple[int, ...]
    local: tuple[int, ...]
    dim: int | None = None
    runs: tuple[tuple[int, int], ...] = ()

    @property
    def inner(self) -> int:
        """Elements per local row (dim 0)."""
        return math.prod(self.local[1:]) if self.local else 1

    def rows_of(self, start: int, end: int) -> tuple[int, int]:
        """The local rows [r0, r1) that flat elements [start, end) of the local tensor lie in."""
        if not self.local:
            return 0, 1
        inner = max(self.inner, 1)
        return start // inner, -(-end // inner)

    def boxes(self, rows: tuple[int, int] | None = None) -> list[tuple[Index, Index]]:
        """(rectangle of the single-device tensor, where it lands in local rows ``rows``) pairs covering
        what the local rows [r0, r1) (default all) hold; rows of a padded vocabulary are not covered (zeros)."""
        if not self.local:
            return [((), ())]
        r0, r1 = rows if rows is not None else (0, self.local[0])
        rest = tuple(slice(0, size) for size in self.local[1:])
        if self.dim is None:
            return [((slice(r0, r1), *rest), (slice(0, r1 - r0), *rest))]
        found: list[tuple[Index, Index]] = []
        at = 0
        for start, length in self.runs:
            if self.dim == 0:
                lo, hi = max(at, r0), min(at + length, r1)
                if lo < hi:
                    found.append(((slice(start + lo - at, start + hi - at), *rest), (slice(lo - r0, hi - r0), *rest)))
            else:
                full_index = list((slice(r0, r1), *rest))
                local_index = list((slice(0, r1 - r0), *rest))
                full_index[self.dim] = slice(start, start + length)
                local_index[self.dim] = slice(at, at + length)
                found.append((tuple(full_index), tuple(local_index)))
            at += length
        return found


def share_of(
    tensor: torch.Tensor, full: tuple[int, ...], tp_size: int, tp_index: int, local: tuple[int, ...] | None = None
) -> Share:
    """The share of local ``tensor`` (a tp slice when tagged ``tp_sharded``, an expert-parallel slice when tagged
    ``ep_slice``; of shape ``local``, default its own) of a single-device tensor of shape ``full``; ValueError when
    the shapes do not fit."""
    local = tuple(tensor.shape) if local is None else tuple(local)
    ep_slice = getattr(tensor, "ep_slice", None)
    if ep_slice is not None:  # (dim, offset, whole size): this rank's experts, consecutive along dim
        if getattr(tensor, "tp_sharded", False) and tp_size > 1:
            raise ValueError("is cut over both ep and tp (experts stay whole under tp)")
        dim, offset, whole = (int(v) for v in ep_slice)
        expected = list(full)
        expected[dim] = local[dim] if len(local) == len(full) else -1
        if whole != full[dim] or tuple(expected) != local or offset + local[dim] > whole:
            raise ValueError(f"has shape {local} here, an ep slice from {offset} of {full}, which does not fit")
        return Share(full, local, dim, ((offset, local[dim]),))
    if not getattr(tensor, "tp_sharded", False) or tp_size == 1:
        if local != full:
            raise ValueError(f"has shape {local} here but {full} on one device")
        return Share(full, local)
    if hasattr(tensor, "tp_grid_placement"):
        raise ValueError("is a 2D/2.5D/3D tensor-parallel block (only 1D tp slices are materialised)")
    dim = int(getattr(tensor, "tp_shard_dim"))  # noqa: B009 - a tag set by mark_sharded
    fused = int(getattr(tensor, "tp_fused_parts", 1))
    pad = hasattr(tensor, "tp_full_size")
    size = padded_size(full[dim], tp_size) if pad else full[dim]
    expected = list(full)
    expected[dim] = size // tp_size
    if tuple(expected) != local:
        raise ValueError(f"has shape {local} here but its 1/{tp_size} tp slice of {full} has {tuple(expected)}")
    return Share(full, local, dim, tuple(tp_runs(full[dim], tp_size, tp_index, fused, pad)))


def is_placeholder(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a placeholder parameter whose values are still to be written."""
    return bool(getattr(tensor, PLACEHOLDER, False))


def cut(full: torch.Tensor, share: Share, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Local rows ``rows`` (default all) of ``share``, cut from the single-device tensor ``full``: a view of it
    when the share is the whole tensor, else a new tensor."""
    r0, r1 = rows if rows is not None else (0, share.local[0] if share.local else 1)
    if share.dim is None:
        return full[r0:r1] if share.local else full
    shape = (r1 - r0, *share.local[1:]) if share.local else ()
    out = full.new_zeros(shape)
    for full_index, local_index in share.boxes(rows):
        out[local_index] = full[full_index]
    return out


__all__ = ["PLACEHOLDER", "Index", "Request", "Share", "WeightSource", "cut", "is_placeholder", "share_of"]
