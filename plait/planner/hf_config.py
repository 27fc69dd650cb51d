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

A ``head_dim`` key that is not hidden / heads (Qwen3, Gemma: wider heads than the width divides into) sets
``ModelSpec.attention_head_dim``: q and the attention's output are heads x head_dim wide.

ALiBi models (BLOOM, MPT with ``attn_config.alibi``, Falcon with ``alibi``) have no trained context length: their
config may have no context key, and they are planned at the sequence length given with ``seq`` (``--seq``);
without it the error names the missing key and the fix. Encoder-decoder configs are refused. ``tie_word_embeddings``
defaults per family as transformers' config classes do (untied for Llama, Mistral, Qwen2, GPT-NeoX; tied otherwise).

Mixture-of-Experts families (``moe_fields``), their keys as transformers' config classes name them:

    family            experts / top-k                      expert width / dense width         shared     MoE blocks
    mixtral           num_local_experts, num_experts_per_tok  intermediate_size               -          all
    olmoe             num_experts, num_experts_per_tok     intermediate_size                  -          all
    qwen2_moe         num_experts, num_experts_per_tok     moe_intermediate_size /            shared_expert_intermediate_size
                                                           intermediate_size                  (a multiple of the expert width)
    qwen3_moe         num_experts (num_local_experts)      moe_intermediate_size /            -
                                                           intermediate_size
                      Qwen's MoE blocks: (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers
    deepseek (v1)     n_routed_experts, num_experts_per_tok  moe_intermediate_size /          n_shared_experts
                                                           intermediate_size
                      DeepSeek's MoE blocks: i >= first_k_dense_replace and i % moe_layer_freq == 0

Their MoE blocks must form the pattern ``ModelSpec`` describes (blocks start, start + every, ...: a prefix of dense
blocks, or every n-th block); another pattern, a shared width that is not a whole number of experts and DeepSeek-V2/V3's
multi-head latent attention (``kv_lora_rank``, which ``ModelSpec``'s attention does not describe) are refused with the
reason. Small parameters the spec does not count are left out: Qwen2-MoE's q/k/v biases and shared-expert gate (h + 1
... per block), OLMoE's q/k norms (under 0.1% of the parameters).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from plait import files
from plait.errors import ConfigError
from plait.models.hf_fields import MOE_KEYS, TOP_K_KEYS, check_fields
from plait.planner.models import ModelSpec

GATED = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo", "olmo2", "internlm2", "cohere", "yi"}
    | {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek"}
)
"""Families whose MLP is gated (SwiGLU / GeGLU: three matrices) whatever their activation key says."""
UNTIED_BY_DEFAULT = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gpt_neox", "phi3", "olmo", "olmo2", "internlm2"}
    | {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek"}
)
BIASED = frozenset({"gpt2", "gpt_neo", "gpt_neox", "gptj", "bloom", "opt", "phi", "gpt_bigcode", "starcoder2"})
LEARNED_POSITIONS = frozenset({"gpt2", "gpt_neo", "opt", "gpt_bigcode"})
ALIBI = frozenset({"bloom"})
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length", "max_sequence_length")
DROPOUT_KEYS = (
    "resid_pdrop", "attn_pdrop", "embd_pdrop", "hidden_dropout", "attention_dropout", "hidden_dropout_prob",
    "attention_probs_dropout_prob", "dropout", "residual_dropout",
)  # fmt: skip
"""Keys of a config's dropout probabilities (GPT-2, BLOOM, OPT, Llama, MPT's attn_config, ...): the largest is used."""


def from_hf_config(path: str | Path, seq: int | None = None) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (module docstring); ``seq`` is the sequence length to plan at (needed
    when the config has no context length, as ALiBi models)."""
    path = Path(path)
    if files.file_problem(path) == "is missing":
        raise ConfigError(f"model config {path} does not exist. Fix: give a Hugging Face config.json.")
    try:  # a regular file only (a FIFO would block), UTF-8, JSON of bounded depth: one line otherwise
        data = json.loads(files.read_text(path.resolve(), "model config"))  # the user's path: a link of theirs too
    except (json.JSONDecodeError, RecursionError) as error:
        reason = "nested too deeply" if isinstance(error, RecursionError) else str(error)
        raise ConfigError(f"cannot read model config {path}: {reason}. Fix: give a Hugging Face config.json.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} holds a JSON {type(data).__name__}, not an object. Fix: give a config.json.")
    return spec_from_hf_dict(data, str(path), path.parent.name or path.stem, seq)


def spec_from_hf_dict(data: dict[str, Any], where: str, default_name: str, seq: int | None = None) -> ModelSpec:
    """A ``ModelSpec`` from the keys of a Hugging Face config; ``where`` names the source in errors. Its sizes are
    checked first, as training checks them (``plait.models.hf_fields``)."""
    check_fields(data, where)
    kind = str(data.get("model_type", "")).lower()
    if data.get("is_encoder_decoder"):
        raise ConfigError(
            f"{where} describes an encoder-decoder model ({kind or 'model_type unknown'}). Fix: the planner "
            f"costs decoder-only transformers; give a causal LM's config (GPT-2, Llama, Mistral, Qwen2, BLOOM, ...)."
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
    head_dim = data.get("head_dim")
    if head_dim is not None and (isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1):
        raise ConfigError(f"{where}: head_dim={head_dim!r} must be a positive whole number. Fix: correct it.")
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
    layers = int(first("layer count", "num_hidden_layers", "n_layer", "n_layers", "num_layers"))
    moe = moe_fields(data, where, kind, layers)
    spec = ModelSpec(
        name=str(data.get("_name_or_path") or default_name),
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv,
        ffn=int(first("MLP width", "intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", default=ffn_default)),
        # an MoE model's dense blocks (if any) use intermediate_size; its experts moe_intermediate_size (moe_fields)
        vocab=int(first("vocabulary size", "vocab_size", "padded_vocab_size")),
        seq=int(seq if seq is not None else str(context)),
        gated=kind in GATED or activation in ("silu", "swiglu", "swish"),
        tied_embeddings=bool(data.get("tie_word_embeddings", kind not in UNTIED_BY_DEFAULT)),
        learned_positions=kind in LEARNED_POSITIONS or (kind == "mpt" and not alibi),
        bias=bias,
        dropout=_dropout(data, attn),
        attention_head_dim=head_dim if head_dim and head_dim * heads != hidden else None,
        **moe,
    )
    return spec


def _int(data: dict[str, Any], key: str, where: str) -> int | None:
    """``data[key]`` as a whole number (None when absent); ConfigError for anything else."""
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{where}: {key}={value!r} must be a whole number >= 0. Fix: correct it in the config.")
    return value


def moe_blocks(data: dict[str, Any], where: str, layers: int) -> list[int]:
    """The indices of a Mixture-of-Experts config's MoE blocks: DeepSeek's ``first_k_dense_replace`` and
    ``moe_layer_freq``, Qwen's ``decoder_sparse_step`` and ``mlp_only_layers``, else every block."""
    if "first_k_dense_replace" in data or "moe_layer_freq" in data:
        first = _int(data, "first_k_dense_replace", where) or 0
        every = _int(data, "moe_layer_freq", where) or 1
        return [i for i in range(layers) if i >= first and i % every == 0]
    step = _int(data, "decoder_sparse_step", where) or 1
    dense = data.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise ConfigError(f"{where}: mlp_only_layers={dense!r} must be a list of block indices. Fix: correct it.")
    return [i for i in range(layers) if i not in dense and (i + 1) % step == 0]


def moe_fields(data: dict[str, Any], where: str, kind: str, layers: int) -> dict[str, Any]:
    """The ``ModelSpec`` fields of a Mixture-of-Experts config (module docstring); {} for a dense one."""
    key = next((k for k in MOE_KEYS if data.get(k) is not None), None)
    experts = _int(data, key, where) if key else None
    if not experts or experts < 2:
        return {}
    if data.get("kv_lora_rank") is not None:
        raise ConfigError(
            f"{where} ({kind or 'no model_type'}) uses multi-head latent attention (kv_lora_rank="
            f"{data['kv_lora_rank']}): its compressed key/value projections are not what the planner's attention "
            f"counts. Fix: plan a model with standard multi-head or grouped-query attention (DeepSeek-MoE v1, "
            f"Mixtral, Qwen-MoE, OLMoE), or describe it as a ModelSpec."
        )
    top_key = next((k for k in TOP_K_KEYS if data.get(k) is not None), None)
    top_k = _int(data, top_key, where) if top_key else None
    if not top_k or top_k > experts:
        raise ConfigError(
            f"{where} has {experts} experts ({key}) but {'no top-k key' if not top_key else f'{top_key}={top_k}'}: "
            f"each token's experts must number 1..{experts}. Fix: set num_experts_per_tok in the config."
        )
    width = _int(data, "moe_intermediate_size", where) or _int(data, "intermediate_size", where)
    if not width:
        raise ConfigError(
            f"{where} has experts but no expert width (moe_intermediate_size or intermediate_size). Fix: set it."
        )
    shared = _int(data, "n_shared_experts", where) or 0
    shared_width = _int(data, "shared_expert_intermediate_size", where) or 0
    if shared_width:
        if shared_width % width:
            raise ConfigError(
                f"{where}: shared_expert_intermediate_size={shared_width} is not a whole number of experts of width "
                f"{width}, which is how the planner describes shared experts. Fix: plan it as a ModelSpec."
            )
        shared = shared_width // width
    blocks = moe_blocks(data, where, layers)
    if not blocks:
        raise ConfigError(f"{where} has {experts} experts but no MoE block. Fix: check decoder_sparse_step / layers.")
    every = blocks[1] - blocks[0] if len(blocks) > 1 else 1
    if blocks != list(range(blocks[0], layers, every)):
        raise ConfigError(
            f"{where}: the MoE blocks {blocks} are not every {every}-th block from block {blocks[0]} on, the pattern the "
            f"planner describes (ModelSpec.moe_start / moe_every). Fix: plan it as a ModelSpec with that pattern."
        )
    return {
        "experts": experts,
        "top_k": top_k,
        "shared_experts": shared,
        "expert_ffn": width,
        "moe_start": blocks[0],
        "moe_every": every,
    }


def _dropout(data: dict[str, Any], attn: dict[str, Any]) -> float:
    """The largest dropout probability a config sets (0.0 when it sets none): the masks it keeps in training."""
    values = [
        float(source[key])
        for source in (data, attn)
        for key in DROPOUT_KEYS
        if isinstance(source.get(key), (int, float)) and not isinstance(source.get(key), bool)
    ]
    return max((v for v in values if 0.0 <= v < 1.0), default=0.0)


__all__ = [
    "ALIBI",
    "DROPOUT_KEYS",
    "GATED",
    "MOE_KEYS",
    "from_hf_config",
    "moe_blocks",
    "moe_fields",
    "spec_from_hf_dict",
]
