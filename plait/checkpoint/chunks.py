"""Where this rank's tensors sit in the layout-free (global) tensors of a checkpoint.

A checkpoint stores, for every parameter name of the single-device model, the *global* tensor (the parameter,
each elementwise optimizer state, the fp32 master copy). A rank holds rectangles of those tensors:

- a tensor-parallel slice is a rectangle at offset ``tp_rank x b`` along ``param.tp_shard_dim`` (b = the local
  size); a fused q|k|v weight (``tp_fused_parts`` = k) holds one rectangle per block, at ``p x b x tp + tp_rank x b``;
  a padded vocabulary (``tp_full_size``) is clipped to the real rows;
- an expert-parallel slice (``param.ep_slice`` = (dim, offset, whole size), set by ``plait.parallel.expert``) is a
  rectangle at ``offset`` along ``dim`` of the whole experts tensor;
- a ZeRO flat shard is a contiguous range [s, e) of a parameter's row-major elements, which is a partial row, a
  block of whole rows and a partial row, each partial row again decomposed over the inner dims
  (``flat_range_boxes``): at most 2 x ndim - 1 rectangles, each a contiguous run of the shard.

``Chunked`` carries a global size and this rank's ``Piece``s (global offsets + a view of the local buffer) and
implements torch.distributed.checkpoint's object protocol (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``): on save DCP writes each piece once (identical replicas are deduplicated), on load it
reads exactly the overlapping regions of the saved pieces into the views, which reshards to any layout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

Box = tuple[tuple[int, ...], tuple[int, ...], int]
"""(offsets, sizes, first flat element) of a rectangle inside one tensor."""


@dataclass(frozen=True)
class Piece:
    """A rectangle of a global tensor held here: its global ``offsets`` and ``view``, a view of local storage."""

    offsets: tuple[int, ...]
    view: torch.Tensor

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(self.view.shape)


def flat_range_boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """Rectangles covering elements [start, end) of a row-major tensor of ``shape``, in order; each one is a
    contiguous run of the flattened tensor beginning at its third field."""
    if start >= end:
        return []
    if len(shape) == 0:
        return [((), (), 0)]
    inner = math.prod(shape[1:])
    rest = tuple(shape[1:])
    first_row, first_col = divmod(start, inner)
    last_row, last_col = divmod(end, inner)

    def in_row(row: int, lo: int, hi: int) -> list[Box]:
        return [((row, *o), (1, *s), row * inner + f) for o, s, f in flat_range_boxes(rest, lo, hi)]

    if first_row == last_row:
        return in_row(first_row, first_col, last_col)
    boxes: list[Box] = []
    if first_col:
        boxes += in_row(first_row, first_col, inner)
        first_row += 1
    if last_row > first_row:
        boxes.append(((first_row, *(0,) * len(rest)), (last_row - first_row, *rest), first_row * inner))
    if last_col:
        boxes += in_row(last_row, 0, last_col)
    return boxes


def is_tp_slice(param: torch.Tensor, tp_size: int) -> bool:
    return tp_size > 1 and bool(getattr(param, "tp_sharded", False))


def global_shape(param: torch.Tensor, local_shape: Sequence[int], tp_size: int) -> torch.Size:
    """The single-device shape of ``param`` whose local (tp or ep slice) shape is ``local_shape``."""
    shape = list(local_shape)
    if is_tp_slice(param, tp_size):
        dim = param.tp_shard_dim  # type: ignore[attr-defined]
        shape[dim] = getattr(param, "tp_full_size", shape[dim] * tp_size)
    ep_slice = getattr(param, "ep_slice", None)
    if ep_slice is not None:
        shape[ep_slice[0]] = ep_slice[2]
    return torch.Size(shape)


def _ep_shifted(param: torch.Tensor, pieces: list[Piece]) -> list[Piece]:
    """``pieces`` of an expert-parallel slice moved to its offset in the whole experts tensor."""
    ep_slice = getattr(param, "ep_slice", None)
    if ep_slice is None:
        return pieces
    dim, offset = ep_slice[0], ep_slice[1]
    return [Piece(p.offsets[:dim] + (p.offsets[dim] + offset,) + p.offsets[dim + 1 :], p.view) for p in pieces]


def tp_pieces(
    param: torch.Tensor,
    local_shape: Sequence[int],
    offsets: Sequence[int],
    view: torch.Tensor,
    tp_rank: int,
    tp_size: int,
) -> list[Piece]:
    """The global pieces of ``view``, a rectangle at local ``offsets`` of ``param``'s tp slice (local shape
    ``local_shape``): one piece unless the rectangle spans several fused blocks; clipped to a padded vocabulary."""
    if not is_tp_slice(param, tp_size):
        return _ep_shifted(param, [Piece(tuple(offsets), view)] if view.numel() else [])
    dim = param.tp_shard_dim  # type: ignore[attr-defined]
    block = local_shape[dim] // getattr(param, "tp_fused_parts", 1)
    full = getattr(param, "tp_full_size", local_shape[dim] * tp_size)
    lo, hi = offsets[dim], offsets[dim] + view.shape[dim]
    pieces = []
    for part in range(lo // block, -(-hi // block)):
        start, end = max(lo, part * block), min(hi, (part + 1) * block)
        at = part * block * tp_size + tp_rank * block + (start - part * block)
        length = min(end - start, full - at)
        if length > 0:
            where = list(offsets)
            where[dim] = at
            piece = view.narrow(dim, start - lo, length)
            if piece.numel():
                pieces.append(Piece(tuple(where), piece))
    return pieces


def whole_pieces(tensor: torch.Tensor, param: torch.Tensor, tp_rank: int, tp_size: int) -> list[Piece]:
    """``tensor``, shaped like ``param``'s local slice and held whole here, as global pieces."""
    return tp_pieces(param, tensor.shape, (0,) * tensor.dim(), tensor.detach(), tp_rank, tp_size)


def flat_pieces(
    flat: torch.Tensor,
    first: int,
    shape: Sequence[int],
    start: int,
    end: int,
    param: torch.Tensor,
    tp_rank: int,
    tp_size: int,
) -> list[Piece]:
    """Global pieces of elements [start, end) of ``param`` (local shape ``shape``), which sit at ``flat[first:]``
    of a 1-D shard buffer (a ZeRO master shard, an optimizer state shard, a ZeRO-3 parameter shard)."""
    pieces = []
    for offsets, sizes, begin in flat_range_boxes(shape, start, end):
        at = first + begin - start
        view = flat.detach()[at : at + math.prod(sizes)].view(sizes)
        pieces += tp_pieces(param, shape, offsets, view, tp_rank, tp_size)
    return pieces


class Chunked:
    """One global tensor of ``size`` of which this rank holds ``pieces`` (maybe none), for DCP save and load."""

    def __init__(self, size: torch.Size, pieces: list[Piece], dtype: torch.dtype | None = None) -> None:
        self._size = torch.Size(size)
        self.pieces = pieces
        self.dtype = dtype if dtype is not None else (pieces[0].view.dtype if pieces else torch.float32)

    def size(self) -> torch.Size:
        return self._size

    def __repr__(self) -> str:
        return f"Chunked(size={tuple(self._size)}, pieces={[(p.offsets, p.sizes) for p in self.pieces]})"

    def __create_write_items__(self, fqn: str, _obj: object) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(piece.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(piece.offsets), torch.Size(piece.sizes)),
                    properties=TensorProperties(dtype=piece.view.dtype),
                    size=self._size,
                ),
            )
            for piece in self.pieces
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(p.offsets), torch.Size(p.sizes)) for p in self.pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        position = index.index
        offsets = tuple(index.offset) if index.offset is not None else ()
        if position is not None and position < len(self.pieces) and self.pieces[position].offsets == offsets:
            return self.pieces[position].view
        for piece in self.pieces:
            if piece.offsets == offsets:
                return piece.view
        raise ValueError(f"{index.fqn}: this rank holds no piece at offsets {offsets}")
