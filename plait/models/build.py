"""``build_model``: the model a run configuration's ``[model]`` section describes, sized to its data.

The section is the same in ``plait train`` and ``plait ps`` (``RunConfig.model``): the reference GPT's
``GPTConfig`` fields, where ``vocab_size`` and ``seq_len`` default to the data's. A model smaller than its data
(fewer positions than a sample's tokens, or fewer embeddings than the data's vocabulary) is refused with a
``ConfigError`` naming both, before any weight is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from plait.errors import ConfigError
from plait.models.config import GPTConfig
from plait.models.gpt import GPT


def model_config(section: Mapping[str, Any], vocab_size: int, seq_len: int) -> GPTConfig:
    """The ``GPTConfig`` of ``section`` for data of ``vocab_size`` symbols in samples of ``seq_len`` tokens."""
    fields = {"vocab_size": vocab_size, "seq_len": seq_len, **section}
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


def build_model(section: Mapping[str, Any], vocab_size: int, seq_len: int) -> nn.Module:
    """The model of ``section`` (see ``model_config``), freshly initialised from torch's current random state."""
    return GPT(model_config(section, vocab_size, seq_len))


__all__ = ["build_model", "model_config"]
