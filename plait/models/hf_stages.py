"""Pipeline stages of Hugging Face causal LMs: a forward that runs whichever parts a stage kept.

``plait.parallel.pipeline.split`` cuts a transformers GPT-2 or Llama model like any model with a block list
(``transformer.h`` / ``model.layers``): the embeddings go with the first stage, the final norm and the LM head
with the last, every stage is a copy of the model with the other parts set to None and the parameter names of
the full model. The model's own forward cannot run such a copy (it embeds, then always applies the final norm),
so ``make_stage_forward`` gives the copy a forward that does what the model's does, part by part:

- GPT-2: ``h = drop(wte(ids) + wpe(positions))`` if the stage has the embeddings; every kept block
  ``h = block(h, causal_mask)``; ``ln_f`` and ``lm_head`` if kept.
- Llama: ``h = embed_tokens(ids)`` if kept; the rotary embedding (no parameters, on every stage)
  ``cos, sin = rotary_emb(h, positions)``; every kept decoder layer; ``norm`` and ``lm_head`` if kept. The
  Mixture-of-Experts families Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE are built the same way (their MoE blocks
  are inside the decoder layers), without sliding-window attention (refused: the stages build the full causal mask).

Positions (0..T-1, no cache) and the causal mask depend only on the sequence length, so every stage rebuilds
them from its input instead of receiving them: only the hidden states cross a stage boundary. Packed documents'
positions (``position_ids`` [B, T], restarting at each document: ``plait.models.inputs``) are given to every stage
by the pipeline runtime; the stages use them instead, and transformers' mask then keeps documents apart. Padding masks
are not supported (plait feeds ``input_ids`` only). Other transformers architectures are refused with a
LayoutError. Tied embeddings (GPT-2's LM head sharing ``wte.weight``) are handled by the split and the
pipeline runtime (a copy on the last stage whose gradient is added to the first stage's; docs/pipeline.md).
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any

import torch
from torch import nn

from plait.errors import LayoutError

SUPPORTED = ("gpt2", "llama", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
"""``config.model_type`` values whose stages ``make_stage_forward`` can run."""


def check_pipeline_support(model: nn.Module) -> None:
    """LayoutError (with the fix) unless ``model`` is a transformers causal LM whose stages plait can run."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in SUPPORTED or not hasattr(model, "lm_head"):
        raise LayoutError(
            f"pipeline parallelism of the transformers model {type(model).__name__} (model_type={model_type!r}) is "
            f"not supported: plait runs the stages of causal LMs of type {', '.join(SUPPORTED)} "
            f"(e.g. GPT2LMHeadModel, LlamaForCausalLM). Fix: use one of those, or pp=1 (dp, tp and ZeRO work on "
            f"any transformers model)."
        )
    config = getattr(model, "config")  # noqa: B009 - a transformers config, typed Any
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise LayoutError(
            f"pipeline parallelism of {type(model).__name__} with sliding-window attention (sliding_window="
            f"{config.sliding_window}) is not supported: plait's stages build the full causal mask. Fix: "
            f"sliding_window=None (or use_sliding_window=False) in the model's config, or pp=1."
        )


def _positions(hidden: torch.Tensor, given: dict[str, Any]) -> torch.Tensor:
    """Packed documents' positions (a stage's keyword ``position_ids``, or plait's ``positions``), else 0..T-1."""
    documents = given.get("position_ids", given.get("positions"))
    if documents is not None:
        return documents.to(hidden.device)
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


@functools.cache
def _cache_keyword() -> str:
    """The name of create_causal_mask's cache argument: ``cache`` (transformers >= 5.24), ``past_key_values``
    before (deprecated in 5.24, to be removed in 5.40)."""
    from transformers.masking_utils import create_causal_mask

    return "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


def _causal_mask(config: Any, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
    from transformers.masking_utils import create_causal_mask

    no_cache: dict[str, Any] = {_cache_keyword(): None}
    return create_causal_mask(
        config=config, inputs_embeds=hidden, attention_mask=None, position_ids=positions, **no_cache
    )


def _gpt2_stage(self: Any, x: torch.Tensor, **given: Any) -> torch.Tensor:
    """GPT2LMHeadModel.forward (no cache, no padding mask) restricted to the parts this stage kept. ``self`` is a
    transformers model, whose submodules are dynamic attributes (typed Any); ``given``: the call's keywords (packed
    documents' positions)."""
    base = self.transformer
    if base.wte is not None:
        hidden = base.drop(base.wte(x) + base.wpe(_positions(x, given)))
    else:
        hidden = x
    positions = _positions(hidden, given)
    mask = _causal_mask(base.config, hidden, positions)
    for block in base.h:
        hidden = block(hidden, None, mask, None, use_cache=False, position_ids=positions)
    if base.ln_f is not None:
        hidden = base.ln_f(hidden)
    return self.lm_head(hidden) if self.lm_head is not None else hidden


def _llama_stage(self: Any, x: torch.Tensor, **given: Any) -> torch.Tensor:
    """LlamaForCausalLM.forward (no cache, no padding mask) restricted to the parts this stage kept (``self`` and
    ``given``: as in ``_gpt2_stage``)."""
    base = self.model
    hidden = base.embed_tokens(x) if base.embed_tokens is not None else x
    positions = _positions(hidden, given)
    mask = _causal_mask(base.config, hidden, positions)
    rotary = base.rotary_emb(hidden, position_ids=positions)
    for layer in base.layers:
        hidden = layer(
            hidden,
            attention_mask=mask,
            position_embeddings=rotary,
            position_ids=positions,
            use_cache=False,  # no cache argument: its name changed in transformers 5.24 (a FutureWarning per call)
        )
    if base.norm is not None:
        hidden = base.norm(hidden)
    return self.lm_head(hidden) if self.lm_head is not None else hidden


_STAGE_FORWARDS = {"gpt2": _gpt2_stage, **{name: _llama_stage for name in SUPPORTED[1:]}}


def make_stage_forward(stage: nn.Module) -> nn.Module:
    """Give a pipeline stage copy of a transformers causal LM the forward above (in place; returns it)."""
    check_pipeline_support(stage)
    model_type = str(getattr(stage, "config").model_type)  # noqa: B009 - a transformers config, typed Any
    stage.forward = types.MethodType(_STAGE_FORWARDS[model_type], stage)
    return stage


__all__ = ["SUPPORTED", "check_pipeline_support", "make_stage_forward"]
