"""The cost model against published measurements (plait/planner/published.py, accuracy.py): compute efficiency
fitted per GPU generation on some tables, reported in-sample, leave-one-out and out-of-sample on others; ZeRO
Figure 1; and the planner on this machine (benchmarks/planner_validation.py)."""

from __future__ import annotations

import statistics

import pytest

from plait.planner.accuracy import default_evaluation, row_efficiency, summary, throughput_error
from plait.planner.hardware import CATALOGUE, GENERATION_EFFICIENCY
from plait.planner.published import SOURCES, ZERO_FIGURE_1, published_runs


def test_published_rows_name_their_source_and_build_valid_layouts():
    runs = published_runs()
    assert len(runs) >= 50 and len({r.label for r in runs}) == len(runs)  # labels identify rows (leave-one-out)
    for run in runs:
        source = SOURCES[run.source]
        assert source.role in ("fit", "test") and source.citation and source.table and source.where
        assert run.metric in ("hardware_tflops", "mfu", "step_time", "tokens_per_gpu") and run.value > 0
        if not run.pending:
            layout = run.layout.resolve(run.layout.world_size)
            assert run.global_batch % layout.dp == 0
    papers = {SOURCES[r.source].paper for r in runs if r.role == "test"} - {
        SOURCES[r.source].paper for r in runs if r.role == "fit"
    }
    assert len(papers) >= 3  # out-of-sample papers, never used for fitting


def test_the_fitted_efficiencies_are_what_the_fit_gives():
    """hardware.GENERATION_EFFICIENCY holds the fit (median over the generation's fitting rows of the efficiency
    at which each row's prediction equals its measurement): refitting reproduces the constants."""
    fitted, _ = default_evaluation()
    assert set(fitted) == {"ampere", "hopper"}
    for generation, (value, own) in fitted.items():
        assert value == pytest.approx(GENERATION_EFFICIENCY[generation], abs=0.002), generation
        assert value == statistics.median(own.values())
    assert CATALOGUE["a100-80gb"].compute_efficiency == GENERATION_EFFICIENCY["ampere"]
    assert CATALOGUE["h100"].compute_efficiency == GENERATION_EFFICIENCY["hopper"]


def test_row_efficiency_is_where_the_prediction_meets_the_measurement():
    run = next(r for r in published_runs() if r.source == "megatron-2021-t1")
    e = row_efficiency(run)
    from plait.planner.accuracy import predict_run, predicted_value

    assert abs(throughput_error(run, predicted_value(run, predict_run(run, e)))) < 1e-3
    assert throughput_error(run, predicted_value(run, predict_run(run, e * 1.1))) > 0  # faster hardware: optimistic


def test_published_accuracy_in_sample_leave_one_out_and_out_of_sample():
    """The numbers docs/planner.md reports (python -m benchmarks.planner_published). Targets (issue 16): out-of-sample
    median |error| <= 10% and max <= 20% on papers not used for fitting. The median holds; the max does not: MT-NLG
    (Megatron-DeepSpeed) runs ~19-24% slower than predicted, with nothing in the model to say why (the same model on
    Megatron-LM's own runs of the same 530B GPT on the same cluster, Narayanan et al. Table 2, is within 1%). The
    bounds below are what holds today, so a regression fails."""
    _, scored = default_evaluation()
    stats = summary(scored)
    keys = ("in_sample", "leave_one_out", "out_of_sample", "out_of_table")
    absolute = {key: [abs(e) for e in stats[key]] for key in keys}
    assert statistics.median(absolute["in_sample"]) < 0.05 and max(absolute["in_sample"]) < 0.20
    assert statistics.median(absolute["leave_one_out"]) < 0.06 and max(absolute["leave_one_out"]) < 0.20
    assert statistics.median(absolute["out_of_sample"]) < 0.10  # the target
    assert max(absolute["out_of_sample"]) < 0.25  # target 0.20: MT-NLG misses it (docstring)
    assert statistics.median(absolute["out_of_table"]) < 0.10 and max(absolute["out_of_table"]) < 0.25
    worst = {s.run.source for s in scored if s.run.role == "test" and s.error is not None and abs(s.error) > 0.2}
    assert worst <= {"mt-nlg-2022", "megatron-2021-t2", "torchtitan-2024"}, worst  # torchtitan: 70B, per-op AC
    assert len(stats["out_of_sample_papers"]) >= 5
    # FSDP over whole nodes (torchtitan on A100s, MosaicML on H100s): the ring collectives share the nodes' NICs
    # (costs.group_link); with one NIC per GPU they were predicted 11-66% too slow
    fsdp = [s for s in scored if s.run.source in ("torchtitan-2024", "mosaicml-h100-nodes") and s.error is not None]
    # the rows with per-operator checkpointing, committed before plait had it, predicted blind once it did
    per_op = [s for s in scored if s.run.source == "torchtitan-2024" and "selective op" in s.run.label]
    assert len(per_op) == 3 and not any(s.pending for s in per_op)
    fsdp = [s for s in fsdp if s not in per_op]
    assert len(fsdp) == 12 and max(abs(s.error) for s in fsdp) < 0.20
    assert max(abs(s.error) for s in per_op) < 0.25  # Llama 2 70B at batch 1: +20.9% (docs/planner.md)


def test_zero_figure_1_model_states():
    from plait.layout import Layout
    from plait.planner.costs import IMPLEMENTATIONS
    from plait.planner.stage_memory import model_state_bytes

    for stage, expected in ZERO_FIGURE_1["bytes_by_stage"].items():
        parts = model_state_bytes(
            ZERO_FIGURE_1["psi"], Layout(dp=ZERO_FIGURE_1["dp"], zero=stage), IMPLEMENTATIONS["plait"]
        )
        assert round(sum(parts[:3]) / 1e9, 1) == expected / 1e9


# ---------------------------------------------------------------------- this machine (benchmarks/planner_validation.py)
def test_calibrated_fits_scale_with_the_group_size_by_the_ring_formulas():
    from dataclasses import replace

    from plait.planner.costs import collective_time
    from plait.planner.hardware import get_hardware

    alpha, beta = 1e-3, 1e-9
    hw = replace(
        get_hardware("h100"),
        measured={"all_reduce": (alpha, beta), "all_gather": (alpha, beta), "send_recv": (alpha, beta)},
        measured_ranks=4,
    )
    nbytes = 1e6
    assert collective_time(hw, "all_reduce", nbytes, 4, False) == pytest.approx(alpha + beta * nbytes)
    # ring all-reduce: 2(n-1) latency steps and 2(n-1)/n of the payload; at 8 ranks vs the measured 4
    at_8 = alpha * 14 / 6 + beta * nbytes * (14 / 8) / (6 / 4)
    assert collective_time(hw, "all_reduce", nbytes, 8, False) == pytest.approx(at_8)
    at_2 = alpha * 1 / 3 + beta * nbytes * (1 / 2) / (3 / 4)  # all-gather: n - 1 steps, (n - 1) / n of the payload
    assert collective_time(hw, "all_gather", nbytes, 2, False) == pytest.approx(at_2)
    assert collective_time(hw, "send_recv", nbytes, 2, False) == pytest.approx(alpha + beta * nbytes)


def test_ranks_sharing_processors_cannot_beat_their_work_spread_over_them():
    from dataclasses import replace

    from plait.layout import Layout
    from plait.models import GPTConfig
    from plait.planner import get_hardware, predict

    config = GPTConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=128)
    own = replace(get_hardware("a100-80gb"), compute_units=0.0)
    shared = replace(own, compute_units=2.0)
    for layout in (Layout(dp=4), Layout(pp=4, dp=1, microbatches=4)):
        alone, together = (predict(config, layout, hw, 16, implementation="plait-cpu") for hw in (own, shared))
        work = alone.time["compute"] + alone.time["optimizer"]  # shared; collectives were timed at 4 ranks already
        comm = sum(alone.time[k] for k in ("tp_comm", "cp_comm", "zero3_comm", "dp_comm"))
        bound = max(alone.step_time, 4 / 2 * work + comm)
        if layout.pp == 1:  # no schedule: the bound is the prediction
            assert together.step_time == pytest.approx(bound, rel=1e-6)
            assert together.time["shared_processors"] == pytest.approx(together.step_time - alone.step_time, abs=1e-12)
        else:  # the schedule run under processor sharing (plait.planner.sharing): the bound or more, never more
            # than every stage's work in a row at the 2/4 speed
            assert bound * (1 - 1e-9) <= together.step_time <= 4 / 2 * 4 * alone.time["compute"] + comm
    # a pipeline's bubble is idle time another rank can use: with 2 processors for 4 ranks, pp=4 m=4 costs
    # no more than dp=4 of the same work
    dp, pp = (
        predict(config, lay, shared, 16, implementation="plait-cpu")
        for lay in (Layout(dp=4), Layout(pp=4, dp=1, microbatches=4))
    )
    assert pp.time["pp_bubble"] > 0 and pp.step_time < 1.5 * dp.step_time


def test_cpu_ranks_pay_every_chunk_its_sends_and_receives():
    """plait-cpu (gloo: copies on the processors the ranks compute on) does not overlap the pipeline's hand-offs:
    every chunk's forward and backward pays its transfer, so under processor sharing, where interleaving's smaller
    bubble buys nothing, more chunks per rank predict slower, as measured on this machine (docs/planner.md)."""
    from dataclasses import replace

    from plait.layout import Layout
    from plait.models import GPTConfig
    from plait.planner import get_hardware, predict
    from plait.planner.costs import IMPLEMENTATIONS

    config = GPTConfig(vocab_size=256, seq_len=128, n_layer=8, n_head=4, d_model=128)
    ops = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
    cpu = replace(
        get_hardware("a100-80gb"), compute_units=2.0, devices_per_node=4, measured={op: (2e-3, 1e-9) for op in ops}
    )
    cpu_impl = IMPLEMENTATIONS["plait-cpu"]
    assert not cpu_impl.overlap_p2p
    overlapped = replace(cpu_impl, overlap_p2p=True)
    steps = {}
    for v in (1, 4):
        layout = Layout(dp=2, pp=2, microbatches=2, schedule="interleaved" if v > 1 else "1f1b", virtual_stages=v)
        steps[v] = [predict(config, layout, cpu, 16, implementation=impl).step_time for impl in (cpu_impl, overlapped)]
    assert steps[4][0] > steps[1][0]  # 4 chunks per rank: 8 hand-offs per micro-batch instead of 2
    assert steps[4][0] - steps[4][1] > steps[1][0] - steps[1][1] > 0  # what the hand-offs add grows with chunks


def test_steady_takes_out_a_load_burst_that_slows_one_round():
    from benchmarks.planner_validation import steady

    # two layouts, the second 2x slower; round 1 ran while the machine was 3x slower
    scaled = steady([[1.0, 3.0, 1.0], [2.0, 6.0, 2.0]])
    assert scaled[0] == pytest.approx([1.0, 1.0, 1.0]) and scaled[1] == pytest.approx([2.0, 2.0, 2.0])


def test_the_choice_is_judged_on_the_finer_second_measurement_when_there_is_one():
    from benchmarks.planner_validation import Row, choice_line, chosen_vs_fastest
    from plait.layout import Layout

    first = Row(4, Layout(dp=4), 0.40, [1.0, 1.2, 1.1], ranked=0)  # broad launch: 10% slower than the second
    second = Row(4, Layout(pp=4, microbatches=4), 0.41, [1.0, 1.0, 1.0], ranked=1)
    other = Row(4, Layout(tp=4), 0.60, [0.5, 0.5, 0.5])  # not ranked by plan(): never the reference
    rows = [first, second, other]
    assert chosen_vs_fastest(rows) == pytest.approx(0.1) and choice_line(rows) == ""
    first.choice, second.choice = [1.00, 1.01, 0.99], [1.02, 1.02, 1.03]
    assert chosen_vs_fastest(rows) == 0.0  # measured alone, the choice is the fastest
    assert choice_line(rows).startswith(" (their medians over 3 rounds measured alone: #1 dp4 1.000")


@pytest.mark.distributed
def test_this_machine_calibrate_predict_measure_compare(tmp_path, monkeypatch):
    """The validation pipeline end to end on 2 ranks and a tiny GPT: calibrate -> plan/predict -> measure ->
    compare. What must hold whatever the load: the calibration is complete and usable by name, every layout
    is predicted and measured, the planner's choice is among them, and the report is written. (The figures
    themselves, Spearman and chosen-vs-fastest over 4 and 8 ranks, are in docs/planner.md: noisy 1-step
    timings on a shared 2-core machine are not asserted.)"""
    from benchmarks.planner_validation import (
        DOC_END,
        DOC_START,
        chosen_vs_fastest,
        spearman,
        table,
        validate,
        write_docs,
    )
    from plait.layout import Layout
    from plait.models import GPTConfig
    from plait.planner import get_hardware, predict
    from plait.planner.calibrate import calibrate
    from plait.planner.hardware import COLLECTIVES

    monkeypatch.setenv("PLAIT_CALIBRATION", str(tmp_path / "cal.json"))
    data = calibrate(2, repeats=1, max_bytes=2**20)
    hw = get_hardware("this-machine")
    assert hw.flops("fp32") > 1e8 and set(hw.measured) == set(COLLECTIVES) and hw.measured_ranks == 2
    assert 1 <= hw.compute_units <= 2 and data["seconds"] < 120
    config = GPTConfig(vocab_size=32, seq_len=16, n_layer=2, n_head=4, d_model=32)
    plain, recomputed = (
        predict(config, Layout(dp=2, recompute=r), hw, 8, implementation="plait-cpu") for r in ("none", "full")
    )
    assert 0 < plain.step_time < recomputed.step_time and plain.fits  # recomputation adds a forward pass

    rows = validate(
        2,
        config,
        (Layout(dp=2), Layout(pp=2, microbatches=2), Layout(tp=2)),
        global_batch=8,
        top=2,
        calibration=data,
        warmup=1,
        steps=1,
        rounds=2,
        choice_rounds=3,
    )
    assert len(rows) >= 3 and [r.ranked for r in rows if r.ranked is not None][:1] == [0]
    assert all(r.predicted > 0 and len(r.measured) == 2 and min(r.measured) > 0 for r in rows)
    # plan()'s ranked layouts measured again on their own; the others not
    assert all(len(r.choice) == 3 and min(r.choice) > 0 for r in rows if r.ranked is not None)
    assert all(not r.choice for r in rows if r.ranked is None)
    assert chosen_vs_fastest(rows) >= 0 and -1 <= spearman(rows) <= 1
    doc = tmp_path / "planner.md"
    doc.write_text(f"# page\n\n{DOC_START}\nold\n{DOC_END}\n\nafter\n")
    write_docs(table(rows), doc)
    text = doc.read_text()
    assert "old" not in text and "after" in text and "| 2 | dp2 |" in text and "Spearman" in text
    assert "rounds measured alone: #1 " in text


def test_per_operator_recomputation_runs_out_of_memory_where_torchtitan_did():
    """torchtitan ran Llama 2 70B with per-operator checkpointing at local batch 1 because batch 2 ran out of
    memory on its 80 GB A100s (docs/performance.md, footnote 1): the model fits the first and not the second."""
    import dataclasses

    from plait.planner.accuracy import predict_run

    run = next(r for r in published_runs() if r.source == "torchtitan-2024" and "70B" in r.label and "op" in r.label)
    efficiency = GENERATION_EFFICIENCY["ampere"]
    assert predict_run(run, efficiency).fits
    assert not predict_run(dataclasses.replace(run, global_batch=2 * run.global_batch), efficiency).fits
