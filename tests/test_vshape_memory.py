"""The planner's in-flight activation memory of the V-shaped schedules (ZB-V, DualPipeV; issue 36) against the
peaks a pipeline really holds, next to 1F1B and ZB-H1 in the same run.

Measured: 2 ranks (pp = 2, m = 2p = 4 micro-batches of 2 rows) train plait's GPT (4 blocks, d 32, the addition
task's 8 tokens) under each schedule; the runtime counts what every micro-batch of a stage keeps for backward
(``PipelineRunner.count_activations``: ``SavedActivations`` of its forward, each storage once, the input
included, held until the micro-batch's last backward action), and the rank's peak is the largest sum over its
stages after any forward (what a V's two chunks hold together, not the sum of their own peaks).

Predicted: ``plait.planner.memory``: each stage's bytes of one micro-batch (``stage_activations``, the formulas of
``plait.planner.activations``) walked over the schedule (``rank_in_flight_peaks``; ``estimate_memory(...)
.activations`` is the largest rank's), and the papers' in-flight counts (``pipeline_closed_form``: ZB-V 2p chunk
activations, 1F1B's p whole stages; DualPipeV 2p + 1).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.harness import run_distributed

SCHEDULES = ("1f1b", "zero-bubble", "zb-v", "dualpipev")
P, M, ROWS = 2, 4, 2
"""pp, micro-batches (m = 2p) and rows per micro-batch."""
GPT_SIZES = {"n_layer": 4, "n_head": 4, "d_model": 32, "bias": False}


def _model() -> tuple[Any, Any]:
    from plait.data import AdditionTask
    from plait.models import GPT, GPTConfig

    task = AdditionTask(digits=2, seed=1)  # vocab 12, seq_len 8
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=task.vocab_size, seq_len=task.seq_len, **GPT_SIZES)), task


def _layout(schedule: str) -> Any:
    from plait import Layout

    return Layout(dp=1, pp=P, microbatches=M, schedule=schedule)


def _measure(schedule: str) -> dict[str, Any]:
    """This rank's peaks (the rank's, and each stage's) over the second step of ``schedule``."""
    from helpers.composition import optimizer

    import plait
    from plait.data import ShardedBatches

    model, task = _model()
    engine = plait.parallelize(model, _layout(schedule), optimizer=optimizer)
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
    assert all(stage.held_bytes == 0 for stage in stages), "every micro-batch was freed by the step's end"
    return {"rank": rank_peak[0], "stages": engine.pipeline.peak_activation_bytes()}


def _measure_all() -> dict[str, dict[str, Any]]:
    return {schedule: _measure(schedule) for schedule in SCHEDULES}


def _stage_bytes(schedule: str) -> list[float]:
    """The planner's bytes of one micro-batch per stage of ``schedule``'s split."""
    from plait.planner.memory import _run_forward, stage_activations

    spec, layout = _model()[0].spec(), _layout(schedule)
    return stage_activations(spec, layout, _run_forward(spec, layout, {"batch": ROWS}, "cpu"))[0]


def _as_the_runtime_counts(stage_bytes: list[float], seq: int, vocab: int) -> list[float]:
    """``stage_bytes`` with the two things the runtime counts otherwise put back (tests/test_recompute.py's
    ``_check_stage_peaks``): a micro-batch's token ids are a view of the rank's batch, whose whole storage it counts
    (8 bytes x M x ROWS x seq instead of ROWS x seq), and the last stage's loss (log-softmax 4 b s V, targets
    8 b s, a scalar) is computed after the stage's forward, outside its count."""
    counted = list(stage_bytes)
    counted[0] += 8 * (M - 1) * ROWS * seq
    counted[-1] -= 4 * ROWS * seq * vocab + 8 * ROWS * seq + 4
    return counted


@pytest.fixture(scope="module")
def measured() -> dict[str, list[dict[str, Any]]]:
    per_rank = run_distributed(_measure_all, P, timeout=300)
    return {schedule: [rank[schedule] for rank in per_rank] for schedule in SCHEDULES}


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_rank_s_measured_peak_is_the_planner_s_walk_over_the_schedule(measured, schedule: str) -> None:
    """To the byte, once the runtime's two counting differences are put back; the planner's own figure
    (``estimate_memory``, the largest rank) within what those differences weigh here."""
    from plait import estimate_memory
    from plait.parallel.pipeline import build_schedule
    from plait.planner.memory import rank_in_flight_peaks

    model, task = _model()
    counted = _as_the_runtime_counts(_stage_bytes(schedule), task.seq_len, task.vocab_size)
    walk = rank_in_flight_peaks(build_schedule(schedule, P, M, 2 if schedule in ("zb-v", "dualpipev") else 1), counted)
    assert [rank["rank"] for rank in measured[schedule]] == walk, (measured[schedule], walk)
    estimate = estimate_memory(model, _layout(schedule), activations={"batch": ROWS}, device="cpu").activations
    peak = max(rank["rank"] for rank in measured[schedule])
    # bytes, no rounding: the two differences above (token-id storage, +384 B per micro-batch of stage 0; the
    # loss, -900 B per one of the last stage) are 0.2-1.3 % of a rank's peak here (1.3 %: ZB-H1's last rank,
    # two losses); the estimate (which counts them as held) sits within 1.5 % of the measured peak
    assert abs(estimate - peak) <= 0.015 * peak, (schedule, estimate, peak)


@pytest.mark.distributed
def test_the_v_holds_the_papers_counts_and_its_ratio_to_1f1b_is_the_planner_s(measured) -> None:
    """Rank 1 of the V holds chunks 1 and 2 (one block each, neither end): its peak is exactly the papers' count of
    chunk activations (ZB-V 2p, DualPipeV 2p + 1) x one chunk's bytes, i.e. ZB-V holds what 1F1B's rank 0 holds in
    blocks (p stages of 2 blocks) and DualPipeV half a stage more. With the ends (rank 0 of a V holds the
    embedding's and the head's), the V's peak over 1F1B's, measured, equals the planner's ratio."""
    from plait.planner.memory import estimate_memory
    from plait.planner.predict import pipeline_closed_form

    model, _ = _model()
    chunk = _stage_bytes("zb-v")[1]
    assert chunk == _stage_bytes("zb-v")[2], "chunks 1 and 2: one block each, neither end"
    for schedule in ("zb-v", "dualpipev"):
        count = pipeline_closed_form(schedule, P, M, 2, 1.0, 2.0, 0.0)[2]
        assert count == {"zb-v": 2 * P, "dualpipev": 2 * P + 1}[schedule]
        assert measured[schedule][1]["rank"] == count * chunk, (schedule, measured[schedule][1], count, chunk)
        peak = {name: max(rank["rank"] for rank in measured[name]) for name in (schedule, "1f1b")}
        estimate = {
            name: estimate_memory(model, _layout(name), activations={"batch": ROWS}, device="cpu").activations
            for name in (schedule, "1f1b")
        }
        ratio, predicted = peak[schedule] / peak["1f1b"], estimate[schedule] / estimate["1f1b"]
        # both figures within 0.6 % of the runtime's counts here (the differences of the test above), so the
        # ratios agree within 1 %: ZB-V ~1.04 (both ends on rank 0), DualPipeV ~1.29 (and half a stage)
        assert ratio == pytest.approx(predicted, rel=0.01), (schedule, ratio, predicted)
    assert measured["zb-v"][1]["rank"] == 2 * P * chunk  # ZB-V: p whole stages' blocks, 1F1B's rank 0 in blocks


@pytest.mark.distributed
def test_zb_h1_holds_every_micro_batch_until_its_w(measured) -> None:
    """plait's I keeps the graph for W (``retain_graph``), so ZB-H1's last rank holds p micro-batches at its peak
    (its W's trail its I's), not 1F1B's one: the planner walks the schedule releasing at W (the simulator's
    ``peak_unfinished``, not ``peak_activations``)."""
    from plait.parallel.pipeline import simulate, zero_bubble

    last = measured["zero-bubble"][P - 1]["rank"]
    assert last == 2 * measured["1f1b"][P - 1]["rank"]
    result = simulate(zero_bubble(P, M))
    assert result.peak_unfinished[P - 1] == 2 and result.peak_activations[P - 1] == 1
