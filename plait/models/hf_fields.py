"""The sizes of a Hugging Face ``config.json``, checked before transformers or plait's planner reads them.

A config.json is data someone else wrote. transformers builds a model from whatever sizes it holds and fails deep
inside for the ones that cannot work: ``num_attention_heads=0`` divides by zero, a negative ``hidden_size`` asks
torch for a tensor of negative size, ``decoder_sparse_step=0`` takes a modulo by zero, ``num_experts_per_tok``
above the expert count fails at the first forward, a float or a bool (a bool is an int to Python) where a count
belongs fails transformers' own type check or silently becomes 1. ``check_fields`` refuses each of them in one line
naming the key and the fix, for training (``plait.models.hf_load.read_config``) and planning
(``plait.planner.hf_config``) alike:

- every size key present (``POSITIVE_KEYS``, ``COUNT_KEYS``: layers, width, heads, MLP width, vocabulary, context,
  experts, ...) is a whole number (not a bool, not a float) from 1 (0 for counts that may be none) to
  ``MAX_SIZE``, the largest dimension whose products with another stay inside torch's 64-bit element counts;
- the width splits into the heads (unless ``head_dim`` sets the heads' width), the key/value heads divide the heads;
- a Mixture-of-Experts config's top-k lies in 1..experts; families whose every block is sparse (``ALL_SPARSE``)
  need experts at all.

A key that is absent or null keeps transformers' default.
"""

from __future__ import annotations

from typing import Any

from plait.errors import ConfigError

MAX_SIZE = 2**31 - 1
"""The largest size accepted: two such dimensions multiply to under 2^62, inside torch's int64 element counts."""
LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
WIDTH_KEYS = ("hidden_size", "n_embd", "n_embed", "d_model")
HEAD_KEYS = ("num_attention_heads", "n_head", "n_heads")
KV_HEAD_KEYS = ("num_key_value_heads", "num_kv_heads", "n_head_kv")
MLP_KEYS = ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", "moe_intermediate_size")
VOCAB_KEYS = ("vocab_size", "padded_vocab_size")
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length", "max_sequence_length")
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
"""Keys of a config's routed expert count (Mixtral; Qwen-MoE, OLMoE; DeepSeek; others)."""
TOP_K_KEYS = ("num_experts_per_tok", "moe_top_k", "num_experts_per_token", "top_k")
"""Keys of the experts each token is routed to (``top_k`` last: older configs use it for sampling too)."""
POSITIVE_KEYS = (
    *LAYER_KEYS, *WIDTH_KEYS, *HEAD_KEYS, *KV_HEAD_KEYS, *MLP_KEYS, *VOCAB_KEYS, *CONTEXT_KEYS, "head_dim",
    "decoder_sparse_step", "moe_layer_freq",
)  # fmt: skip
"""Sizes that are at least 1 when present."""
COUNT_KEYS = (
    *MOE_KEYS,
    *TOP_K_KEYS[:3],
    "first_k_dense_replace",
    "n_shared_experts",
    "shared_expert_intermediate_size",
)
"""Counts that may be 0 when present (a Qwen-MoE config with 0 experts is dense)."""
ALL_SPARSE = frozenset({"mixtral", "olmoe"})
"""Families whose every block routes to experts (transformers builds them with no dense MLP)."""


def _first(fields: dict[str, Any], keys: tuple[str, ...]) -> tuple[str, int] | None:
    """The first of ``keys`` set (not null) in ``fields``, with its (checked) value."""
    key = next((k for k in keys if fields.get(k) is not None), None)
    return None if key is None else (key, fields[key])


def check_fields(fields: dict[str, Any], where: str) -> None:
    """ConfigError (one line, naming ``where``, the key and the fix) for a size of ``fields`` that no model can
    have (module docstring)."""
    for keys, low in ((POSITIVE_KEYS, 1), (COUNT_KEYS, 0)):
        for key in keys:
            value = fields.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_SIZE:
                raise ConfigError(
                    f"{where}: {key}={value!r} must be a whole number from {low} to {MAX_SIZE} (not a float or a "
                    f"bool). Fix: correct {key} in the config.json."
                )
    width, heads, kv = _first(fields, WIDTH_KEYS), _first(fields, HEAD_KEYS), _first(fields, KV_HEAD_KEYS)
    if width and heads and fields.get("head_dim") is None and width[1] % heads[1]:
        raise ConfigError(
            f"{where}: {width[0]}={width[1]} does not split into {heads[0]}={heads[1]} heads. Fix: a width that is a "
            f"multiple of the head count (or set head_dim)."
        )
    if heads and kv and heads[1] % kv[1]:
        raise ConfigError(
            f"{where}: {kv[0]}={kv[1]} does not divide {heads[0]}={heads[1]}: each key/value head serves a whole "
            f"group of query heads. Fix: a key/value head count that divides the head count."
        )
    _check_experts(fields, where)


def _check_experts(fields: dict[str, Any], where: str) -> None:
    """A Mixture-of-Experts config's top-k lies in 1..experts; an always-sparse family has experts."""
    experts, top_k = _first(fields, MOE_KEYS), _first(fields, TOP_K_KEYS)
    kind = str(fields.get("model_type", ""))
    count = experts[1] if experts else 0
    if count == 0 and kind not in ALL_SPARSE:
        return  # a dense model (Qwen-MoE with no experts is one)
    k = top_k[1] if top_k else None
    if experts is None or isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= count:
        have = f"{count} experts ({experts[0]})" if experts else f"no expert count ({', '.join(MOE_KEYS)})"
        said = f"{top_k[0]}={k!r}" if top_k else "no top-k key"
        raise ConfigError(
            f"{where} ({kind or 'no model_type'}) has {have} but {said}: each token's experts must number 1.."
            f"{count or 'experts'}. Fix: set num_experts_per_tok in the config (and the expert count, "
            f"{MOE_KEYS[0]} or num_experts, at least as large)."
        )


__all__ = ["ALL_SPARSE", "CONTEXT_KEYS", "MAX_SIZE", "MOE_KEYS", "TOP_K_KEYS", "check_fields"]
