"""Show plans: a rich table of the top layouts, one layout's breakdown, and a RunConfig TOML for the best one.

The TOML is a complete run configuration that ``plait train --config`` reads: ``[layout]`` (every Layout field,
including the ``pipeline_cuts`` the inter-op pass chose), ``[model]`` (the reference GPT's GPTConfig fields, or
``hf_config = "PATH"`` when the plan was made from a Hugging Face config.json) and ``[train]`` with the global
batch; the prediction it came from (and what Alpa's passes chose) is written above them as comments.
"""

from __future__ import annotations

from pathlib import Path

import tomli_w
from rich.console import Console
from rich.table import Table

from plait.layout import Offload, Recompute
from plait.planner.models import ModelSpec
from plait.planner.predict import Prediction, fmt_bytes, fmt_time
from plait.planner.search import PlanResult


def layout_text(p: Prediction) -> str:
    lay = p.layout
    parts = [
        f"dp{lay.dp}",
        f"tp{lay.tp}",
        f"pp{lay.pp}",
        f"cp{lay.cp}",
        *([f"ep{lay.ep}"] if lay.ep > 1 else []),
        f"zero{lay.zero}",
        f"mbs{p.micro_batch}",
        f"m{lay.microbatches}",
    ]
    if lay.pp > 1:
        parts.append(lay.schedule + (f"x{lay.virtual_stages}" if lay.virtual_stages > 1 else ""))
        if lay.pipeline_cuts:
            parts.append("cuts " + ",".join(map(str, lay.pipeline_cuts)))
    if lay.sequence_parallel:
        parts.append("sp")
    if lay.recompute != Recompute.NONE:
        mode = lay.recompute
        parts.append(
            "recompute" + ("" if mode == "full" else f"-{mode}" if isinstance(mode, str) else f"-blocks{list(mode)}")
        )
    if lay.offload != Offload.NONE:
        parts.append(f"offload-{lay.offload}")
    return " ".join(parts)


def memory_text(p: Prediction) -> str:
    m = p.memory
    text = (
        f"{fmt_bytes(m.device)} = params {fmt_bytes(m.parameters)} + grads {fmt_bytes(m.gradients)} + "
        f"optim {fmt_bytes(m.optimizer_states)} + act {fmt_bytes(m.activations)} + other "
        f"{fmt_bytes(m.buffers + m.reserved)}"
    )
    return text + (f" (host {fmt_bytes(m.host)})" if m.host else "")


def time_text(p: Prediction) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {fmt_time(v)}" for k, v in p.time.items() if v > 0)


def plan_table(result: PlanResult) -> Table:
    spec = result.model
    size = f"{spec.parameters / 1e9:.1f}B" + (f", {spec.active_parameters / 1e9:.1f}B active" if spec.experts else "")
    table = Table(
        title=f"{spec.name} ({size}) on {result.world_size} x "
        f"{result.hardware.name}, global batch {result.global_batch} x {result.model.seq} tokens"
    )
    for column in ("#", "layout", "step", "tokens/s", "TFLOP/s/GPU", "MFU", "memory per GPU", "time breakdown"):
        table.add_column(column, overflow="fold")
    for rank, p in enumerate(result.candidates, 1):
        table.add_row(
            str(rank),
            layout_text(p),
            fmt_time(p.step_time),
            f"{p.tokens_per_s:,.0f}",
            f"{p.tflops_per_device:.0f}",
            f"{p.mfu:.1%}",
            memory_text(p),
            time_text(p),
        )
    return table


def print_plan(result: PlanResult, console: Console | None = None) -> None:
    console = console or Console()
    console.print(plan_table(result))
    console.print(f"why #2 loses: {result.why_runner_up_loses()}")
    for note in result.notes:
        console.print(f"- {note}")
    console.print(
        f"searched {result.evaluated} layouts ({result.pruned} pruned by memory or shape) in {result.seconds:.2f} s"
    )


def print_prediction(p: Prediction, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=f"{p.model} on {p.world_size} x {p.hardware}: {layout_text(p)}")
    table.add_column("quantity")
    table.add_column("predicted", overflow="fold")
    rows = [
        ("step time", fmt_time(p.step_time)),
        ("breakdown", time_text(p)),
        ("tokens/s", f"{p.tokens_per_s:,.0f}"),
        ("TFLOP/s per GPU (hardware)", f"{p.tflops_per_device:.1f}"),
        ("MFU / HFU", f"{p.mfu:.1%} / {p.hfu:.1%}"),
        ("memory per GPU", memory_text(p)),
        ("fits", f"{'yes' if p.fits else 'NO'} (limit {fmt_bytes(p.memory_limit)})"),
        ("stages (blocks)", " | ".join(f"{a}-{b - 1}" for a, b in p.stages)),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)


def model_section(spec: ModelSpec, hf_config: str | Path | None = None) -> dict[str, object]:
    """The ``[model]`` section of a planned run: ``hf_config = PATH`` as the user named it for a model planned from
    a Hugging Face config.json (like every path of a run configuration, relative to the folder ``plait train``
    runs in: the plan moves to another machine with the project), else the reference GPT's GPTConfig fields that
    build ``spec``."""
    if hf_config is not None:
        return {"hf_config": Path(hf_config).as_posix()}
    return dict(spec.to_gpt_config())


def plan_toml(p: Prediction, model_fields: dict[str, object], notes: list[str] | tuple[str, ...] = ()) -> str:
    """A RunConfig TOML (``plait train --config``) for prediction ``p``, with the prediction (and ``notes``, e.g.
    what Alpa's passes chose) as comments."""
    header = [
        f"# plait plan: {p.model} on {p.world_size} x {p.hardware}",
        f"# predicted step {fmt_time(p.step_time)}, {p.tokens_per_s:,.0f} tokens/s, "
        f"{p.tflops_per_device:.0f} TFLOP/s per GPU, MFU {p.mfu:.1%}",
        f"# memory per GPU {memory_text(p)}",
        *(f"# {note}" for note in notes),
        "",
    ]
    body = {"layout": p.layout.to_dict(), "model": dict(model_fields), "train": {"global_batch": p.global_batch}}
    return "\n".join(header) + tomli_w.dumps(body)


def write_plan_toml(
    p: Prediction, model_fields: dict[str, object], path: str | Path, notes: list[str] | tuple[str, ...] = ()
) -> Path:
    path = Path(path)
    path.write_text(plan_toml(p, model_fields, notes))
    return path


__all__ = [
    "layout_text",
    "memory_text",
    "model_section",
    "plan_table",
    "plan_toml",
    "print_plan",
    "print_prediction",
    "write_plan_toml",
]
