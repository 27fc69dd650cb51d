"""Hugging Face Mixture-of-Experts parity: tiny Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE models (2 decoder layers, 4
experts of width 16, top-2, d 32, 4 heads over 2 key/value heads (OLMoE: 4), eager attention, random seeded weights,
nothing downloaded) trained by plait under a layout and by one device, compared step by step with
``helpers.moe.assert_cell_matches`` (losses, norms before clipping, the balance loss, the tokens routed to each
expert, step-0 gradients, final parameters, the evaluation loss).

The configs ask for a balance loss (``output_router_logits=True``, ``router_aux_loss_coef`` 0.1, so alpha = 0.1 x 2
/ 2 layers = 0.1: ``plait.models.hf_moe.balance_settings``), Qwen2-MoE has its gated shared expert (width 24) and
Qwen3-MoE its per-head q/k norms. Batches: 8 rows of 16 random tokens, targets the inputs shifted by one, each row
scoring an uneven number of them (``reference.uneven_mask``); 3 AdamW steps, clipping at 0.05 (below the norm)
unless a cell says otherwise. ``starve``: experts 2 and 3 of every layer never chosen (``starve_experts``), so under ep=2
the second ep rank receives no row at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from helpers import moe
from helpers.composition import optimizer, whole_gradients
from helpers.reference import uneven_mask
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

import plait
from plait import Layout
from plait.models.hf import return_logits
from plait.models.hf_moe import adapt_hf_moe

GLOBAL_BATCH = 8
SEQ = 16
VOCAB = 64
STARVED = (2, 3)
COMMON: dict[str, Any] = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts_per_tok": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": SEQ,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
    "output_router_logits": True,
    "router_aux_loss_coef": 0.1,
}
FAMILIES: dict[str, tuple[type, type, dict[str, Any]]] = {
    "mixtral": (MixtralForCausalLM, MixtralConfig, {"intermediate_size": 16, "num_local_experts": 4}),
    "qwen2_moe": (
        Qwen2MoeForCausalLM,
        Qwen2MoeConfig,
        {"intermediate_size": 32, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24, "num_experts": 4},
    ),
    "qwen3_moe": (
        Qwen3MoeForCausalLM,
        Qwen3MoeConfig,
        {"intermediate_size": 32, "moe_intermediate_size": 16, "num_experts": 4, "head_dim": 8},
    ),
    "olmoe": (OlmoeForCausalLM, OlmoeConfig, {"intermediate_size": 16, "num_experts": 4, "num_key_value_heads": 4}),
}


def make_config(family: str, **overrides: Any) -> Any:
    """The tiny config of ``family`` (module docstring), eager attention."""
    _, config_class, fields = FAMILIES[family]
    config = config_class(**{**COMMON, **fields, **overrides})
    config._attn_implementation = "eager"
    return config


def make_model(family: str, starve: bool = False, **overrides: Any) -> torch.nn.Module:
    """A seeded tiny model of ``family`` as transformers builds it (not adapted)."""
    model_class = FAMILIES[family][0]
    torch.manual_seed(1234)
    model = model_class(make_config(family, **overrides))
    if starve:
        starve_experts(model, STARVED)
    return model


@torch.no_grad()
def starve_experts(model: torch.nn.Module, experts: tuple[int, ...]) -> None:
    """Make ``experts`` of every layer never chosen: feature 0 of the residual stream is the constant 0.1 (the
    embedding's column 0; attention, experts and MLPs write nothing into it: row 0 of every output projection is
    zero), so after each RMSNorm it is a positive ~3, and those experts' router rows are -5 on it and 0 elsewhere:
    their logits ~-15 sit far below the others' (~+-0.1). Training moves these weights by ~lr per step, ~1e-3."""
    model.get_submodule("model.embed_tokens").weight[:, 0] = 0.1
    for name, param in model.named_parameters():
        if name.endswith(("o_proj.weight", "down_proj.weight")) and param.dim() == 2:
            param[0] = 0.0
        elif name.endswith("experts.down_proj"):
            param[:, 0] = 0.0
        elif name.endswith("mlp.gate.weight"):
            param[list(experts)] = 0.0
            param[list(experts), 0] = -5.0


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens, targets the inputs shifted by one, rows scoring uneven numbers of them."""
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(300 + step))
    rows = [1000 * step + row for row in range(GLOBAL_BATCH)]
    return tokens[:, :-1].contiguous(), uneven_mask(tokens[:, 1:].contiguous(), rows)


@dataclass(frozen=True)
class Cell(moe.Cell):
    """``helpers.moe.Cell`` (name, layout, config overrides, clipping at 0.05 by default, starved experts) of one
    ``family``."""

    family: str = "mixtral"


_REFERENCES: dict[tuple, dict[str, Any]] = {}


def reference(cell: Cell) -> dict[str, Any]:
    """One device on each whole global batch (``helpers.moe.train_one_device``): the family's model with its MoE
    blocks as plait's (``adapt_hf_moe``, as ``parallelize`` does) in a plain loop."""
    key = (cell.family, cell.starve, tuple(sorted(cell.model.items())), cell.clip)
    if key not in _REFERENCES:
        model = make_model(cell.family, cell.starve, **cell.model)
        adapt_hf_moe(model)
        _REFERENCES[key] = moe.train_one_device(return_logits(model).train(), global_batch, cell.clip)
    return _REFERENCES[key]


def _shard(batch: tuple[torch.Tensor, torch.Tensor], index: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    share = GLOBAL_BATCH // size
    return batch[0][index * share : (index + 1) * share], batch[1][index * share : (index + 1) * share]


def train_cell(cell: Cell) -> dict[str, Any]:
    """Train ``cell`` on this rank; everything ``assert_cell_matches`` compares."""
    model = make_model(cell.family, cell.starve, **cell.model)
    engine = plait.parallelize(model, Layout(**cell.layout), optimizer=optimizer, max_grad_norm=cell.clip)
    grads: list[dict[str, torch.Tensor]] = []
    engine.before_optimizer_step.append(lambda e: grads.append(whole_gradients(e)) if not grads else None)
    dp_rank, dp = engine.mesh.index("dp"), engine.mesh.size("dp")
    stats = [engine.train_step(_shard(global_batch(step), dp_rank, dp)) for step in range(moe.STEPS)]
    evaluation = engine.evaluate([_shard(global_batch(moe.STEPS), dp_rank, dp)]).loss
    return moe.cell_results(engine, stats, grads[0], evaluation)


def train_cells(cells: list[Cell]) -> dict[str, dict[str, Any]]:
    """Every cell of this job's world size, one after another (one process start-up)."""
    world = torch.distributed.get_world_size()
    return {cell.name: train_cell(cell) for cell in cells if cell.world == world}
