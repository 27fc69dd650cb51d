"""What the planner needs to know about a model: ``ModelSpec`` (a decoder-only transformer's sizes) or a list of
``LayerProfile`` (any model, measured block by block with ``profile_layers``).

A model may be given by name (``NAMED``: GPT-2 sizes, GPT-3 175B, Llama 1/2/3), by a Hugging Face
``config.json`` path (read as JSON; transformers is not needed), by a transformers model or its config (read
through ``config.to_dict()``, the same keys), by a ``GPTConfig``, or by a plait ``GPT``.

``ModelSpec`` itself (sizes, parameter count, FLOPs per token) lives in ``plait.models.spec``, the one model
description that metrics, the reference GPT and the planner share; it is imported here so that
``from plait.planner.models import ModelSpec`` keeps working.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait.errors import ConfigError
from plait.models.spec import ModelSpec


@dataclass(frozen=True)
class LayerProfile:
    """One block of any model, measured for one sample: forward matmul FLOPs, parameters, bytes saved for
    backward, and bytes of its output (what a pipeline stage boundary after it sends)."""

    name: str
    flops: float
    parameters: int
    activation_bytes: float
    output_bytes: float


def _gpt2(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    return ModelSpec(
        name, layers, hidden, heads, 4 * hidden, 50257, 1024, tied_embeddings=True, learned_positions=True, bias=True
    )


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
            "gpt3-175b", 96, 12288, 96, 4 * 12288, 50257, 2048, tied_embeddings=True, learned_positions=True, bias=True
        ),
        # Touvron et al. 2023 (LLaMA), Table 2; Llama 2 (Touvron et al. 2023b) for 70B (GQA, 8 kv heads).
        _llama("llama-7b", 32, 4096, 32, 32, 11008, 32000, 2048),
        _llama("llama-13b", 40, 5120, 40, 40, 13824, 32000, 2048),
        _llama("llama-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
        # Llama 3 herd of models (Dubey et al. 2024), Table 3; vocab 128256, context 8192.
        _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
        _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
        _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192),
    )
}


def from_hf_config(path: str | Path) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (GPT-2 or Llama-family keys) without importing transformers."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(f"cannot read model config {path}: {error}. Fix: give a Hugging Face config.json.") from error
    return spec_from_hf_dict(data, str(path), path.parent.name or path.stem)


def spec_from_hf_dict(data: dict[str, Any], where: str, default_name: str) -> ModelSpec:
    """A ``ModelSpec`` from the keys of a Hugging Face config (``config.json`` or ``PretrainedConfig.to_dict()``);
    ``where`` names the source in errors."""

    def first(*keys: str, default: Any = None) -> Any:
        for key in keys:
            if data.get(key) is not None:
                return data[key]
        if default is None:
            raise ConfigError(f"{where} has none of {', '.join(keys)}. Fix: give a decoder-only model's config.")
        return default

    hidden = int(first("hidden_size", "n_embd", "d_model"))
    kind = str(data.get("model_type", ""))
    gated = str(first("hidden_act", "activation_function", default="gelu")) in ("silu", "swiglu") or kind in (
        "llama",
        "mistral",
        "qwen2",
        "gemma",
    )
    gpt2 = kind == "gpt2"
    return ModelSpec(
        name=str(data.get("_name_or_path") or default_name),
        layers=int(first("num_hidden_layers", "n_layer")),
        hidden=hidden,
        heads=int(first("num_attention_heads", "n_head")),
        kv_heads=int(first("num_key_value_heads", default=first("num_attention_heads", "n_head"))),
        ffn=int(first("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden)),
        vocab=int(first("vocab_size")),
        seq=int(first("max_position_embeddings", "n_positions", "n_ctx")),
        gated=gated,
        tied_embeddings=bool(data.get("tie_word_embeddings", gpt2)),
        learned_positions=gpt2,
        bias=gpt2,
    )


def resolve_model(model: Any, seq: int | None = None) -> ModelSpec | list[LayerProfile]:
    """A ``ModelSpec`` (or a list of ``LayerProfile``) from a name, a config.json path, a transformers model or
    config, a GPTConfig, a GPT, a ModelSpec or a profile list; ``seq`` overrides the context length of a spec."""
    from plait.models import GPT, GPTConfig
    from plait.models.hf import is_hf_model

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
        ).with_seq(seq)
    if isinstance(model, GPTConfig):
        return ModelSpec.from_gpt_config(model).with_seq(seq)
    if isinstance(model, (str, Path)):
        key = str(model).lower()
        if key in NAMED:
            return NAMED[key].with_seq(seq)
        if str(model).endswith(".json") or Path(model).is_file():
            return from_hf_config(model).with_seq(seq)
        raise ConfigError(
            f"unknown model {model!r}. Fix: use one of {', '.join(NAMED)}, a Hugging Face "
            f"config.json path, a GPTConfig, a plait GPT or a transformers model."
        )
    raise ConfigError(
        f"cannot plan for a {type(model).__name__}. Fix: pass a model name, a config.json path, a "
        f"GPTConfig, a GPT, a transformers model or config, a ModelSpec, or "
        f"profile_layers(blocks, example)."
    )


def profile_layers(blocks: list[nn.Module], example: torch.Tensor) -> list[LayerProfile]:
    """Measure each block on ``example`` (one sample's input, e.g. [1, seq, hidden]): forward FLOPs with
    ``torch.utils.flop_counter``, parameters, bytes autograd saves for backward, output bytes."""
    from torch.utils.flop_counter import FlopCounterMode

    profiles, x = [], example
    for index, block in enumerate(blocks):
        saved: list[int] = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            saved.append(tensor.numel() * tensor.element_size())  # noqa: B023 - called within this iteration
            return tensor

        counter = FlopCounterMode(display=False)
        with counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = block(x)
        params = sum(p.numel() for p in block.parameters())
        profiles.append(
            LayerProfile(
                f"{index}:{type(block).__name__}",
                float(counter.get_total_flops()),
                params,
                float(sum(saved)),
                float(out.numel() * out.element_size()),
            )
        )
        x = out.detach()
    return profiles


__all__ = [
    "LayerProfile",
    "ModelSpec",
    "NAMED",
    "from_hf_config",
    "profile_layers",
    "resolve_model",
    "spec_from_hf_dict",
]
