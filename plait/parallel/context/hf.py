"""Context parallelism for Hugging Face transformers models (Llama, GPT-2, any model whose attention goes
through transformers' ``AttentionInterface``).

transformers >= 4.48 dispatches every attention call of such a model to ``ALL_ATTENTION_FUNCTIONS[
config._attn_implementation](module, q, k, v, mask, scaling=..., dropout=...)``, with q [B, H, T, D] and the
distinct key/value heads k, v [B, KV, T, D]. plait registers one stateless function under ``ATTENTION_NAME``
and switches the model to it (``set_attn_implementation``); the function runs the ring or Ulysses kernel that
``apply_hf_context_parallel`` attached to that very attention module (``module.plait_context_core``), so the
cp group's sharding reaches the kernel through the module, never through a global. The model's own code is
untouched: q, k, v are projected (and rotated by RoPE) on this rank's tokens only.

The sequence is fed through the model's ``position_ids``: a forward pre-hook cuts ``input_ids`` [B, T] to
this rank's T/cp positions (zigzag for ring, contiguous for Ulysses) and passes those global positions as
``position_ids`` [1, T/cp], which Llama turns into its RoPE angles and GPT-2 into its learned position
embeddings. transformers builds no mask for an attention implementation without a registered mask function,
so the kernels apply the causal mask themselves; padding masks are refused (pack sequences instead).

Packed documents (``position_ids`` [B, T] given by the caller: ``plait.models.inputs``): the pre-hook slices them
to this rank's tokens as it slices ``input_ids`` and keeps them on the model's handle for this forward
(``documents``); the attention function hands them to the kernel, which then never attends across a document.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from plait.comm import Comm
from plait.errors import LayoutError
from plait.layout import Layout
from plait.parallel.context.hooks import AXIS, ContextParallelModel
from plait.parallel.context.plan import ContextPlan, check_dropout, check_positions_argument, check_ulysses_heads
from plait.parallel.context.ring import RingAttention
from plait.parallel.context.sharding import SequenceSharding
from plait.parallel.context.ulysses import UlyssesAttention

ATTENTION_NAME = "plait_context_parallel"
"""The key plait registers in transformers' AttentionInterface (and sets as ``config._attn_implementation``)."""
CORE_ATTRIBUTE = "plait_context_core"
"""The attribute of each HF attention module that holds its ring/Ulysses kernel."""
HANDLE_ATTRIBUTE = "plait_context_handle"
"""The attribute of each HF attention module that holds the model's hooks (this forward's document positions)."""


def context_parallel_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function signature: this rank's queries over the whole (sharded) sequence,
    returned as [B, T/cp, H, D] like every AttentionInterface function (no attention weights)."""
    core = getattr(module, CORE_ATTRIBUTE, None)
    if core is None:
        raise RuntimeError(
            f"{type(module).__name__} runs attn_implementation={ATTENTION_NAME!r} but has no context-parallel "
            f"kernel: only plait.parallelize with cp > 1 sets this implementation up."
        )
    if dropout:
        raise RuntimeError(f"attention dropout={dropout} reached the context-parallel kernel (refused at planning)")
    if attention_mask is not None:
        raise RuntimeError("a prepared attention mask reached the context-parallel kernel; it applies causality itself")
    handle = getattr(module, HANDLE_ATTRIBUTE, None)
    documents = handle.documents if handle is not None else None
    return core.attend(query, key, value, scale=scaling, positions=documents).transpose(1, 2), None


def _attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The attention modules of a transformers model: those whose class is named *Attention and that carry the
    model config and an ``is_causal`` flag (what transformers' attention modules pass to the interface)."""
    return [
        (path, module)
        for path, module in model.named_modules()
        if type(module).__name__.endswith("Attention")
        and hasattr(module, "is_causal")
        and getattr(module, "config", None) is not None
    ]


def plan_hf_context_parallel(model: nn.Module, layout: Layout) -> ContextPlan:
    """Pure checks that a transformers model can run with ``layout.cp``, raising LayoutError with the fix."""
    name, config = type(model).__name__, getattr(model, "config", None)
    if not getattr(type(model), "_supports_attention_backend", False) or config is None:
        raise LayoutError(
            f"context parallelism of {name} needs its attention to go through transformers' AttentionInterface "
            f"(a class with _supports_attention_backend = True, as Llama and GPT-2 have in transformers >= 4.48); "
            f"{name} does not. Fix: upgrade transformers, use such a model (or plait's GPT), or cp=1."
        )
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False):
        raise LayoutError(
            f"{name} has cross-attention (encoder-decoder or add_cross_attention=True), whose keys come from "
            f"another sequence that context parallelism does not shard. Fix: a decoder-only model, or cp=1."
        )
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise LayoutError(
            f"{name} uses sliding-window attention (sliding_window={config.sliding_window}); the context-parallel "
            f"kernels compute full causal attention. Fix: sliding_window=None, or cp=1."
        )
    check_positions_argument(model, "position_ids", "a model whose forward takes position_ids")
    check_dropout(name, getattr(config, "attention_dropout", 0.0) or getattr(config, "attn_pdrop", 0.0))
    modules = _attention_modules(model)
    if not modules:
        raise LayoutError(f"no attention modules found in {name}. Fix: use cp=1 for this model.")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for path, _ in modules:
        check_ulysses_heads(path, heads, kv_heads, layout)
    paths = tuple(path for path, _ in modules)
    return ContextPlan(layout.cp_mode, layout.cp, paths, (heads // kv_heads,) * len(paths), hugging_face=True)


class HuggingFaceContextParallelModel(ContextParallelModel):
    """The sequence-sharding hooks of a transformers model: positions go in as ``position_ids``; ``documents``
    holds this forward's packed-document positions of this rank's tokens (None without documents)."""

    documents: Tensor | None = None

    def local_call(
        self, local_tokens: Tensor, index: Tensor, rest: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if rest:
            raise TypeError(
                f"a context-parallel {type(self.model).__name__} takes input_ids positionally and "
                f"everything else by keyword (attention_mask=..., position_ids=...)"
            )
        mask = kwargs.pop("attention_mask", None)
        if mask is not None and not bool(mask.all()):
            raise LayoutError(
                "context parallelism does not take padding masks (attention_mask with zeros): the kernels apply "
                "the causal mask only. Fix: pack the sequences so that no token is padding, or use cp=1."
            )
        given = kwargs.get("position_ids")
        positions = index.unsqueeze(0) if given is None else given.index_select(-1, index)
        self.documents = None if given is None else positions.expand(local_tokens.shape[0], -1)
        return (local_tokens,), {**kwargs, "position_ids": positions}


def apply_hf_context_parallel(
    model: nn.Module, plan: ContextPlan, sharding: SequenceSharding, comm: Comm
) -> HuggingFaceContextParallelModel:
    """Register the attention function, attach a kernel to every attention module, switch the model to it."""
    from transformers import AttentionInterface, PreTrainedModel

    if not isinstance(model, PreTrainedModel):  # plan_hf_context_parallel has refused other classes already
        raise LayoutError(
            f"context parallelism of a transformers model needs a PreTrainedModel (set_attn_implementation); "
            f"{type(model).__name__} is not one. Fix: pass the model itself (e.g. LlamaForCausalLM), or use cp=1."
        )
    AttentionInterface.register(ATTENTION_NAME, context_parallel_attention)  # idempotent; the function is stateless
    core_class = RingAttention if plan.mode == "ring" else UlyssesAttention
    kv_groups = dict(zip(plan.attention_paths, plan.kv_groups))
    handle = HuggingFaceContextParallelModel(model, sharding, comm)
    for path, module in _attention_modules(model):
        core = core_class(comm, sharding, kv_group=kv_groups[path], causal=bool(module.is_causal), axis=AXIS)
        setattr(module, CORE_ATTRIBUTE, core)
        setattr(module, HANDLE_ATTRIBUTE, handle)  # a plain attribute (the hooks, not a submodule)
    model.set_attn_implementation(ATTENTION_NAME)
    return handle


__all__ = [
    "ATTENTION_NAME",
    "HuggingFaceContextParallelModel",
    "apply_hf_context_parallel",
    "context_parallel_attention",
    "plan_hf_context_parallel",
]
