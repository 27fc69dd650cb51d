"""The activations a pipeline rank holds in flight, measured, against the planner's estimate: the V-shaped
schedules (ZB-V, DualPipeV) next to 1F1B and ZB-H1 in one run (issue 36).

``python -m benchmarks.vshape_memory`` trains plait's GPT (4 blocks, d 32, the addition task's 8 tokens) on 2
spawned gloo ranks (pp = 2, m = 2p = 4 micro-batches of 2 rows) under each schedule and prints a Markdown table.

Measured: the runtime counts what every micro-batch of a stage keeps for backward (``PipelineRunner.
count_activations``: ``SavedActivations`` of its forward, each storage once, the input included, held until the
micro-batch's last backward action); the rank's peak is the largest sum over its stages after any forward (what a
V's two chunks hold together, not the sum of their own peaks), over the second step.

Predicted (``plait.planner``): each stage's bytes of one micro-batch (``memory.stage_activations``) walked over
the schedule (``memory.rank_in_flight_peaks``; ``estimate_memory(...).activations`` is the largest rank's); the
search's closed form (``predict(...).memory.activations``: the papers' in-flight counts, ``pipeline_closed_form``,
x a chunk's bytes). The runtime counts two things otherwise than the planner (``as_the_runtime_counts``); the
walk on the stage bytes corrected for them is the measured peak to the byte (tests/test_vshape_memory.py).
"""

from __future__ import annotations

from typing import Any

import torch

SCHEDULES = ("1f1b", "zero-bubble", "zb-v", "dualpipev")
P, M, ROWS = 2, 4, 2
"""pp, micro-batches (m = 2p) and rows per micro-batch."""
GPT_SIZES = {"n_layer": 4, "n_head": 4, "d_model": 32, "bias": False}

__all__ = ["SCHEDULES", "as_the_runtime_counts", "layout", "measure", "model", "stage_bytes", "table"]


def model() -> tuple[Any, Any]:
    """The GPT (seeded) and its task."""
    from plait.data import AdditionTask
    from plait.models import GPT, GPTConfig

    task = AdditionTask(digits=2, seed=1)  # vocab 12, seq_len 8
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=task.vocab_size, seq_len=task.seq_len, **GPT_SIZES)), task


def layout(schedule: str) -> Any:
    from plait import Layout

    return Layout(dp=1, pp=P, microbatches=M, schedule=schedule)


def _measure_rank(schedule: str) -> dict[str, Any]:
    """This rank's peaks (the rank's, and each stage's) over the second step of ``schedule``."""
    import plait
    from plait.data import ShardedBatches

    gpt, task = model()
    engine = plait.parallelize(gpt, layout(schedule), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    stages = list(engine.pipeline.stages.values())
    rank_peak = [0]
    for stage in stages:  # a stage's held bytes grow only in its forward: the rank's peak is after one
        forward = stage.forward

        def counted(*args: Any, _forward: Any = forward, **kwargs: Any) -> torch.Tensor:
            output = _forward(*args, **kwargs)
            rank_peak[0] = max(rank_peak[0], sum(s.held_bytes for s in stages))
            return output

        stage.forward = counted  # type: ignore[method-assign]
    loader = ShardedBatches(task, M * ROWS)
    engine.train_step(loader.batch_at(0))
    engine.pipeline.count_activations()
    engine.train_step(loader.batch_at(1))
    left = sum(stage.held_bytes for stage in stages)
    return {"rank": rank_peak[0], "stages": engine.pipeline.peak_activation_bytes(), "left": left}


def _measure_ranks() -> dict[str, dict[str, Any]]:
    return {schedule: _measure_rank(schedule) for schedule in SCHEDULES}


def measure(timeout: float = 300.0) -> dict[str, list[dict[str, Any]]]:
    """schedule -> per rank {"rank": its peak, "stages": each stage's peak, "left": bytes held after the step}."""
    from plait.launch import run_local

    per_rank = run_local(_measure_ranks, P, timeout=timeout)
    return {schedule: [rank[schedule] for rank in per_rank] for schedule in SCHEDULES}


def stage_bytes(schedule: str) -> list[float]:
    """The planner's bytes of one micro-batch per stage of ``schedule``'s split."""
    from plait.planner.memory import _run_forward, stage_activations

    spec, shape = model()[0].spec(), layout(schedule)
    return stage_activations(spec, shape, _run_forward(spec, shape, {"batch": ROWS}, "cpu"))[0]


def as_the_runtime_counts(stages: list[float], seq: int, vocab: int) -> list[float]:
    """``stages`` (bytes per stage) with the two things the runtime counts otherwise put back (as
    tests/test_recompute.py's ``_check_stage_peaks``): a micro-batch's token ids are a view of the rank's batch,
    whose whole storage it counts (8 bytes x M x ROWS x seq instead of ROWS x seq), and the last stage's loss
    (log-softmax 4 b s V, targets 8 b s, a scalar) is computed after the stage's forward, outside its count."""
    counted = list(stages)
    counted[0] += 8 * (M - 1) * ROWS * seq
    counted[-1] -= 4 * ROWS * seq * vocab + 8 * ROWS * seq + 4
    return counted


def predicted(schedule: str) -> dict[str, Any]:
    """The planner's figures for ``schedule``: its walk per rank, the walk on the runtime's counting, the
    estimate (largest rank) and the search's closed form."""
    from plait import estimate_memory
    from plait.parallel.pipeline import build_schedule
    from plait.planner.memory import rank_in_flight_peaks
    from plait.planner.predict import predict

    gpt, task = model()
    shape = layout(schedule)
    built = build_schedule(schedule, P, M, shape.virtual_stages)
    own = stage_bytes(schedule)
    return {
        "walk": rank_in_flight_peaks(built, own),
        "counted": rank_in_flight_peaks(built, as_the_runtime_counts(own, task.seq_len, task.vocab_size)),
        "estimate": estimate_memory(gpt, shape, activations={"batch": ROWS}, device="cpu").activations,
        "closed_form": predict(gpt.config, shape, "h100", global_batch=M * ROWS).memory.activations,
    }


def table(measured: dict[str, list[dict[str, Any]]]) -> str:
    """Markdown: per schedule, each rank's measured peak, the planner's walk (and on the runtime's counting), the
    estimate and the closed form against the largest measured peak, and the ratio to 1F1B of each."""
    rows = [
        "| schedule | measured rank 0 / 1 (B) | planner walk rank 0 / 1 | walk as the runtime counts | "
        "estimate_memory (x measured) | closed form (x measured) | x 1F1B measured / estimated |",
        "|---|---|---|---|---|---|---|",
    ]
    base = max(rank["rank"] for rank in measured["1f1b"])
    base_estimate = predicted("1f1b")["estimate"]
    for schedule in SCHEDULES:
        got = [rank["rank"] for rank in measured[schedule]]
        pred, peak = predicted(schedule), max(got)
        rows.append(
            f"| {schedule} | {got[0]:,} / {got[1]:,} | {pred['walk'][0]:,.0f} / {pred['walk'][1]:,.0f} | "
            f"{pred['counted'][0]:,.0f} / {pred['counted'][1]:,.0f} | {pred['estimate']:,.0f} "
            f"({pred['estimate'] / peak:.3f}) | {pred['closed_form']:,.0f} ({pred['closed_form'] / peak:.3f}) | "
            f"{peak / base:.3f} / {pred['estimate'] / base_estimate:.3f} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    print(table(measure()))
