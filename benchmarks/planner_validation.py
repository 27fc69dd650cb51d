"""The planner on this machine: predicted vs measured step time of the reference GPT on 4 and 8 CPU ranks.

    python -m benchmarks.planner_validation              # 4 and 8 ranks, prints the table (needs a quiet machine)
    python -m benchmarks.planner_validation --write-docs # and puts it into docs/planner.md
    python -m benchmarks.planner_validation --quick      # 4 ranks, 2 rounds: checks that it runs (~5 min)

For each world size: ``plait calibrate`` at that many gloo ranks (compute throughput, the processors the ranks
really get, per-collective alpha-beta fits up to the model's gradient size), then ``plait.planner.predict`` for a
broad fixed set of layouts (at 4 ranks 25: data parallel with ZeRO-1/2/3 and recomputation, tensor parallel with and
without sequence parallelism, context parallel ring and Ulysses, pipelines with 1F1B, interleaving and zero-bubble,
and mixtures) plus the top layouts ``plait.plan`` ranks (``--gpu this-machine``, implementation ``plait-cpu``).
Every layout carries the stage cuts the planner predicts it with (``Layout.pipeline_cuts``), so the runtime runs
the split that was predicted. Then every layout is trained in one launch (``benchmarks.launch``): one engine per
layout built from the same seed, a warm-up step each, then ``rounds`` rounds of ``steps`` timed steps in
alternating order (A B C, C B A, ...); each round is scaled to the typical round (``steady``), so slow phases of
the shared machine fall on every layout alike; the median step is the measurement. Reported: the table (layout,
predicted, measured, measured / predicted), the Spearman rank correlation of predicted vs measured, and how much
slower (measured) the planner's choice is than the fastest of the layouts it ranked.

That last figure compares a few layouts that the model predicts close to one another (often within 3 %), so it
needs a finer measurement than the broad set's five samples each: after the broad launch, the layouts plan() ranked
are measured again on their own in a second launch of ``choice_rounds`` alternating rounds (default 20), with the
same drift correction, and the choice is judged on those medians. The broad table keeps the first launch's.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.launch import launch
from benchmarks.report import replace_between
from plait.layout import Layout
from plait.models import GPT, GPTConfig, lm_loss

MODEL = GPTConfig(vocab_size=256, seq_len=128, n_layer=8, n_head=8, d_model=192)
"""8 blocks of width 192 (3.6M parameters, 14 MB of fp32 gradients): small enough that 4 ranks hold ~30 engines at
once on a shared machine, large enough that compute, not Python, dominates a step."""
GLOBAL_BATCH = 16
LAYOUTS: dict[int, tuple[Layout, ...]] = {
    4: (
        Layout(dp=4),
        Layout(dp=4, microbatches=4),
        Layout(dp=4, zero=1),
        Layout(dp=4, zero=2),
        Layout(dp=4, zero=3),
        Layout(dp=4, recompute="full"),
        Layout(dp=4, zero=3, recompute="full"),
        Layout(dp=4, recompute="op"),
        Layout(dp=4, zero=3, recompute="op"),
        Layout(dp=2, tp=2),
        Layout(dp=2, tp=2, sequence_parallel=True),
        Layout(tp=4),
        Layout(tp=4, sequence_parallel=True),
        Layout(cp=4),
        Layout(cp=4, cp_mode="ulysses"),
        Layout(dp=2, cp=2),
        Layout(tp=2, cp=2),
        Layout(pp=4, microbatches=4),
        Layout(pp=4, microbatches=8),
        Layout(pp=4, microbatches=16),
        Layout(pp=4, microbatches=8, schedule="interleaved", virtual_stages=2),
        Layout(pp=4, microbatches=8, schedule="zero-bubble"),
        Layout(pp=2, dp=2, microbatches=2),
        Layout(pp=2, dp=2, microbatches=4, schedule="interleaved", virtual_stages=2),
        Layout(pp=2, dp=2, zero=1, microbatches=2),
        Layout(pp=2, tp=2, microbatches=4),
        Layout(pp=2, cp=2, microbatches=4),
    ),
    8: (
        Layout(dp=8),
        Layout(dp=8, zero=1),
        Layout(dp=8, zero=3),
        Layout(dp=4, cp=2),
        Layout(dp=2, tp=2, cp=2),
        Layout(dp=4, tp=2),
        Layout(dp=2, tp=4),
        Layout(tp=8),
        Layout(pp=2, dp=4, microbatches=2),
        Layout(pp=4, dp=2, microbatches=4),
        Layout(pp=8, microbatches=8),
        Layout(dp=2, tp=2, pp=2, microbatches=4),
    ),
}
"""Hand-picked layouts that differ in what they cost (replicated work, collectives, bubbles, recomputation)."""
DOC = Path(__file__).resolve().parent.parent / "docs" / "planner.md"
DOC_START, DOC_END = "<!-- planner-validation:start -->", "<!-- planner-validation:end -->"


@dataclass
class Row:
    """One layout: its prediction (seconds) and its measured step times (seconds), and whether plan() ranked it."""

    world: int
    layout: Layout
    predicted: float
    measured: list[float]
    ranked: int | None = None
    """Its place in plan()'s ranking (0 = the planner's choice), None if plan() did not list it."""
    choice: list[float] = field(default_factory=list)
    """Step times from the second launch that measures only plan()'s ranked layouts (module docstring)."""

    @property
    def median(self) -> float:
        return statistics.median(self.measured)

    @property
    def name(self) -> str:
        lay, parts = self.layout, []
        for key in ("dp", "tp", "cp", "pp"):
            if getattr(lay, key) > 1:
                parts.append(
                    f"{key}{getattr(lay, key)}" + ("-ulysses" if key == "cp" and lay.cp_mode == "ulysses" else "")
                )
        parts += [f"zero{lay.zero}"] * bool(lay.zero) + [f"m{lay.microbatches}"] * (lay.microbatches > 1)
        if lay.pp > 1:
            parts.append(lay.schedule + (f"x{lay.virtual_stages}" if lay.virtual_stages > 1 else ""))
        recompute = {"full": "recompute", "op": "recompute-op", "selective": "recompute-selective"}
        if isinstance(lay.recompute, str) and lay.recompute in recompute:
            parts.append(recompute[lay.recompute])
        parts += ["sp"] * lay.sequence_parallel
        return " ".join(parts)


def _train_rank(
    config: GPTConfig, layouts: list[Layout], global_batch: int, warmup: int, steps: int, rounds: int
) -> list[list[float]]:
    """One rank: build an engine per layout (same seed), warm up, time alternating rounds; rank 0's step times."""
    import plait

    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(config.vocab_size, (global_batch, config.seq_len + 1), generator=generator)
        engines, batches = [], []
        for layout in layouts:
            torch.manual_seed(1234)
            engine = plait.parallelize(
                GPT(config), layout, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), loss_fn=lm_loss, timeout_s=120
            )
            share = global_batch // engine.mesh.size("dp")
            rows = tokens[engine.mesh.index("dp") * share : (engine.mesh.index("dp") + 1) * share]
            engines.append(engine)
            batches.append((rows[:, :-1], rows[:, 1:]))
        for engine, batch in zip(engines, batches):
            for _ in range(warmup):
                engine.train_step(batch)
        seconds: list[list[float]] = [[] for _ in layouts]
        for round_ in range(rounds):
            order = list(range(len(layouts)))
            for index in order if round_ % 2 == 0 else order[::-1]:
                for _ in range(steps):
                    dist.barrier()
                    started = time.perf_counter()
                    engines[index].train_step(batches[index])  # ends in an all-reduce of the loss: all ranks done
                    seconds[index].append(time.perf_counter() - started)
        dist.barrier()
        return seconds if rank == 0 else []
    finally:
        dist.destroy_process_group()


def measure(
    config: GPTConfig,
    world: int,
    layouts: list[Layout],
    global_batch: int,
    warmup: int = 1,
    steps: int = 1,
    rounds: int = 5,
) -> list[list[float]]:
    """Step times of every layout on ``world`` local gloo ranks, measured in one launch (module docstring)."""
    return launch(_train_rank, world, config, layouts, global_batch, warmup, steps, rounds)[0]


def validate(
    world: int,
    config: GPTConfig = MODEL,
    layouts: tuple[Layout, ...] | None = None,
    global_batch: int = GLOBAL_BATCH,
    top: int = 4,
    calibration: dict[str, Any] | None = None,
    choice_rounds: int = 20,
    **timing: int,
) -> list[Row]:
    """Calibrate at ``world`` ranks (unless ``calibration`` is given), predict ``layouts`` and plan()'s ``top``
    layouts, measure them all, then plan()'s ranked layouts alone in ``choice_rounds`` rounds (0: not); rows in
    the order measured."""
    from plait.planner import Hardware, plan, predict
    from plait.planner.calibrate import calibrate, payload_sizes
    from plait.planner.search import with_pipeline_cuts

    if calibration is None:
        with tempfile.TemporaryDirectory() as tmp:
            gradient_bytes = 4 * GPT(config).num_parameters()
            calibration = calibrate(
                world, out=Path(tmp) / "calibration.json", max_bytes=max(payload_sizes(gradient_bytes))
            )
    hw = Hardware.from_dict(calibration["hardware"])
    ranked = plan(
        config, world, hw, global_batch=global_batch, precision="fp32", implementation="plait-cpu", top=top
    ).candidates
    chosen = [p.layout for p in ranked]
    predicted = {lay: p for lay, p in zip(chosen, ranked)}
    for lay in layouts if layouts is not None else LAYOUTS[world]:
        prediction = predict(config, lay.resolve(world), hw, global_batch, implementation="plait-cpu")
        cut = with_pipeline_cuts(prediction)  # the runtime runs the split the planner predicted
        predicted.setdefault(cut.layout, cut)
    rows = [
        Row(world, lay, p.step_time, [], chosen.index(lay) if lay in chosen else None) for lay, p in predicted.items()
    ]
    candidates = [row.layout for row in rows]
    for row, seconds in zip(rows, steady(measure(config, world, candidates, global_batch, **timing))):
        row.measured = seconds
    ranked_rows = [row for row in rows if row.ranked is not None]
    if choice_rounds > 0 and len(ranked_rows) > 1:
        timing = {**timing, "rounds": choice_rounds}
        layouts_ranked = [row.layout for row in ranked_rows]
        for row, seconds in zip(ranked_rows, steady(measure(config, world, layouts_ranked, global_batch, **timing))):
            row.choice = seconds
    return rows


def steady(seconds: list[list[float]]) -> list[list[float]]:
    """Step times with the machine's drift taken out: every sample of round k (the k-th step of each layout,
    taken within seconds of each other) is divided by that round's median over the layouts and multiplied by
    the median of those round medians, so a load burst from other programs scales a whole round, not the
    layouts that happened to run during it."""
    rounds = [statistics.median(column) for column in zip(*seconds)]
    typical = statistics.median(rounds)
    return [[t / r * typical for t, r in zip(row, rounds)] for row in seconds]


def spearman(rows: list[Row]) -> float:
    """Spearman's rank correlation of predicted vs median measured step time (scipy.stats.spearmanr)."""
    from scipy.stats import spearmanr

    return float(spearmanr([r.predicted for r in rows], [r.median for r in rows]).statistic)


def chosen_vs_fastest(rows: list[Row]) -> float:
    """Measured step of the planner's choice / the fastest measured of the layouts plan() ranked, minus 1: on the
    second launch's medians when it ran (module docstring), else on the broad launch's."""
    ranked = [r for r in rows if r.ranked is not None]
    choice = next(r for r in ranked if r.ranked == 0)
    if all(r.choice for r in ranked):
        return statistics.median(choice.choice) / min(statistics.median(r.choice) for r in ranked) - 1
    return choice.median / min(r.median for r in ranked) - 1


def choice_line(rows: list[Row]) -> str:
    """The second launch's medians of plan()'s ranked layouts, in plan()'s order ("" when it did not run)."""
    ranked = sorted((r for r in rows if r.ranked is not None), key=lambda r: r.ranked or 0)
    if not ranked or not all(r.choice for r in ranked):
        return ""
    medians = ", ".join(f"#{(r.ranked or 0) + 1} {r.name} {statistics.median(r.choice):.3f}" for r in ranked)
    return f" (their medians over {len(ranked[0].choice)} rounds measured alone: {medians} s)"


def table(rows: list[Row]) -> str:
    """A Markdown table of the rows with Spearman and chosen-vs-fastest per world size."""
    lines = [
        "| ranks | layout | plan() rank | predicted (s) | measured median (s) | measured / predicted |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in sorted(rows, key=lambda r: (r.world, r.predicted)):
        place = "" if r.ranked is None else f"#{r.ranked + 1}"
        lines.append(
            f"| {r.world} | {r.name} | {place} | {r.predicted:.3f} | {r.median:.3f} | {r.median / r.predicted:.2f} |"
        )
    lines.append("")
    for world in sorted({r.world for r in rows}):
        of = [r for r in rows if r.world == world]
        ranked = sum(r.ranked is not None for r in of)
        lines.append(
            f"- {world} ranks: Spearman {spearman(of):+.2f} over {len(of)} layouts; the planner's choice "
            f"is {chosen_vs_fastest(of):+.1%} vs the fastest (measured) of the {ranked} layouts it ranked"
            f"{choice_line(of)}."
        )
    lines.append(f"- all: Spearman {spearman(rows):+.2f} over {len(rows)} layouts.")
    return "\n".join(lines)


def write_docs(text: str, path: Path = DOC) -> None:
    """Replace the block between the validation markers of docs/planner.md with ``text``."""
    replace_between(path, DOC_START, DOC_END, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8], help="rank counts (default 4 8)")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per layout per round")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    parser.add_argument(
        "--choice-rounds", type=int, default=20, help="rounds of plan()'s ranked layouts measured alone (0: not)"
    )
    parser.add_argument("--write-docs", action="store_true", help="put the table into docs/planner.md")
    parser.add_argument("--quick", action="store_true", help="4 ranks, 2 rounds: check that it runs (noisy figures)")
    args = parser.parse_args(argv)
    if args.quick:
        args.worlds, args.rounds, args.choice_rounds = [4], 2, 4
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    rows = [
        row
        for world in args.worlds
        for row in validate(world, steps=args.steps, rounds=args.rounds, choice_rounds=args.choice_rounds)
    ]
    text = table(rows) + (
        f"\n- measured {time.strftime('%Y-%m-%d %H:%M')} in {time.perf_counter() - started:.0f} s "
        f"on {os.cpu_count()} cores; 1-minute load average {load_before:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after (other programs share the machine)."
    )
    print(text)
    if args.write_docs:
        write_docs(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
