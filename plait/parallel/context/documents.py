"""Packed documents under ring attention: which parts of each visiting key/value block a rank computes.

A query of global index g with document position p (``plait.models.inputs``: its place in its own document) sees
the keys of global indices [g - p, g] (``plait.models.layers.document_mask``). Under zigzag sharding a rank knows
its queries' g and p, and the global indices of every other rank's keys (``SequenceSharding.local_positions``),
so it decides alone — no position ever travels — for each piece of the causal zigzag split
(``SequenceSharding.pieces``) whether

- no query of the piece sees any of its keys (every query's document began after the piece's last key): the piece
  is **skipped**, neither computed forward nor backward (the block still travels the ring: the next rank may need
  it);
- every query sees every key the causal split gives it (every document began before the piece's first key): the
  piece runs as without documents;
- otherwise it runs with an explicit mask, built from the queries' positions when the piece is computed (forward,
  and again in backward: only the [B, T/cp] positions are kept for backward, never a mask).

The decisions need four numbers per call (the extremes of g - p over the rank's two query chunks): one host read.
``BlockCounts`` records what was skipped, so benchmarks and tests see the saving.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from plait.models.layers import document_mask
from plait.parallel.context.sharding import BlockPiece, SequenceSharding


@dataclass
class BlockCounts:
    """Block pieces a ring attention computed, computed with a document mask, and skipped as fully masked
    (forward passes only; backward visits the same pieces)."""

    computed: int = 0
    masked: int = 0
    skipped: int = 0

    def reset(self) -> None:
        self.computed = self.masked = self.skipped = 0


@dataclass(frozen=True)
class DocumentPiece:
    """A piece to compute, and whether it needs a document mask beyond the causal split's own shape."""

    piece: BlockPiece
    masked: bool


class DocumentRing:
    """This rank's queries' document positions [B, T/cp] under a zigzag ``sharding``: the pieces to compute of
    each source rank's block (``pieces``) and their masks (``mask``)."""

    def __init__(self, sharding: SequenceSharding, positions: Tensor) -> None:
        self.sharding, self.positions = sharding, positions
        local = positions.shape[-1]
        self.length = local * sharding.size
        self.query_index = sharding.local_positions(self.length, device=positions.device)
        earliest = self.query_index - positions  # the first key each query sees, [B, T/cp]
        second = earliest[:, local // 2 :]
        bounds = torch.stack((earliest.min(), earliest.max(), second.min(), second.max())).tolist()
        self._all = (int(bounds[0]), int(bounds[1]))
        self._second = (int(bounds[2]), int(bounds[3]))
        self._half = local // 2

    def key_index(self, source: int) -> Tensor:
        """Global indices of rank ``source``'s keys, in its local order."""
        return self.sharding.local_positions(self.length, source, device=self.positions.device)

    def pieces(self, source: int, counts: BlockCounts | None = None) -> list[DocumentPiece]:
        """What to compute of rank ``source``'s block: the causal split's pieces, minus those fully masked."""
        keys = self.key_index(source)
        kept = []
        for piece in self.sharding.pieces(source, len(self.query_index), causal=True):
            first, last = int(keys[piece.kv_rows][0]), int(keys[piece.kv_rows][-1])
            low, high = self._second if piece.q_rows.start == self._half else self._all
            if not piece.causal and last < low:  # every query's document began after this piece's last key
                if counts is not None:
                    counts.skipped += 1
                continue
            kept.append(DocumentPiece(piece, masked=first < high))  # some query's document began after `first`
            if counts is not None:
                counts.computed += 1
                counts.masked += first < high
        return kept

    def mask(self, source: int, piece: BlockPiece) -> Tensor:
        """The document mask [B, 1, rows, cols] of a piece (causal within it as well)."""
        keys = self.key_index(source)[piece.kv_rows]
        return document_mask(self.positions[:, piece.q_rows], self.query_index[piece.q_rows], keys)


__all__ = ["BlockCounts", "DocumentPiece", "DocumentRing"]
