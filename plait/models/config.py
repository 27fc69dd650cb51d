"""`GPTConfig`: the hyper-parameters of the reference decoder-only transformer, validated on construction."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

POSITION_KINDS = ("learned", "rope")
NORM_KINDS = ("layernorm", "rmsnorm")
MLP_KINDS = ("gelu", "swiglu")
ROUTER_SCORES = ("softmax", "sigmoid")
BALANCE_KINDS = ("aux_loss", "aux_free", "none")


@dataclass
class GPTConfig:
    """Sizes and architecture switches of `plait.models.GPT` (GPT-2 style by default, Llama style via presets).

    Mixture-of-Experts (``n_experts > 0``; ``plait.models.moe``, docs/expert_parallel.md): the feed-forward of the
    blocks ``moe_start, moe_start + moe_every, ...`` becomes ``n_experts`` routed experts of width ``moe_d_ff``
    (default ``ffn_dim``), of which each token uses ``top_k``, plus ``n_shared_experts`` always-on experts (one MLP
    of width ``n_shared_experts x moe_d_ff``). The router scores experts with a softmax or a sigmoid
    (``router_score``) and, with ``router_norm_topk``, rescales the k chosen weights to sum to 1. Load balancing
    (``moe_balance``): "aux_loss" (DeepSeek-V3's sequence-wise balance loss times ``aux_loss_coef``), "aux_free"
    (DeepSeek-V3's per-expert selection bias, moved by ``bias_update_rate`` after each step) or "none".
    ``capacity_factor``: None routes every token (dropless); a number caps each expert at
    ceil(capacity_factor x T x top_k / n_experts) tokens of each sequence of T tokens and drops the rest (counted).
    """

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
    n_experts: int = 0
    top_k: int = 2
    n_shared_experts: int = 0
    moe_d_ff: int | None = None
    moe_start: int = 0
    moe_every: int = 1
    router_score: str = "softmax"
    router_norm_topk: bool = True
    moe_balance: str = "aux_loss"
    aux_loss_coef: float = 0.01
    bias_update_rate: float = 0.001
    capacity_factor: float | None = None

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
        self._check_experts()

    def _check_experts(self) -> None:
        """The Mixture-of-Experts fields (class docstring); nothing is checked beyond the type of n_experts when 0."""
        if isinstance(self.n_experts, bool) or not isinstance(self.n_experts, int) or self.n_experts < 0:
            raise ValueError(f"n_experts={self.n_experts!r} must be 0 (a dense model) or a positive integer.")
        if self.n_experts == 0:
            return
        _require_positive_int("top_k", self.top_k)
        if self.top_k > self.n_experts:
            raise ValueError(
                f"top_k={self.top_k} exceeds n_experts={self.n_experts}: each token chooses top_k distinct experts. "
                f"Fix: top_k <= {self.n_experts}."
            )
        if isinstance(self.n_shared_experts, bool) or not isinstance(self.n_shared_experts, int):
            raise ValueError(f"n_shared_experts={self.n_shared_experts!r} must be an integer >= 0.")
        if self.n_shared_experts < 0:
            raise ValueError(f"n_shared_experts={self.n_shared_experts} must be >= 0.")
        if self.moe_d_ff is not None:
            _require_positive_int("moe_d_ff", self.moe_d_ff, "or None for ffn_dim")
        if isinstance(self.moe_start, bool) or not isinstance(self.moe_start, int) or not 0 <= self.moe_start:
            raise ValueError(f"moe_start={self.moe_start!r} must be a block index >= 0.")
        if self.moe_start >= self.n_layer:
            raise ValueError(
                f"moe_start={self.moe_start} leaves no MoE block in n_layer={self.n_layer} blocks. "
                f"Fix: moe_start < {self.n_layer}, or n_experts=0 for a dense model."
            )
        _require_positive_int("moe_every", self.moe_every)
        _require_choice("router_score", self.router_score, ROUTER_SCORES)
        _require_choice("moe_balance", self.moe_balance, BALANCE_KINDS)
        if not isinstance(self.router_norm_topk, bool):
            raise ValueError(f"router_norm_topk={self.router_norm_topk!r} must be true or false.")
        for name in ("aux_loss_coef", "bias_update_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}={value!r} must be a finite number >= 0.")
        factor = self.capacity_factor
        if factor is not None and (
            isinstance(factor, bool) or not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0)
        ):
            raise ValueError(
                f"capacity_factor={factor!r} must be a positive number, or None for dropless routing (every token "
                f"reaches its experts)."
            )

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

    @property
    def expert_ffn_dim(self) -> int:
        """Hidden width of one routed expert: moe_d_ff if set, else ``ffn_dim``."""
        return self.moe_d_ff if self.moe_d_ff is not None else self.ffn_dim

    def is_moe_layer(self, index: int) -> bool:
        """Whether block ``index`` has a Mixture-of-Experts feed-forward (blocks moe_start, +moe_every, ...)."""
        return self.n_experts > 0 and index >= self.moe_start and (index - self.moe_start) % self.moe_every == 0

    @property
    def moe_layers(self) -> list[int]:
        """The indices of the MoE blocks, in order ([] for a dense model)."""
        return [index for index in range(self.n_layer) if self.is_moe_layer(index)]

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
