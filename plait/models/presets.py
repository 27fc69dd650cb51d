"""Reference GPT presets by name: ``[model] preset = "gpt2-small"`` (other ``[model]`` keys override its fields).

The sizes are those of the published models; the vocabulary and the context are not part of a preset (they come
from the run's data unless ``vocab_size`` / ``seq_len`` are given). Parameter counts differ slightly from the
originals: plait's GPT has an untied LM head (V d more parameters than GPT-2) and no biases in the Llama style.

- GPT-2 (Radford et al. 2019, Table 2; the "small" ... "xl" of the Hugging Face configs): learned positions,
  LayerNorm with biases, GELU MLP of 4 d.
- Llama style (Touvron et al. 2023): RoPE, RMSNorm, SwiGLU, no biases. ``llama-style-125m`` and ``-350m`` are the
  GPT-3 paper's 125M / 350M shapes (Brown et al. 2020, Table 2.1) with Llama's switches; ``llama-style-1b`` is
  Llama 3.2 1B's shape (16 layers, d 2048, 32 heads, 8 key/value heads, SwiGLU width 8192, rope theta 500000).
- ``tiny``: plait's test and demo model (2 layers, d 64, 4 heads).
- ``small-moe``: the ``stdlib-lm`` run's GPT (4 layers, d 128, 4 heads, GELU MLP of 4 d = 512) with a
  Mixture-of-Experts feed-forward in every block: 8 experts of width 256, top-2, so a token goes through the same
  512-wide feed-forward as the dense model's (and its router: 128 x 8 more per block); 4 x the feed-forward
  parameters in all. Balanced by the sequence-wise auxiliary loss (plait's default), dropless
  (docs/expert_parallel.md).
"""

from __future__ import annotations

from typing import Any

from plait.errors import ConfigError

_GPT2 = {"position": "learned", "norm": "layernorm", "mlp": "gelu", "bias": True}
_LLAMA = {"position": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"n_layer": 2, "n_head": 4, "d_model": 64},
    "gpt2-small": {**_GPT2, "n_layer": 12, "n_head": 12, "d_model": 768},
    "gpt2-medium": {**_GPT2, "n_layer": 24, "n_head": 16, "d_model": 1024},
    "gpt2-large": {**_GPT2, "n_layer": 36, "n_head": 20, "d_model": 1280},
    "gpt2-xl": {**_GPT2, "n_layer": 48, "n_head": 25, "d_model": 1600},
    "llama-style-125m": {**_LLAMA, "n_layer": 12, "n_head": 12, "d_model": 768},
    "llama-style-350m": {**_LLAMA, "n_layer": 24, "n_head": 16, "d_model": 1024},
    "llama-style-1b": {
        **_LLAMA,
        "n_layer": 16,
        "n_head": 32,
        "n_kv_head": 8,
        "d_model": 2048,
        "d_ff": 8192,
        "rope_theta": 500000.0,
    },
    "small-moe": {"n_layer": 4, "n_head": 4, "d_model": 128, "n_experts": 8, "top_k": 2, "moe_d_ff": 256},
}
"""Preset name -> GPTConfig fields (without vocab_size and seq_len)."""


def preset_fields(name: Any) -> dict[str, Any]:
    """The GPTConfig fields of preset ``name`` (a copy); ConfigError naming the presets for an unknown one."""
    if not isinstance(name, str) or name not in PRESETS:
        raise ConfigError(f"model.preset={name!r} is unknown. Fix: use one of {', '.join(PRESETS)}.")
    return dict(PRESETS[name])


__all__ = ["PRESETS", "preset_fields"]
