"""A ``ModelSpec`` from a Hugging Face config (a ``config.json`` read as JSON, or ``PretrainedConfig.to_dict()``),
without importing transformers: the planner only needs the sizes.

Decoder-only dense families, each with the keys its config class uses (transformers' ``configuration_*.py``):

    family        layers / width / heads / kv heads / MLP width / context keys           MLP      positions
    llama & co    num_hidden_layers, hidden_size, num_attention_heads,                   gated    RoPE
                  num_key_value_heads, intermediate_size, max_position_embeddings
    gpt2          n_layer, n_embd, n_head, n_inner (default 4h), n_positions             GELU     learned
    gpt_neox      as llama, not gated                                                    GELU     RoPE
    opt           num_hidden_layers, hidden_size, num_attention_heads, ffn_dim,          ReLU     learned
                  max_position_embeddings
    bloom         n_layer, hidden_size (n_embed), n_head; MLP 4h; no context key         GELU     ALiBi
    falcon        num_hidden_layers, hidden_size, num_attention_heads, num_kv_heads       GELU     RoPE / ALiBi
                  (or multi_query: 1); MLP ffn_hidden_size or 4h; max_position_embeddings (newer configs)
    mpt           n_layers, d_model, n_heads, expansion_ratio x d_model, max_seq_len      GELU     ALiBi / learned

ALiBi models (BLOOM, MPT with ``attn_config.alibi``, Falcon with ``alibi``) have no trained context length: their
config may have no context key, and they are planned at the sequence length given with ``seq`` (``--seq``);
without it the error names the missing key and the fix. Encoder-decoder and mixture-of-experts configs are refused
(the cost model times dense decoder blocks). ``tie_word_embeddings`` defaults per family as transformers' config
classes do (untied for Llama, Mistral, Qwen2, GPT-NeoX; tied otherwise).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from plait import files
from plait.errors import ConfigError
from plait.planner.models import ModelSpec

GATED = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo", "olmo2", "internlm2", "cohere", "yi"}
)
"""Families whose MLP is gated (SwiGLU / GeGLU: three matrices) whatever their activation key says."""
UNTIED_BY_DEFAULT = frozenset({"llama", "mistral", "qwen2", "qwen3", "gpt_neox", "phi3", "olmo", "olmo2", "internlm2"})
BIASED = frozenset({"gpt2", "gpt_neo", "gpt_neox", "gptj", "bloom", "opt", "phi", "gpt_bigcode", "starcoder2"})
LEARNED_POSITIONS = frozenset({"gpt2", "gpt_neo", "opt", "gpt_bigcode"})
ALIBI = frozenset({"bloom"})
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length", "max_sequence_length")
DROPOUT_KEYS = (
    "resid_pdrop", "attn_pdrop", "embd_pdrop", "hidden_dropout", "attention_dropout", "hidden_dropout_prob",
    "attention_probs_dropout_prob", "dropout", "residual_dropout",
)  # fmt: skip
"""Keys of a config's dropout probabilities (GPT-2, BLOOM, OPT, Llama, MPT's attn_config, ...): the largest is used."""
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def from_hf_config(path: str | Path, seq: int | None = None) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (module docstring); ``seq`` is the sequence length to plan at (needed
    when the config has no context length, as ALiBi models)."""
    path = Path(path)
    if files.file_problem(path) == "is missing":
        raise ConfigError(f"model config {path} does not exist. Fix: give a Hugging Face config.json.")
    try:  # a regular file only (a FIFO would block), UTF-8, JSON of bounded depth: one line otherwise
        data = json.loads(files.read_text(path, "model config"))
    except (json.JSONDecodeError, RecursionError) as error:
        reason = "nested too deeply" if isinstance(error, RecursionError) else str(error)
        raise ConfigError(f"cannot read model config {path}: {reason}. Fix: give a Hugging Face config.json.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} holds a JSON {type(data).__name__}, not an object. Fix: give a config.json.")
    return spec_from_hf_dict(data, str(path), path.parent.name or path.stem, seq)


def spec_from_hf_dict(data: dict[str, Any], where: str, default_name: str, seq: int | None = None) -> ModelSpec:
    """A ``ModelSpec`` from the keys of a Hugging Face config; ``where`` names the source in errors."""
    kind = str(data.get("model_type", "")).lower()
    if data.get("is_encoder_decoder"):
        raise ConfigError(
            f"{where} describes an encoder-decoder model ({kind or 'model_type unknown'}). Fix: the planner "
            f"costs decoder-only transformers; give a causal LM's config (GPT-2, Llama, Mistral, Qwen2, BLOOM, ...)."
        )
    experts = [key for key in MOE_KEYS if isinstance(data.get(key), int) and data[key] > 1]
    if experts:
        raise ConfigError(
            f"{where} is a mixture-of-experts model ({experts[0]}={data[experts[0]]}). Fix: the planner costs dense "
            f"decoder blocks only; give a dense model's config."
        )

    def first(what: str, *keys: str, default: Any = None) -> Any:
        for key in keys:
            if data.get(key) is not None:
                return data[key]
        if default is None:
            raise ConfigError(
                f"{where} ({kind or 'no model_type'}) has no {what}: none of the keys {', '.join(keys)}. Fix: give "
                f"a decoder-only causal LM's config.json that sets one of them."
            )
        return default

    attn: dict[str, Any] = data["attn_config"] if isinstance(data.get("attn_config"), dict) else {}
    alibi = kind in ALIBI or bool(data.get("alibi")) or bool(attn.get("alibi"))
    hidden = int(first("hidden width", "hidden_size", "n_embd", "n_embed", "d_model"))
    heads = int(first("attention head count", "num_attention_heads", "n_head", "n_heads"))
    if data.get("multi_query") and data.get("num_kv_heads") is None:
        kv = 1
    else:
        kv = int(first("kv head count", "num_key_value_heads", "num_kv_heads", "n_head_kv", default=heads))
    ratio = data.get("expansion_ratio")
    ffn_default = int(ratio * hidden) if isinstance(ratio, (int, float)) else 4 * hidden
    context = next((data[key] for key in CONTEXT_KEYS if data.get(key) is not None), None)
    if seq is None and context is None:
        reason = " (it uses ALiBi position biases, so no context length is trained in)" if alibi else ""
        raise ConfigError(
            f"{where} ({kind or 'no model_type'}) has no context length: none of {', '.join(CONTEXT_KEYS)}{reason}. "
            f"Fix: give the sequence length to plan at: --seq N (plan(..., seq=N))."
        )
    activation = str(first("activation", "hidden_act", "activation_function", "hidden_activation", default="gelu"))
    no_bias = data.get("no_bias")
    bias = (not no_bias) if isinstance(no_bias, bool) else bool(data.get("bias", kind in BIASED))
    spec = ModelSpec(
        name=str(data.get("_name_or_path") or default_name),
        layers=int(first("layer count", "num_hidden_layers", "n_layer", "n_layers", "num_layers")),
        hidden=hidden,
        heads=heads,
        kv_heads=kv,
        ffn=int(first("MLP width", "intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", default=ffn_default)),
        vocab=int(first("vocabulary size", "vocab_size", "padded_vocab_size")),
        seq=int(seq if seq is not None else str(context)),
        gated=kind in GATED or activation in ("silu", "swiglu", "swish"),
        tied_embeddings=bool(data.get("tie_word_embeddings", kind not in UNTIED_BY_DEFAULT)),
        learned_positions=kind in LEARNED_POSITIONS or (kind == "mpt" and not alibi),
        bias=bias,
        dropout=_dropout(data, attn),
    )
    return spec


def _dropout(data: dict[str, Any], attn: dict[str, Any]) -> float:
    """The largest dropout probability a config sets (0.0 when it sets none): the masks it keeps in training."""
    values = [
        float(source[key])
        for source in (data, attn)
        for key in DROPOUT_KEYS
        if isinstance(source.get(key), (int, float)) and not isinstance(source.get(key), bool)
    ]
    return max((v for v in values if 0.0 <= v < 1.0), default=0.0)


__all__ = ["ALIBI", "DROPOUT_KEYS", "GATED", "from_hf_config", "spec_from_hf_dict"]
