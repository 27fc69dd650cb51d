"""What the planner needs to know about a model: ``ModelSpec`` (a decoder-only transformer's sizes) or a list of
``plait.planner.profile.LayerProfile`` (any model, measured block by block with ``profile_layers``).

A model may be given by name (``NAMED``: GPT-2 sizes, GPT-3 175B, Llama 1/2/3), by a Hugging Face
``config.json`` path (read as JSON by ``hf_config.py``; transformers is not needed), by a transformers model or its config (read
through ``config.to_dict()``, the same keys), by a ``GPTConfig``, or by a plait ``GPT``.

``ModelSpec`` itself (sizes, parameter count, FLOPs per token) lives in ``plait.models.spec``, the one model
description that metrics, the reference GPT and the planner share; it is imported here so that
``from plait.planner.models import ModelSpec`` keeps working.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from plait.errors import ConfigError
from plait.models.spec import ModelSpec
from plait.planner.profile import LayerProfile

GPT_DROPOUT = 0.1
"""GPT-2's and GPT-3's dropout (Radford et al. 2019's released configs; Megatron-LM's default): the masks count."""


def _gpt2(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    return ModelSpec(
        name, layers, hidden, heads, 4 * hidden, 50257, 1024, tied_embeddings=True, learned_positions=True, bias=True,
        dropout=GPT_DROPOUT,
    )  # fmt: skip


def _llama(name: str, layers: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int, seq: int) -> ModelSpec:
    return ModelSpec(name, layers, hidden, heads, ffn, vocab, seq, kv_heads=kv, gated=True)


NAMED: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        # Radford et al. 2019 (GPT-2), Table 2; vocab 50257, context 1024.
        _gpt2("gpt2", 12, 768, 12),
        _gpt2("gpt2-medium", 24, 1024, 16),
        _gpt2("gpt2-large", 36, 1280, 20),
        _gpt2("gpt2-xl", 48, 1600, 25),
        # Brown et al. 2020 (GPT-3), Table 2.1: 96 layers, d_model 12288, 96 heads, context 2048.
        ModelSpec(
            "gpt3-175b",
            96,
            12288,
            96,
            4 * 12288,
            50257,
            2048,
            tied_embeddings=True,
            learned_positions=True,
            bias=True,
            dropout=GPT_DROPOUT,
        ),  # fmt: skip
        # Touvron et al. 2023 (LLaMA), Table 2 (no dropout); Llama 2 (Touvron et al. 2023b) for 70B (GQA, 8 kv heads).
        _llama("llama-7b", 32, 4096, 32, 32, 11008, 32000, 2048),
        _llama("llama-13b", 40, 5120, 40, 40, 13824, 32000, 2048),
        _llama("llama-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
        # Llama 3 herd of models (Dubey et al. 2024), Table 3; vocab 128256, context 8192.
        _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
        _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
        _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192),
    )
}


def resolve_model(model: Any, seq: int | None = None) -> ModelSpec | list[LayerProfile]:
    """A ``ModelSpec`` (or a list of ``LayerProfile``) from a name, a config.json path, a transformers model or
    config, a GPTConfig, a GPT, a ModelSpec or a profile list; ``seq`` overrides the context length of a spec."""
    from plait.models import GPT, GPTConfig
    from plait.models.hf import is_hf_model
    from plait.planner.hf_config import from_hf_config, spec_from_hf_dict

    if isinstance(model, ModelSpec):
        return model.with_seq(seq)
    if isinstance(model, list) and model and all(isinstance(item, LayerProfile) for item in model):
        return model
    if isinstance(model, GPT):
        model = model.config
    if is_hf_model(model):  # a transformers model or its PretrainedConfig: the same keys as its config.json
        config = model if hasattr(model, "to_dict") and not isinstance(model, nn.Module) else model.config
        return spec_from_hf_dict(
            config.to_dict(),
            f"{type(config).__name__} of {type(model).__name__}",
            str(getattr(config, "model_type", "") or type(model).__name__),
            seq,
        )
    if isinstance(model, GPTConfig):
        return ModelSpec.from_gpt_config(model).with_seq(seq)
    if isinstance(model, (str, Path)):
        key = str(model).lower()
        if key in NAMED:
            return NAMED[key].with_seq(seq)
        if str(model).endswith(".json") or Path(model).is_file():
            return from_hf_config(model, seq)
        raise ConfigError(
            f"unknown model {model!r}. Fix: use one of {', '.join(NAMED)}, a Hugging Face "
            f"config.json path, a GPTConfig, a plait GPT or a transformers model."
        )
    raise ConfigError(
        f"cannot plan for a {type(model).__name__}. Fix: pass a model name, a config.json path, a "
        f"GPTConfig, a GPT, a transformers model or config, a ModelSpec, or "
        f"profile_layers(blocks, example)."
    )


__all__ = [
    "ModelSpec",
    "NAMED",
    "resolve_model",
]
