"""`GPTConfig`: the hyper-parameters of the reference decoder-only transformer, validated on construction."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

POSITION_KINDS = ("learned", "rope")
NORM_KINDS = ("layernorm", "rmsnorm")
MLP_KINDS = ("gelu", "swiglu")


@dataclass
class GPTConfig:
    """Sizes and architecture switches of `plait.models.GPT` (GPT-2 style by default, Llama style via presets)."""

    vocab_size: int = 16
    seq_len: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int | None = None
    d_model: int = 64
    d_ff: int | None = None
    position: str = "learned"
    norm: str = "layernorm"
    mlp: str = "gelu"
    bias: bool = True
    dropout: float = 0.0
    init_std: float = 0.02
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            _require_positive_int(name, getattr(self, name))
        for name in ("n_kv_head", "d_ff"):
            if getattr(self, name) is not None:
                _require_positive_int(name, getattr(self, name), "or None for the default")
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_head={self.n_head}: "
                f"pick d_model a multiple of n_head (e.g. d_model={self.n_head * max(1, self.d_model // self.n_head)})."
            )
        if self.n_head % self.kv_heads != 0:
            raise ValueError(
                f"n_kv_head={self.n_kv_head} does not divide n_head={self.n_head}: "
                f"use a divisor of n_head (e.g. 1 or {self.n_head}) or None for n_head."
            )
        _require_choice("position", self.position, POSITION_KINDS)
        _require_choice("norm", self.norm, NORM_KINDS)
        _require_choice("mlp", self.mlp, MLP_KINDS)
        if self.position == "rope" and self.head_dim % 2 != 0:
            raise ValueError(
                f"position='rope' needs an even head_dim, got head_dim=d_model/n_head={self.head_dim}: "
                "change d_model or n_head so that d_model/n_head is even."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} is outside [0, 1): use e.g. 0.0 (no dropout) or 0.1.")
        for name in ("init_std", "rope_theta"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value!r} must be a positive finite number.")

    @property
    def head_dim(self) -> int:
        """Width of one attention head: d_model / n_head."""
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads (n_kv_head resolved: None means n_head, i.e. plain multi-head attention)."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def ffn_dim(self) -> int:
        """Hidden width of the MLP: d_ff if set, else 4*d_model (gelu) or 8*d_model/3 rounded up to 8 (swiglu)."""
        if self.d_ff is not None:
            return self.d_ff
        if self.mlp == "swiglu":
            return -(-int(8 * self.d_model / 3) // 8) * 8
        return 4 * self.d_model

    @classmethod
    def tiny(cls, **overrides: Any) -> GPTConfig:
        """The defaults: a 2-layer, 64-wide GPT-2 style model for tests and CPU demos."""
        return cls(**overrides)

    @classmethod
    def llama_style(cls, **overrides: Any) -> GPTConfig:
        """Llama-style switches (rope, rmsnorm, swiglu, no biases) on top of the defaults, then `overrides`."""
        fields: dict[str, Any] = {"position": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False}
        fields.update(overrides)
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        """A plain dict of the fields (round-trips through `from_dict`, TOML and JSON)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GPTConfig:
        """Build from a plain dict of fields; unknown keys raise a ValueError listing the valid ones."""
        valid = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(valid))
        if unknown:
            raise ValueError(f"unknown GPTConfig field(s) {unknown}: valid fields are {valid}.")
        return cls(**values)


def _require_positive_int(name: str, value: Any, alternative: str = "") -> None:
    """Raise a ValueError naming `name` unless `value` is an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        hint = f" {alternative}" if alternative else ""
        raise ValueError(f"{name}={value!r} must be a positive integer (>= 1){hint}.")


def _require_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """Raise a ValueError naming `name` unless `value` is one of `choices`."""
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported: use one of {list(choices)}.")
