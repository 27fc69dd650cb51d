"""The planner: hardware, models, cost formulas, memory, pipeline timing, search, report, CLI (Alpa's passes:
tests/test_planner_alpa.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time

import pytest
import torch

from plait.errors import ConfigError, LayoutError
from plait.layout import Layout
from plait.models import GPT, GPTConfig
from plait.planner import (
    NAMED,
    get_hardware,
    plan,
    predict,
    profile_layers,
    published,
    resolve_model,
)
from plait.planner.calibrate import fit_alpha_beta
from plait.planner.costs import IMPLEMENTATIONS, block_flops, collective_time, spans_nodes
from plait.planner.memory import zero_paper_bytes
from plait.planner.predict import pipeline_closed_form
from plait.planner.report import plan_toml
from plait.planner.search import _divisors, _shapes
from plait.planner.stage_memory import block_activation_bytes, model_state_bytes, stage_memory
from plait.train.config import load_config

H100 = get_hardware("h100")


# ---------------------------------------------------------------------- hardware and models
def test_catalogue_names_aliases_and_errors(monkeypatch, tmp_path):
    assert get_hardware("A100").name == "a100-80gb" and get_hardware("h200").memory_bytes == 141e9
    assert get_hardware("b200").flops("bf16") == 2.25e15 and H100.intra_node_bandwidth == 450e9
    with pytest.raises(ConfigError, match="unknown GPU 'tpu'.*a100-40gb.*this-machine"):
        get_hardware("tpu")
    monkeypatch.setenv("PLAIT_CALIBRATION", str(tmp_path / "none.json"))
    with pytest.raises(ConfigError, match="plait calibrate"):
        get_hardware("this-machine")


@pytest.mark.parametrize(
    "name, billions",
    [
        ("gpt3-175b", 174.6),
        ("llama-7b", 6.74),
        ("llama-13b", 13.0),
        ("llama-70b", 68.98),
        ("llama3-8b", 8.03),
        ("llama3-405b", 405.9),
        ("gpt2", 0.124),
    ],
)
def test_named_models_have_their_published_sizes(name, billions):
    assert NAMED[name].parameters / 1e9 == pytest.approx(billions, rel=0.01)


def test_models_from_hf_config_gptconfig_and_profiles(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "num_hidden_layers": 80,
                "hidden_size": 8192,
                "num_attention_heads": 64,
                "num_key_value_heads": 8,
                "intermediate_size": 28672,
                "vocab_size": 32000,
                "max_position_embeddings": 4096,
                "hidden_act": "silu",
            }
        )
    )
    assert resolve_model(str(path)).parameters == NAMED["llama-70b"].parameters
    config = GPTConfig(vocab_size=32, seq_len=16, n_layer=2, n_head=4, d_model=32)
    model = GPT(config)
    spec = resolve_model(model)
    assert spec.parameters == model.num_parameters()  # exact: the same architecture
    profiles = profile_layers([model.blocks["0"], model.blocks["1"]], torch.randn(1, 16, 32))
    assert profiles[0].parameters == spec.block_parameters
    # flop_counter counts the matmuls (2 b s x weights); the attention product is the formula's 4 b s^2 h
    assert profiles[0].flops == block_flops(spec, 1, 16, 16) - 4 * 16 * 16 * 32
    with pytest.raises(ConfigError, match="unknown model 'llama-9000'.*llama3-8b"):
        resolve_model("llama-9000")


def test_models_from_transformers_objects_use_their_config():
    import transformers  # in the venv (plait.models.hf supports it); the models are built from configs

    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=32, bos_token_id=0, eos_token_id=0
        )
    )
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=100,
            max_position_embeddings=32,
            bos_token_id=0,
            eos_token_id=0,
        )
    )
    for model in (gpt2, llama):  # built from configs: nothing downloaded; counts exact (same architecture)
        assert resolve_model(model).parameters == sum(p.numel() for p in model.parameters())
    spec = resolve_model(llama.config, seq=16)
    assert (spec.kv, spec.gated, spec.seq, spec.tied_embeddings) == (2, True, 16, False)
    assert resolve_model(gpt2).learned_positions and resolve_model(gpt2).tied_embeddings
    assert predict(llama, Layout(dp=2), "h100", global_batch=4).step_time > 0


# ---------------------------------------------------------------------- formulas
def test_collectives_follow_alpha_beta_and_rank_order():
    s, n, hw = 1e9, 8, H100
    beta = hw.intra_node_bandwidth * 0.8
    ring = 2 * (n - 1) * hw.intra_node_latency + 2 * (n - 1) / n * s / beta
    assert collective_time(hw, "all_reduce", s, n, False) == pytest.approx(ring)
    assert collective_time(hw, "all_gather", s, n, False) == pytest.approx(ring / 2, rel=1e-3)
    assert collective_time(hw, "all_reduce", s, 1, True) == 0.0
    assert collective_time(hw, "all_reduce", s, n, True) > 5 * collective_time(hw, "all_reduce", s, n, False)
    layout = Layout(dp=4, tp=8, pp=2)  # tp innermost: one node; dp stride 8: across nodes
    assert not spans_nodes(layout, "tp", 8) and spans_nodes(layout, "dp", 8) and spans_nodes(layout, "pp", 8)
    assert not spans_nodes(Layout(dp=2, tp=4), "dp", 8)


def test_ring_collectives_spread_their_traffic_over_the_nics_of_a_node():
    """group_link: a ring crossing nodes uses the links of all its ranks in a node (NCCL: a channel per NIC), so
    FSDP over whole DGX A100 nodes gets 8 x 25 GB/s (NVIDIA measures 192 GB/s all-reduce bus bandwidth there),
    data parallelism beside tp = 8 (one rank per node) 25 GB/s, four ranks per node 100 GB/s."""
    from plait.planner.costs import group_link

    a100 = get_hardware("a100-80gb")
    nic, nvlink = a100.inter_node_bandwidth, a100.intra_node_bandwidth
    assert group_link(a100, 64, 64) == (a100.inter_node_latency, 8 * nic)  # all 8 GPUs of 8 nodes
    assert group_link(a100, 128, 16) == (a100.inter_node_latency, nic)  # stride 8: one GPU per node
    assert group_link(a100, 64, 32) == (a100.inter_node_latency, 4 * nic)  # stride 2: four per node
    assert group_link(a100, 8, 8) == (a100.intra_node_latency, nvlink)  # inside a node: NVLink, as before
    assert group_link(a100, 64, 64, ring=False)[1] == nic  # all-to-all: each rank's own link
    s = 1e9
    fsdp, one_per_node = (collective_time(a100, "all_gather", s, n, span) for n, span in ((64, 64), (64, 512)))
    assert fsdp == pytest.approx(63 * a100.inter_node_latency + 63 / 64 * s / (8 * nic * 0.8))
    assert one_per_node == pytest.approx(63 * a100.inter_node_latency + 63 / 64 * s / (nic * 0.8))
    alltoall = collective_time(a100, "all_to_all", s, 64, 64)
    assert alltoall == pytest.approx(63 * a100.inter_node_latency + 63 / 64 * s / (nic * 0.8))
    # a whole-node FSDP group moves its gathers faster than one spread one GPU per node: ZeRO-3 time falls
    spec, layout = NAMED["llama-7b"], Layout(dp=64, zero=3, precision="bf16")
    packed = predict(spec, layout, a100, global_batch=64).time["zero3_comm"]
    spread = predict(spec, layout, dataclasses.replace(a100, devices_per_node=1), global_batch=64)
    assert packed < spread.time["zero3_comm"]


def test_zero_paper_figure_through_the_planner():
    impl = IMPLEMENTATIONS["megatron-2021"]
    psi, dp = 7.5e9, 64
    for stage, expected_gb in {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}.items():
        parts = model_state_bytes(psi, Layout(dp=dp, zero=stage), impl)
        total = sum(parts[:3])
        assert total == zero_paper_bytes(psi, dp, stage)  # the same formula, not a re-derivation
        assert round(total / 1e9, 1) == expected_gb  # Rajbhandari et al. 2020, Figure 1
    params, grads, states, host = model_state_bytes(psi, Layout(dp=dp, zero=2, offload="cpu"), impl)
    assert host == states == 12 * psi / dp and grads == 2 * psi / dp


def test_activations_follow_korthikanti():
    spec = NAMED["gpt3-175b"]
    impl = IMPLEMENTATIONS["megatron-2021"]
    s, b, h, a, t = 2048, 1, spec.hidden, spec.heads, 8
    tp_only = block_activation_bytes(spec, Layout(dp=1, tp=t, precision="bf16"), b, s, impl, False)
    assert tp_only == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    with_sp = block_activation_bytes(
        spec, Layout(dp=1, tp=t, sequence_parallel=True, precision="bf16"), b, s, impl, False
    )
    assert with_sp == pytest.approx(s * b * h * (34 + 5 * a * s / h) / t)
    recomputed = block_activation_bytes(
        spec, Layout(dp=1, tp=t, sequence_parallel=True, precision="bf16"), b, s, impl, True
    )
    assert recomputed == pytest.approx(2 * s * b * h / t)


def test_activations_follow_the_block_shape_in_the_megatron_accounting():
    """Korthikanti's terms for a Llama-style block: grouped-query k/v, a SwiGLU MLP of width f, no dropout masks."""
    spec = NAMED["llama3-405b"]
    impl = IMPLEMENTATIONS["llama3"]  # flash attention: no s^2 term
    s, b, h, t = 8192, 1, spec.hidden, 8
    layout = Layout(dp=1, tp=t, sequence_parallel=True, precision="bf16")
    got = block_activation_bytes(spec, layout, b, s, impl, False)
    units = (
        4 + 2 + 2 + 2 + 4 * spec.kv / spec.heads + 2 + 6 * spec.ffn / h
    )  # norms, inputs, q, k|v, o, gate|up, product
    assert got == pytest.approx(s * b * h * units / t)
    gpt = NAMED["gpt3-175b"]
    with_dropout = block_activation_bytes(gpt, layout, b, 2048, impl, False)
    without = block_activation_bytes(dataclasses.replace(gpt, dropout=0.0), layout, b, 2048, impl, False)
    assert with_dropout - without == pytest.approx(2 * 2048 * b * gpt.hidden / t)  # two 1-byte residual masks


def test_deepspeed_zero3_gathers_at_most_its_live_parameters():
    """DeepSpeed keeps at most stage3_max_live_parameters (1e9) gathered, but a larger matrix is gathered whole;
    plait and FSDP gather a block and prefetch the next."""
    spec = published.gpt("gpt-530b", 105, 20480, 128)
    layout = Layout(dp=64, zero=3, recompute="full", precision="bf16")
    block = spec.block_parameters

    def buffers(name):
        return stage_memory(spec, layout, IMPLEMENTATIONS[name], 1, 2048, spec.parameters, 105, 1, True, block).buffers

    assert buffers("deepspeed-zero3") == pytest.approx(2 * 4 * 20480 * 20480)  # the MLP's 4h x h matrix, bf16
    assert buffers("megatron-2021") == pytest.approx(2 * 2 * block)


@pytest.mark.parametrize(
    "schedule, p, m, v",
    [
        ("1f1b", 4, 8, 1),
        ("1f1b", 8, 32, 1),
        ("interleaved", 4, 8, 2),
        ("interleaved", 4, 8, 3),
        ("interleaved", 2, 8, 4),
        ("zero-bubble", 4, 12, 1),
        ("gpipe", 4, 8, 1),
        ("zb-v", 4, 8, 2),
        ("zb-v", 8, 32, 2),
        ("dualpipev", 4, 8, 2),
        ("dualpipev", 2, 8, 2),
    ],
)
def test_pipeline_closed_forms_match_the_simulator(schedule, p, m, v):
    """The search's fast pass and predict(exact=True) agree on equal stages (3%: the p2p transfers the closed
    forms put on the critical path); a rank's forward f and backward b are split over its v chunks."""
    from plait.parallel.pipeline import build_schedule, simulate

    f, b, p2p = 1.0, 2.0, 0.05
    sim = simulate(build_schedule(schedule, p, m, v), {"F": f / v, "B": b / v, "p2p": p2p})
    makespan, busy, in_flight = pipeline_closed_form(schedule, p, m, v, f, b, p2p)
    assert makespan == pytest.approx(sim.makespan, rel=0.03)
    assert busy == pytest.approx(max(sim.busy)) and in_flight == max(sim.peak_activations)


def test_predict_reports_consistent_numbers_and_rejects_bad_layouts():
    layout = Layout(dp=16, tp=8, pp=4, microbatches=32, zero=1, sequence_parallel=True, precision="bf16")
    fast = predict("llama-70b", layout, "h100", global_batch=512, exact=False)
    exact = predict("llama-70b", layout, "h100", global_batch=512)
    assert exact.step_time == pytest.approx(fast.step_time, rel=0.03)
    assert sum(exact.time.values()) == pytest.approx(exact.step_time, rel=1e-9)
    assert 0 < exact.mfu <= exact.hfu < 1 and exact.fits
    assert exact.tflops_per_device == pytest.approx(exact.hfu * 989, rel=1e-9)
    with pytest.raises(LayoutError, match="tp=3 does not split 64 heads"):
        predict("llama-70b", Layout(dp=1, tp=3), "h100", global_batch=8)
    with pytest.raises(LayoutError, match="81 chunks"):
        predict("llama-70b", Layout(dp=1, pp=81), "h100", global_batch=81)
    with pytest.raises(LayoutError, match="multiple of 16"):
        predict("llama-70b", Layout(dp=16, tp=8), "h100", global_batch=100)


# ---------------------------------------------------------------------- search, report, CLI
def test_plan_ranks_fitting_layouts_and_writes_a_runnable_toml(tmp_path):
    result = plan("llama-7b", 16, "a100-80gb", seq=2048, global_batch=64, top=8)
    times = [c.step_time for c in result.candidates]
    assert times == sorted(times) and all(c.fits and c.world_size == 16 for c in result.candidates)
    by_hand = predict("llama-7b", Layout(dp=16, microbatches=4, zero=1), "a100-80gb", global_batch=64, seq=2048)
    assert any(c.layout.pp > 1 for c in result.candidates)
    assert result.best.step_time <= by_hand.step_time * (1 + 1e-9)
    assert "slower" in result.why_runner_up_loses()
    path = tmp_path / "plan.toml"
    path.write_text(plan_toml(result.best, resolve_model("llama-7b", 2048).to_gpt_config(), result.notes))
    config = load_config(path)
    assert config.layout == result.best.layout and config.train.global_batch == 64
    assert config.model["n_layer"] == 32 and config.model["mlp"] == "swiglu"
    piped = next(c for c in result.candidates if c.layout.pp > 1)  # the inter-op pass's cuts are in the layout
    assert len(piped.layout.pipeline_cuts) == piped.layout.pp * piped.layout.virtual_stages - 1
    assert [start for start, _ in piped.stages[1:]] == list(piped.layout.pipeline_cuts)


def test_plan_errors_name_what_would_help():
    with pytest.raises(ConfigError, match="cannot plan for 0 devices"):
        plan("llama-7b", 0)
    with pytest.raises(ConfigError, match=r"fits no layout of 1 x a100-40gb.*more devices"):
        plan("llama3-405b", 1, "a100-40gb", global_batch=1)
    with pytest.raises(ConfigError, match="unknown GPU"):
        plan("llama-7b", 8, "v100")


@pytest.mark.parametrize("gpus, global_batch", [(1024, 1024), (10_000, 2000)])
def test_plan_for_a_70b_model_on_thousands_of_gpus_takes_seconds(gpus, global_batch):
    # 10,000 = 2^4 x 5^4 GPUs: dp is a multiple of 25, so the batch is one too (2000 x 4096 tokens = 8M, the
    # order of Llama 2's 4M-token batches)
    started = time.process_time()  # this process's CPU time: the search's cost, whatever else loads the machine
    result = plan("llama-70b", gpus, "h100", global_batch=global_batch, top=3)
    assert time.process_time() - started < 10  # the bound; 2-5 s of one core
    assert result.best.fits and result.best.world_size == gpus and result.best.mfu > 0.2


def test_a_batch_no_layout_splits_names_batches_and_device_counts_that_do():
    # 10,000 GPUs and batch 1024: dp divides 1024 (a power of two <= 1024) while 10,000 / dp must be tp x cp x pp
    # with pp <= 80 layers: 625 = 5^4 does not fit, so nothing splits. 1000 = 40 x 25 and 9,984 = 8 x 1248 do.
    with pytest.raises(
        ConfigError,
        match=r"no layout of 10000 devices splits a global batch of 1024.*"
        r"1000.*dp can be 25.*9984 or 10112 devices",
    ) as error:
        plan("llama-70b", 10_000, "h100", global_batch=1024)
    suggested = [int(n) for n in re.search(r"splits: ([\d or]+) \(", str(error.value)).group(1).split(" or ")]
    spec = resolve_model("llama-70b")
    for batch in suggested:  # each suggestion has a shape to search (the full search is timed in the test above)
        assert _shapes(spec, H100, 10_000, batch, max_cp=16)
    for gpus in (9984, 10112):
        assert _shapes(spec, H100, gpus, 1024, max_cp=16)
    assert plan("llama-70b", 9984, "h100", global_batch=1024, top=1).best.world_size == 9984


def test_divisors_come_from_factorisation_not_a_loop_over_n():
    started = time.perf_counter()
    assert _divisors(2**20 + 1) == [1, 17, 61681, 2**20 + 1]
    assert len(_divisors(10**12)) == 169  # (12 + 1)^2: a loop over 10^12 candidates would never finish
    assert time.perf_counter() - started < 1
    # a prime: dp would have to be 1 or 1,048,573; the largest count any shape reaches for batch 1024 is
    # tp 8 x pp 80 x dp 1024 = 655,360 (cp needs >= 4096 tokens per rank: none at 4096)
    with pytest.raises(ConfigError, match=r"of 1048573 devices.*splits: 1048573 .*or 655360 devices"):
        plan("llama-70b", 1_048_573, "h100", global_batch=1024)


def test_cli_plan_simulate_and_errors(tmp_path, capsys):
    from plait.cli.main import main

    out = tmp_path / "plan.toml"
    assert (
        main(
            [
                "plan",
                "--model",
                "llama-7b",
                "--gpus",
                "8",
                "--gpu",
                "a100",
                "--seq",
                "2048",
                "--global-batch",
                "32",
                "--top",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert load_config(out).layout.world_size == 8
    assert (
        main(["simulate", "--model", "gpt2", "--gpu", "h100", "--global-batch", "16", "--layout", "dp=4,tp=2,zero=1"])
        == 0
    )
    printed = capsys.readouterr().out
    assert "MFU" in printed and "why #2 loses" in printed
    assert main(["plan", "--model", "llama-7b", "--gpus", "8", "--gpu", "tpu"]) == 2
    assert main(["simulate", "--model", "gpt2", "--layout", "dp=4,tp=5"]) == 2
    assert "unknown GPU 'tpu'" in capsys.readouterr().err


def test_alpha_beta_fit_recovers_a_line():
    sizes = [1e3, 1e4, 1e5, 1e6]
    alpha, beta = fit_alpha_beta(sizes, [2e-5 + 3e-10 * s for s in sizes])
    assert alpha == pytest.approx(2e-5) and beta == pytest.approx(3e-10)


def test_zero2_and_zero3_with_pipeline_hold_unsharded_gradients_and_reduce_once():
    """plait runs ZeRO-2/3 with pp by accumulating each micro-batch's gradients unsharded (no_sync) and
    reduce-scattering once per step: the planner predicts those layouts (no refusal) with whole stage gradients,
    and ZeRO-3 with zero-bubble holding the gathered stage chunk (its I and W passes need every weight)."""
    kw = dict(world_size=None, global_batch=64)
    flat = predict("gpt2-xl", Layout(dp=8, zero=3, microbatches=8), "a100-80gb", **kw)
    piped = predict("gpt2-xl", Layout(dp=4, pp=2, zero=3, microbatches=8), "a100-80gb", **kw)
    zb = predict("gpt2-xl", Layout(dp=4, pp=2, zero=3, microbatches=8, schedule="zero-bubble"), "a100-80gb", **kw)
    assert piped.memory.gradients > 2 * flat.memory.gradients  # unsharded (x dp=4) over half the model (pp=2)
    assert piped.memory.parameters < piped.memory.gradients  # parameters stay sharded over dp
    assert zb.memory.buffers > piped.memory.buffers
    zero2 = predict("gpt2-xl", Layout(dp=4, pp=2, zero=2, microbatches=8), "a100-80gb", **kw)
    zero1 = predict("gpt2-xl", Layout(dp=4, pp=2, zero=1, microbatches=8), "a100-80gb", **kw)
    assert zero2.memory.gradients == zero1.memory.gradients
    assert piped.time["dp_comm"] > 0  # the one reduce-scatter per step


def test_processor_sharing_simulation_of_a_pipeline():
    """``shared_makespan``: with a processor per rank it is the schedule simulator's makespan; on one processor a
    pipeline (always some stage with work) takes exactly the sum of all its work; r replicas on r processors
    take as long as one on one."""
    import dataclasses

    from plait.parallel.pipeline import build_schedule, simulate
    from plait.parallel.pipeline.simulate import Costs
    from plait.planner.sharing import shared_makespan

    costs = Costs(F=[1.0, 1.5, 1.0, 2.0], B=[2.0, 3.0, 2.0, 4.0], p2p=0.25)
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero-bubble", 1)):
        schedule = build_schedule(name, 4 // v, 4, v) if v > 1 else build_schedule(name, 4, 6, 1)
        assert math.isclose(shared_makespan(schedule, costs, units=8), simulate(schedule, costs).makespan)
        serial = dataclasses.replace(costs, p2p=0.0)
        work = sum(serial.of(a) for actions in schedule.actions for a in actions)
        assert math.isclose(shared_makespan(schedule, serial, units=1), work), name
        assert math.isclose(
            shared_makespan(schedule, costs, units=2, replicas=2), shared_makespan(schedule, costs, units=1, replicas=1)
        )
        assert shared_makespan(schedule, costs, units=2) >= simulate(schedule, costs).makespan - 1e-9


def test_split_backward_makes_zero_bubble_dearer_where_calibrated():
    """``Hardware.split_backward`` (I + W over B) prices zero-bubble's two backward passes: 1.0 on GPUs (Qi et al.
    2023), measured by ``plait calibrate`` on CPU (plait's second graph traversal costs extra)."""
    import dataclasses

    from plait.planner.calibrate import measure_split_backward

    assert 1.0 <= measure_split_backward(width=64, seq=32, repeats=3) < 10.0
    layout = Layout(dp=1, pp=4, microbatches=8, schedule="zero-bubble")
    hw = get_hardware("h100")
    base = predict("gpt2-xl", layout, hw, global_batch=8).step_time
    dear = predict("gpt2-xl", layout, dataclasses.replace(hw, split_backward=1.3), global_batch=8).step_time
    assert dear > base * 1.05
    one_f_one_b = Layout(dp=1, pp=4, microbatches=8)
    assert (
        predict("gpt2-xl", one_f_one_b, dataclasses.replace(hw, split_backward=1.3), global_batch=8).step_time
        == predict("gpt2-xl", one_f_one_b, hw, global_batch=8).step_time
    )


def test_plan_offers_per_operator_recomputation_but_not_under_zero_bubble():
    """Where a layout needs recomputation to fit, plan() tries selective, then op, then full (the cheapest that
    fits); op is never paired with zero-bubble, whose split backward the runtime refuses for it."""
    result = plan("llama-70b", 64, "h100", global_batch=128, top=12)
    pairs = {(c.layout.recompute, c.layout.schedule) for c in result.candidates}
    assert any(recompute == "op" for recompute, _ in pairs), pairs
    assert ("op", "zero-bubble") not in pairs
