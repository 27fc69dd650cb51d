"""Cut a model into ``p * v`` pipeline stages whose parameters keep the full model's names.

Two shapes of model can be cut:

- an ``nn.Sequential``: its children are the units; stage k runs a contiguous range of them (the stage is an
  ``nn.Sequential`` holding those children under their original names "3", "4", ..., so ``3.weight`` stays
  ``3.weight``);
- a model keeping its repeated blocks in a ``ModuleDict``/``ModuleList`` named like blocks (``blocks``,
  ``layers``, ``h``, ...; the reference ``GPT``): the blocks are the units. Every module with parameters that
  is registered *before* the block container (on the path from the root to it: embeddings) goes with stage 0,
  every one registered *after* it (final norm, LM head) with the last stage. A stage is a copy of the model in
  which the other stages' blocks are deleted and the other parts set to None, so its forward must tolerate
  that (the reference GPT does: hidden states in when ``tok_embed`` is None, out when ``lm_head`` is None).

Cut points: ``cuts=[3, 6]`` makes three stages starting at units 0, 3 and 6; the default is an even split (the
first ``n % S`` stages get one unit more). An automatic partitioner plugs in by returning such cut points.

Copies are cheap: ``build_stage`` deep-copies only the parts the stage keeps (modules it drops are put in
deepcopy's memo, so they are neither copied nor kept), and ``share=True`` builds a *view* that reuses the
source's modules (several stage views of one rank's local model share its parameters; see ``local_model``).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from torch import nn

from plait.errors import LayoutError
from plait.models.hf import is_hf_model
from plait.models.hf_stages import check_pipeline_support, make_stage_forward
from plait.parallel.blocks import BLOCK_CONTAINER_NAMES, find_block_container


@dataclass(frozen=True)
class SplitPlan:
    """Which units each stage holds: stage k runs units ``bounds[k]:bounds[k+1]`` of ``unit_names``."""

    kind: str
    """"sequential" or "blocks"."""
    container: str
    """Module path of the unit container ("" for an nn.Sequential root, e.g. "blocks" for the GPT)."""
    unit_names: tuple[str, ...]
    bounds: tuple[int, ...]
    first_parts: tuple[str, ...] = ()
    """Module paths (with parameters) that go with stage 0 (registered before the container)."""
    last_parts: tuple[str, ...] = ()
    """Module paths (with parameters) that go with the last stage (registered after the container)."""
    tied: tuple[tuple[str, str], ...] = ()
    """Parameters shared by the first and the last stage (tied embeddings), as (name on stage 0, name on the
    last stage): the last stage holds a copy as a buffer (see ``tie_copy``)."""

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    def units_of(self, stage: int) -> tuple[str, ...]:
        return self.unit_names[self.bounds[stage] : self.bounds[stage + 1]]

    def paths_of(self, stages: list[int] | tuple[int, ...]) -> set[str]:
        """Module paths (units and first/last parts) that the given stages hold."""
        prefix = f"{self.container}." if self.container else ""
        kept = {prefix + name for s in stages for name in self.units_of(s)}
        if 0 in stages:
            kept.update(self.first_parts)
        if self.num_stages - 1 in stages:
            kept.update(self.last_parts)
        return kept

    def all_paths(self) -> set[str]:
        return self.paths_of(list(range(self.num_stages)))

    def describe(self) -> str:
        parts = [
            f"stage {s}: {self.container or 'units'}[{self.bounds[s]}:{self.bounds[s + 1]}]"
            for s in range(self.num_stages)
        ]
        return "; ".join(parts)


def find_units(model: nn.Module) -> tuple[str, str, list[str]]:
    """``(kind, container_path, unit_names)`` of a model the pipeline can cut; LayoutError if there is none."""
    if isinstance(model, nn.Sequential):
        return "sequential", "", [name for name, _ in model.named_children()]
    found = find_block_container(model)
    if found is not None:
        path, container = found
        return "blocks", path, [name for name, _ in container.named_children()]
    raise LayoutError(
        f"pipeline parallelism (pp > 1) cannot cut a {type(model).__name__}: it is not an nn.Sequential and has no "
        f"ModuleDict/ModuleList of blocks named one of {', '.join(BLOCK_CONTAINER_NAMES)}. Fix: give the model as an "
        f"nn.Sequential, keep its repeated blocks in such a container, or set pp=1."
    )


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _outer_parts(model: nn.Module, container: str) -> tuple[list[str], list[str]]:
    """Modules with parameters registered before / after the container, on each level of its path."""
    before: list[str] = []
    after: list[str] = []
    parent, prefix = model, ""
    for name in container.split("."):
        seen = False
        for child_name, child in parent.named_children():
            if child_name == name:
                seen = True
                continue
            if child is not None and _has_params(child):
                (after if seen else before).append(prefix + child_name)
        if any(True for _ in parent.parameters(recurse=False)):
            raise LayoutError(
                f"{type(parent).__name__} {prefix.rstrip('.') or '(the root)'} holds parameters directly, which a "
                f"pipeline stage cannot own. Fix: move them into a submodule (e.g. an nn.Linear or nn.Embedding)."
            )
        parent, prefix = parent.get_submodule(name), f"{prefix}{name}."
    return before, after


def plan_split(
    model: nn.Module, num_stages: int, cuts: list[int] | tuple[int, ...] | None = None, *, v_schedule: str | None = None
) -> SplitPlan:
    """Plan ``num_stages`` stages over the model's units (even split, or the stages starting at ``cuts``).
    ``v_schedule``: the V-shaped schedule (ZB-V, DualPipeV) the stages are for, whose two chunks per rank are fixed:
    a refusal then names the fixes that fit it."""
    kind, container, units = find_units(model)
    n = len(units)
    if num_stages > n:
        what = "children" if kind == "sequential" else f"blocks in '{container}'"
        if v_schedule is None:
            why, fix = "", f"use pp x virtual_stages <= {n} (e.g. pp={max(1, n)} with virtual_stages=1), or a model"
        else:
            why = f": schedule={v_schedule!r} runs two chunks per rank (a V)"
            fix = f"use a model with at least {num_stages} layers, or a schedule of one stage per rank (e.g. "
            fix += f"schedule='zero-bubble' or '1f1b') with pp <= {n}"
        raise LayoutError(
            f"the pipeline needs pp x virtual_stages = {num_stages} stages, but the model has only {n} {what}{why}. "
            f"Fix: {fix}{'' if v_schedule else f' with at least {num_stages} layers'}."
        )
    if cuts is None:
        size, extra = divmod(n, num_stages)
        bounds = [0]
        for stage in range(num_stages):
            bounds.append(bounds[-1] + size + (1 if stage < extra else 0))
    else:
        cuts = list(cuts)
        if len(cuts) != num_stages - 1 or any(not isinstance(c, int) or isinstance(c, bool) for c in cuts):
            raise LayoutError(
                f"cuts={cuts} must list {num_stages - 1} unit indices (where stages 1..{num_stages - 1} start) for "
                f"{num_stages} stages. Fix: e.g. cuts={[round(n * k / num_stages) for k in range(1, num_stages)]}."
            )
        bounds = [0, *cuts, n]
        if any(b <= a for a, b in zip(bounds, bounds[1:])):
            raise LayoutError(
                f"cuts={cuts} must increase strictly within 1..{n - 1} so that every stage holds at least one of the "
                f"{n} units. Fix: e.g. cuts={[round(n * k / num_stages) for k in range(1, num_stages)]}."
            )
    first, last = _outer_parts(model, container) if kind == "blocks" else ([], [])
    plan = SplitPlan(kind, container, tuple(units), tuple(bounds), tuple(first), tuple(last))
    tied = _tied_pairs(model, plan)
    if is_hf_model(model):
        check_pipeline_support(model)
    return dataclasses.replace(plan, tied=tied) if tied else plan


def _remove(root: nn.Module, path: str, container: str) -> None:
    """Delete a unit from its container (keeping the others' names) or set an outer part to None."""
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    if parent_path == container and isinstance(parent, (nn.ModuleDict, nn.ModuleList, nn.Sequential)):
        del parent._modules[name]  # not ``del parent[i]``: ModuleList/Sequential would renumber the rest
    else:
        setattr(parent, name, None)


def build_stage(
    model: nn.Module, plan: SplitPlan, stages: list[int] | tuple[int, ...] | int, share: bool = False
) -> nn.Module:
    """A copy of ``model`` holding only what ``stages`` hold (one stage, or a rank's union of stages).

    Parameter names are those of ``model``. With ``share=True`` the kept parts are ``model``'s own modules
    (a view, for running one stage of a rank's local model); otherwise they are deep copies.
    """
    stages = [stages] if isinstance(stages, int) else list(stages)
    keep = plan.paths_of(stages)
    present = {path for path, _ in model.named_modules()}
    drop = sorted(path for path in plan.all_paths() - keep if path in present)
    memo: dict[int, object] = {}
    for path in drop:
        module = model.get_submodule(path)
        memo[id(module)] = module  # neither copied nor kept: removed from the copy below
    if share:
        for path in keep & present:
            module = model.get_submodule(path)
            memo[id(module)] = module
    part = copy.deepcopy(model, memo)
    for path in drop:
        _remove(part, path, plan.container)
    if plan.num_stages - 1 in stages and 0 not in stages and not share:  # a view shares its rank's model, whose
        for _, name in plan.tied:  # tie was cut when it was built (or kept: a V holds both ends on rank 0)
            tie_copy(part, name)
    if is_hf_model(part):
        make_stage_forward(part)
    return part


def tie_copy(stage: nn.Module, name: str) -> None:
    """Turn the last stage's copy of a tied parameter into a buffer (same name): the first stage owns the
    parameter (the optimizer, the dp reduction and the gradient norm see it once); the pipeline runtime gives
    the copy the owner's values before each step and adds the copy's gradient to the owner's after it."""
    path, _, attr = name.rpartition(".")
    owner = stage.get_submodule(path)
    if attr in owner._parameters:
        param = owner._parameters.pop(attr)
        assert param is not None  # tied names come from named_parameters(), which skips None (absent) entries
        owner.register_buffer(attr, param.detach().clone())


def _tied_pairs(model: nn.Module, plan: SplitPlan) -> tuple[tuple[str, str], ...]:
    """Parameters held by two stages: allowed between the first and the last stage (tied embeddings, Megatron's
    way: a copy on the last stage), refused otherwise."""
    owner: dict[int, tuple[int, str]] = {}
    tied: list[tuple[str, str]] = []
    last = plan.num_stages - 1
    for stage in range(plan.num_stages):
        for path in sorted(plan.paths_of([stage])):
            for name, param in model.get_submodule(path).named_parameters():
                first, first_name = owner.setdefault(id(param), (stage, f"{path}.{name}"))
                if first == stage:
                    continue
                if (first, stage) != (0, last):
                    raise LayoutError(
                        f"parameter {path}.{name} is shared by pipeline stages {first} and {stage} (tied weights "
                        f"across stages; only the first and the last stage may share one, like tied embeddings). "
                        f"Fix: untie them (e.g. give the LM head its own weight, for Hugging Face models "
                        f"config.tie_word_embeddings=False), choose cuts that keep both users in one stage, or use "
                        f"pp=1."
                    )
                tied.append((first_name, f"{path}.{name}"))
    return tuple(tied)


def split_model(model: nn.Module, num_stages: int, cuts: list[int] | tuple[int, ...] | None = None) -> list[nn.Module]:
    """Every stage of ``model`` as its own module (deep copies; names unchanged). See ``plan_split``."""
    plan = plan_split(model, num_stages, cuts)
    return [build_stage(model, plan, stage) for stage in range(plan.num_stages)]


def local_model(model: nn.Module, plan: SplitPlan, stages: list[int]) -> tuple[nn.Module, list[nn.Module]]:
    """This rank's part: one module holding every stage in ``stages`` (what the data-parallel strategy and the
    optimizer see; names unchanged) and one view per stage that shares its parameters (what the pipeline runs)."""
    local = build_stage(model, plan, stages)
    if len(stages) == 1:
        return local, [local]
    return local, [build_stage(local, plan, stage, share=True) for stage in stages]


__all__ = ["SplitPlan", "build_stage", "tie_copy", "find_units", "local_model", "plan_split", "split_model"]
