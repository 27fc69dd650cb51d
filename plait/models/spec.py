"""``ModelSpec``: one description of a decoder-only transformer, which owns its parameter count and its FLOPs.

Everything that needs a model's size or its FLOPs per token reads them here: ``GPT.flops_per_token`` (the
reference model), the run metrics' MFU (``plait.train.metrics``), the planner's cost model
(``plait.planner.costs`` re-exports ``block_flops`` and ``logits_flops``) and its memory model. A ``GPTConfig``
becomes a spec with ``ModelSpec.from_gpt_config``; the planner reads named models and Hugging Face configs into
the same class (``plait.planner.models``).

Parameters of one block (Narayanan et al. 2021, sec. 5.1, generalised to grouped-query attention and gated
MLPs), h = hidden, k kv heads of width d = h / a, f = ffn width: attention h (h + 2 k d) + h h, MLP (2|3) h f,
(a model whose heads are wider or narrower than h / a, ``attention_head_dim`` as Qwen3 and Gemma set it: q and the
attention's output are a d wide, so attention is h (a d + 2 k d) + a d h and its core 4 b s_q s_k a d),
norms 2 h (4 h with LayerNorm biases), biases where the model has them; plus the embeddings V h (+ s h for
learned positions), the final norm and an untied head V h.

FLOPs (Narayanan et al. 2021, eq. 3; a multiply-add is 2 FLOPs). A block's forward pass on b samples of s_q
queries attending to s_k keys:

    2 b s_q [h (h + 2 k d) + h^2 + (2|3) h f]   (the matmuls: 2 x tokens x matmul weights)
    + 4 b s_q s_k h                              (scores q k^T and their product with v, every head)

For f = 4h, k = a and s_q = s_k = s that is 24 b s h^2 (1 + s / 6h), the paper's figure. The logits cost
2 b s h V. A backward pass costs twice its forward (a gradient for the input and one for the weights), so the
*model* FLOPs of one trained token at context s are

    3 x [L (2 [h (h + 2 k d) + h^2 + (2|3) h f] + 4 s h) + 2 h V]

Mixture-of-Experts blocks (``experts`` > 0: the blocks ``moe_start, moe_start + moe_every, ...``) replace the MLP
by a router (h E weights), E routed experts of width f_e (each (2|3) h f_e, no biases) of which a token uses
``top_k``, and ``shared_experts`` always-on experts (one MLP of width shared x f_e). ``parameters`` counts every
expert (what memory holds), ``active_parameters`` the ones a token uses (top_k routed + shared); the FLOPs per
token count the active ones and the router: 2 [attention + h E + (top_k + shared) (2|3) h f_e] + 4 s h per MoE
block (Fedus et al. 2022 count a token's FLOPs through the experts it is routed to; the dispatch itself is data
movement, not FLOPs).

Model FLOPs leave recomputation out (Chowdhery et al. 2022, app. B: MFU counts the FLOPs the model needs,
not what the system chose to redo); ``recompute_flops_per_token`` gives the extra *hardware* FLOPs of each
recomputation mode. The attention term counts the whole s x s square, as Narayanan et al. and Chowdhery et al.
do, although a causal kernel skips half of it. Embedding lookups, norms, biases, activation functions and the
softmax are not matmuls and cost no FLOPs here. This is why the older estimate ``6 N + 12 L h s`` (N = every
parameter) overcounts an untied model: it charges 6 FLOPs per token to each of the V h + s h parameters of the
input embeddings (a lookup, not a matmul) and to every bias and norm weight: for a GPT-2-small-shaped model
(12 x 768, V = 50,304, s = 1024) 1091.9 M instead of the 854.7 M counted here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from plait.errors import ConfigError

if TYPE_CHECKING:
    from plait.models.config import GPTConfig

RECOMPUTE_KINDS = ("none", "selective", "op", "full")
"""Recomputation modes whose extra FLOPs ``recompute_flops_per_token`` knows (a tuple of blocks: per block)."""


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer: ``layers`` blocks of width ``hidden`` with ``heads`` attention heads
    (``kv_heads`` key/value heads), an MLP of width ``ffn`` (``gated``: SwiGLU, three matrices), ``vocab``
    tokens and a default context of ``seq`` tokens."""

    name: str
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    seq: int
    kv_heads: int | None = None
    gated: bool = False
    tied_embeddings: bool = False
    learned_positions: bool = False
    bias: bool = False
    rms_norm: bool | None = None
    """RMSNorm (True) or LayerNorm (False); None: as the families go, LayerNorm with learned positions (GPT-2,
    GPT-3), RMSNorm with rotary ones (Llama)."""
    dropout: float = 0.0
    """The dropout probability of training (attention and residual dropout); above 0 the forward keeps masks."""
    experts: int = 0
    """Routed experts of each MoE block (0: a dense model; module docstring)."""
    top_k: int = 0
    """Routed experts each token uses."""
    shared_experts: int = 0
    """Always-on experts of each MoE block (one MLP of width shared_experts x expert_ffn)."""
    expert_ffn: int | None = None
    """Width of one expert (None: ``ffn``)."""
    moe_start: int = 0
    moe_every: int = 1
    """The MoE blocks are moe_start, moe_start + moe_every, ... (as ``GPTConfig``)."""
    attention_head_dim: int | None = None
    """The width of one attention head where it is not hidden / heads (Qwen3, Gemma: a Hugging Face config's
    ``head_dim``); q and the attention's output are then heads x it wide (``q_width``)."""

    def __post_init__(self) -> None:
        for key in ("layers", "hidden", "heads", "ffn", "vocab", "seq"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"model {self.name!r}: {key}={value!r} must be a positive integer.")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model {self.name!r}: dropout={self.dropout!r} is outside [0, 1); use e.g. 0.0 or 0.1.")
        if self.attention_head_dim is None and self.hidden % self.heads:
            raise ConfigError(f"model {self.name!r}: hidden={self.hidden} is not a multiple of heads={self.heads}.")
        width = self.attention_head_dim
        if width is not None and (not isinstance(width, int) or isinstance(width, bool) or width < 1):
            raise ConfigError(f"model {self.name!r}: attention_head_dim={width!r} must be a positive integer or None.")
        if self.heads % self.kv:
            raise ConfigError(f"model {self.name!r}: kv_heads={self.kv} does not divide heads={self.heads}.")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ConfigError(f"model {self.name!r}: top_k={self.top_k} must be in 1..experts={self.experts}.")

    # ------------------------------------------------------------------ sizes
    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.hidden // self.heads

    @property
    def q_width(self) -> int:
        """The width of q and of the attention's output: heads x head_dim (= hidden unless ``attention_head_dim``)."""
        return self.heads * self.head_dim

    @property
    def uses_rms_norm(self) -> bool:
        return (not self.learned_positions) if self.rms_norm is None else self.rms_norm

    @property
    def norm_parameters(self) -> int:
        """Weights (and LayerNorm biases) of one norm."""
        return self.hidden * (2 if self.bias and not self.uses_rms_norm else 1)

    @property
    def matmul_parameters(self) -> int:
        """Weights of one block's matmuls: q, k, v, o and the MLP's (2|3) matrices."""
        h, f, kvw, qw = self.hidden, self.ffn, self.kv * self.head_dim, self.q_width
        return h * (qw + 2 * kvw) + qw * h + (3 if self.gated else 2) * h * f

    @property
    def block_parameters(self) -> int:
        h, f, kvw, qw = self.hidden, self.ffn, self.kv * self.head_dim, self.q_width
        biases = (qw + 2 * kvw + h + (2 if self.gated else 1) * f + h) if self.bias else 0
        return self.matmul_parameters + biases + 2 * self.norm_parameters

    # ------------------------------------------------------------------ Mixture-of-Experts (module docstring)
    def is_moe_block(self, index: int) -> bool:
        """Whether block ``index`` is a Mixture-of-Experts block."""
        return self.experts > 0 and index >= self.moe_start and (index - self.moe_start) % self.moe_every == 0

    @property
    def moe_blocks(self) -> int:
        """How many blocks are MoE blocks."""
        return sum(1 for index in range(self.layers) if self.is_moe_block(index))

    @property
    def expert_parameters(self) -> int:
        """Weights of one routed expert: (2|3) h f_e."""
        return (3 if self.gated else 2) * self.hidden * (self.expert_ffn or self.ffn)

    @property
    def attention_parameters(self) -> int:
        """Weights of one block's attention matmuls: q, k, v, o."""
        h, kvw, qw = self.hidden, self.kv * self.head_dim, self.q_width
        return h * (qw + 2 * kvw) + qw * h

    def _moe_block(self, routed: int) -> int:
        """An MoE block's parameters with ``routed`` routed experts (biases: attention's, the shared MLP's)."""
        h, kvw, width = self.hidden, self.kv * self.head_dim, self.shared_experts * (self.expert_ffn or self.ffn)
        biases = (
            (self.q_width + 2 * kvw + h + ((2 if self.gated else 1) * width + h if width else 0)) if self.bias else 0
        )
        experts = (routed + self.shared_experts) * self.expert_parameters
        return self.attention_parameters + h * self.experts + experts + biases + 2 * self.norm_parameters

    @property
    def moe_block_parameters(self) -> int:
        """Every parameter of one MoE block (all E routed experts)."""
        return self._moe_block(self.experts)

    @property
    def moe_block_active_parameters(self) -> int:
        """The parameters of one MoE block a token uses (top_k routed experts, the shared ones, the router)."""
        return self._moe_block(self.top_k)

    def block_matmul_parameters(self, index: int) -> int:
        """The matmul weights a token goes through in block ``index`` (an MoE block: attention, router, the active
        experts)."""
        if not self.is_moe_block(index):
            return self.matmul_parameters
        active = (self.top_k + self.shared_experts) * self.expert_parameters
        return self.attention_parameters + self.hidden * self.experts + active

    @property
    def embedding_parameters(self) -> int:
        return self.vocab * self.hidden + (self.seq * self.hidden if self.learned_positions else 0)

    @property
    def head_parameters(self) -> int:
        """Final norm and (untied) output projection."""
        return self.norm_parameters + (0 if self.tied_embeddings else self.vocab * self.hidden)

    @property
    def parameters(self) -> int:
        """Every parameter (all experts of every MoE block)."""
        moe = self.moe_blocks
        blocks = (self.layers - moe) * self.block_parameters + moe * self.moe_block_parameters
        return blocks + self.embedding_parameters + self.head_parameters

    @property
    def active_parameters(self) -> int:
        """The parameters one token uses (= ``parameters`` for a dense model)."""
        moe = self.moe_blocks
        blocks = (self.layers - moe) * self.block_parameters + moe * self.moe_block_active_parameters
        return blocks + self.embedding_parameters + self.head_parameters

    # ------------------------------------------------------------------ FLOPs (module docstring)
    def block_forward_flops(self, batch: int, seq_q: int, seq_k: int | None = None) -> int:
        """Forward FLOPs of one block for ``batch`` samples of ``seq_q`` queries attending to ``seq_k`` keys
        (default ``seq_q``): 2 b s_q (matmul weights) + 4 b s_q s_k h."""
        seq_k = seq_q if seq_k is None else seq_k
        return 2 * batch * seq_q * self.matmul_parameters + self.attention_core_flops(batch, seq_q, seq_k)

    def attention_core_flops(self, batch: int, seq_q: int, seq_k: int | None = None) -> int:
        """Forward FLOPs of one block's attention core (q k^T and the product with v): 4 b s_q s_k h."""
        seq_k = seq_q if seq_k is None else seq_k
        return 4 * batch * seq_q * seq_k * self.q_width

    def logits_forward_flops(self, batch: int, seq: int) -> int:
        """Forward FLOPs of the output projection: 2 b s h V."""
        return 2 * batch * seq * self.hidden * self.vocab

    def forward_flops_per_token(
        self,
        seq: int | None = None,
        blocks: int | None = None,
        logits: bool = True,
        block_indices: Sequence[int] | None = None,
    ) -> int:
        """Forward FLOPs of one token at context ``seq`` (default ``self.seq``) through ``blocks`` blocks (default
        all; blocks 0 .. blocks-1 where MoE blocks differ) or the blocks ``block_indices`` and, with ``logits``, the
        output projection: a pipeline stage's share with its own counts."""
        s = self.seq if seq is None else seq
        if block_indices is None:
            block_indices = range(self.layers if blocks is None else blocks)
        matmuls = sum(2 * self.block_matmul_parameters(index) for index in block_indices)
        return matmuls + len(block_indices) * 4 * s * self.q_width + (2 * self.hidden * self.vocab if logits else 0)

    def flops_per_token(self, seq: int | None = None, blocks: int | None = None, logits: bool = True) -> int:
        """Model FLOPs of one trained token (forward + backward = 3 x forward, recomputation excluded)."""
        return 3 * self.forward_flops_per_token(seq, blocks, logits)

    def recompute_flops_per_token(
        self, recompute: str | tuple[int, ...], seq: int | None = None, fused_attention: bool = True
    ) -> int:
        """Extra hardware FLOPs per trained token that ``recompute`` adds (not model FLOPs): "full" runs every
        block's forward again, "selective" only the attention cores (Korthikanti et al. 2022, sec. 5: 4 s h per
        block), a tuple of block indices the forward of those blocks. Counted whole, as the papers count it:
        torch's non-reentrant checkpoint stops a recomputation once it has rebuilt what backward needs, skipping
        the region's last matmul (whose output nothing saved), so it really spends a little less.

        "op" (``plait.parallel.recompute.OperatorPolicy``) is counted as torch spends it: the even-numbered
        matmuls of each block except the last, which that early stop skips (k and o: 2 h (k d + a d); gated, up:
        2 h f), and with an unfused attention kernel (``fused_attention`` False) the core, 4 s h."""
        s = self.seq if seq is None else seq
        if recompute == "none":
            return 0
        if recompute == "full":
            return self.forward_flops_per_token(s, logits=False)
        if recompute == "selective":
            return self.layers * 4 * s * self.q_width
        if recompute == "op":
            h = self.hidden
            matmuls = 2 * h * (self.kv * self.head_dim + self.q_width) + (2 * h * self.ffn if self.gated else 0)
            return self.layers * (matmuls + (0 if fused_attention else 4 * s * self.q_width))
        if isinstance(recompute, tuple):
            return self.forward_flops_per_token(s, blocks=len(set(recompute)), logits=False)
        raise ValueError(f"recompute={recompute!r} is unknown; use one of {RECOMPUTE_KINDS} or a tuple of blocks")

    # ------------------------------------------------------------------ other forms
    def with_seq(self, seq: int | None) -> ModelSpec:
        if seq is None or seq == self.seq:
            return self
        return dataclasses.replace(self, seq=seq)

    @classmethod
    def from_gpt_config(cls, config: GPTConfig, name: str = "gpt") -> ModelSpec:
        """The spec of plait's reference ``GPT`` built from ``config`` (untied head)."""
        return cls(
            name,
            config.n_layer,
            config.d_model,
            config.n_head,
            config.ffn_dim,
            config.vocab_size,
            config.seq_len,
            kv_heads=config.kv_heads,
            gated=config.mlp == "swiglu",
            learned_positions=config.position == "learned",
            bias=config.bias,
            rms_norm=config.norm == "rmsnorm",
            dropout=config.dropout,
            experts=config.n_experts,
            top_k=config.top_k if config.n_experts else 0,
            shared_experts=config.n_shared_experts if config.n_experts else 0,
            expert_ffn=config.expert_ffn_dim if config.n_experts else None,
            moe_start=config.moe_start,
            moe_every=config.moe_every,
        )

    def to_gpt_config(self) -> dict[str, object]:
        """The ``[model]`` fields of a RunConfig (plait.models.GPTConfig) that build this model (ConfigError for
        heads that are not hidden / heads wide: plait's GPT has no such attention)."""
        if self.q_width != self.hidden:
            raise ConfigError(
                f"model {self.name!r} has heads of width {self.head_dim} ({self.heads} x {self.head_dim} = "
                f"{self.q_width} != hidden {self.hidden}): plait's GPT has head_dim = d_model / n_head. Fix: train it "
                f"from its Hugging Face config (model.hf_config)."
            )
        fields: dict[str, object] = {
            "n_layer": self.layers,
            "d_model": self.hidden,
            "n_head": self.heads,
            "n_kv_head": self.kv,
            "d_ff": self.ffn,
            "vocab_size": self.vocab,
            "seq_len": self.seq,
            "mlp": "swiglu" if self.gated else "gelu",
            "position": "learned" if self.learned_positions else "rope",
            "norm": "rmsnorm" if self.uses_rms_norm else "layernorm",
            "bias": self.bias,
        }
        if self.experts:
            fields.update(
                n_experts=self.experts,
                top_k=self.top_k,
                n_shared_experts=self.shared_experts,
                moe_d_ff=self.expert_ffn or self.ffn,
                moe_start=self.moe_start,
                moe_every=self.moe_every,
            )
        return fields


def block_flops(spec: ModelSpec, batch: int, seq_q: int, seq_k: int) -> float:
    """Forward FLOPs of one block for ``batch`` samples of ``seq_q`` queries attending to ``seq_k`` keys."""
    return float(spec.block_forward_flops(batch, seq_q, seq_k))


def logits_flops(spec: ModelSpec, batch: int, seq: int) -> float:
    """Forward FLOPs of the output projection for ``batch`` samples of ``seq`` tokens."""
    return float(spec.logits_forward_flops(batch, seq))


__all__ = ["RECOMPUTE_KINDS", "ModelSpec", "block_flops", "logits_flops"]
