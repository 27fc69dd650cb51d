"""The planner's subcommands of ``plait``: plan, simulate, calibrate (wired in by plait/cli/main.py)."""

from __future__ import annotations

import argparse
from typing import Any

from plait.errors import ConfigError
from plait.layout import Precision

PLANNER_COMMANDS = ("plan", "simulate", "calibrate")


def add_planner_commands(commands: Any) -> None:
    plan = commands.add_parser(
        "plan",
        help="rank every layout of a model on a cluster by predicted step time",
        description="Search all layouts (dp, tp, pp, cp, expert parallelism for MoE models, ZeRO, micro-batches, "
        "schedule, recomputation, offload) and print the best.",
    )
    _model_args(plan)
    plan.add_argument("--top", type=int, default=5, help="layouts to show (default 5)")
    plan.add_argument("--out", help="write the best layout as a TOML that `plait train --config` reads")
    plan.add_argument("--json", dest="json_out", help="write every shown prediction as JSON")
    sim = commands.add_parser(
        "simulate",
        help="predict one layout: step time, throughput, MFU, memory",
        description="Predict one given layout with the planner's cost model.",
    )
    _model_args(sim)
    sim.add_argument(
        "--layout",
        required=True,
        help="e.g. dp=16,tp=8,pp=8,microbatches=64,schedule=1f1b,zero=1 (stage cuts: pipeline_cuts=[10,20,...])",
    )
    cal = commands.add_parser(
        "calibrate",
        help="measure this machine (matmul FLOP/s, gloo alpha-beta) in seconds",
        description="Fit this machine's compute and collectives; plan with --gpu this-machine.",
    )
    cal.add_argument("--nproc", type=int, default=2, help="local gloo processes (default 2)")
    cal.add_argument("--out", help="where to write the JSON (default ~/.cache/plait/calibration.json)")
    cal.add_argument("--repeats", type=int, default=7, help="timed runs per collective and size (median; default 7)")
    cal.add_argument(
        "--max-mb", type=float, default=32, help="largest collective payload, MiB (default 32: your gradients' size)"
    )


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        help="a name (llama-70b, gpt3-175b, ...) or a Hugging Face config.json path, dense or Mixture-of-Experts "
        "(Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-MoE; ALiBi models such as BLOOM: give --seq)",
    )
    parser.add_argument("--gpus", type=int, help="number of devices (plan: required; simulate: from --layout)")
    parser.add_argument("--gpu", default="h100", help="a100-40gb, a100-80gb, h100, h200, b200 or this-machine")
    parser.add_argument(
        "--hardware",
        metavar="FILE.toml",
        help="a custom cluster (per-level bandwidth/latency, devices per node, oversubscription); replaces --gpu",
    )
    parser.add_argument("--seq", type=int, help="sequence length (default: the model's context)")
    parser.add_argument("--global-batch", type=int, help="samples per step (default: one per dp rank)")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument(
        "--implementation",
        default="plait",
        help="plait, megatron-2021, or plait-cpu (CPU ranks in fp32, with --gpu this-machine)",
    )


def parse_layout(text: str) -> Any:
    """``dp=2,tp=4,schedule=1f1b`` -> Layout (values read as TOML, falling back to strings)."""
    from plait.layout import Layout
    from plait.train.config import parse_value

    fields: dict[str, Any] = {}
    parts, depth, current = [], 0, ""
    for char in text:  # split on commas outside brackets: pipeline_cuts=[6,12] is one item
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    for item in filter(None, (part.strip() for part in parts)):
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--layout item {item!r} is not key=value. Fix: e.g. --layout dp=2,tp=4")
        fields[key.strip()] = parse_value(value.strip())
    return Layout.from_dict(fields)


def run_planner(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console() if Console().is_terminal else Console(width=200)
    if args.command == "calibrate":
        from plait.planner.calibrate import calibrate

        data = calibrate(args.nproc, repeats=args.repeats, out=args.out, max_bytes=int(args.max_mb * 2**20))
        hw = data["hardware"]
        console.print(
            f"matmul {hw['peak_flops']['fp32'] / 1e9:.1f} GFLOP/s, memory "
            f"{hw['memory_bandwidth'] / 1e9:.1f} GB/s, in {data['seconds']:.1f} s -> {data['path']}"
        )
        for op, (alpha, beta) in hw["measured"].items():
            console.print(f"  {op:15s} alpha {alpha * 1e6:8.1f} us   beta {beta * 1e9:8.3f} ns/byte")
        return 0
    from plait.planner.hardware import get_hardware
    from plait.planner.models import ModelSpec, resolve_model
    from plait.planner.report import model_section, print_plan, print_prediction, write_plan_toml

    spec = resolve_model(args.model, args.seq)
    if not isinstance(spec, ModelSpec):  # names and config paths always give a spec; keep the type checker sure
        raise ConfigError("plait plan / simulate need a model name or a config.json. Fix: e.g. --model llama-7b.")
    hardware = get_hardware(args.hardware if args.hardware else args.gpu)
    if args.command == "plan":
        import json

        from plait.planner.search import plan

        if args.gpus is None:
            raise ConfigError("plait plan needs --gpus. Fix: e.g. --gpus 1024.")
        result = plan(
            spec,
            args.gpus,
            hardware,
            global_batch=args.global_batch,
            top=args.top,
            precision=args.precision,
            implementation=args.implementation,
        )
        print_plan(result, console)
        if args.out:
            hf_config = args.model if str(args.model).endswith(".json") else None
            path = write_plan_toml(result.best, model_section(spec, hf_config), args.out, result.notes)
            console.print(f"wrote {path} (plait train --config {path})")
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump([p.to_dict() for p in result.candidates], f, indent=1)
        return 0
    from dataclasses import replace

    from plait.planner.predict import predict

    layout = parse_layout(args.layout)
    if args.precision != Precision.BF16 or layout.precision == Precision.FP32:
        layout = replace(layout, precision=args.precision)
    prediction = predict(
        spec, layout, hardware, global_batch=args.global_batch, world_size=args.gpus, implementation=args.implementation
    )
    print_prediction(prediction, console)
    return 0


__all__ = ["PLANNER_COMMANDS", "add_planner_commands", "parse_layout", "run_planner"]
