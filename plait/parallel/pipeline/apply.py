"""How ``plait.parallelize`` sets up pipeline parallelism: check the layout and the schedule before any
communication (``plan_pipeline``), then keep this rank's stages (``place_pipeline``).

Rank with pp index r holds the stages its schedule's placement gives it (``Schedule.stages_on``: r, r + p, ...
interleaved; r and 2p - 1 - r in a V, so rank 0 holds both ends and a tie between them stays one parameter on
one rank). With one stage its local model is
that stage; with v > 1 it is one pruned copy of the model holding all of them (what the data-parallel strategy
and the optimizer see, with the full model's parameter names), and each stage runs as a view sharing its
parameters (``split.local_model``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from plait.errors import LayoutError, ScheduleError
from plait.layout import Layout, PipelineSchedule
from plait.parallel.pipeline.schedule import Placement, Schedule, build_schedule
from plait.parallel.pipeline.simulate import simulate
from plait.parallel.pipeline.split import SplitPlan, local_model, plan_split
from plait.parallel.pipeline.stage import PipelineStage


@dataclass(frozen=True)
class PipelinePlan:
    """The schedule to run and how the model is cut (one stage per schedule stage)."""

    schedule: Schedule
    split: SplitPlan


def plan_pipeline(
    model: nn.Module, layout: Layout, cuts: list[int] | None = None, schedule: Schedule | None = None
) -> PipelinePlan | None:
    """None when ``layout.pp == 1``; otherwise the checked plan. Raises LayoutError / ScheduleError (pure checks,
    the same on every rank) for what cannot run."""
    if layout.pp == 1:
        if cuts is not None or schedule is not None:
            raise LayoutError(
                "pipeline_cuts / pipeline_schedule were given, but the layout has pp=1. "
                "Fix: set pp > 1, or leave them out."
            )
        return None
    if schedule is None:
        try:
            schedule = build_schedule(layout.schedule, layout.pp, layout.microbatches, layout.virtual_stages)
        except ScheduleError as error:
            raise LayoutError(f"layout {layout.short()} schedule={layout.schedule!r}: {error}") from error
    expected = (layout.pp, layout.microbatches, layout.virtual_stages)
    if (schedule.p, schedule.m, schedule.v) != expected:
        raise LayoutError(
            f"the pipeline schedule has p={schedule.p} m={schedule.m} v={schedule.v}, but the layout has "
            f"pp={layout.pp} microbatches={layout.microbatches} virtual_stages={layout.virtual_stages}. "
            f"Fix: build the schedule for the layout's numbers, or change the layout."
        )
    simulate(schedule)  # ScheduleError (malformed, wrongly ordered, deadlocking) before any process runs it
    v_schedule = schedule.name if schedule.placement == Placement.V and schedule.v == 2 else None
    split = plan_split(model, schedule.num_stages, cuts, v_schedule=v_schedule)
    for stage in range(split.num_stages):
        if not any(p.requires_grad for path in split.paths_of([stage]) for p in model.get_submodule(path).parameters()):
            raise LayoutError(
                f"pipeline stage {stage} ({split.describe().split('; ')[stage]}) holds no trainable parameters, so "
                f"its rank would have nothing to optimize. Fix: choose pipeline_cuts that give every stage "
                f"parameters (e.g. move a parameter-free first layer into the next stage), or use fewer stages."
            )
    if split.tied and (layout.tp > 1 or layout.schedule == PipelineSchedule.PIPEDREAM):
        what = f"tp={layout.tp}" if layout.tp > 1 else 'schedule="pipedream"'
        raise LayoutError(
            f"{', '.join(first + ' = ' + last for first, last in split.tied)} tie the first and the last pipeline "
            f"stage, which is not supported with {what}. Fix: untie them (for Hugging Face models build them with "
            f"config.tie_word_embeddings=False; otherwise give the LM head its own weight), or use "
            f"{'tp=1' if layout.tp > 1 else 'a synchronous schedule such as 1f1b'}."
        )
    if split.tied and layout.zero == 3:
        raise LayoutError(
            f"{', '.join(first + ' = ' + last for first, last in split.tied)} tie the first and the last pipeline "
            f"stage, which is not supported with zero=3: the pipeline sends the first stage's whole weight to the "
            f"last stage's copy before each step and adds the copy's gradient to it after, but ZeRO-3 keeps only "
            f"1/dp of it between uses. Fix: untie them (for Hugging Face models build them with "
            f"config.tie_word_embeddings=False; otherwise give the LM head its own weight), or use zero=1 or zero=2."
        )
    return PipelinePlan(schedule, split)


def place_pipeline(model: nn.Module, plan: PipelinePlan, pp_index: int) -> tuple[nn.Module, list[PipelineStage]]:
    """This rank's local model and its stages (see the module doc)."""
    stage_ids = plan.schedule.stages_on(pp_index)
    local, views = local_model(model, plan.split, stage_ids)
    stages = [PipelineStage(view, s, plan.schedule.num_stages) for s, view in zip(stage_ids, views)]
    for stage in stages:
        if stage.is_first or stage.is_last:
            stage.tied = plan.split.tied
    return local, stages


__all__ = ["PipelinePlan", "place_pipeline", "plan_pipeline"]
