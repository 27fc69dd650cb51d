"""Built-in tensor-parallel plans for Hugging Face transformers causal LMs: GPT-2 (``GPT2LMHeadModel``), Llama
(``LlamaForCausalLM``, GQA included) and the MoE families Mixtral, Qwen2-MoE, Qwen3-MoE (OLMoE refused). Imported
by ``plan.builtin_plans`` / ``plan.attention_heads`` only for a model from the ``transformers`` package, so plait
itself imports without transformers installed.

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

Mixture-of-Experts families (``plait.models.hf_moe``): Mixtral, Qwen2-MoE and Qwen3-MoE get Llama's attention split
(Qwen3's q/k norms, one weight applied to each head alone, stay whole on every rank; their gradients, partial
over the rank's heads, are summed over tp); their MoE layers are no tp
region, as in plait's GPT: the router and the routed experts stay whole on every tp rank (expert parallelism
splits the experts over the data ranks instead), Qwen2-MoE's shared expert is split like a dense MLP (its per-token
gate ``shared_expert_gate`` stays whole), and the dense layers of Qwen (``mlp_only_layers``,
``decoder_sparse_step``) are split like Llama's MLP. OLMoE is refused: its q_norm / k_norm normalise q and k over
all heads together, which a split of the heads would normalise per rank.

None of these models supports Megatron sequence parallelism here (their causal masks are built from the input's
sequence length, which SP would cut): ``sequence_parallel=True`` raises a LayoutError.
"""

from __future__ import annotations

from torch import nn
from transformers import (
    GPT2LMHeadModel,
    LlamaForCausalLM,
    MixtralForCausalLM,
    OlmoeForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM,
)
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
from transformers.models.llama.modeling_llama import LlamaAttention
from transformers.models.mixtral.modeling_mixtral import MixtralAttention
from transformers.models.olmoe.modeling_olmoe import OlmoeAttention
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeAttention
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeAttention

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


def _attention_and_vocab() -> Plan:
    """Llama-style decoders: heads split in attention (q/k/v colwise, o rowwise), vocab-parallel embedding and head."""
    return {
        "model.embed_tokens": "vocab",
        "model.layers.*.self_attn": "enter",
        "model.layers.*.self_attn.q_proj": "colwise",
        "model.layers.*.self_attn.k_proj": "colwise",
        "model.layers.*.self_attn.v_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
        "lm_head": "colwise_vocab",
    }


def _swiglu(path: str) -> Plan:
    """A SwiGLU MLP (gate_proj, up_proj, down_proj) split on its width, entered once."""
    return {path: "enter", f"{path}.gate_proj": "colwise", f"{path}.up_proj": "colwise", f"{path}.down_proj": "rowwise"}


def llama_plan(model: nn.Module) -> Plan:
    """Llama: heads split in attention, SwiGLU split on its width, vocab-parallel embedding and head; RMSNorms and
    the rotary embedding replicated."""
    assert isinstance(model, LlamaForCausalLM)
    return {**_attention_and_vocab(), **_swiglu("model.layers.*.mlp")}


def moe_plan(model: nn.Module) -> Plan:
    """Mixtral, Qwen2-MoE, Qwen3-MoE: Llama's attention and vocabulary split; in MoE layers (those with ``experts``)
    only Qwen2-MoE's shared expert is split, dense layers are split like Llama's MLP (module docstring)."""
    plan = _attention_and_vocab()
    for index, layer in enumerate(model.get_submodule("model.layers").children()):
        mlp = layer.get_submodule("mlp")
        if not hasattr(mlp, "experts"):
            plan.update(_swiglu(f"model.layers.{index}.mlp"))
        elif hasattr(mlp, "shared_expert"):
            plan.update(_swiglu(f"model.layers.{index}.mlp.shared_expert"))
    return plan


def olmoe_plan(model: nn.Module) -> Plan:
    """OLMoE: refused (module docstring)."""
    raise LayoutError(
        f"tensor parallelism of {type(model).__name__} is not supported: OLMoE's q_norm and k_norm normalise q and k "
        f"over all heads together, and a split of the heads would normalise each rank's heads alone. Fix: tp=1 "
        f"(split OLMoE with ep and dp / ZeRO)."
    )


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
    """Llama and the MoE families' attention (Mixtral, Qwen2-MoE, Qwen3-MoE): query and key/value heads."""
    assert isinstance(module, (LlamaAttention, MixtralAttention, Qwen2MoeAttention, Qwen3MoeAttention))
    config = module.config
    return {
        "attention heads (num_attention_heads)": config.num_attention_heads,
        # typed Optional; LlamaConfig sets None to num_attention_heads (plain multi-head attention)
        "key/value heads (num_key_value_heads)": config.num_key_value_heads or config.num_attention_heads,
    }


def _qwen3_localize(module: nn.Module, tp: int) -> None:
    """Qwen3-MoE's q_norm / k_norm: one weight over a head's dimensions, applied to every head. Each rank applies it
    to its own heads only, so its gradient is a partial sum over tp: tagged ``sequence_partial``, the strategy
    sums it over tp after backward (as sequence parallelism's norms)."""
    assert isinstance(module, Qwen3MoeAttention)
    for norm in (module.q_norm, module.k_norm):
        norm.weight.sequence_partial = True  # type: ignore[attr-defined]


def _olmoe_heads(module: nn.Module) -> dict[str, int]:
    """A plan of the user's splitting OLMoE's attention: refused as the built-in plan is."""
    olmoe_plan(module)
    return {}


def plans() -> dict[type, PlanFactory]:
    """The built-in plans of the Hugging Face model classes plait knows, by class."""
    return {
        GPT2LMHeadModel: gpt2_plan,
        LlamaForCausalLM: llama_plan,
        MixtralForCausalLM: moe_plan,
        Qwen2MoeForCausalLM: moe_plan,
        Qwen3MoeForCausalLM: moe_plan,
        OlmoeForCausalLM: olmoe_plan,
    }


def attention_heads() -> dict[type, AttentionHeads]:
    """How tensor parallelism sees their attention modules: head counts to check, per-rank counts to set."""
    gqa = AttentionHeads(_llama_heads)
    return {
        GPT2Attention: AttentionHeads(_gpt2_heads, _gpt2_localize),
        LlamaAttention: gqa,
        MixtralAttention: gqa,
        Qwen2MoeAttention: gqa,
        Qwen3MoeAttention: AttentionHeads(_llama_heads, _qwen3_localize),
        OlmoeAttention: AttentionHeads(_olmoe_heads),
    }


__all__ = ["attention_heads", "gpt2_plan", "llama_plan", "moe_plan", "olmoe_plan", "plans"]
