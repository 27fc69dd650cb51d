"""The reference decoder-only transformer (GPT-2 or Llama style) and its language-modelling loss.

`GPT` knows nothing of parallelism, but tolerates being cut into pipeline stages: any of `tok_embed`, `pos_embed`,
`norm_f`, `lm_head` may be set to None and entries of `blocks` deleted; parameter names stay those of the full model.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from plait.models.config import GPTConfig
from plait.models.layers import MLP, Attention, Block, RMSNorm, make_norm
from plait.models.moe import GroupedExperts
from plait.models.spec import ModelSpec

__all__ = ["GPT", "GPTConfig"]


class GPT(nn.Module):
    """Token (+ learned position) embedding, `n_layer` pre-norm blocks, final norm and an untied LM head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embed: nn.Embedding | None = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_embed: nn.Embedding | None = (
            nn.Embedding(config.seq_len, config.d_model) if config.position == "learned" else None
        )
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleDict({str(index): Block(config, index) for index in range(config.n_layer)})
        self.norm_f: nn.Module | None = make_norm(config)
        self.lm_head: nn.Linear | None = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init: weights ~ N(0, init_std), biases 0, norm weights 1; attn.o and mlp.down use
        init_std / sqrt(2 * n_layer) so that the residual stream's variance does not grow with depth (so do the
        routed experts' w_down and the shared experts' down; the router is a Linear like the others)."""
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.n_layer)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, (nn.LayerNorm, RMSNorm)):
                if module.weight is not None:
                    nn.init.ones_(module.weight)
                bias = getattr(module, "bias", None)
                if isinstance(bias, torch.Tensor):
                    nn.init.zeros_(bias)
        for module in self.modules():
            if isinstance(module, Attention):
                nn.init.normal_(module.o.weight, mean=0.0, std=residual_std)
            elif isinstance(module, MLP):
                nn.init.normal_(module.down.weight, mean=0.0, std=residual_std)
            elif isinstance(module, GroupedExperts):
                module.reset_parameters(std, residual_std)

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """Token ids [B, T] (or hidden states [B, T, d_model] when `tok_embed` is None) -> logits [B, T, vocab]
        (or hidden states when `lm_head` is None). `positions` [T] (default arange(T)) are the tokens' absolute
        positions, used by learned position embeddings and by RoPE; per-row positions [B, T] are those of packed
        documents (restarting at 0 at each document, ``plait.models.inputs``): embeddings and RoPE restart with
        them and attention never crosses a document boundary (``layers.document_mask``)."""
        length = x.shape[1]
        if positions is None:
            positions = torch.arange(length, device=x.device)
        if self.tok_embed is not None:
            hidden = self.tok_embed(x)
            if self.pos_embed is not None:
                hidden = hidden + self.pos_embed(positions)
            hidden = self.drop(hidden)
        else:
            hidden = x
        for key in sorted(self.blocks.keys(), key=int):
            hidden = self.blocks[key](hidden, positions)
        if self.norm_f is not None:
            hidden = self.norm_f(hidden)
        if self.lm_head is not None:
            return self.lm_head(hidden)
        return hidden

    def num_parameters(self) -> int:
        """Number of parameters this module holds (only the present parts, for a pipeline stage)."""
        return sum(parameter.numel() for parameter in self.parameters())

    def spec(self) -> ModelSpec:
        """The model description of the whole model (``plait.models.spec``: sizes, parameters, FLOPs)."""
        return ModelSpec.from_gpt_config(self.config)

    def flops_per_token(self) -> int:
        """Model FLOPs of one trained token at context ``seq_len`` through the parts this module holds (the present
        blocks, and the LM head if present): ``ModelSpec.flops_per_token`` (Narayanan et al. 2021, eq. 3; forward +
        backward = 3 x forward; recomputation excluded, Chowdhery et al. 2022 app. B). Embedding lookups cost no
        FLOPs, so summing over pipeline stages gives the full model's figure."""
        indices = [int(key) for key in self.blocks.keys()]  # a stage's own blocks (MoE and dense ones differ)
        return 3 * self.spec().forward_flops_per_token(block_indices=indices, logits=self.lm_head is not None)
