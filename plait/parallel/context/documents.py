"""Packed documents under ring attention: which parts of each visiting key/value block a rank computes.

A query of global index g with document position p (``plait.models.inputs``: its place in its own document) sees
the keys of global indices [g - p, g] (``plait.models.layers.document_mask``). Under zigzag sharding a rank knows
its queries' g and p, and the global indices of every other rank's keys (``SequenceSharding.local_positions``),
so it decides alone — no position ever travels — what to compute of each visiting block.

Each piece of the causal zigzag split (``SequenceSharding.pieces``) is cut into *tiles* of at most ``tile`` query
rows (within one of the rank's two chunks). A tile's queries see, at most, the keys from the earliest document
start among them to the latest query among them; the piece's keys are in increasing global order, so that is one
contiguous range of key columns, and the tile is computed against that range only (like FlashAttention's block
sparsity over a block-diagonal mask):

- an empty range (every document of the tile began after the piece's last key): the tile is **skipped**, forward
  and backward (the block still travels the ring: the next rank may need it);
- a range every query of the tile sees whole (every document began before its first key, every query after its
  last): computed without a mask;
- otherwise with an explicit mask, built from the queries' positions when the tile is computed (forward, and again
  in backward: only the [B, T/cp] positions are kept for backward, never a mask).

With documents shorter than the sequence's chunks most of the off-diagonal blocks are skipped whole (from cp = 4
on, the chunks of other ranks far from a rank's own), and within the others only a band along the diagonal is
computed. The decisions need the extremes of g - p per tile over the batch: one host read per call.
``BlockCounts`` records what was computed and skipped, so benchmarks and tests see the saving.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from plait.models.layers import document_mask
from plait.parallel.context.sharding import BlockPiece, SequenceSharding

TILE = 256
"""Query rows per tile (the granularity of skipping and of trimming a block's key range)."""


@dataclass
class BlockCounts:
    """Tiles a ring attention computed, computed with a document mask, and skipped as fully masked (forward
    passes only; backward visits the same tiles). Without documents every piece is one computed tile."""

    computed: int = 0
    masked: int = 0
    skipped: int = 0

    def reset(self) -> None:
        self.computed = self.masked = self.skipped = 0


@dataclass(frozen=True)
class DocumentPiece:
    """A piece to compute, and whether it needs a document mask beyond its own shape."""

    piece: BlockPiece
    masked: bool


class DocumentRing:
    """This rank's queries' document positions [B, T/cp] under a zigzag ``sharding``: the tiles to compute of each
    source rank's block (``pieces``) and their masks (``mask``)."""

    def __init__(self, sharding: SequenceSharding, positions: Tensor, tile: int = TILE) -> None:
        self.sharding, self.positions = sharding, positions
        local = positions.shape[-1]
        self.length = local * sharding.size
        self.query_index = sharding.local_positions(self.length, device=positions.device)
        earliest = self.query_index - positions  # the first key each query sees, [B, T/cp]
        half = local // 2
        starts = [*range(0, half, tile), *range(half, local, tile)]  # tiles never straddle the two chunks
        ends = [min(start + tile, half if start < half else local) for start in starts]
        low, high = earliest.min(dim=0).values, earliest.max(dim=0).values
        bounds = torch.stack([torch.stack((low[a:b].min(), high[a:b].max())) for a, b in zip(starts, ends)])
        queries = self.query_index.tolist()
        self._tiles = [
            (start, end, int(first), int(last), queries[start], queries[end - 1])
            for (start, end), (first, last) in zip(zip(starts, ends), bounds.tolist())
        ]  # (rows, earliest key seen by any, by all; first and last query)

    def key_index(self, source: int) -> Tensor:
        """Global indices of rank ``source``'s keys, in its local order."""
        return self.sharding.local_positions(self.length, source, device=self.positions.device)

    def pieces(self, source: int, counts: BlockCounts | None = None) -> list[DocumentPiece]:
        """The tiles to compute of rank ``source``'s block (module docstring)."""
        keys = self.sharding.local_positions(self.length, source).numpy()
        kept = []
        for piece in self.sharding.pieces(source, len(self.query_index), causal=True):
            columns = keys[piece.kv_rows]
            for start, end, first_seen, all_see, first_query, last_query in self._tiles:
                if start < piece.q_rows.start or end > piece.q_rows.stop:
                    continue
                begin = int(np.searchsorted(columns, first_seen, side="left"))
                stop = int(np.searchsorted(columns, last_query, side="right"))
                if begin >= stop:
                    if counts is not None:
                        counts.skipped += 1
                    continue
                whole = columns[begin] >= all_see and columns[stop - 1] <= first_query
                cols = slice(piece.kv_rows.start + begin, piece.kv_rows.start + stop)
                kept.append(DocumentPiece(BlockPiece(slice(start, end), cols, False), masked=not whole))
                if counts is not None:
                    counts.computed += 1
                    counts.masked += not whole
        return kept

    def mask(self, source: int, piece: BlockPiece) -> Tensor:
        """The document mask [B, 1, rows, cols] of a tile (causal within it as well)."""
        keys = self.key_index(source)[piece.kv_rows]
        return document_mask(self.positions[:, piece.q_rows], self.query_index[piece.q_rows], keys)


__all__ = ["TILE", "BlockCounts", "DocumentPiece", "DocumentRing"]
