"""Which sequence positions each context-parallel rank holds, and which key blocks its queries may see.

Ulysses cuts the sequence into ``cp`` contiguous pieces: rank r holds positions [r T/cp, (r+1) T/cp).
Ring attention with a causal mask cuts it into ``2 cp`` chunks of length c = T/(2 cp) and gives rank r the
chunks r and 2cp-1-r ("zigzag", as in Llama 3's context parallelism and the zigzag ring of Zhu et al.):
an early chunk, which sees few keys, is paired with a late one, which sees many, so every rank does the same
work. With chunk ids (r, 2cp-1-r) for the queries and (s, 2cp-1-s) for the keys of rank s, the causal mask at
chunk granularity leaves exactly one of three shapes per (r, s) block, each c x 2c or 2c x 2c:

- s == r: causal over the local 2c positions (the local order is increasing);
- s <  r: every local query sees the first chunk (s) of the block, none of the second;
- s >  r: only the second query chunk (2cp-1-r) sees the block, all of it.

So no rank ever computes a fully masked block, and the masked half of the diagonal blocks is the only waste.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plait.errors import LayoutError

CP_SHARDINGS = {"ring": "zigzag", "ulysses": "contiguous"}
"""The sequence split each ``Layout.cp_mode`` uses."""


@dataclass(frozen=True)
class BlockPiece:
    """Queries ``q_rows`` of this rank attend keys ``kv_rows`` of a visiting block, with a causal mask or not."""

    q_rows: slice
    kv_rows: slice
    causal: bool


@dataclass(frozen=True)
class SequenceSharding:
    """The split of a length-T sequence over ``size`` ranks (``mode`` "ring": zigzag, "ulysses": contiguous);
    ``index`` is this rank's position in the cp group."""

    mode: str
    size: int
    index: int

    def __post_init__(self) -> None:
        if self.mode not in CP_SHARDINGS:
            choices = ", ".join(map(repr, CP_SHARDINGS))
            raise LayoutError(f"cp_mode={self.mode!r} is unknown. Fix: use one of {choices}.")
        if not 0 <= self.index < self.size:
            raise LayoutError(f"cp index {self.index} is outside a cp group of {self.size} ranks.")

    @property
    def chunks(self) -> int:
        """Pieces the sequence is cut into: 2 cp (zigzag) or cp (contiguous)."""
        return 2 * self.size if self.mode == "ring" else self.size

    def check_length(self, length: int) -> None:
        """Raise LayoutError (pure, before any collective) when ``length`` does not split into ``chunks``."""
        if length % self.chunks:
            lower, upper = length - length % self.chunks, length + self.chunks - length % self.chunks
            how = f"2*cp = {self.chunks} chunks (zigzag)" if self.mode == "ring" else f"cp = {self.chunks} pieces"
            raise LayoutError(
                f"context parallel ({self.mode}, cp={self.size}) cuts the sequence into {how}, but the sequence has "
                f"{length} tokens. Fix: use a sequence length that is a multiple of {self.chunks} "
                f"(e.g. {lower or upper} or {upper}), pad the batch, or change cp."
            )

    def chunk_ids(self, rank: int | None = None) -> tuple[int, ...]:
        """The chunks rank ``rank`` (default: this one) holds, in local order."""
        rank = self.index if rank is None else rank
        return (rank, 2 * self.size - 1 - rank) if self.mode == "ring" else (rank,)

    def local_positions(self, length: int, rank: int | None = None, device: torch.device | None = None) -> torch.Tensor:
        """The global positions ([length / cp], increasing) that rank ``rank`` holds."""
        self.check_length(length)
        chunk = length // self.chunks
        return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in self.chunk_ids(rank)])

    def gathered_order(self, length: int, device: torch.device | None = None) -> torch.Tensor:
        """Global positions of the rank-ordered concatenation of every rank's local tokens (what an all-gather
        over cp yields); ``argsort`` of it puts gathered tokens back in sequence order."""
        return torch.cat([self.local_positions(length, rank, device) for rank in range(self.size)])

    def pieces(self, source: int, local_length: int, causal: bool) -> list[BlockPiece]:
        """What this rank's queries compute against the key/value block of rank ``source`` (see module doc)."""
        everything = slice(0, local_length)
        if not causal:
            return [BlockPiece(everything, everything, False)]
        if self.mode != "ring":
            raise ValueError("blockwise causal pieces are defined for the zigzag (ring) sharding only")
        half = local_length // 2
        if source == self.index:
            return [BlockPiece(everything, everything, True)]
        if source < self.index:
            return [BlockPiece(everything, slice(0, half), False)]
        return [BlockPiece(slice(half, local_length), everything, False)]
