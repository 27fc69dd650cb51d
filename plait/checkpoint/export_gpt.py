"""plait's own GPT (dense or Mixture-of-Experts) as a Hugging Face folder: ``plait convert CKPT FOLDER``.

A checkpoint of ``plait.models.GPT`` records its ``GPTConfig`` in plait.json (``meta["model"]["config"]``,
``identity.model_meta``). ``hf_architecture`` names the transformers family that computes what that GPT computes,
operation for operation, and ``export_gpt`` writes the folder that family's ``from_pretrained`` opens: config.json,
generation_config.json and the weights under the names and in the layout ``save_pretrained`` writes (per-expert
tensors for the MoE families), streamed as ``convert.export_hf`` streams them: each output tensor is built from the
few checkpoint tensors it needs just before its bytes are written (the last tensor read is kept for the next
expert's slice of it). A config that no family computes exactly is refused (``ConfigError`` naming the field).

=========================================================  ====================  ===============================
GPTConfig                                                  transformers          how
=========================================================  ====================  ===============================
learned positions, layernorm, gelu (dense)                 GPT2LMHeadModel       activation "gelu" (exact erf,
                                                                                 plait's nn.GELU; not GPT-2's
                                                                                 tanh "gelu_new"); Conv1D weights
                                                                                 transposed, q/k/v into c_attn;
                                                                                 bias=False as zero biases;
                                                                                 kv heads repeated (GQA)
rope, rmsnorm, swiglu (dense)                              LlamaForCausalLM      attention_bias = mlp_bias = bias
MoE, softmax, router_norm_topk, no shared experts,         MixtralForCausalLM
every block MoE
MoE, softmax, otherwise                                    Qwen2MoeForCausalLM   dense blocks: mlp_only_layers;
                                                                                 shared experts: see below
MoE, sigmoid, MoE blocks moe_start..n_layer-1              Glm4MoeForCausalLM    expert_bias as
                                                                                 e_score_correction_bias
=========================================================  ====================  ===============================

The MoE families need rope, rmsnorm, swiglu and bias=False. Equalities relied on (tests/test_convert_gpt.py
compares the logits): layernorm and rmsnorm eps 1e-5 both sides; plait's RoPE rotates halves (``layers.
apply_rotary``) as these families do, so q and k are copied unpermuted; a kv head serves the n_head / n_kv_head
consecutive query heads (``Attention.attend``), hence GPT-2's repeated rows. Qwen2-MoE gates its shared expert by
sigmoid(shared_expert_gate(x)), plait's shared experts are ungated: the gate's weight is written as zeros
(sigmoid(0) = 1/2 exactly) and the shared down projection doubled (exact in binary floating point), so 1/2 x 2 x
down(...) is plait's output; no shared experts are zero-width ones (an exact zero added). GLM-4-MoE chooses by
sigmoid score + e_score_correction_bias and divides the chosen scores by their sum + 1e-20 as plait's sigmoid
router does; one expert group, scaling factor 1.

Refused, with the field and the fix (export one ``.safetensors`` file instead): any other mix of position / norm
/ mlp; MoE with gelu experts or biases (the families' experts are bias-free SwiGLU); ``capacity_factor`` (token
dropping: the families route every token); a softmax router with ``moe_balance="aux_free"`` (the selection bias
steers routing at inference, and no softmax family has one); a sigmoid router whose MoE blocks are not
``moe_start`` to the last (GLM-4-MoE's ``first_k_dense_replace``) or with one expert.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor

from plait.checkpoint import outputs
from plait.checkpoint import safetensors_writer as writer
from plait.checkpoint.outputs import MARKER
from plait.checkpoint.slices import CheckpointSource
from plait.errors import ConfigError
from plait.logging import get_logger
from plait.models.config import GPTConfig
from plait.models.gpt import GPT

log = get_logger(__name__)
Read = Callable[[str], Tensor]
Recipe = tuple[torch.dtype, tuple[int, ...], Callable[[Read], Tensor]]
"""One output tensor: its dtype, its shape, and how to build it from the checkpoint's tensors (read by name)."""
ARCHITECTURES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
}
"""``model_type`` -> the transformers class that ``export_gpt`` writes a folder of."""
EPS = 1e-5
"""plait's layernorm and rmsnorm epsilon (``plait.models.layers``)."""
FIX = "Fix: export the weights as one file instead (OUT ending in .safetensors)."


def recorded_gpt_config(meta: dict[str, Any]) -> GPTConfig | None:
    """The ``GPTConfig`` a checkpoint's plait.json records for plait's GPT, or None (another model)."""
    model = meta.get("model")
    fields = model.get("config") if isinstance(model, dict) else None
    if not isinstance(fields, dict):
        return None
    try:
        return GPTConfig.from_dict(fields)
    except (ValueError, TypeError):
        return None


def _refuse(config: GPTConfig, field: str, why: str) -> ConfigError:
    return ConfigError(
        f"plait's GPT with {field}={getattr(config, field)!r} has no exactly-equal Hugging Face architecture: {why}. "
        f"{FIX}"
    )


def hf_architecture(config: GPTConfig) -> str:
    """The ``model_type`` of the transformers family computing what ``GPT(config)`` computes (module docstring),
    or the ConfigError naming the field that no family has."""
    llama_style = ("rope", "rmsnorm", "swiglu")
    style = (config.position, config.norm, config.mlp)
    if config.n_experts == 0:
        if style == ("learned", "layernorm", "gelu"):
            return "gpt2"
        if style == llama_style:
            return "llama"
        family, wanted = ("GPT-2", {"norm": "layernorm", "mlp": "gelu"})
        if config.position == "rope":
            family, wanted = ("Llama", {"norm": "rmsnorm", "mlp": "swiglu"})
        field = next(name for name, want in wanted.items() if getattr(config, name) != want)
        raise _refuse(config, field, f"{family}, the family of position={config.position!r}, takes {wanted[field]!r}")
    for field, want in zip(("mlp", "position", "norm"), ("swiglu", "rope", "rmsnorm")):
        if getattr(config, field) != want:
            raise _refuse(config, field, f"transformers' MoE families take {field}={want!r}")
    if config.bias:
        raise _refuse(config, "bias", "transformers' MoE families have no biases in their experts and projections")
    if config.capacity_factor is not None:
        raise _refuse(
            config,
            "capacity_factor",
            "it drops tokens past each expert's capacity, transformers' MoE families route every token",
        )
    if config.router_score == "softmax":
        if config.moe_balance == "aux_free":
            raise _refuse(
                config,
                "moe_balance",
                "its selection bias steers routing at inference too, and no softmax-routed transformers family has one",
            )
        every = config.moe_layers == list(range(config.n_layer))
        return "mixtral" if config.router_norm_topk and config.n_shared_experts == 0 and every else "qwen2_moe"
    if config.moe_layers != list(range(config.moe_start, config.n_layer)):
        raise _refuse(
            config,
            "moe_every",
            "GLM-4-MoE, the sigmoid-routed family, has MoE in every block from its first (first_k_dense_replace)",
        )
    if config.n_experts < 2:
        raise _refuse(config, "n_experts", "GLM-4-MoE's router ranks experts by the sum of its two best scores")
    return "glm4_moe"


def hf_config_fields(config: GPTConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    """The transformers config (``AutoConfig.for_model(model_type, **fields)``) of ``config``'s model; no token
    ids (plait's GPT knows none, and a default eos id would stop ``generate`` early)."""
    tokens = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "dtype": str(dtype).split(".")[-1]}
    if model_type == "gpt2":
        dropout = {name: config.dropout for name in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
        return {
            "vocab_size": config.vocab_size,
            "n_positions": config.seq_len,
            "n_embd": config.d_model,
            "n_layer": config.n_layer,
            "n_head": config.n_head,
            "n_inner": config.ffn_dim,
            "activation_function": "gelu",  # plait's nn.GELU(): the exact erf form, not GPT-2's "gelu_new"
            "layer_norm_epsilon": EPS,
            "tie_word_embeddings": False,
            **dropout,
            **tokens,
        }
    fields: dict[str, Any] = {
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.kv_heads,
        "max_position_embeddings": config.seq_len,
        "rms_norm_eps": EPS,
        "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": float(config.rope_theta)},
        "attention_dropout": config.dropout,
        "tie_word_embeddings": False,
        **tokens,
    }
    experts = {"num_experts_per_tok": config.top_k, "moe_intermediate_size": config.expert_ffn_dim}
    if model_type == "llama":
        fields.update(attention_bias=config.bias, mlp_bias=config.bias)
    elif model_type == "mixtral":
        fields.update(
            num_local_experts=config.n_experts,
            num_experts_per_tok=config.top_k,
            intermediate_size=config.expert_ffn_dim,
            router_jitter_noise=0.0,
            sliding_window=None,
        )
    elif model_type == "qwen2_moe":
        fields.update(
            experts,
            num_experts=config.n_experts,
            shared_expert_intermediate_size=config.n_shared_experts * config.expert_ffn_dim,
            norm_topk_prob=config.router_norm_topk,
            decoder_sparse_step=1,
            mlp_only_layers=[index for index in range(config.n_layer) if not config.is_moe_layer(index)],
            qkv_bias=False,
            use_sliding_window=False,
        )
    else:  # glm4_moe
        fields["rope_parameters"]["partial_rotary_factor"] = 1.0
        fields.update(
            experts,
            n_routed_experts=config.n_experts,
            n_shared_experts=config.n_shared_experts,
            first_k_dense_replace=config.moe_start,
            norm_topk_prob=config.router_norm_topk,
            routed_scaling_factor=1.0,
            n_group=1,
            topk_group=1,
            use_qk_norm=False,
            attention_bias=False,
        )
    return fields


def _copy(name: str, transform: Callable[[Tensor], Tensor] = lambda tensor: tensor) -> Callable[[Read], Tensor]:
    return lambda read: transform(read(name))


def _zeros(shape: tuple[int, ...], dtype: torch.dtype) -> Callable[[Read], Tensor]:
    return lambda read: torch.zeros(shape, dtype=dtype)


class _Plan:
    """The output tensors in writing order (name -> ``Recipe``), built from the checkpoint's dtypes and shapes."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: Callable[[str], torch.dtype]) -> None:
        self.shapes, self.dtype = shapes, dtype
        self.recipes: dict[str, Recipe] = {}

    def copy(self, out: str, name: str) -> None:
        """``out`` is the checkpoint's ``name`` as it is."""
        self.recipes[out] = (self.dtype(name), self.shapes[name], _copy(name))

    def transposed(self, out: str, name: str) -> None:
        """``out`` is the 2-D ``name`` transposed (GPT-2's Conv1D stores [in, out])."""
        rows, cols = self.shapes[name]
        self.recipes[out] = (self.dtype(name), (cols, rows), _copy(name, lambda tensor: tensor.t()))

    def copy_or_zeros(self, out: str, name: str, like: str, width: int) -> None:
        """``name`` when the checkpoint has it, else zeros of ``width`` in ``like``'s dtype (bias=False)."""
        if name in self.shapes:
            self.copy(out, name)
        else:
            self.recipes[out] = (self.dtype(like), (width,), _zeros((width,), self.dtype(like)))


def _expert_transposed(expert: int) -> Callable[[Tensor], Tensor]:
    """Expert ``expert``'s [in, out] matrix of a 3-D expert weight, as transformers' [out, in]."""
    return lambda tensor: tensor[expert].t()


def _repeat_heads(tensor: Tensor, groups: int, head_dim: int) -> Tensor:
    """Rows (or entries) of kv heads, each repeated for the ``groups`` query heads it serves (``Attention.attend``)."""
    return tensor.reshape(-1, head_dim, *tensor.shape[1:]).repeat_interleave(groups, dim=0).flatten(0, 1)


def _gpt2_plan(config: GPTConfig, plan: _Plan) -> None:
    d, f, groups, head = config.d_model, config.ffn_dim, config.n_head // config.kv_heads, config.head_dim

    def c_attn(prefix: str, kind: str) -> Callable[[Read], Tensor]:
        def build(read: Read) -> Tensor:
            parts = []
            for proj in ("q", "k", "v"):
                name = f"{prefix}.{proj}.{kind}"
                if name not in plan.shapes:  # bias=False: zero biases
                    parts.append(torch.zeros(d, dtype=plan.dtype(f"{prefix}.q.weight")))
                    continue
                tensor = read(name)
                parts.append(tensor if proj == "q" else _repeat_heads(tensor, groups, head))
            fused = torch.cat(parts)
            return fused.t() if kind == "weight" else fused

        return build

    plan.copy("transformer.wte.weight", "tok_embed.weight")
    plan.copy("transformer.wpe.weight", "pos_embed.weight")
    for index in range(config.n_layer):
        src, out = f"blocks.{index}", f"transformer.h.{index}"
        attn = f"{src}.attn"
        dtype = plan.dtype(f"{attn}.q.weight")
        plan.copy(f"{out}.ln_1.weight", f"{src}.norm1.weight")
        plan.copy_or_zeros(f"{out}.ln_1.bias", f"{src}.norm1.bias", f"{src}.norm1.weight", d)
        plan.recipes[f"{out}.attn.c_attn.weight"] = (dtype, (d, 3 * d), c_attn(attn, "weight"))
        plan.recipes[f"{out}.attn.c_attn.bias"] = (dtype, (3 * d,), c_attn(attn, "bias"))
        plan.transposed(f"{out}.attn.c_proj.weight", f"{attn}.o.weight")
        plan.copy_or_zeros(f"{out}.attn.c_proj.bias", f"{attn}.o.bias", f"{attn}.o.weight", d)
        plan.copy(f"{out}.ln_2.weight", f"{src}.norm2.weight")
        plan.copy_or_zeros(f"{out}.ln_2.bias", f"{src}.norm2.bias", f"{src}.norm2.weight", d)
        plan.transposed(f"{out}.mlp.c_fc.weight", f"{src}.mlp.up.weight")
        plan.copy_or_zeros(f"{out}.mlp.c_fc.bias", f"{src}.mlp.up.bias", f"{src}.mlp.up.weight", f)
        plan.transposed(f"{out}.mlp.c_proj.weight", f"{src}.mlp.down.weight")
        plan.copy_or_zeros(f"{out}.mlp.c_proj.bias", f"{src}.mlp.down.bias", f"{src}.mlp.down.weight", d)
    plan.copy("transformer.ln_f.weight", "norm_f.weight")
    plan.copy_or_zeros("transformer.ln_f.bias", "norm_f.bias", "norm_f.weight", d)
    plan.copy("lm_head.weight", "lm_head.weight")


def _rope_family_plan(config: GPTConfig, model_type: str, plan: _Plan) -> None:
    """Llama and the MoE families: the same attention and norms; dense, routed and shared feed-forwards."""
    d = config.d_model
    plan.copy("model.embed_tokens.weight", "tok_embed.weight")
    for index in range(config.n_layer):
        src, out = f"blocks.{index}", f"model.layers.{index}"
        plan.copy(f"{out}.input_layernorm.weight", f"{src}.norm1.weight")
        for proj in ("q", "k", "v", "o"):
            for kind in ("weight", "bias"):
                if f"{src}.attn.{proj}.{kind}" in plan.shapes:
                    plan.copy(f"{out}.self_attn.{proj}_proj.{kind}", f"{src}.attn.{proj}.{kind}")
        plan.copy(f"{out}.post_attention_layernorm.weight", f"{src}.norm2.weight")
        if not config.is_moe_layer(index):
            for proj in ("gate", "up", "down"):
                for kind in ("weight", "bias"):
                    if f"{src}.mlp.{proj}.{kind}" in plan.shapes:
                        plan.copy(f"{out}.mlp.{proj}_proj.{kind}", f"{src}.mlp.{proj}.{kind}")
            continue
        moe = f"{out}.block_sparse_moe" if model_type == "mixtral" else f"{out}.mlp"
        router = f"{src}.mlp.router"
        plan.copy(f"{moe}.gate.weight", f"{router}.gate.weight")
        if model_type == "glm4_moe":
            bias = f"{moe}.gate.e_score_correction_bias"
            if f"{router}.expert_bias" in plan.shapes:
                plan.copy(bias, f"{router}.expert_bias")
            else:  # chosen by score alone
                plan.recipes[bias] = (torch.float32, (config.n_experts,), _zeros((config.n_experts,), torch.float32))
        names = ("w1", "w3", "w2") if model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        for kind, part in zip(("w_gate", "w_up", "w_down"), names):  # kind by kind: one 3-D tensor read at a time
            name = f"{src}.mlp.experts.{kind}"
            experts, rows, cols = plan.shapes[name]
            for expert in range(experts):
                # plait computes rows @ w[e] ([in, out]); transformers F.linear(rows, weight) ([out, in])
                plan.recipes[f"{moe}.experts.{expert}.{part}.weight"] = (
                    plan.dtype(name),
                    (cols, rows),
                    _copy(name, _expert_transposed(expert)),
                )
        if model_type == "mixtral":
            continue
        shared = "shared_expert" if model_type == "qwen2_moe" else "shared_experts"
        like = f"{router}.gate.weight"
        for proj in ("gate", "up", "down"):
            out_name, name = f"{moe}.{shared}.{proj}_proj.weight", f"{src}.mlp.shared.{proj}.weight"
            if name not in plan.shapes:  # no shared experts: zero-width ones, an exact zero added
                shape = (d, 0) if proj == "down" else (0, d)
                plan.recipes[out_name] = (plan.dtype(like), shape, _zeros(shape, plan.dtype(like)))
            elif model_type == "qwen2_moe" and proj == "down":  # times sigmoid(0) = 1/2 below: exact
                plan.recipes[out_name] = (plan.dtype(name), plan.shapes[name], _copy(name, lambda tensor: tensor * 2))
            else:
                plan.copy(out_name, name)
        if model_type == "qwen2_moe":
            plan.recipes[f"{moe}.shared_expert_gate.weight"] = (
                plan.dtype(like),
                (1, d),
                _zeros((1, d), plan.dtype(like)),
            )
    plan.copy("model.norm.weight", "norm_f.weight")
    plan.copy("lm_head.weight", "lm_head.weight")


def _check_tensors(config: GPTConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    """ConfigError unless the checkpoint holds exactly the tensors of ``GPT(config)`` (built on the meta device)."""
    with torch.device("meta"):
        expected = {name: tuple(tensor.shape) for name, tensor in GPT(config).state_dict().items()}
    missing, unexpected = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
    wrong = [name for name in expected if name in shapes and shapes[name] != expected[name]]
    if missing or unexpected or wrong:
        raise ConfigError(
            f"the checkpoint's tensors are not those of plait's GPT of its recorded config (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}, other shape {wrong[:3]}). {FIX}"
        )


def _last_read(read: Read) -> Read:
    """``read`` keeping the last tensor read, for the next expert's slice of the same 3-D tensor."""
    last: dict[str, Tensor] = {}

    def cached(name: str) -> Tensor:
        if name not in last:
            last.clear()
            last[name] = read(name)
        return last[name]

    return cached


def export_gpt(
    source: CheckpointSource, checkpoint: str | Path, out: Path, config: GPTConfig, shard_bytes: int
) -> Path:
    """Write ``source`` (a checkpoint of ``GPT(config)``) as the Hugging Face folder ``out`` (module docstring),
    in shards past ``shard_bytes``, with plait's marker; ``out`` has been checked (``outputs.check_folder_out``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type = hf_architecture(config)
    shapes = source.shapes()
    _check_tensors(config, shapes)
    plan = _Plan(shapes, source.dtype)
    if model_type == "gpt2":
        _gpt2_plan(config, plan)
    else:
        _rope_family_plan(config, model_type, plan)
    hf_config = AutoConfig.for_model(
        model_type, **hf_config_fields(config, model_type, source.dtype("tok_embed.weight"))
    )
    with torch.device("meta"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Initializing zero-element tensors")  # zero-width shared experts
        model = cast(Any, AutoModelForCausalLM.from_config(hf_config, trust_remote_code=False))
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    made = {name: shape for name, (_, shape, _) in plan.recipes.items()}
    expected = _saved_names(expected, model_type)  # what save_pretrained writes, and from_pretrained fuses back
    if made != expected:
        differ = sorted(set(made) ^ set(expected)) or [name for name in made if made[name] != expected[name]]
        raise ConfigError(
            f"transformers' {ARCHITECTURES[model_type]} does not hold the tensors plait writes for it ({differ[:3]}): "
            f"another transformers version. Fix: use transformers>=5.23,<6 (pip install 'plait[hf]'), or {FIX[5:]}"
        )
    read = _last_read(source.whole)
    specs = {name: (dtype, shape) for name, (dtype, shape, _) in plan.recipes.items()}
    hf_config.architectures = [ARCHITECTURES[model_type]]
    step = source.meta.get("step")
    with outputs.staged(out) as tmp:
        tmp.mkdir()
        hf_config.save_pretrained(str(tmp))
        if getattr(model, "generation_config", None) is not None and model.can_generate():
            model.generation_config.save_pretrained(str(tmp))
        writer.write_sharded(tmp, specs, lambda name: plan.recipes[name][2](read), shard_bytes, {"format": "pt"})
        written = sorted(entry.name for entry in tmp.iterdir())
        marker = {"written_by": "plait convert", "source": str(checkpoint), "step": step, "files": written}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2))
    log.info("exported plait's GPT (step %s) as %s, a Hugging Face folder %s", step, ARCHITECTURES[model_type], out)
    return out


def _saved_names(state: dict[str, tuple[int, ...]], model_type: str) -> dict[str, tuple[int, ...]]:
    """A model's fused expert tensors (``experts.gate_up_proj`` [E, 2I, d], ``experts.down_proj`` [E, d, I]) under
    the per-expert names and shapes ``save_pretrained`` writes (Mixtral's w1/w3/w2 under block_sparse_moe)."""
    parts = ("w1", "w3", "w2") if model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in state.items():
        if model_type == "mixtral":
            name = name.replace(".mlp.", ".block_sparse_moe.")
        prefix, _, kind = name.rpartition(".")
        if not prefix.endswith(".experts") or kind not in ("gate_up_proj", "down_proj"):
            out[name] = shape
            continue
        experts, rows, cols = shape
        for expert in range(experts):
            if kind == "gate_up_proj":
                out[f"{prefix}.{expert}.{parts[0]}.weight"] = (rows // 2, cols)
                out[f"{prefix}.{expert}.{parts[1]}.weight"] = (rows // 2, cols)
            else:
                out[f"{prefix}.{expert}.{parts[2]}.weight"] = (rows, cols)
    return out


__all__ = ["ARCHITECTURES", "export_gpt", "hf_architecture", "hf_config_fields", "recorded_gpt_config"]
