"""Ring attention (Liu et al. 2023) with zigzag load balancing: queries stay, key/value blocks travel.

Each of the cp ranks holds T/cp positions (``SequenceSharding``, zigzag). Forward: cp steps; at step i the
rank attends its queries to the key/value block of rank r-i while that block is already on its way to rank
r+1 (a batched isend/irecv posted *before* the compute, so the transfer overlaps it), and folds the block's
(o, lse) into running accumulators with the online-softmax merge (``blockwise``). cp-1 hops move the blocks.

Backward recomputes every block's probabilities from the saved (q, k, v, o, lse) as FlashAttention does and
circulates the key/value blocks once more, now followed by their gradient accumulators: the blocks are
visited in the order r-1, r-2, ..., r+1, r (own block last), so the accumulator of block b starts at rank
b+1 and, after collecting every rank's contribution, arrives at its owner b after cp-1 hops.
Bytes sent per rank and layer, with block = B * kv_heads * T/cp * head_dim elements:
forward (cp-1) * 2 * block (k and v, input dtype); backward (cp-1) * 2 * block (input dtype) +
(cp-1) * 2 * block (float32 gradient accumulators).

Packed documents (``positions`` [B, T/cp], ``plait.models.inputs``): each rank decides from its own queries'
positions which pieces of each visiting block some query sees (``context.documents.DocumentRing``); fully masked
pieces are skipped forward and backward, partly masked ones computed with a mask. The bytes are the same: every
block still travels the whole ring.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from plait.comm import Comm, Pending
from plait.parallel.context.blockwise import block_backward, block_forward, merge_into, repeat_kv, sum_kv_groups
from plait.parallel.context.documents import BlockCounts, DocumentPiece, DocumentRing
from plait.parallel.context.sharding import SequenceSharding


def _pass_on(comm: Comm, axis: str, outgoing: Tensor) -> tuple[Tensor, Pending]:
    """Post the ring hop: send ``outgoing`` to the next cp rank, receive the previous rank's into a new buffer."""
    incoming = torch.empty_like(outgoing)
    pending = comm.send_recv(
        sends=[(outgoing, comm.mesh.peer(axis, 1))],
        recvs=[(incoming, comm.mesh.peer(axis, -1))],
        axis=axis,
        async_op=True,
    )
    return incoming, pending


def _pieces(
    sharding: SequenceSharding,
    documents: DocumentRing | None,
    source: int,
    local_length: int,
    causal: bool,
    counts: BlockCounts | None = None,
) -> list[DocumentPiece]:
    """The pieces of rank ``source``'s block to compute: the causal split's, less those no document sees."""
    if documents is not None:
        return documents.pieces(source, counts)
    pieces = [DocumentPiece(piece, False) for piece in sharding.pieces(source, local_length, causal)]
    if counts is not None:
        counts.computed += len(pieces)
    return pieces


def ring_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    comm: Comm,
    axis: str,
    sharding: SequenceSharding,
    group: int,
    causal: bool,
    scale: float,
    documents: DocumentRing | None = None,
    counts: BlockCounts | None = None,
) -> tuple[Tensor, Tensor]:
    """Float32 (o, lse) of local queries [B, H, Tl, D] over the whole ring's keys/values [B, H/group, Tl, D]
    (``documents``: the queries' packed-document positions; ``counts``: pieces computed and skipped)."""
    n, rank, local_length = sharding.size, sharding.index, q.shape[2]
    # o lives as [B, Tl, H, D] in memory: the Attention layer's transpose(1, 2).reshape is then a view, and the
    # output projection saves the very storage this function saves (no extra copy kept for backward)
    batch, heads, _, dim = q.shape
    out = torch.zeros(batch, local_length, heads, dim, dtype=torch.float32, device=q.device).transpose(1, 2)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    block = torch.stack((k, v))  # one message per hop
    for step in range(n):  # step 0 is the own block, which every query row sees: lse is finite from then on
        source = (rank - step) % n
        hop = _pass_on(comm, axis, block) if step < n - 1 else None
        keys, values = repeat_kv(block[0], group), repeat_kv(block[1], group)
        for part in _pieces(sharding, documents, source, local_length, causal, counts):
            piece = part.piece
            rows, cols = piece.q_rows, piece.kv_rows
            mask = documents.mask(source, piece) if part.masked and documents is not None else None
            block_out, block_lse = block_forward(
                q[:, :, rows], keys[:, :, cols], values[:, :, cols], scale, piece.causal, mask
            )
            merge_into(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
        if hop is not None:
            incoming, pending = hop
            pending.wait()
            block = incoming
    return out, lse


def ring_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    comm: Comm,
    axis: str,
    sharding: SequenceSharding,
    group: int,
    causal: bool,
    scale: float,
    documents: DocumentRing | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Float32 (dq, dk, dv) of this rank's q, k, v; every rank's gradient contributions to k, v travel home."""
    n, rank, local_length = sharding.size, sharding.index, q.shape[2]
    delta = (grad_out.float() * out.float()).sum(dim=-1)
    grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    own = torch.stack((k, v))
    block = own
    if n > 1:  # the first visit is block r-1: this hop cannot overlap compute
        block, first = _pass_on(comm, axis, own)
        first.wait()
    carried: tuple[Tensor, Pending] | None = None  # the contributions collected so far, in flight to this rank
    for step in range(n):
        source = (rank - step - 1) % n
        current = own if step == n - 1 else block
        next_hop = _pass_on(comm, axis, block) if step < n - 2 else None
        keys, values = repeat_kv(current[0], group), repeat_kv(current[1], group)
        contribution = torch.zeros(current.shape, dtype=torch.float32, device=q.device)
        for part in _pieces(sharding, documents, source, local_length, causal):
            piece = part.piece
            rows, cols = piece.q_rows, piece.kv_rows
            grad_q_piece, grad_k_piece, grad_v_piece = block_backward(
                q[:, :, rows],
                keys[:, :, cols],
                values[:, :, cols],
                grad_out[:, :, rows],
                lse[:, :, rows],
                delta[:, :, rows],
                scale,
                piece.causal,
                documents.mask(source, piece) if part.masked and documents is not None else None,
            )
            grad_q[:, :, rows] += grad_q_piece
            contribution[0][:, :, cols] += sum_kv_groups(grad_k_piece, group)
            contribution[1][:, :, cols] += sum_kv_groups(grad_v_piece, group)
        if carried is not None:  # the other ranks' contributions to this block, collected so far
            collected, carried_pending = carried
            carried_pending.wait()
            contribution += collected
        if step < n - 1:
            carried = _pass_on(comm, axis, contribution)
        if next_hop is not None:
            next_block, next_pending = next_hop
            next_pending.wait()
            block = next_block
    return grad_q, contribution[0], contribution[1]


class _RingAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        comm: Comm,
        axis: str,
        sharding: SequenceSharding,
        group: int,
        causal: bool,
        scale: float,
        positions: Tensor | None,
        counts: BlockCounts,
    ) -> Tensor:
        documents = DocumentRing(sharding, positions) if positions is not None else None
        out, lse = ring_forward(q, k, v, comm, axis, sharding, group, causal, scale, documents, counts)
        out = out.to(q.dtype)
        # the positions are saved (and so counted as activations); the decisions travel as plain Python
        ctx.save_for_backward(q, k, v, out, lse, *(() if positions is None else (positions,)))
        ctx.setup = (comm, axis, sharding, group, causal, scale, documents)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors[:5]
        grad_q, grad_k, grad_v = ring_backward(grad_out.contiguous(), q, k, v, out, lse, *ctx.setup)
        return (grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)) + (None,) * 8


class RingAttention(nn.Module):
    """Drop-in for ``ScaledDotProductAttention`` under ring context parallelism: softmax(q k^T / sqrt(D)) v over
    the whole (sharded) sequence, for the local queries [B, H, T/cp, D].

    ``kv_group`` is the number of query heads per key/value head: the Attention layer hands over k and v
    already repeated to H heads, so only every ``kv_group``-th head is sent around the ring and the
    repetition is redone locally (GQA costs kv_heads/H of the bytes of full multi-head attention).
    """

    def __init__(
        self, comm: Comm, sharding: SequenceSharding, kv_group: int = 1, causal: bool = True, axis: str = "cp"
    ) -> None:
        super().__init__()
        if sharding.mode != "ring":
            raise ValueError(f"RingAttention needs the zigzag ('ring') sharding, got {sharding.mode!r}")
        self.comm, self.sharding, self.kv_group, self.causal, self.axis = comm, sharding, kv_group, causal, axis
        self.counts = BlockCounts()
        """Block pieces computed, masked and skipped by this layer's forward passes (``context.documents``)."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor | None = None) -> Tensor:
        """q [B, H, T/cp, D]; k, v repeated to the H query heads (as plait's Attention hands them over);
        ``positions``: this rank's queries' document positions [B, T/cp] (packed documents), or None."""
        group = self.kv_group
        if q.shape[1] % group or k.shape[1] != q.shape[1]:
            raise ValueError(
                f"RingAttention expects k/v repeated to the {q.shape[1]} query heads in groups of {group}, got "
                f"{k.shape[1]} key heads"
            )
        return self.attend(q, k[:, ::group], v[:, ::group], positions=positions)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, scale: float | None = None, positions: Tensor | None = None
    ) -> Tensor:
        """q [B, H, T/cp, D] over the distinct key/value heads k, v [B, KV, T/cp, D] (KV divides H), scores
        scaled by ``scale`` (default 1/sqrt(D)); returns [B, H, T/cp, D], laid out [B, T/cp, H, D] in memory.
        ``positions`` [B, T/cp]: the queries' places in their packed documents (module docstring)."""
        heads, kv_heads = q.shape[1], k.shape[1]
        if heads % kv_heads:
            raise ValueError(f"{heads} query heads cannot share {kv_heads} key/value heads evenly")
        if q.shape[2] % 2 and self.causal:
            raise ValueError(f"zigzag ring attention needs an even local length (two chunks), got {q.shape[2]}")
        if positions is not None and not self.causal:
            raise ValueError("packed documents need causal attention; this ring attention is not causal")
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return _RingAttentionFunction.apply(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            self.comm,
            self.axis,
            self.sharding,
            heads // kv_heads,
            self.causal,
            scale,
            None if positions is None else positions.to(q.device),
            self.counts,
        )

    def extra_repr(self) -> str:
        return f"cp={self.sharding.size}, rank={self.sharding.index}, kv_group={self.kv_group}, causal={self.causal}"
