"""Built-in tensor-parallel plans for Hugging Face transformers causal LMs: GPT-2 (``GPT2LMHeadModel``) and Llama
(``LlamaForCausalLM``, GQA included). Imported by ``plan.builtin_plans`` / ``plan.attention_heads`` only for a
model from the ``transformers`` package, so plait itself imports without transformers installed.

GPT-2 (Radford et al. 2019) keeps its linear layers as ``Conv1D`` (weight [in, out]) and fuses q, k and v into one
projection ``c_attn`` whose output is [q | k | v], each d wide. Megatron's split gives rank i of t the heads
[i n/t, (i+1) n/t) of each: the style "colwise_fused_qkv" slices each third separately, so the local output is
[q_i | k_i | v_i] and GPT2Attention's ``split(split_size)`` still finds q, k and v once ``split_size`` is the
local width d/t (``localize`` sets it, with ``num_heads`` and ``embed_dim``). ``c_proj`` is row parallel. The
token embedding ``wte`` is tied to ``lm_head``: "vocab" and "colwise_vocab" both take rows [i V/t, (i+1) V/t) of
the [V, d] table, so the two layers share one local slice and its gradient sums both uses, as on one device.

Llama (Touvron et al. 2023): q/k/v/gate/up column parallel, o/down row parallel, ``embed_tokens`` vocab parallel,
``lm_head`` split on the vocabulary. Its attention infers the head counts from the projection widths
(``view(..., -1, head_dim)``) and ``num_key_value_groups`` (query heads per kv head) is the same on every rank,
so nothing needs localising; tp must divide both the query and the key/value heads.

Neither model supports Megatron sequence parallelism here (their causal masks are built from the input's
sequence length, which SP would cut): ``sequence_parallel=True`` raises a LayoutError.
"""

from __future__ import annotations

from torch import nn
from transformers import GPT2LMHeadModel, LlamaForCausalLM
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
from transformers.models.llama.modeling_llama import LlamaAttention

from plait.errors import LayoutError
from plait.parallel.tensor.plan import AttentionHeads, Plan, PlanFactory


def gpt2_plan(model: nn.Module) -> Plan:
    """GPT-2: vocab-parallel (tied) embedding and head, fused q/k/v split by heads, MLP split on its width."""
    assert isinstance(model, GPT2LMHeadModel)
    if model.config.add_cross_attention:
        raise LayoutError(
            "the built-in GPT-2 tensor-parallel plan does not cover cross-attention "
            "(config.add_cross_attention=True). Fix: pass tp_plan= covering crossattention, or tp=1."
        )
    return {
        "transformer.wte": "vocab",
        "transformer.h.*.attn": "enter",
        "transformer.h.*.attn.c_attn": "colwise_fused_qkv",
        "transformer.h.*.attn.c_proj": "rowwise",
        "transformer.h.*.mlp": "enter",
        "transformer.h.*.mlp.c_fc": "colwise",
        "transformer.h.*.mlp.c_proj": "rowwise",
        "lm_head": "colwise_vocab",
    }


def llama_plan(model: nn.Module) -> Plan:
    """Llama: heads split in attention (q/k/v colwise, o rowwise), SwiGLU split on its width, vocab-parallel
    embedding and head; RMSNorms and the rotary embedding replicated."""
    assert isinstance(model, LlamaForCausalLM)
    return {
        "model.embed_tokens": "vocab",
        "model.layers.*.self_attn": "enter",
        "model.layers.*.self_attn.q_proj": "colwise",
        "model.layers.*.self_attn.k_proj": "colwise",
        "model.layers.*.self_attn.v_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.mlp": "enter",
        "model.layers.*.mlp.gate_proj": "colwise",
        "model.layers.*.mlp.up_proj": "colwise",
        "model.layers.*.mlp.down_proj": "rowwise",
        "lm_head": "colwise_vocab",
    }


# attention_heads() maps each attention class to its functions, so the asserts below hold.


def _gpt2_heads(module: nn.Module) -> dict[str, int]:
    assert isinstance(module, GPT2Attention)
    return {"attention heads (n_head)": module.num_heads}


def _gpt2_localize(module: nn.Module, tp: int) -> None:
    """GPT2Attention splits c_attn's output with ``split_size``: make it (and the head count) the local one."""
    assert isinstance(module, GPT2Attention)
    module.num_heads //= tp
    module.embed_dim //= tp
    module.split_size //= tp


def _llama_heads(module: nn.Module) -> dict[str, int]:
    assert isinstance(module, LlamaAttention)
    config = module.config
    return {
        "attention heads (num_attention_heads)": config.num_attention_heads,
        # typed Optional; LlamaConfig sets None to num_attention_heads (plain multi-head attention)
        "key/value heads (num_key_value_heads)": config.num_key_value_heads or config.num_attention_heads,
    }


def plans() -> dict[type, PlanFactory]:
    """The built-in plans of the Hugging Face model classes plait knows, by class."""
    return {GPT2LMHeadModel: gpt2_plan, LlamaForCausalLM: llama_plan}


def attention_heads() -> dict[type, AttentionHeads]:
    """How tensor parallelism sees their attention modules: head counts to check, per-rank counts to set."""
    return {GPT2Attention: AttentionHeads(_gpt2_heads, _gpt2_localize), LlamaAttention: AttentionHeads(_llama_heads)}


__all__ = ["attention_heads", "gpt2_plan", "llama_plan", "plans"]
