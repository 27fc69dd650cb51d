"""The benchmark runner works end to end (a few steps; the figures themselves live in BENCHMARKS.md): every pair
runs, its contenders train the same thing (same losses, same parameters), bytes and model-state memory are
reported, and ``--suite all`` covers every pair (data parallel and ZeRO and pipeline, V-shaped included, at 2 and 4 ranks, tensor
parallel at 2, context parallel at 4; the smoke test runs each at 2)."""

import pytest

pytestmark = pytest.mark.distributed

SAME_PARAMS = 1e-5
"""fp32 parameters after 4 AdamW steps (lr 1e-3) whose gradients differ only by reduction order."""

SAME_PARAMS_CP = 1e-4
"""Ring attention merges blockwise softmaxes (online log-sum-exp) where the baseline runs one fused
``scaled_dot_product_attention``: fp32 rounding differs at ~1e-7 relative in the gradients, and AdamW's
normalised update (up to lr = 1e-3 per step) can turn that into ~1e-5 in a parameter whose gradient is near
zero; 1e-4 is a tenth of one step."""

ROLES = {
    "pp": ["plait", "baseline", "plait", "baseline"],
    "ppv": ["plait", "baseline", "plait", "baseline"],
    "cp": ["plait", "plait", "baseline"],
}


@pytest.mark.parametrize("suite", ["overhead", "ddp", "zero1", "zero3", "pp", "ppv", "tp", "cp"])
def test_benchmark_suite_runs_and_contenders_agree(suite, tmp_path):
    from benchmarks.report import write_markdown
    from benchmarks.run import QUICK, run_suite

    rows = run_suite(suite, world=2, **QUICK)
    assert [row["role"] for row in rows] == ROLES.get(suite, ["plait", "baseline"])
    for row in rows:
        assert row["tokens_per_s"] > 0 and row["same_loss"], row
        assert row["param_max_diff_vs_baseline"] < (SAME_PARAMS_CP if suite == "cp" else SAME_PARAMS), row
        assert row["model_state_mb"] > 0 and set(row["model_state_parts"]) >= {"parameters", "optimizer_states"}
    for plait_row in (row for row in rows if row["role"] == "plait"):
        if suite != "overhead":  # plait sends its theory, padding and the 4-12 bytes of loss and norm aside
            assert plait_row["wire_vs_theory"] == pytest.approx(1.0, rel=1e-4), plait_row
    plait_row = rows[0]
    if suite in ("zero3", "pp", "ppv"):  # both hold 1/N of parameters, gradients and AdamW state (pp: the same stages)
        assert plait_row["model_state_vs_baseline"] == pytest.approx(1.0, rel=0.01), plait_row
    if suite == "tp":  # the same slices; torch's gradients hold 64 KiB more (one [V/t, d] fp32 storage), ~1%
        assert plait_row["model_state_vs_baseline"] == pytest.approx(1.0, rel=0.02), plait_row
    if suite == "cp":  # ring keeps exactly the no-cp activations per rank (same tokens); Ulysses one B T/N d more
        ring, ulysses, dp = (row["saved_activation_mb"] for row in rows)
        layers, tokens, width = 4, 16 * 128 // 2, 128
        assert ring == pytest.approx(dp, rel=1e-3), rows
        assert (ulysses - ring) * 2**20 == pytest.approx(layers * tokens * width * 4, rel=1e-6), rows
    out = tmp_path / "BENCH.md"
    out.write_text(f"# B\n\n<!-- bench:{suite} -->\nold\n<!-- /bench:{suite} -->\n\nprose stays\n")
    write_markdown(
        out,
        rows,
        "python -m benchmarks.run --quick",
        {"plait": "x", "nproc": 2, "cpu": "c", "torch": "t", "load_1m": 0.0},
    )
    text = out.read_text()
    assert "old" not in text and "prose stays" in text and rows[1]["contender"] in text


def test_suite_all_covers_every_pair_at_two_and_four_ranks():
    from benchmarks.contenders import SUITES
    from benchmarks.run import worlds_of

    covered = {(name, world) for name, suite in SUITES.items() for world in worlds_of(suite, None)}
    assert covered >= (
        {(name, world) for name in ("ddp", "zero1", "zero3", "pp", "ppv") for world in (2, 4)}
        | {("overhead", 1), ("tp", 2), ("cp", 4)}
    )
    assert worlds_of(SUITES["zero3"], 4) == [4] and worlds_of(SUITES["overhead"], 4) == [1]


def test_param_server_push_window_times_pushes_that_landed_between_two_polls():
    from benchmarks.param_server import push_window

    # the usual case: from the first poll that saw a push to the last poll
    assert push_window([(0.0, 0, 0), (1.0, 3, 3), (2.0, 12, 12)]) == ((1.0, 3, 3), (2.0, 12, 12))
    # a fast machine: every push between two polls -> from the poll before them (CI once timed 0 pushes/s)
    assert push_window([(0.0, 0, 0), (0.5, 0, 0), (1.0, 12, 12), (1.5, 12, 12)]) == ((0.5, 0, 0), (1.5, 12, 12))
    with pytest.raises(RuntimeError, match="no report came before"):
        push_window([(1.0, 12, 12), (2.0, 12, 12)])


@pytest.mark.timeout(120)
def test_param_server_benchmark_measures_pushes_and_writes_its_block(tmp_path):
    from benchmarks.param_server import SERVERS, markdown, measure
    from benchmarks.report import machine, replace_block

    rows = [
        {"size": "tiny", "code": "after", "mode": mode, "workers": 2, "extra": {}, **measure("tiny", mode, 2, 6, {})}
        for mode in ("asp", "bsp")
    ]
    assert rows[0]["pushes"] == 12 and rows[1]["pushes"] == 12  # every push of 2 workers x 6 steps was applied
    assert all(row["pushes_per_s"] > 0 and row["single_steps_per_s"] > 0 for row in rows)
    assert rows[1]["updates_per_s"] * 2 == pytest.approx(rows[1]["pushes_per_s"])  # BSP: one update per round of 2
    out = tmp_path / "BENCH.md"
    out.write_text("intro\n<!-- bench:ps -->\nold\n<!-- /bench:ps -->\noutro\n")
    info = {**machine(), "conditions": "test"}
    replace_block(out, "ps", markdown(rows, {"tiny": 50.0, "large": 5.0}, "python -m benchmarks.param_server", info))
    text = out.read_text()
    assert text.startswith("intro\n<!-- bench:ps -->\n`python -m benchmarks.param_server`") and "old" not in text
    assert f"| tiny | after | asp | {SERVERS} | 2 | float32 |" in text and text.endswith("<!-- /bench:ps -->\noutro\n")


@pytest.mark.timeout(300)
def test_moe_benchmark_runs_plait_at_ep_2_and_1_and_reports_against_theory(tmp_path):
    """benchmarks/moe.py without its DeepSpeed peer (its own virtualenv; BENCHMARKS.md has the comparison): both
    layouts train the same model (the same step-0 loss), ep=2 reduces only the dense parameters' gradients (the
    theory's 1/7 of ep=1's here) and exchanges tokens, and the block is written."""
    import argparse

    from benchmarks.moe import markdown, run, theory
    from benchmarks.report import replace_block

    args = argparse.Namespace(steps=1, warmup=0, rounds=1, deepspeed=None)
    results = run(args)
    law = theory()
    for rows in results.values():
        ep2, ep1 = rows["plait ep=2"], rows["plait ep=1"]
        assert ep2["losses"][0] == pytest.approx(ep1["losses"][0], rel=1e-6)
        reduce = {name: sum(b for k, b in row["wire"].items() if "all_reduce" in k and k.split()[0] != "ep")
                  for name, row in (("ep2", ep2), ("ep1", ep1))}  # fmt: skip
        assert reduce["ep2"] / reduce["ep1"] == pytest.approx(law["allreduce ep=2"] / law["allreduce ep=1"], rel=1e-3)
        assert sum(b for k, b in ep2["wire"].items() if "all_to_all" in k) > 0.5 * law["plait a2a"]
        assert ep2["model_state_bytes"] < ep1["model_state_bytes"]
    out = tmp_path / "BENCH.md"
    out.write_text("<!-- bench:moe -->\nold\n<!-- /bench:moe -->\n")
    replace_block(out, "moe", markdown(results, args))
    assert "| plait ep=2 |" in out.read_text() and "old" not in out.read_text()
