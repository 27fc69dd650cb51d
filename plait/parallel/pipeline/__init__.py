"""Pipeline parallelism: schedules as data, their simulator (and, from ``plait.observe``, their pictures), the
runtime that executes them, and PipeDream.

    from plait.parallel.pipeline import build_schedule, simulate, draw_schedule
    schedule = build_schedule("1f1b", p=4, m=8)      # or Schedule.from_text / from_csv
    print(schedule.to_text())                        # "0F0 0F1 0F2 0F3 0B0 ..." one line per rank
    result = simulate(schedule, {"F": 1, "B": 2})    # raises ScheduleError on a deadlock
    draw_schedule(result, "1f1b.png")

Running a pipeline (``split.py`` cuts the model, ``stage.py`` runs one chunk, ``runtime.py`` executes the lowered
schedule with batched p2p) is set up by ``plait.parallelize`` for ``Layout(pp > 1)``. Where to cut the model:
``plait.planner.partition.auto_partition(gpt_layers(model), tokens, p)``. A real run's timeline, for the same
pictures: ``engine.pipeline_timeline()`` (``measured.py``). See docs/pipeline.md.
"""

from plait.observe.pipeline_picture import draw_schedule
from plait.parallel.pipeline.generators import (
    GENERATORS,
    gpipe,
    interleaved,
    naive,
    one_f_one_b,
    pipedream,
    zero_bubble,
)
from plait.parallel.pipeline.measured import gather_timeline
from plait.parallel.pipeline.pipedream import PipeDreamOptions, PipeDreamRunner, replica_batch, round_robin
from plait.parallel.pipeline.runtime import PipelineRunner, TensorMeta, check_schedule
from plait.parallel.pipeline.schedule import (
    COMM_KINDS,
    COMPUTE_KINDS,
    KINDS,
    Action,
    Schedule,
    ScheduleError,
    build_schedule,
    lower,
)
from plait.parallel.pipeline.simulate import Costs, SimResult, Span, as_costs, simulate
from plait.parallel.pipeline.split import SplitPlan, find_units, local_model, plan_split, split_model
from plait.parallel.pipeline.stage import PipelineStage

__all__ = [
    "Action",
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "Costs",
    "GENERATORS",
    "KINDS",
    "PipeDreamOptions",
    "PipeDreamRunner",
    "PipelineRunner",
    "PipelineStage",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "Span",
    "SplitPlan",
    "TensorMeta",
    "as_costs",
    "build_schedule",
    "check_schedule",
    "draw_schedule",
    "find_units",
    "gather_timeline",
    "gpipe",
    "interleaved",
    "local_model",
    "lower",
    "naive",
    "one_f_one_b",
    "pipedream",
    "plan_split",
    "replica_batch",
    "round_robin",
    "simulate",
    "split_model",
    "zero_bubble",
]
