"""Building blocks of the reference transformer: norms, rotary embedding, attention, MLP and the residual block.

Nothing here knows about parallelism. Attention reads its head counts from tensor shapes, so a wrapper that swaps
`q`/`k`/`v`/`o` for sharded layers (fewer heads per device) or `core` for a distributed kernel needs no changes here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from plait.models.config import GPTConfig
from plait.models.moe import MoE


class RMSNorm(nn.Module):
    """Root-mean-square norm: y = x / sqrt(mean(x^2) + eps) * weight (no mean subtraction, no bias)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        """Weight back to ones."""
        nn.init.ones_(self.weight)


def make_norm(config: GPTConfig) -> nn.Module:
    """The norm layer that `config.norm` names (LayerNorm with bias iff `config.bias`, or RMSNorm)."""
    if config.norm == "rmsnorm":
        return RMSNorm(config.d_model)
    return nn.LayerNorm(config.d_model, eps=1e-5, bias=config.bias)


def rotary_inverse_frequencies(head_dim: int, theta: float, device: torch.device | None = None) -> Tensor:
    """Rotation speeds of the head_dim/2 rotary planes: theta^(-2i/head_dim), i = 0 .. head_dim/2 - 1."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    return 1.0 / (theta**exponents)


def apply_rotary(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Rotate q or k ([B, H, T, D]) by position (RoPE, half-split layout): x*cos(p*f) + rotate_half(x)*sin(p*f).

    Angles are computed elementwise from the absolute `positions` ([T] or [B, T]), so a chunk of a sequence rotated
    with its global positions is bit-identical to the same slice of the full-sequence rotation.
    """
    head_dim = x.shape[-1]
    inv_freq = rotary_inverse_frequencies(head_dim, theta, device=x.device)
    angles = positions.to(device=x.device, dtype=torch.float32).unsqueeze(-1) * inv_freq  # [..., T, D/2]
    angles = torch.cat((angles, angles), dim=-1).unsqueeze(-3)  # [1 or B, 1, T, D] after broadcasting
    first_half, second_half = x.float().chunk(2, dim=-1)
    rotated_half = torch.cat((-second_half, first_half), dim=-1)
    return (x.float() * angles.cos() + rotated_half * angles.sin()).type_as(x)


def document_mask(positions: Tensor, query_index: Tensor | None = None, key_index: Tensor | None = None) -> Tensor:
    """Which keys each query may see in packed documents: boolean [B, 1, Tq, Tk], True where query i attends key j.

    ``positions`` [B, Tq] are the queries' places in their own documents (0 at each document's first token:
    ``plait.models.inputs``); ``query_index`` [Tq] and ``key_index`` [Tk] are the tokens' indices in the window
    (default: ``arange(Tq)`` for both, the whole window). Query i sees key j iff 0 <= g_i - g_j <= positions_i:
    causal, and not before its document's first token. Positions that never restart give the causal mask, so the
    rule needs no document ids, and a context-parallel rank evaluates it from its own queries' positions and the
    global indices its sharding fixes, without the keys' positions."""
    if query_index is None:
        query_index = torch.arange(positions.shape[-1], device=positions.device)
    if key_index is None:
        key_index = query_index
    distance = query_index.unsqueeze(-1) - key_index.unsqueeze(0)  # [Tq, Tk]
    return ((distance >= 0) & (distance <= positions.unsqueeze(-1))).unsqueeze(1)


class ScaledDotProductAttention(nn.Module):
    """Causal softmax(q k^T / sqrt(D)) v on [B, H, T, D] tensors; the swap point for distributed attention kernels.

    With ``positions`` [B, T] (packed documents) the causal mask is ``document_mask(positions)``: no query attends
    across a document boundary (an explicit boolean mask: PyTorch's fused kernels that take one run it). Positions
    that never restart (0, 1, ..., T-1 in every row, or from k > 0: one document fills the window) take the causal
    kernel, as without positions; telling costs one read of a flag on the host."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = dropout

    def forward(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor | None = None) -> Tensor:
        dropout_p = self.dropout if self.training else 0.0
        if positions is None or is_one_document(positions):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        if positions.shape[0] != q.shape[0]:
            raise ValueError(
                f"packed documents' positions hold {positions.shape[0]} rows, but attention sees {q.shape[0]}: a "
                f"layout that cuts the batch inside the model (2D/2.5D/3D tensor parallelism) cannot take them. Fix: "
                f"tp_mode='1d', or data.attention='causal'."
            )
        mask = document_mask(positions.to(q.device))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


def is_one_document(positions: Tensor, index: Tensor | None = None) -> bool:
    """Whether no query's document began inside the window: every row's ``positions`` [B, T] are at least the
    tokens' window indices ``index`` (default arange(T)), so the document mask is the causal one (a host read)."""
    if index is None:
        index = torch.arange(positions.shape[-1], device=positions.device)
    return bool((positions >= index).all())


class Attention(nn.Module):
    """Multi-head (or grouped-query) causal self-attention with an output projection.

    Head counts come from the projections' output widths (width // head_dim), never from the config, so sharding
    `q`/`k`/`v` by heads just works; with fewer kv heads each kv head serves n_q/n_kv consecutive q heads.

    ``recompute_core`` (set by ``Layout(recompute="selective")``, off by default): the attention core (`attend`:
    the kv-head repetition, softmax(q k^T) and its product with v, whatever kernel `core` is) keeps nothing for
    backward but its inputs q, k, v and runs again in backward (torch.utils.checkpoint, RNG replayed), so the
    s^2-sized softmax, its dropout mask and output of a math kernel are never held (Korthikanti et al. 2022,
    "selective activation recomputation"). The flag lives here, not on `core`, so that it survives a swapped core.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.use_rope = config.position == "rope"
        self.rope_theta = config.rope_theta
        q_width = config.n_head * config.head_dim
        kv_width = config.kv_heads * config.head_dim
        self.q = nn.Linear(config.d_model, q_width, bias=config.bias)
        self.k = nn.Linear(config.d_model, kv_width, bias=config.bias)
        self.v = nn.Linear(config.d_model, kv_width, bias=config.bias)
        self.o = nn.Linear(q_width, config.d_model, bias=config.bias)
        self.core = ScaledDotProductAttention(config.dropout)
        self.recompute_core = False

    def split_heads(self, projected: Tensor) -> Tensor:
        """[B, T, heads*head_dim] -> [B, heads, T, head_dim], with heads read off the tensor's width."""
        batch, length, width = projected.shape
        return projected.view(batch, length, width // self.head_dim, self.head_dim).transpose(1, 2)

    def project_qkv(self, x: Tensor, positions: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values as [B, H, T, D] (rotated by `positions`, default arange(T), under RoPE; kv heads
        not yet repeated)."""
        q, k, v = self.split_heads(self.q(x)), self.split_heads(self.k(x)), self.split_heads(self.v(x))
        if self.use_rope:
            if positions is None:
                positions = torch.arange(x.shape[1], device=x.device)
            q = apply_rotary(q, positions, self.rope_theta)
            k = apply_rotary(k, positions, self.rope_theta)
        return q, k, v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, documents: Tensor | None = None) -> Tensor:
        """The attention core: kv heads repeated to the query heads, then `core` -> [B, H, T, D]; ``documents``
        (the queries' document positions [B, T], or None for plain causal attention) goes to the core as
        ``positions``."""
        q_heads, kv_heads = q.shape[1], k.shape[1]
        if q_heads != kv_heads:
            if q_heads % kv_heads != 0:
                raise ValueError(f"{q_heads} query heads cannot share {kv_heads} key/value heads evenly.")
            k = k.repeat_interleave(q_heads // kv_heads, dim=1)
            v = v.repeat_interleave(q_heads // kv_heads, dim=1)
        if documents is None:
            return self.core(q, k, v)
        return self.core(q, k, v, positions=documents)

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """``positions``: [T] (or None: arange) are absolute positions of one causal sequence; [B, T] are
        per-row document positions (``plait.models.inputs``), from which the core derives a document mask."""
        q, k, v = self.project_qkv(x, positions)
        documents = positions if positions is not None and positions.dim() == 2 else None
        if self.recompute_core and torch.is_grad_enabled():
            attended = checkpoint(self.attend, q, k, v, documents, use_reentrant=False)
        else:
            attended = self.attend(q, k, v, documents)  # [B, H, T, D]
        batch, _, length, _ = attended.shape
        return self.o(attended.transpose(1, 2).reshape(batch, length, q.shape[1] * self.head_dim))


class MLP(nn.Module):
    """Position-wise feed-forward: down(gelu(up(x))), or SwiGLU down(silu(gate(x)) * up(x)). ``hidden``: its width
    (default ``config.ffn_dim``; an MoE layer's shared experts use n_shared_experts x the expert width)."""

    def __init__(self, config: GPTConfig, hidden: int | None = None) -> None:
        super().__init__()
        self.kind = config.mlp
        hidden = hidden if hidden is not None else config.ffn_dim
        if self.kind == "swiglu":
            self.gate = nn.Linear(config.d_model, hidden, bias=config.bias)
        self.up = nn.Linear(config.d_model, hidden, bias=config.bias)
        self.act = nn.GELU() if self.kind == "gelu" else nn.SiLU()
        self.down = nn.Linear(hidden, config.d_model, bias=config.bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "swiglu":
            return self.down(self.act(self.gate(x)) * self.up(x))
        return self.down(self.act(self.up(x)))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm1(x)), then + mlp(norm2(x)) (residual dropout on both branches).
    Block ``index`` of a Mixture-of-Experts config (``config.is_moe_layer(index)``) has an ``MoE`` as its ``mlp``
    (``plait.models.moe``; shared experts as one MLP of their total width)."""

    def __init__(self, config: GPTConfig, index: int = 0) -> None:
        super().__init__()
        self.norm1 = make_norm(config)
        self.attn = Attention(config)
        self.norm2 = make_norm(config)
        self.mlp: MLP | MoE
        if config.is_moe_layer(index):
            shared = config.n_shared_experts * config.expert_ffn_dim
            self.mlp = MoE(config, index, MLP(config, hidden=shared) if shared else None)
        else:
            self.mlp = MLP(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        x = x + self.drop(self.attn(self.norm1(x), positions))
        return x + self.drop(self.mlp(self.norm2(x)))
