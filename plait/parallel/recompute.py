"""Activation recomputation (gradient checkpointing): whole blocks, their attention cores, or chosen operators.

A recomputed block keeps only its input during forward; backward runs the block's forward again to rebuild
the activations it needs (Chen et al. 2016). Per transformer layer this trades ~34 s b h bytes of stored
activations for 2 s b h (the input) at the cost of one extra forward (Korthikanti et al. 2022, sec. 4).
``Layout.recompute`` picks what is recomputed:

- "full": every block; a tuple of block indices: those blocks. The block's ``forward`` is replaced on the
  instance by one that calls torch.utils.checkpoint (non-reentrant, RNG state preserved, so dropout masks
  replay exactly); module paths and parameter names do not change.
- "selective" (Korthikanti et al. 2022, sec. 5): only the attention core of every block, the part whose
  activations grow with s^2 (softmax output, its dropout mask, the dropped-out probabilities: 5 a s^2 b bytes
  per layer with a math kernel) while its FLOPs are a small share (4 b s^2 h of the block's 24 b s h^2 + 4 b s^2 h).
  The block keeps everything else, and the core keeps its inputs q, k, v. plait's ``Attention``: its
  ``recompute_core`` flag (the core swapped by context parallelism is recomputed as well, ring/Ulysses exchange
  included). Hugging Face models whose attention goes through transformers' ``AttentionInterface`` (GPT-2,
  Llama, ...): the model switches to a registered function that runs the model's previous implementation (eager,
  sdpa, plait's context-parallel kernel) under torch.utils.checkpoint; the attention mask is built as for that
  implementation. With a fused kernel (SDPA flash/memory-efficient, which keep only the log-sum-exp) selective
  recomputation saves little: there is no s^2 term to drop.
- "op" (per-operator selective checkpointing, torchtitan's "selective op" policy, Liang et al. 2024): every block
  runs under torch.utils.checkpoint with a policy (``OperatorPolicy``) that keeps the outputs of the fused attention
  kernels (SDPA flash / memory-efficient / cuDNN) and of the odd-numbered matmuls of the block (1st, 3rd, ...: q,
  v, the MLP's first), and recomputes everything else in backward: norms, rotary, activation functions, dropout
  (its RNG state replayed), the other matmuls and the collectives among them (torchtitan's policy, in its
  parallelize_llama.py, also keeps its tensor-parallel reduce-scatters' outputs; plait runs them again, as under
  "full"). Matmuls are what is costly to redo: keeping every other output halves their recomputation for half
  their memory, while the elementwise work is cheap to redo. With a math attention kernel (unfused: bmm,
  softmax) the core is recomputed as under "selective". Per Llama-style block (s b tokens, width h, kv heads k of
  width d, MLP width f, e bytes an element, tp t) it keeps the block's input and e s b ((h + k d + h + f) / t + h)
  bytes: q, v, the attention output (and its fp32 log-sum-exp), gate, and down's whole output (row-parallel,
  before its reduction; kept though backward never reads it: torch's checkpoint stops a recomputation before the
  region's last matmul). It adds the FLOPs of k, o and up (``ModelSpec.recompute_flops_per_token``). The
  zero-bubble schedule is refused with it: its split backward runs backward twice over a block, and selective
  checkpointing allows once.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from plait.errors import LayoutError
from plait.models.hf import is_hf_model
from plait.models.layers import Attention
from plait.observe.memory import counting_saved_activations, note_kept
from plait.parallel.blocks import BLOCK_CONTAINER_NAMES, find_blocks

SELECTIVE_PREFIX = "plait_selective_"
"""transformers attention implementations plait registers: ``plait_selective_<the implementation it wraps>``."""
INNER_ATTRIBUTE = "plait_recompute_inner"
"""The attribute of each HF attention module holding the attention function that selective recomputation wraps."""


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_recompute(model: nn.Module, recompute: str | tuple[int, ...]) -> list[str]:
    """Make the chosen blocks (or, "selective", attention cores) recompute their activations in backward;
    returns the module paths recomputed. Applying the same choice twice changes nothing."""
    if recompute == "none":
        return []
    if recompute == "selective":
        return apply_selective_recompute(model)
    blocks = find_blocks(model)
    checkpointed = (
        functools.partial(_checkpointed, context_fn=operator_contexts) if recompute == "op" else _checkpointed
    )
    if not blocks:
        raise LayoutError(
            f"recompute={recompute!r} needs the model's blocks, but {type(model).__name__} has no ModuleList/ModuleDict "
            f"named one of {', '.join(BLOCK_CONTAINER_NAMES)}. Fix: set recompute='none', or keep the blocks in such a container."
        )
    if isinstance(recompute, str):
        if recompute not in ("full", "op"):
            raise LayoutError(
                f"recompute={recompute!r} is unknown. Fix: use 'none', 'selective', 'op', 'full' or block indices."
            )
        chosen = blocks
    else:
        bad = [i for i in recompute if i >= len(blocks)]
        if bad:
            raise LayoutError(
                f"recompute lists block(s) {bad}, but the model has {len(blocks)} blocks (0..{len(blocks) - 1}). "
                f"Fix: choose indices below {len(blocks)}."
            )
        chosen = [blocks[i] for i in sorted(set(recompute))]
    for _path, block in chosen:
        if not getattr(block, "_plait_recompute", False):
            block.forward = functools.partial(checkpointed, block.forward)
            block._plait_recompute = True  # type: ignore[assignment]  # Module.__setattr__'s stub: Tensor | Module
    return [path for path, _ in chosen]


# ---------------------------------------------------------------------- "op": chosen operators' outputs kept
_aten = torch.ops.aten
MATMULS = (_aten.mm.default, _aten.addmm.default)
"""The matmuls ``OperatorPolicy`` counts (a Linear on any input runs one of them)."""
FUSED_ATTENTION = tuple(
    getattr(_aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(_aten, name)
)
"""The fused attention kernels whose outputs ``OperatorPolicy`` keeps."""


class OperatorPolicy:
    """torchtitan's per-operator checkpointing policy for one region (a block): keep the outputs of the fused
    attention kernels and of the odd-numbered matmuls, recompute everything else. The forward and its
    recomputation count matmuls separately, so both make the same choices."""

    def __init__(self) -> None:
        self.matmuls = {False: 0, True: 0}  # by ctx.is_recompute
        self.kept_last = False

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        keep = func in FUSED_ATTENTION
        if func in MATMULS:
            self.matmuls[ctx.is_recompute] += 1
            keep = self.matmuls[ctx.is_recompute] % 2 == 1
        self.kept_last = keep
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


class _KeptOutputs(TorchDispatchMode):
    """Hands the outputs ``policy`` keeps to the counting ``SavedActivations`` (entered above the caching mode,
    only while one counts: it sees each operator first, and the policy's choice once the operator has run)."""

    def __init__(self, policy: OperatorPolicy) -> None:
        super().__init__()
        self.policy = policy

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.policy.kept_last = False
        out = func(*args, **(kwargs or {}))
        if self.policy.kept_last:
            for tensor in tree_leaves(out):
                if isinstance(tensor, Tensor):
                    note_kept(tensor)
        return out


@contextlib.contextmanager
def _counted(forward: Any, policy: OperatorPolicy) -> Iterator[None]:
    with forward, _KeptOutputs(policy):
        yield


def operator_contexts() -> tuple[Any, Any]:
    """torch.utils.checkpoint's ``context_fn`` for "op": a fresh ``OperatorPolicy`` per region and call."""
    policy = OperatorPolicy()
    forward, recompute = create_selective_checkpoint_contexts(policy)
    if counting_saved_activations():
        return _counted(forward, policy), recompute
    return forward, recompute


# ---------------------------------------------------------------------- selective: the attention cores
def apply_selective_recompute(model: nn.Module) -> list[str]:
    """Recompute every attention core of ``model`` (plait ``Attention`` layers, or a transformers model's
    attention modules); LayoutError with the fix when it has neither."""
    plait_layers = [(path, module) for path, module in model.named_modules() if isinstance(module, Attention)]
    if plait_layers:
        for _, attention in plait_layers:
            attention.recompute_core = True
        return [path for path, _ in plait_layers]
    if is_hf_model(model):
        return _apply_hf_selective(model)
    raise LayoutError(
        f"recompute='selective' recomputes attention cores, but {type(model).__name__} has neither plait's "
        f"Attention layers nor a transformers attention that goes through AttentionInterface. Fix: use "
        f"recompute='full' (or a list of blocks), which works on any model with a block list."
    )


def _hf_attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Attention modules of a transformers model: classes named *Attention that carry the model config and an
    ``is_causal`` flag (what transformers' attention modules pass to the AttentionInterface functions)."""
    return [
        (path, module)
        for path, module in model.named_modules()
        if type(module).__name__.endswith("Attention")
        and hasattr(module, "is_causal")
        and getattr(module, "config", None) is not None
    ]


def recomputed_attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kwargs: Any
) -> tuple[Tensor, None]:
    """transformers' attention-function signature: the module's wrapped implementation under checkpoint (no
    attention weights are returned: training does not ask for them)."""
    inner = getattr(module, INNER_ATTRIBUTE, None)
    if inner is None:
        raise RuntimeError(
            f"{type(module).__name__} runs a plait selective-recomputation attention but has no wrapped "
            f"implementation: only plait.parallelize with recompute='selective' sets it up."
        )

    def core(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        return inner(module, q, k, v, mask, **kwargs)[0]

    if not module.training or not (query.requires_grad or key.requires_grad or value.requires_grad):
        return core(query, key, value, attention_mask), None
    return checkpoint(core, query, key, value, attention_mask, use_reentrant=False), None


def _apply_hf_selective(model: nn.Module) -> list[str]:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = getattr(model, "config", None)
    modules = _hf_attention_modules(model)
    if config is None or not getattr(type(model), "_supports_attention_backend", False) or not modules:
        raise LayoutError(
            f"recompute='selective' on {type(model).__name__} needs its attention to go through transformers' "
            f"AttentionInterface (a class with _supports_attention_backend = True, as Llama and GPT-2 have in "
            f"transformers >= 4.48). Fix: upgrade transformers, or use recompute='full'."
        )
    current = str(config._attn_implementation)
    if current.startswith(SELECTIVE_PREFIX):  # applied already
        return [path for path, _ in modules]
    if current == "eager":  # each model family has its own eager function, beside its attention class
        inner = {id(m): getattr(sys.modules[type(m).__module__], "eager_attention_forward", None) for _, m in modules}
    else:
        inner = {id(m): ALL_ATTENTION_FUNCTIONS[current] for _, m in modules}
    missing = [path for path, m in modules if inner[id(m)] is None]
    if missing:
        raise LayoutError(
            f"recompute='selective' cannot find the eager attention function of {missing[0]} "
            f"({type(model).__name__}). Fix: load the model with attn_implementation='sdpa', or use recompute='full'."
        )
    name = SELECTIVE_PREFIX + current
    AttentionInterface.register(name, recomputed_attention)  # idempotent; the function is stateless
    if current in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:  # the mask the wrapped implementation expects
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[current])
    for _, module in modules:
        setattr(module, INNER_ATTRIBUTE, inner[id(module)])
    cast(Any, model).set_attn_implementation(name)  # a transformers PreTrainedModel's method
    return [path for path, _ in modules]


__all__ = [
    "BLOCK_CONTAINER_NAMES",
    "apply_recompute",
    "apply_selective_recompute",
    "find_blocks",
    "operator_contexts",
    "OperatorPolicy",
    "recomputed_attention",
]
