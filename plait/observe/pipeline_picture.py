"""Draw a simulated (or measured) schedule as in the GPipe paper's figure: one row per rank, time to the right, a
box per forward / backward / weight-gradient pass labelled with its micro-batch, idle time left grey; and a measured
run's timeline (``plait.parallel.pipeline.measured.gather_timeline``) saved as that picture and as a Chrome/Perfetto
trace."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plait.parallel.pipeline.simulate import SimResult

COLORS = {"F": "#4e79a7", "B": "#59a14f", "I": "#76b7b2", "W": "#b07aa1"}
LABELS = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weights)"}
IDLE = "#e6e6e6"


def _shade(color: str, amount: float) -> tuple[float, float, float]:
    """``color`` mixed with white by ``amount`` (0: unchanged); later model chunks are drawn lighter."""
    red, green, blue = (int(color[i : i + 2], 16) / 255 for i in (1, 3, 5))
    return red + (1 - red) * amount, green + (1 - green) * amount, blue + (1 - blue) * amount


def draw_schedule(result: SimResult, path: str | Path, title: str | None = None, unit: str = "cost units") -> Path:
    """Save a PNG of ``result``'s timelines to ``path``; the title ends with the bubble fraction. ``unit`` names
    the time axis (a measured run, ``measured.gather_timeline``, is in ms)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    schedule, makespan = result.schedule, result.makespan or 1.0
    steps = max((sum(not s.action.is_comm for s in spans) for spans in result.timelines), default=1)
    width = min(20.0, max(8.0, 0.32 * steps))
    fig, ax = plt.subplots(figsize=(width, 1.0 + 0.55 * schedule.p), dpi=120)
    axis_px = 0.85 * width * fig.dpi
    kinds = set()
    for rank, spans in enumerate(result.timelines):
        ax.barh(rank, makespan, left=0, height=0.8, color=IDLE, edgecolor="none")
        for span in spans:
            a, duration = span.action, span.end - span.start
            if a.is_comm or duration <= 0:
                continue
            kinds.add(a.kind)
            chunk = a.stage // schedule.p
            color = _shade(COLORS[a.kind], 0.45 * chunk / max(1, schedule.v - 1))
            ax.barh(rank, duration, left=span.start, height=0.8, color=color, edgecolor="black", linewidth=0.4)
            box_px = duration / makespan * axis_px
            if box_px >= 8:
                ax.text(
                    span.start + duration / 2,
                    rank,
                    str(a.microbatch),
                    ha="center",
                    va="center",
                    fontsize=7 if box_px >= 14 else 5,
                    color="white" if chunk == 0 else "black",
                )
    ax.set_yticks(range(schedule.p), [f"rank {r}" for r in range(schedule.p)])
    ax.set_ylim(schedule.p - 0.5, -0.5)
    ax.set_xlim(0, makespan)
    ax.set_xlabel(f"time ({unit}); makespan {makespan:.4g}")
    handles = [Patch(color=COLORS[k], label=LABELS[k]) for k in COLORS if k in kinds]
    handles.append(Patch(color=IDLE, label="idle"))
    if schedule.v > 1:
        handles.append(Patch(color=_shade(COLORS["F"], 0.45), label="later model chunks: lighter"))
    legend_in = 0.3  # inches kept below the axes for the legend
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    where = "" if schedule.placement == "interleaved" else f", {schedule.placement.upper()} placement"
    heading = title or f"{schedule.name}  (p={schedule.p}, m={schedule.m}, v={schedule.v}{where})"
    ax.set_title(f"{heading}: bubble {result.bubble_fraction:.1%}")
    fig.tight_layout(rect=(0, legend_in / fig.get_figheight(), 1, 1))
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def save_timeline(result: SimResult, trace: str | Path | None = None, png: str | Path | None = None) -> None:
    """Write a measured ``result`` as a Chrome/Perfetto trace (JSON) and/or a PNG (``draw_schedule``)."""
    if trace is not None:
        path = Path(trace)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result.to_chrome_trace(us_per_unit=1000.0)))
    if png is not None:
        s = result.schedule
        Path(png).parent.mkdir(parents=True, exist_ok=True)
        draw_schedule(result, png, title=f"measured {s.name}  (p={s.p}, m={s.m}, v={s.v})", unit="ms")


__all__ = ["draw_schedule", "save_timeline"]
