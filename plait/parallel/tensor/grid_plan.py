"""Plans for 2D / 2.5D / 3D tensor parallelism (``Layout(tp_mode="2d" | "2.5d" | "3d")``): which module becomes
which grid layer, checked purely, then applied in place (parameter names stay the model's).

Under these modes every activation between layers is cut over the grid (``grid.ACTIVATION_PLACEMENT``), so
every module that holds parameters must become a grid layer. Styles:

=================  ===================================================================================
``grid_in``        nn.Linear reading the activation placement (q/k/v, up/gate): Linear2D / Linear2p5D, or in
                   3D a Linear3D reducing over ``tp_dep`` with its output features on ``tp_col``
``grid_out``       nn.Linear writing the activation placement (attention's o, the MLP's down): the same layer in
                   2D / 2.5D; in 3D the reverse orientation (reduce over ``tp_col``, output on ``tp_dep``), so a
                   pair in -> out leaves its input's layout (Bian et al.)
``grid_vocab``     the LM head: a ``grid_in`` layer whose logits stay cut (batch x vocabulary over ``tp_col``)
                   for the grid cross-entropy, gathered whole for any other loss and in evaluation
``grid_embedding`` nn.Embedding -> GridEmbedding (table columns split; ids batch-split)
``grid_norm``      nn.LayerNorm / plait's RMSNorm -> GridNorm (statistics all-reduced over the feature axes)
``grid_enter``     any module: its input is all-gathered over ``tp_col`` once for the ``grid_in`` layers below
                   it (q/k/v share one gather; gate/up too), instead of once per layer
=================  ===================================================================================

Attention heads: the output features of a ``grid_in`` layer are cut over ``tp_col`` (q ranks), so each rank
holds whole heads of its batch block: n_head / q query and n_kv_head / q key/value heads, as in Colossal-AI's
2D / 2.5D / 3D attention; plait's ``Attention`` reads the head counts from the widths, so it runs unchanged.
"""

from __future__ import annotations

import functools

from torch import Tensor, nn

from plait.comm import Comm, all_gather
from plait.errors import LayoutError
from plait.layout import Layout, tp_grid_dims
from plait.logging import get_logger
from plait.models.gpt import GPT
from plait.models.layers import RMSNorm
from plait.parallel.tensor.fields import optional_tensor_field, tensor_field
from plait.parallel.tensor.grid import (
    HEAD_AXIS,
    TP_COL,
    TP_DEP,
    GridLinear,
    Placement,
    split_problems,
    vector_placement,
)
from plait.parallel.tensor.grid_layers import GridEmbedding, GridNorm
from plait.parallel.tensor.linear2d import Linear2D, summa_placements
from plait.parallel.tensor.linear2p5d import Linear2p5D
from plait.parallel.tensor.linear3d import Linear3D, cube_placements
from plait.parallel.tensor.plan import (
    Plan,
    PlanFactory,
    ResolvedPlan,
    gpt_plan,
    input_hook,
    match_plan,
    planned_attention_heads,
    registered_plan,
)

log = get_logger(__name__)

GRID_STYLES = ("grid_in", "grid_out", "grid_vocab", "grid_embedding", "grid_norm", "grid_enter")
LINEAR_GRID_STYLES = ("grid_in", "grid_out", "grid_vocab")
LINEAR_CLASSES: dict[str, type[GridLinear]] = {"2d": Linear2D, "2.5d": Linear2p5D, "3d": Linear3D}


FROM_1D_STYLES = {
    "vocab": "grid_embedding",
    "seq_shard": "grid_embedding",
    "enter": "grid_enter",
    "colwise": "grid_in",
    "rowwise": "grid_out",
    "colwise_vocab": "grid_vocab",
}
"""How a Megatron 1D style maps to a grid style: the column layer of a pair reads the activation layout, the row
layer writes it; the position embedding (SP's "seq_shard") is a grid embedding like the token one."""


def gpt_grid_plan(model: nn.Module) -> Plan:
    """plait's GPT on a grid: its 1D plan with each style mapped by ``FROM_1D_STYLES`` (embeddings split on the
    features, attention and MLP as pairs of grid layers with the heads over ``tp_col``, the LM head cut over batch
    and vocabulary), plus the norms, which 1D keeps replicated."""
    plan = {path: FROM_1D_STYLES[style] for path, style in gpt_plan(model).items()}
    return {**plan, "blocks.*.norm1": "grid_norm", "blocks.*.norm2": "grid_norm", "norm_f": "grid_norm"}


def builtin_grid_plans() -> dict[type, PlanFactory]:
    """Built-in 2D / 2.5D / 3D plans by model class (the same plan serves the three modes)."""
    return {GPT: gpt_grid_plan}


def default_grid_plan(model: nn.Module, mode: str) -> Plan:
    """The registered grid plan of ``model``'s class; LayoutError naming the fix when none is registered."""
    plans = builtin_grid_plans()
    plan = registered_plan(model, plans)
    if plan is not None:
        return plan
    raise LayoutError(
        f"tp_mode={mode!r} has no built-in plan for {type(model).__name__} (built-in: "
        f"{', '.join(c.__name__ for c in plans)}). Fix: pass tp_plan={{module path: style}} with styles from "
        f"{', '.join(GRID_STYLES)} covering every module that holds parameters, or use tp_mode='1d'."
    )


def linear_placements(mode: str, style: str) -> dict[str, Placement]:
    """Weight / bias / input / output placements of the grid layer a linear style makes in ``mode``."""
    if mode != "3d":
        return summa_placements(mode)
    return cube_placements(**_cube_axes(style))


def _cube_axes(style: str) -> dict[str, str]:
    """3D orientation: layers reading the activation placement reduce over tp_dep, the others over tp_col."""
    if style == "grid_out":
        return {"reduce_axis": TP_COL, "out_axis": TP_DEP}
    return {"reduce_axis": TP_DEP, "out_axis": TP_COL}


def resolve_grid_plan(model: nn.Module, plan: Plan, layout: Layout) -> ResolvedPlan:
    """Match ``plan`` against ``model`` and check it for the layout's grid, without communication (the same
    LayoutError on every rank): styles, module types, every parameter in a grid layer, sizes that do not split
    into the grid's blocks, heads that do not split over ``tp_col``."""
    mode, sizes = layout.tp_mode, tp_grid_dims(layout.tp, layout.tp_mode, layout.tp_depth)
    modules = dict(model.named_modules())
    styles = match_plan(model, plan, GRID_STYLES)
    for path, style in styles.items():
        _check_grid_module(path, modules[path], style, mode, sizes)
    _check_every_parameter(model, styles, mode)
    _check_grid_heads(modules, styles, mode, sizes[HEAD_AXIS])
    ordered = {path: styles[path] for path in modules if path in styles}
    return ResolvedPlan(ordered, sequence_parallel=False)


def _check_grid_module(path: str, module: nn.Module, style: str, mode: str, sizes: dict[str, int]) -> None:
    wanted = {"grid_embedding": (nn.Embedding,), "grid_norm": (nn.LayerNorm, RMSNorm)}.get(style, (nn.Linear,))
    if style != "grid_enter" and type(module) not in wanted:
        names = " or ".join(t.__name__ for t in wanted)
        raise LayoutError(
            f"tp plan: {path} is a {type(module).__name__}, but style {style!r} needs a {names}. "
            f"Fix: give {path} a style that fits it, or use tp_mode='1d'."
        )
    tensors: dict[str, tuple[Placement, Tensor]]
    if style in LINEAR_GRID_STYLES:
        placements = linear_placements(mode, style)
        tensors = {"weight": (placements["weight"], tensor_field(module, "weight"))}
        bias = optional_tensor_field(module, "bias")
        if bias is not None:
            tensors["bias"] = (placements["bias"], bias)
    elif style == "grid_embedding":
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            raise LayoutError(
                f"tp plan: {path}: a grid embedding supports neither max_norm, scale_grad_by_freq nor "
                f"sparse=True. Fix: build the embedding without them, or use tp_mode='1d'."
            )
        tensors = {"weight": (vector_placement(mode, dim=1), tensor_field(module, "weight"))}
    elif style == "grid_norm":
        # a LayerNorm names its shape (its weight is None with elementwise_affine=False); plait's RMSNorm has a weight
        shape = (
            module.normalized_shape if isinstance(module, nn.LayerNorm) else (tensor_field(module, "weight").shape[0],)
        )
        if len(shape) != 1:
            raise LayoutError(
                f"tp plan: {path} normalises over {tuple(shape)}; a grid norm takes one feature dim. "
                f"Fix: use tp_mode='1d' for this model."
            )
        tensors = {name: (vector_placement(mode), p) for name, p in module.named_parameters(recurse=False)}
    else:
        return
    for name, (placement, tensor) in tensors.items():
        problems = split_problems(tuple(tensor.shape), placement, sizes)
        if problems:
            raise LayoutError(
                f"tp_mode={mode!r}: {path}.{name} of shape {tuple(tensor.shape)} does not split over the grid "
                f"({'; '.join(problems)}), which style {style!r} needs. Fix: resize the model so that these sizes "
                f"are multiples of the block counts, or choose a smaller tp (or tp_mode='1d')."
            )


def _check_every_parameter(model: nn.Module, styles: dict[str, str], mode: str) -> None:
    """Activations are cut between layers, so a parameter outside a grid layer would see only a block."""
    owners = {path for path, style in styles.items() if style != "grid_enter"}
    for name, _ in model.named_parameters():
        owner = name.rpartition(".")[0]
        if owner not in owners:
            raise LayoutError(
                f"tp_mode={mode!r} cuts every activation over the grid, but parameter {name} belongs to "
                f"{owner or 'the model'}, "
                f"which the tp plan does not make a grid layer. Fix: give {owner or 'it'} one of the styles "
                f"{', '.join(s for s in GRID_STYLES if s != 'grid_enter')}, or use tp_mode='1d'."
            )


def _check_grid_heads(modules: dict[str, nn.Module], styles: dict[str, str], mode: str, q: int) -> None:
    """Whole heads per rank: tp_col's q ranks split the query heads and the key/value heads."""
    for path, heads, label in planned_attention_heads(modules, styles):
        if heads % q:
            raise LayoutError(
                f"tp_mode={mode!r} splits the heads over tp_col={q} ranks, but {path} has {heads} {label}: each rank "
                f"needs whole heads. Fix: use a model whose head counts are multiples of {q}, or a smaller tp (or "
                f"tp_mode='1d')."
            )


def apply_grid_plan(resolved: ResolvedPlan, root: nn.Module, comm: Comm, gather_logits: bool | str) -> list[str]:
    """Swap the planned modules of ``root`` in place for grid layers; ``gather_logits`` is the
    ``gather_output`` of "grid_vocab" heads (True, or "eval" under the grid cross-entropy). Returns the paths."""
    mode = comm.mesh.layout.tp_mode
    modules = dict(root.named_modules())
    entered_paths = [p for p, s in resolved.styles.items() if s == "grid_enter"]
    done = []
    for path, style in resolved.styles.items():
        module = modules[path]
        if style == "grid_enter":
            module.register_forward_pre_hook(
                input_hook(functools.partial(_gather_grid_in, comm, mode), style), with_kwargs=True
            )
            continue
        new = _build_grid(path, module, style, comm, mode, entered_paths, gather_logits)
        parent_path, _, leaf = path.rpartition(".")
        setattr(modules[parent_path] if parent_path else root, leaf, new)
        done.append(path)
    log.info("tensor parallel %s over tp=%d: %d modules swapped", mode, comm.size("tp"), len(done))
    return done


def _gather_grid_in(comm: Comm, mode: str, x: Tensor) -> Tensor:
    """grid_in layers take their input gathered over tp_col: the features (2D / 2.5D) or the batch (3D)."""
    return all_gather(x, comm, TP_COL, dim=0 if mode == "3d" else -1)


def _build_grid(
    path: str, module: nn.Module, style: str, comm: Comm, mode: str, entered_paths: list[str], gather_logits: bool | str
) -> nn.Module:
    # the asserts hold: resolve_grid_plan (_check_grid_module) has checked each planned module's exact type
    if style == "grid_embedding":
        assert isinstance(module, nn.Embedding)
        return GridEmbedding.from_embedding(module, comm, path)
    if style == "grid_norm":
        assert isinstance(module, (nn.LayerNorm, RMSNorm))
        return GridNorm.from_norm(module, comm, path)
    entered = style != "grid_out" and any(path.startswith(p + ".") for p in entered_paths)
    kwargs: dict[str, object] = dict(entered=entered, gather_output=gather_logits if style == "grid_vocab" else False)
    if mode == "3d":
        kwargs.update(_cube_axes(style))
    assert isinstance(module, nn.Linear)
    return LINEAR_CLASSES[mode].from_linear(module, comm, path, **kwargs)


__all__ = [
    "builtin_grid_plans",
    "GRID_STYLES",
    "apply_grid_plan",
    "default_grid_plan",
    "gpt_grid_plan",
    "linear_placements",
    "resolve_grid_plan",
]
