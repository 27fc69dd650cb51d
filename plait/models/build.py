"""``build_model``: the model a run configuration's ``[model]`` section describes, sized to its data.

The section is the same in ``plait train`` and ``plait ps`` (``RunConfig.model``), one of:

- the reference GPT: ``GPTConfig`` fields, optionally on top of a named ``preset`` (``plait.models.presets``;
  the other keys override the preset's fields); ``vocab_size`` and ``seq_len`` default to the data's;
- a Hugging Face causal LM: ``hf = "FOLDER"`` (a ``save_pretrained`` folder: its weights) or
  ``hf_config = "config.json"`` (fresh weights), from local files only (``plait.models.hf_load``); with
  ``num_hidden_layers = N`` a depth-N slice of it (its first N layers, the same widths).

A model smaller than its data (fewer positions than a sample's tokens, or fewer embeddings than the data's
vocabulary) is refused with a ``ConfigError`` naming both, before any weight is built (for an HF model, right
after its config is read).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from plait.errors import ConfigError
from plait.models.config import GPTConfig
from plait.models.gpt import GPT
from plait.models.presets import preset_fields

HF_SOURCES = ("hf", "hf_config")


def is_hf_section(section: Mapping[str, Any]) -> bool:
    """Whether ``section`` describes a Hugging Face model (``hf`` or ``hf_config``)."""
    return any(key in section for key in HF_SOURCES)


def model_config(section: Mapping[str, Any], vocab_size: int, seq_len: int) -> GPTConfig:
    """The ``GPTConfig`` of ``section`` for data of ``vocab_size`` symbols in samples of ``seq_len`` tokens."""
    fields = dict(section)
    base = preset_fields(fields.pop("preset")) if "preset" in fields else {}
    fields = {"vocab_size": vocab_size, "seq_len": seq_len, **base, **fields}
    try:
        config = GPTConfig.from_dict(fields)
    except ValueError as error:
        raise ConfigError(f"[model] section: {error}") from error
    if config.seq_len < seq_len or config.vocab_size < vocab_size:
        raise ConfigError(
            f"the model (seq_len={config.seq_len}, vocab_size={config.vocab_size}) is smaller than the "
            f"data (seq_len={seq_len}, vocab_size={vocab_size}). Fix: drop model.seq_len/vocab_size "
            f"to take them from the data."
        )
    return config


def check_model_section(section: Mapping[str, Any], vocab_size: int, seq_len: int) -> None:
    """The errors ``build_model`` would raise that need no weights (before any process starts): GPT fields and
    presets, and an HF model's files (a folder with safetensors weights, or a readable config.json)."""
    if not is_hf_section(section):
        model_config(section, vocab_size, seq_len)
        return
    from pathlib import Path

    from plait.models.hf_load import check_weights_folder, section_fields

    if "hf" in section:
        check_weights_folder(Path(str(section["hf"])))
    section_fields(section)  # a readable config.json, and a num_hidden_layers slice it allows


def build_model(section: Mapping[str, Any], vocab_size: int, seq_len: int, weights: bool = True) -> nn.Module:
    """The model of ``section`` (module docstring); fresh weights come from torch's current random state. With
    ``weights=False`` an ``hf`` folder's model gets fresh weights too, its own to be read later (``plait train``
    builds on the meta device and reads each rank's share: ``plait.train.weights.open_weights``)."""
    if is_hf_section(section):
        from plait.models.hf_load import build_hf_model, check_fits

        if "preset" in section:
            raise ConfigError("[model] has both a preset and a Hugging Face model. Fix: keep one of them.")
        model = build_hf_model(section, weights)
        check_fits(model, vocab_size, seq_len)
        return model
    return GPT(model_config(section, vocab_size, seq_len))


__all__ = ["build_model", "check_model_section", "is_hf_section", "model_config"]
