"""Tensor-parallel plans as data: ``{module path pattern: style}``, checked purely, then applied in place.

A pattern is a dotted module path in which a ``*`` component matches any one name (``blocks.*.attn.q``). Styles:

=================  ===================================================================================
``colwise``        nn.Linear -> ColumnParallelLinear: output features split; f at its input
``colwise_gather`` the same, output all-gathered back to whole (any consumer works)
``colwise_vocab``  the LM head: logits stay split over the vocabulary when the loss is vocab-parallel
                   cross-entropy, else they are gathered (``parallelize`` decides, from the loss)
``colwise_fused_qkv`` a fused [q | k | v] projection (GPT-2's c_attn): column parallel with each third split
                   separately, so each rank holds [q_i | k_i | v_i], its heads of each, in the model's layout
``rowwise``        nn.Linear -> RowParallelLinear: input features split; g (all-reduce) at its output
``vocab``          nn.Embedding -> VocabParallelEmbedding: rows split, partial lookups all-reduced
``enter``          any module: its first input enters the tp region once (f: identity fwd / all-reduce bwd;
                   all-gather of the sequence under SP) for all the column layers below it (Megatron's f at
                   the input of attention and MLP: one collective instead of one per q/k/v or gate/up)
``seq_shard``      any module: under sequence parallelism its output keeps this rank's sequence chunk
                   (dim -2; e.g. a position embedding added to the sequence-split token embeddings)
=================  ===================================================================================

Linear styles take an nn.Linear or a transformers ``Conv1D`` (weight [in, out]; recognised by name, so plait needs
no transformers to import). The built-in plan for a model is found by class in ``builtin_plans(model)``, a table
built on each call (no registry filled at import): plait's GPT, and for a model of the ``transformers`` package the
plans of ``hf_plans`` (Hugging Face GPT-2 and Llama, imported only then). ``attention_heads`` tells the checks how
many heads such a third-party attention module has and, after the swap, sets its per-rank head counts. Any other
model passes its plan as ``parallelize(..., tp_plan=...)``.
Swapped modules take the place of the originals, so parameter names stay the model's; two planned modules that
shared a weight (tied embeddings) share the slice afterwards, which is the same slice for "vocab" and a
"colwise"/"colwise_vocab" head (rows [i V/t, (i+1) V/t) of the [V, d] table).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import Tensor, nn

from plait.comm import Comm, copy_to
from plait.errors import LayoutError
from plait.logging import get_logger
from plait.models.gpt import GPT
from plait.models.layers import Attention
from plait.parallel.tensor.fields import int_field, tensor_field
from plait.parallel.tensor.layers import (
    AXIS,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_sequence,
    is_tp_sharded,
    tp_shard_dim,
)

log = get_logger(__name__)

Plan = dict[str, str]
STYLES = ("colwise", "colwise_gather", "colwise_vocab", "colwise_fused_qkv", "rowwise", "vocab", "enter", "seq_shard")
LINEAR_STYLES = ("colwise", "colwise_gather", "colwise_vocab", "colwise_fused_qkv", "rowwise")
FUSED_PARTS = {"colwise_fused_qkv": 3}
PADDED_STYLES = ("vocab", "colwise_vocab")
"""The styles whose split size (the vocabulary) ``Layout(tp_pad_vocab=True)`` pads to a multiple of tp."""
INPUT_KEYWORDS = ("hidden_states", "x", "input")
"""Where an "enter" module's input is when it is called with keywords only (HF Llama: self_attn(hidden_states=...))."""
PlanFactory = Callable[[nn.Module], Plan]
TRANSFORMERS = "transformers."
"""Classes from modules starting with this come from Hugging Face transformers (plans in ``hf_plans``)."""


@dataclass(frozen=True)
class AttentionHeads:
    """How tensor parallelism sees a third-party attention module: ``heads(module)`` gives {label: count} for
    the checks (tp must divide each), ``localize(module, tp)`` sets its per-rank head attributes after the swap
    (None: its forward infers them), ``sequence_parallel``: whether its model works under Megatron-SP."""

    heads: Callable[[nn.Module], dict[str, int]]
    localize: Callable[[nn.Module, int], None] | None = None
    sequence_parallel: bool = False


def _from_transformers(obj: object) -> bool:
    return any(cls.__module__.startswith(TRANSFORMERS) for cls in type(obj).__mro__)


def builtin_plans(model: nn.Module) -> dict[type, PlanFactory]:
    """The built-in plans by model class that apply to ``model``'s library, built on this call: plait's GPT, plus
    Hugging Face GPT-2 and Llama when ``model`` comes from transformers (``hf_plans`` is imported only then)."""
    plans: dict[type, PlanFactory] = {GPT: gpt_plan}
    if _from_transformers(model):
        from plait.parallel.tensor import hf_plans

        plans.update(hf_plans.plans())
    return plans


def attention_heads(module: nn.Module) -> AttentionHeads | None:
    """How tensor parallelism sees ``module`` if it is a third-party attention module plait knows (Hugging Face
    GPT-2 / Llama attention: ``hf_plans``), else None (plait's own ``Attention`` is checked directly)."""
    if not _from_transformers(module):
        return None
    from plait.parallel.tensor import hf_plans

    return hf_plans.attention_heads().get(type(module))


def default_plan(model: nn.Module) -> Plan:
    """The built-in plan of ``model``'s class; LayoutError naming the fix when there is none."""
    plans = builtin_plans(model)
    plan = registered_plan(model, plans)
    if plan is not None:
        return plan
    raise LayoutError(
        f"tensor parallelism has no built-in plan for {type(model).__name__} (built-in: "
        f"{', '.join(c.__name__ for c in plans)}). Fix: pass tp_plan={{module path: style}}, e.g. "
        f"{{'mlp.up': 'colwise', 'mlp.down': 'rowwise'}}, with styles from {', '.join(STYLES)}."
    )


def registered_plan(model: nn.Module, registry: dict[type, PlanFactory]) -> Plan | None:
    """The plan ``registry`` holds for the most derived class of ``model`` (None when it holds none)."""
    for cls in type(model).__mro__:
        if cls in registry:
            return registry[cls](model)
    return None


def gpt_plan(model: nn.Module) -> Plan:
    """plait's GPT: vocab-parallel embedding, heads split in attention (q/k/v colwise, o rowwise), the MLP split
    on its hidden width, the LM head split on the vocabulary; norms replicated. Mixture-of-Experts blocks: the
    router and the routed experts stay whole on every tp rank (expert parallelism splits experts over the data
    ranks instead: ``plait.parallel.expert``), the shared experts' MLP is split like a dense MLP; the MoE layer
    itself is no tp region, so under sequence parallelism each tp rank routes its own chunk of the sequence."""
    assert isinstance(model, GPT)
    config = model.config
    plan: Plan = {
        "tok_embed": "vocab",
        "blocks.*.attn": "enter",
        "blocks.*.attn.q": "colwise",
        "blocks.*.attn.k": "colwise",
        "blocks.*.attn.v": "colwise",
        "blocks.*.attn.o": "rowwise",
        "lm_head": "colwise_vocab",
    }
    dense = [index for index in range(config.n_layer) if not config.is_moe_layer(index)]
    mlps = ["blocks.*.mlp"] if len(dense) == config.n_layer else [f"blocks.{index}.mlp" for index in dense]
    if config.n_experts and config.n_shared_experts:
        mlps.append("blocks.*.mlp.shared")  # only MoE blocks have one
    for mlp in mlps:
        plan.update({mlp: "enter", f"{mlp}.up": "colwise", f"{mlp}.down": "rowwise"})
        if config.mlp == "swiglu":
            plan[f"{mlp}.gate"] = "colwise"
    if model.pos_embed is not None:
        plan["pos_embed"] = "seq_shard"
    return plan


def _matches(pattern: str, path: str) -> bool:
    parts, names = pattern.split("."), path.split(".")
    return len(parts) == len(names) and all(fnmatch.fnmatchcase(n, p) for p, n in zip(parts, names))


@dataclass(frozen=True)
class ResolvedPlan:
    """A checked plan: the style of every matched module path (in model order)."""

    styles: dict[str, str]
    sequence_parallel: bool
    pad_vocab: bool = False


def resolve_plan(
    model: nn.Module, plan: Plan, tp: int, sequence_parallel: bool = False, pad_vocab: bool = False
) -> ResolvedPlan:
    """Match ``plan`` against ``model`` and check it for ``tp`` ranks, without communication (the same
    LayoutError on every rank): unknown styles, patterns matching nothing, wrong module types, sizes that do
    not split (``pad_vocab``: the vocabulary of "vocab" / "colwise_vocab" is padded instead), heads / kv heads
    that do not split, a sequence that does not split under SP."""
    modules = dict(model.named_modules())
    styles = match_plan(model, plan, STYLES)
    for path, style in styles.items():
        _check_module(path, modules[path], style, tp, pad_vocab)
    _check_heads(modules, styles, tp)
    _check_known_attention(modules, styles, tp, sequence_parallel)
    if sequence_parallel:
        seq_len = getattr(getattr(model, "config", None), "seq_len", None)
        if isinstance(seq_len, int) and seq_len % tp:
            raise LayoutError(
                f"sequence_parallel=True splits the sequence over tp={tp}, but {type(model).__name__} has "
                f"seq_len={seq_len}. Fix: use a sequence length that is a multiple of {tp}, or sequence_parallel=False."
            )
    ordered = {path: styles[path] for path in modules if path in styles}
    return ResolvedPlan(ordered, sequence_parallel, pad_vocab)


def match_plan(model: nn.Module, plan: Plan, allowed: tuple[str, ...]) -> dict[str, str]:
    """``{module path: style}`` for every module a plan pattern matches; LayoutError for a style not in
    ``allowed``, a pattern naming no module (with near names), or a module given two styles. Pure."""
    if not isinstance(plan, dict) or not plan:
        raise LayoutError(f"a tensor-parallel plan is a non-empty dict {{module path: style}}, got {plan!r}.")
    modules = dict(model.named_modules())
    styles: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in allowed:
            raise LayoutError(
                f"tp plan entry {pattern!r}: unknown style {style!r}. Fix: use one of {', '.join(allowed)}."
            )
        hits = [path for path in modules if path and _matches(pattern, path)]
        if not hits:
            near = [p for p in modules if p and p.rsplit(".", 1)[-1] == pattern.rsplit(".", 1)[-1]][:3]
            raise LayoutError(
                f"tp plan entry {pattern!r} names no module of {type(model).__name__}"
                + (f" (modules with that name: {', '.join(near)})" if near else "")
                + ". Fix: use module paths from model.named_modules(), with '*' for one path component."
            )
        for path in hits:
            if path in styles and styles[path] != style:
                raise LayoutError(
                    f"{path} gets two styles from the tp plan ({styles[path]!r}, {style!r}). Fix: keep one."
                )
            styles[path] = style
    return styles


def is_conv1d(module: nn.Module) -> bool:
    """A transformers ``Conv1D`` (Y = X W + b, weight [in, out] = [nx, nf]), told by name and fields."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def linear_sizes(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of an nn.Linear or a Conv1D."""
    if is_conv1d(module):
        return int_field(module, "nx"), int_field(module, "nf")
    return int_field(module, "in_features"), int_field(module, "out_features")


def _check_module(path: str, module: nn.Module, style: str, tp: int, pad_vocab: bool = False) -> None:
    if style in LINEAR_STYLES and type(module) is not nn.Linear and not is_conv1d(module):
        raise LayoutError(
            f"tp plan: {path} is a {type(module).__name__}, but style {style!r} needs an nn.Linear "
            f"(or a transformers Conv1D). Fix: give {path} a style that fits it, or remove it from the plan."
        )
    if style == "vocab" and type(module) is not nn.Embedding:
        raise LayoutError(
            f"tp plan: {path} is a {type(module).__name__}, but style 'vocab' needs an nn.Embedding. "
            f"Fix: give {path} a style that fits it, or remove it from the plan."
        )
    if style in ("enter", "seq_shard") or (pad_vocab and style in PADDED_STYLES):
        return
    if style == "rowwise":
        what, size = "in_features", linear_sizes(module)[0]
    elif style == "vocab":
        what, size = "vocabulary (num_embeddings)", int_field(module, "num_embeddings")
    else:
        what, size = "out_features", linear_sizes(module)[1]
    parts = FUSED_PARTS.get(style, 1)
    if size % parts or (size // parts) % tp:
        fused = f" (each of its {parts} fused blocks: {size // parts})" if parts > 1 else ""
        raise LayoutError(
            f"tp={tp} does not divide the {what} of {path} ({size}){fused}, which style {style!r} splits. "
            f"Fix: choose tp dividing {size // parts} (or resize the model"
            + (", or pad the vocabulary with Layout(tp_pad_vocab=True)" if style in PADDED_STYLES else "")
            + ")."
        )


def planned_attention_heads(modules: dict[str, nn.Module], styles: dict[str, str]) -> list[tuple[str, int, str]]:
    """``(path, heads, label)`` for the query and the key/value heads of every plait ``Attention`` whose q is
    planned (the counts read off the projection widths)."""
    out = []
    for path, module in modules.items():
        if isinstance(module, Attention) and f"{path}.q" in styles:
            for proj, label in (("q", "attention heads (n_head)"), ("k", "key/value heads (n_kv_head)")):
                out.append((path, getattr(module, proj).out_features // module.head_dim, label))
    return out


def _check_heads(modules: dict[str, nn.Module], styles: dict[str, str], tp: int) -> None:
    """Whole attention heads per rank: tp must divide the query heads and the key/value heads."""
    for path, heads, label in planned_attention_heads(modules, styles):
        if heads % tp:
            raise LayoutError(
                f"tp={tp} does not divide the {heads} {label} of {path}: tensor parallelism gives each rank whole "
                f"heads. Fix: choose tp dividing {heads} (e.g. tp={_largest_divisor(heads, tp)})."
            )


def _check_known_attention(
    modules: dict[str, nn.Module], styles: dict[str, str], tp: int, sequence_parallel: bool
) -> None:
    """The same head check for the third-party attention modules ``attention_heads`` knows (Hugging Face's)."""
    for path, module in modules.items():
        spec = attention_heads(module)
        if spec is None or not any(p.startswith(path + ".") for p in styles):
            continue
        if sequence_parallel and not spec.sequence_parallel:
            raise LayoutError(
                f"sequence_parallel=True is not supported for {type(module).__name__} ({path}). "
                f"Fix: use sequence_parallel=False with this model."
            )
        for label, heads in spec.heads(module).items():
            if heads % tp:
                raise LayoutError(
                    f"tp={tp} does not divide the {heads} {label} of {path}: tensor parallelism gives each rank whole "
                    f"heads. Fix: choose tp dividing {heads} (e.g. tp={_largest_divisor(heads, tp)})."
                )


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, at_most + 1) if n % d == 0)


def _enter_hook(comm: Comm, sequence_parallel: bool) -> Callable[..., tuple]:
    """Megatron's f (or the SP all-gather along the sequence) at a module's input (``input_hook``)."""

    def enter(x: Tensor) -> Tensor:
        return gather_sequence(x, comm, AXIS) if sequence_parallel else copy_to(x, comm, AXIS)

    return input_hook(enter, "enter")


def input_hook(enter: Callable[[Tensor], Tensor], style: str) -> Callable[..., tuple]:
    """Forward pre-hook (with kwargs) applying ``enter`` to the module's first positional input, or else to its
    ``INPUT_KEYWORDS`` keyword input (LayoutError naming ``style`` when there is neither)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        if args:
            return (enter(args[0]), *args[1:]), kwargs
        for key in INPUT_KEYWORDS:
            if key in kwargs:
                return args, {**kwargs, key: enter(kwargs[key])}
        raise LayoutError(
            f"tp style {style!r} on {type(module).__name__}: it was called without a positional input or one of the "
            f"keywords {', '.join(INPUT_KEYWORDS)}, so its input cannot enter the tp region. Fix: remove {style!r} "
            f"from the plan for this module (its layers then gather their inputs themselves)."
        )

    return hook


def _seq_shard_hook(comm: Comm) -> Callable[..., Tensor]:
    """Forward hook: keep this rank's contiguous chunk of the output along dim -2 (the sequence)."""

    def hook(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        parts, index = comm.size(AXIS), comm.mesh.index(AXIS)
        length = output.shape[-2]
        if length % parts:
            raise LayoutError(
                f"sequence parallelism: a sequence of {length} does not split over tp={parts}. "
                f"Fix: use a sequence length that is a multiple of {parts}."
            )
        chunk = length // parts
        return output.narrow(-2, index * chunk, chunk)

    return hook


def _build(
    path: str,
    module: nn.Module,
    style: str,
    comm: Comm,
    resolved: ResolvedPlan,
    entered: bool,
    gather_logits: bool | str,
) -> nn.Module:
    transposed, sequence_parallel = is_conv1d(module), resolved.sequence_parallel
    pad = resolved.pad_vocab and style in PADDED_STYLES
    if style == "rowwise":
        return RowParallelLinear.from_linear(module, comm, AXIS, sequence_parallel, name=path, transposed=transposed)
    if style == "vocab":
        assert isinstance(module, nn.Embedding)  # resolve_plan (_check_module) has checked: exactly an nn.Embedding
        return VocabParallelEmbedding.from_embedding(module, comm, AXIS, sequence_parallel, name=path, pad=pad)
    mode = "entered" if entered else ("sequence" if sequence_parallel else "copy")
    gather = True if style == "colwise_gather" else (gather_logits if style == "colwise_vocab" else False)
    return ColumnParallelLinear.from_linear(
        module,
        comm,
        AXIS,
        gather,
        mode,
        name=path,
        transposed=transposed,
        fused_parts=FUSED_PARTS.get(style, 1),
        pad=pad,
    )


def _tie(new: nn.Module, original: nn.Module, tied: dict[int, nn.Module], path: str) -> None:
    """Two planned modules that shared a weight (tied embeddings) share the new slice, which must be the same one."""
    first = tied.setdefault(id(original.weight), new)
    if first is new:
        return
    first_weight, new_weight = tensor_field(first, "weight"), tensor_field(new, "weight")
    same = (
        first_weight.shape == new_weight.shape
        and tp_shard_dim(first_weight) == tp_shard_dim(new_weight)
        and getattr(first_weight, "tp_fused_parts", 1) == getattr(new_weight, "tp_fused_parts", 1)
    )
    if not same:
        raise LayoutError(
            f"tp plan: {path} shares its weight with another planned module, but their styles split it "
            f"differently. Fix: give tied modules matching styles ('vocab' with 'colwise_vocab')."
        )
    new.weight = first_weight


def apply_plan(
    resolved: ResolvedPlan, roots: Iterable[nn.Module], comm: Comm, gather_logits: bool | str = True
) -> list[str]:
    """Swap the planned modules in place under every root in ``roots`` (a pipeline rank's local model and its
    stage views share modules: a module found under several roots is swapped by the same parallel layer).
    Paths absent from a root (another pipeline stage's) are skipped. ``gather_logits`` is the
    ``gather_output`` of "colwise_vocab" heads (True, False, or "eval"). Returns the swapped paths."""
    roots = list({id(root): root for root in roots}.values())
    swapped: dict[int, nn.Module] = {}
    tied: dict[int, nn.Module] = {}
    done: list[str] = []
    entered_paths = [p for p, s in resolved.styles.items() if s == "enter"]
    for path, style in resolved.styles.items():
        for root in roots:
            modules = dict(root.named_modules())
            if path not in modules:
                continue
            module = modules[path]
            if style == "enter":
                if not getattr(module, "_plait_tp_enter", False):
                    module.register_forward_pre_hook(_enter_hook(comm, resolved.sequence_parallel), with_kwargs=True)
                    module._plait_tp_enter = True
                continue
            if style == "seq_shard":
                if resolved.sequence_parallel and not getattr(module, "_plait_tp_seq_shard", False):
                    module.register_forward_hook(_seq_shard_hook(comm))
                    module._plait_tp_seq_shard = True
                continue
            if any(module is new for new in swapped.values()):
                continue  # reached again through another root that shares it: already swapped
            if id(module) not in swapped:
                entered = style != "rowwise" and any(path.startswith(p + ".") for p in entered_paths)
                swapped[id(module)] = _build(path, module, style, comm, resolved, entered, gather_logits)
                _tie(swapped[id(module)], module, tied, path)
                done.append(path)
            parent_path, _, leaf = path.rpartition(".")
            setattr(modules[parent_path] if parent_path else root, leaf, swapped[id(module)])
    _localize_attention(roots, done, comm.size(AXIS))
    if resolved.sequence_parallel:
        for root in roots:
            mark_sequence_partial(root)
    log.info(
        "tensor parallel over tp=%d: %d modules swapped (sequence_parallel=%s)",
        comm.size(AXIS),
        len(done),
        resolved.sequence_parallel,
    )
    return done


def _localize_attention(roots: list[nn.Module], swapped: list[str], tp: int) -> None:
    """Known third-party attention modules with swapped projections get their per-rank head counts (once each)."""
    for root in roots:
        for path, module in root.named_modules():
            spec = attention_heads(module)
            if spec is None or spec.localize is None or getattr(module, "_plait_tp_localized", False):
                continue
            if any(p.startswith(path + ".") for p in swapped):
                spec.localize(module, tp)
                module._plait_tp_localized = True


def mark_sequence_partial(model: nn.Module) -> None:
    """Under sequence parallelism every replicated parameter (norms, row-parallel biases, position embeddings)
    sees only this rank's sequence chunk, so its gradient is a partial sum over tp: tag it for the strategy."""
    for param in model.parameters():
        if not is_tp_sharded(param):
            param.sequence_partial = True  # type: ignore[attr-defined]


__all__ = [
    "attention_heads",
    "builtin_plans",
    "STYLES",
    "AttentionHeads",
    "Plan",
    "ResolvedPlan",
    "apply_plan",
    "default_plan",
    "gpt_plan",
    "input_hook",
    "is_conv1d",
    "match_plan",
    "planned_attention_heads",
    "registered_plan",
    "resolve_plan",
]
