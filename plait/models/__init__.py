"""Reference models: a GPT/Llama-style decoder-only transformer that knows nothing of parallelism."""

from plait.models.config import GPTConfig
from plait.models.gpt import GPT
from plait.models.layers import (
    MLP,
    Attention,
    Block,
    RMSNorm,
    ScaledDotProductAttention,
    apply_rotary,
    make_norm,
)
from plait.models.loss import lm_loss
from plait.models.spec import ModelSpec

__all__ = [
    "GPT",
    "GPTConfig",
    "ModelSpec",
    "lm_loss",
    "Attention",
    "Block",
    "MLP",
    "RMSNorm",
    "ScaledDotProductAttention",
    "apply_rotary",
    "make_norm",
]
