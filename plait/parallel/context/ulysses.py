"""DeepSpeed-Ulysses (Jacobs et al. 2023): trade the sequence split for a head split around attention.

Each cp rank holds a contiguous T/cp slice of the sequence for all H heads. An all-to-all over cp turns
q, k, v from [B, H, T/cp, D] into [B, H/cp, T, D] (rank j receives heads j H/cp .. (j+1) H/cp - 1 of every
rank's slice, concatenated in sequence order), each rank runs ordinary full-sequence attention for its
heads, and a second all-to-all turns the output back into [B, H, T/cp, D]. Backward is the same four
all-to-alls in reverse (``plait.comm.all_to_all`` is differentiable). Under GQA only the kv_heads distinct
key/value heads are exchanged (rank j gets kv heads j kv/cp .., exactly the ones its query heads use), so
both H and kv_heads must be divisible by cp. With tensor parallelism the heads are first split over tp, so
each rank attends H / (tp cp) heads: H must be divisible by tp * cp.

Bytes sent per rank and layer (ring all-to-all model, e = element size, Tl = T/cp):
forward (cp-1)/cp * B Tl D e * (2 H + 2 kv_heads) (q and o with H heads, k and v with kv_heads), backward the same.

Packed documents (``positions`` [B, T/cp], ``plait.models.inputs``): the positions move with the sequence. After
the all-to-all each rank attends the whole sequence, so it all-gathers the positions over cp ((cp-1)/cp x 8 B T
bytes per layer, int64) and applies ``document_mask`` to the full-length attention.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from plait.comm import Comm, all_to_all
from plait.models.layers import document_mask, is_one_document
from plait.parallel.context.blockwise import repeat_kv
from plait.parallel.context.sharding import SequenceSharding

HEAD_DIM, SEQ_DIM = 1, 2
"""Dimensions of the [B, H, T, D] tensors that attention cores receive."""


class UlyssesAttention(nn.Module):
    """Drop-in for ``ScaledDotProductAttention`` under Ulysses context parallelism (contiguous sharding).

    ``kv_group`` is the number of query heads per key/value head: k and v arrive repeated to H heads, so only
    every ``kv_group``-th head is exchanged and the repetition is redone after the all-to-all.
    """

    def __init__(
        self, comm: Comm, sharding: SequenceSharding, kv_group: int = 1, causal: bool = True, axis: str = "cp"
    ) -> None:
        super().__init__()
        if sharding.mode != "ulysses":
            raise ValueError(f"UlyssesAttention needs the contiguous ('ulysses') sharding, got {sharding.mode!r}")
        self.comm, self.sharding, self.kv_group, self.causal, self.axis = comm, sharding, kv_group, causal, axis

    def _to_heads(self, x: Tensor) -> Tensor:
        """[B, h, T/cp, D] -> [B, h/cp, T, D]."""
        return all_to_all(x.contiguous(), self.comm, self.axis, scatter_dim=HEAD_DIM, gather_dim=SEQ_DIM)

    def _to_sequence(self, x: Tensor) -> Tensor:
        """[B, h/cp, T, D] -> [B, h, T/cp, D], laid out [B, T/cp, h, D] in memory so that the Attention layer's
        transpose(1, 2).reshape is a view (the output projection then saves no extra copy)."""
        tokens_first = x.transpose(HEAD_DIM, SEQ_DIM)  # [B, T, h/cp, D]
        gathered = all_to_all(tokens_first, self.comm, self.axis, scatter_dim=1, gather_dim=2)  # [B, T/cp, h, D]
        return gathered.transpose(1, 2)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor | None = None) -> Tensor:
        """q [B, H, T/cp, D]; k, v repeated to the H query heads (as plait's Attention hands them over);
        ``positions``: this rank's tokens' document positions [B, T/cp] (packed documents), or None."""
        group = self.kv_group
        return self.attend(q, k[:, ::group], v[:, ::group], positions=positions)

    def _mask(self, positions: Tensor | None) -> Tensor | None:
        """The document mask of the whole sequence from every rank's positions (None: causal)."""
        if positions is None:
            return None
        if not self.causal:
            raise ValueError("packed documents need causal attention; this Ulysses attention is not causal")
        whole = self.comm.all_gather(positions.contiguous(), self.axis, dim=1)  # contiguous shards: sequence order
        return None if is_one_document(whole) else document_mask(whole)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, scale: float | None = None, positions: Tensor | None = None
    ) -> Tensor:
        """q [B, H, T/cp, D] over the distinct key/value heads k, v [B, KV, T/cp, D], scores scaled by ``scale``
        (default 1/sqrt(D)); returns [B, H, T/cp, D], laid out [B, T/cp, H, D] in memory. ``positions`` [B, T/cp]:
        the tokens' places in their packed documents (module docstring)."""
        cp, heads, kv_heads = self.sharding.size, q.shape[HEAD_DIM], k.shape[HEAD_DIM]
        if heads % cp or kv_heads % cp:
            raise ValueError(
                f"Ulysses splits heads over cp={cp}, but this layer has {heads} query and {kv_heads} key/value heads"
            )
        group = heads // kv_heads
        q_heads = self._to_heads(q)
        k_heads = repeat_kv(self._to_heads(k), group)
        v_heads = repeat_kv(self._to_heads(v), group)
        mask = self._mask(None if positions is None else positions.to(q.device))
        causal = self.causal and mask is None
        out = F.scaled_dot_product_attention(q_heads, k_heads, v_heads, attn_mask=mask, is_causal=causal, scale=scale)
        return self._to_sequence(out)

    def extra_repr(self) -> str:
        return f"cp={self.sharding.size}, rank={self.sharding.index}, kv_group={self.kv_group}, causal={self.causal}"
