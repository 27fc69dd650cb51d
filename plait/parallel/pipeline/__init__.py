"""Pipeline parallelism, process-free part: schedules as data, their simulator and their pictures.

    from plait.parallel.pipeline import build_schedule, simulate, draw_schedule
    schedule = build_schedule("1f1b", p=4, m=8)      # or Schedule.from_text / from_csv
    print(schedule.to_text())                        # "0F0 0F1 0F2 0F3 0B0 ..." one line per rank
    result = simulate(schedule, {"F": 1, "B": 2})    # raises ScheduleError on a deadlock
    draw_schedule(result, "1f1b.png")

See docs/pipeline.md.
"""

from plait.parallel.pipeline.draw import draw_schedule
from plait.parallel.pipeline.schedule import (
    COMM_KINDS,
    COMPUTE_KINDS,
    GENERATORS,
    KINDS,
    Action,
    Schedule,
    ScheduleError,
    build_schedule,
    gpipe,
    interleaved,
    lower,
    naive,
    one_f_one_b,
    pipedream,
    zero_bubble,
)
from plait.parallel.pipeline.simulate import Costs, SimResult, Span, as_costs, simulate

__all__ = [
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "GENERATORS",
    "KINDS",
    "Action",
    "Costs",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "Span",
    "as_costs",
    "build_schedule",
    "draw_schedule",
    "gpipe",
    "interleaved",
    "lower",
    "naive",
    "one_f_one_b",
    "pipedream",
    "simulate",
    "zero_bubble",
]
