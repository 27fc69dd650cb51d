"""Mixture-of-Experts in the planner: MoE configs read, FLOPs from the active experts, the token exchange's
alpha-beta cost on the hardware's links, expert parallelism in plan() and in the memory estimate (equal to what a
tiny MoE GPT holds on CPU ranks, to the byte)."""

import dataclasses
import json

import pytest
import torch
from helpers.harness import run_distributed
from helpers.memory import measured_step
from helpers.moe import MODEL

from plait import Layout, estimate_memory
from plait.errors import ConfigError, LayoutError
from plait.models import GPT, GPTConfig, ModelSpec
from plait.planner import get_hardware, plan, predict
from plait.planner.activations import Forward, block_bytes
from plait.planner.costs import IMPLEMENTATIONS
from plait.planner.expert_activations import korthikanti_moe_block_bytes
from plait.planner.experts import all_to_all_time, exchange_bytes, moe_block_time
from plait.planner.hardware import GB, Hardware, NetworkLevel
from plait.planner.hf_config import spec_from_hf_dict
from plait.planner.models import resolve_model

H100 = get_hardware("h100")
PLAIT = IMPLEMENTATIONS["plait"]
MIXTRAL = ModelSpec("mixtral-8x7b", 32, 4096, 32, 14336, 32000, 4096, kv_heads=8, gated=True, experts=8, top_k=2)
"""Mixtral 8x7B (Jiang et al. 2024): 32 blocks of width 4096, 32 heads (8 kv), 8 SwiGLU experts of 14336, top-2."""
TINY = {**MODEL, "vocab_size": 12, "seq_len": 8}
"""tests/helpers/moe.py's model (4 blocks, blocks 1 and 3 MoE, 8 experts of width 8, top-2, one shared) on
12-token vocabularies and 8-token rows."""


# ---------------------------------------------------------------------- the model: configs, parameters, FLOPs
HF_MOE = {  # transformers config class, tiny fields, parameters the spec leaves out (by name)
    "MixtralConfig": ({"num_local_experts": 4, "intermediate_size": 24}, ()),
    "Qwen2MoeConfig": (
        {"num_experts": 6, "intermediate_size": 40, "moe_intermediate_size": 8, "shared_expert_intermediate_size": 16,
         "decoder_sparse_step": 2, "num_hidden_layers": 4},
        ("proj.bias", "shared_expert_gate"),
    ),
    "Qwen3MoeConfig": (
        {"num_experts": 4, "intermediate_size": 40, "moe_intermediate_size": 8, "head_dim": 16, "mlp_only_layers": [0]},
        ("q_norm", "k_norm"),
    ),
    "OlmoeConfig": ({"num_experts": 8, "intermediate_size": 8, "num_key_value_heads": 4}, ("q_norm", "k_norm")),
}  # fmt: skip


@pytest.mark.parametrize("name", list(HF_MOE))
def test_hf_moe_configs_count_what_transformers_builds(name):
    """Each MoE family's config, read as plait plan reads config.json, counts the parameters transformers builds
    from it, except the small ones the spec does not describe (named: Qwen2-MoE's q/k/v biases and shared-expert
    gate, the q/k norms), and its active parameters are those of top_k routed experts. Qwen3-MoE's heads here are
    twice hidden / heads wide (its head_dim key, as Qwen3-30B-A3B's 128 with hidden 2048 and 32 heads)."""
    transformers = pytest.importorskip("transformers")
    fields, left_out = HF_MOE[name]
    base = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4}
    base.update({"num_key_value_heads": 2, "num_experts_per_tok": 2, "max_position_embeddings": 64})
    config = getattr(transformers, name)(**{**base, **fields})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    named = dict(model.named_parameters())
    uncounted = sum(p.numel() for n, p in named.items() if any(part in n for part in left_out))
    spec = spec_from_hf_dict(config.to_dict(), name, name)
    assert spec.parameters == sum(p.numel() for p in named.values()) - uncounted
    routed = [n for n in named if ".experts." in n]
    assert spec.moe_blocks == len({n.split(".layers.")[1].split(".")[0] for n in routed})
    per_expert = spec.expert_parameters
    assert spec.parameters - spec.active_parameters == spec.moe_blocks * (spec.experts - spec.top_k) * per_expert


def test_deepseek_style_keys_and_what_is_refused(tmp_path):
    """DeepSeek-MoE's keys (routed and shared experts, a prefix of dense blocks, every moe_layer_freq-th block),
    counted by hand; multi-head latent attention, patterns ModelSpec cannot describe and missing top-k refused."""
    data = {
        "model_type": "deepseek", "num_hidden_layers": 5, "hidden_size": 64, "num_attention_heads": 4,
        "intermediate_size": 96, "moe_intermediate_size": 16, "n_routed_experts": 8, "n_shared_experts": 2,
        "num_experts_per_tok": 3, "first_k_dense_replace": 1, "moe_layer_freq": 1, "vocab_size": 100,
        "max_position_embeddings": 128, "hidden_act": "silu",
    }  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    spec = resolve_model(str(path))
    assert (spec.experts, spec.top_k, spec.shared_experts, spec.expert_ffn) == (8, 3, 2, 16)
    assert [spec.is_moe_block(i) for i in range(5)] == [False, True, True, True, True]
    h, attention, norms = 64, 4 * 64 * 64, 2 * 64
    dense_block = attention + 3 * h * 96 + norms
    moe_block = attention + h * 8 + (8 + 2) * 3 * h * 16 + norms
    assert spec.parameters == dense_block + 4 * moe_block + 2 * 100 * h + h
    # per token: attention, the router, 3 routed + 2 shared experts; 4 s h for the scores; the logits
    active = attention + h * 8 + (3 + 2) * 3 * h * 16
    assert spec.flops_per_token() == 3 * (2 * (attention + 3 * h * 96) + 4 * 2 * active + 5 * 4 * 128 * h + 2 * h * 100)
    refused = {
        "multi-head latent attention": {"kv_lora_rank": 512},
        r"MoE blocks \[1, 2, 4\] are not every": {"first_k_dense_replace": 0, "mlp_only_layers": [0, 3]},
        "not a whole number of experts": {"shared_expert_intermediate_size": 40},
        "no top-k key": {"num_experts_per_tok": None},
    }
    for words, change in refused.items():
        bad = {**data, **change}
        if "mlp_only_layers" in change:  # Qwen's keys instead of DeepSeek's
            bad = {k: v for k, v in bad.items() if k not in ("first_k_dense_replace", "moe_layer_freq")}
        path.write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=words):
            resolve_model(str(path))


def test_flops_per_token_counts_the_active_experts():
    """Mixtral: 2 x (attention + router + 2 experts) per token and block (Narayanan et al.'s count with the MLP
    replaced), not the 8 experts it holds; an ep layout does not change the model FLOPs."""
    h, kv, f = 4096, 8 * 128, 14336
    per_block = h * (h + 2 * kv) + h * h + h * 8 + 2 * 3 * h * f
    expected = 3 * (32 * (2 * per_block + 4 * 4096 * h) + 2 * h * 32000)
    assert MIXTRAL.flops_per_token() == expected
    assert MIXTRAL.active_parameters < MIXTRAL.parameters / 3
    run = {"global_batch": 64, "hardware": "h100"}
    a = predict(MIXTRAL, Layout(dp=64, zero=3, precision="bf16"), **run)
    b = predict(MIXTRAL, Layout(dp=64, ep=8, zero=1, precision="bf16"), **run)
    assert a.model_flops == b.model_flops == 64 * 4096 * expected


# ---------------------------------------------------------------------- the token exchange on the links
def test_all_to_all_time_is_the_hand_computed_alpha_beta():
    """Inside a node every byte but a rank's own S / P rides NVLink; across nodes the bytes to other nodes ride the
    NIC while the rest ride NVLink, both at once; beyond a leaf switch the spine's oversubscribed share is a third
    link (module docstring of plait.planner.experts)."""
    s, eff = 64e6, 0.8
    nvlink, nic, alpha_in, alpha_out = 450 * GB, 50 * GB, 5e-6, 1e-5
    assert all_to_all_time(H100, s, 8, 1, eff) == pytest.approx(7 * alpha_in + s * 7 / 8 / (nvlink * eff))
    across = 15 * alpha_out + max(s * 7 / 16 / (nvlink * eff), s * 8 / 16 / (nic * eff))
    assert all_to_all_time(H100, s, 16, 1, eff) == pytest.approx(across)
    # stride 2 (ep beside tp = 2): 4 of the 8 ranks in a node, 4 nodes
    strided = 7 * alpha_out + max(s * 3 / 8 / (nvlink * eff), s * 4 / 8 / (nic * eff))
    assert all_to_all_time(H100, s, 8, 2, eff) == pytest.approx(strided)
    cluster = Hardware(
        "three-levels", {"bf16": 1e15}, 80e9, 3e12, 0, 0, 8,
        levels=(NetworkLevel("node", 8, 400e9, 2e-6), NetworkLevel("leaf", 32, 50e9, 5e-6),
                NetworkLevel("spine", 0, 50e9, 1e-5, oversubscription=4)),
    )  # fmt: skip
    t = all_to_all_time(cluster, s, 64, 1, 1.0)  # 8 nodes in 2 leaves
    assert t == pytest.approx(63 * 1e-5 + max(s * 7 / 64 / 400e9, s * 56 / 64 / 50e9, s * 32 / 64 / 12.5e9))
    assert all_to_all_time(H100, s, 1, 1, eff) == 0.0


def test_the_exchange_in_a_prediction_equals_its_formula():
    """Per MoE block and micro-batch: forward the count exchange and two all-to-alls of S = b s k h e, backward
    two; the step's ep_comm is m x blocks x that, and the exchange is the only difference ep makes in a block."""
    layout = Layout(dp=16, ep=8, zero=1, microbatches=4, precision="bf16")
    b, s = 2, 4096
    assert exchange_bytes(MIXTRAL, layout, PLAIT, b, s) == b * s * 2 * 4096 * 2
    one = all_to_all_time(H100, b * s * 2 * 4096 * 2, 8, 1, 0.8)
    counts = all_to_all_time(H100, 8 * 8, 8, 1, 0.8)
    result = predict(MIXTRAL, layout, "h100", 16 * 4 * b)
    assert result.time["ep_comm"] == pytest.approx(4 * 32 * (4 * one + counts))
    alone = moe_block_time(MIXTRAL, H100, PLAIT, dataclasses.replace(layout, ep=1), b, s)
    split = moe_block_time(MIXTRAL, H100, PLAIT, layout, b, s)
    assert split.forward == alone.forward and split.forward_comm - alone.forward_comm == pytest.approx(2 * one + counts)
    assert split.backward_comm - alone.backward_comm == pytest.approx(2 * one)
    # sequence parallelism splits the routed tokens over tp: a rank exchanges S / t
    sp = Layout(dp=8, tp=2, ep=8, sequence_parallel=True, precision="bf16")
    assert exchange_bytes(MIXTRAL, sp, PLAIT, b, s) == b * s * 2 * 4096 * 2 / 2


def test_ep_layouts_refused_where_they_cannot_split():
    with pytest.raises(LayoutError, match="ep=3 does not divide the 8 experts"):
        predict(MIXTRAL, Layout(dp=6, ep=3), "h100", 6)
    with pytest.raises(LayoutError, match="llama-7b has none"):
        predict("llama-7b", Layout(dp=8, ep=2), "h100", 8)


# ---------------------------------------------------------------------- plan() and the stage memory
def test_plan_chooses_expert_parallelism_where_memory_forces_it():
    """64 SwiGLU experts of width 14336 in 16 blocks (181B parameters, 6.6B active) on 64 H100s: no layout
    without ep holds them (ZeRO-3 gathers a block's 11B expert parameters whole); the plan splits the experts,
    and the same layout at ep = 1 does not fit."""
    spec = ModelSpec("moe-181b", 16, 4096, 32, 14336, 32000, 4096, kv_heads=8, gated=True, experts=64, top_k=2)
    result = plan(spec, 64, "h100", global_batch=64, top=3)
    assert all(c.layout.ep > 1 and c.fits for c in result.candidates)
    best = result.best
    assert not predict(spec, dataclasses.replace(best.layout, ep=1), "h100", 64).fits
    assert best.time["ep_comm"] > 0


def test_routed_experts_states_are_split_over_ep_and_sharded_over_edp():
    """The ZeRO paper's accounting per rank, dense parameters over dp x cp = 16, routed experts / ep over
    edp = 16 / ep (Mixtral: 45B routed of 46.7B)."""
    routed = 32 * 8 * 3 * 4096 * 14336
    dense = MIXTRAL.parameters - routed
    for ep, zero in ((1, 1), (8, 1), (8, 3), (4, 2)):
        mem = predict(MIXTRAL, Layout(dp=16, ep=ep, zero=zero, precision="bf16"), "h100", 16).memory
        edp = 16 // ep
        state = {1: lambda psi, n: (2 * psi, 2 * psi, 12 * psi / n), 2: lambda psi, n: (2 * psi, 2 * psi / n,
                 12 * psi / n), 3: lambda psi, n: (2 * psi / n, 2 * psi / n, 12 * psi / n)}[zero]  # fmt: skip
        expected = [a + b for a, b in zip(state(dense, 16), state(routed / ep, edp))]
        assert [mem.parameters, mem.gradients, mem.optimizer_states] == pytest.approx(expected)


def test_korthikanti_moe_block_replaces_the_mlp_terms():
    """Megatron-style accounting of an MoE block: the dense block's MLP terms (2 s b h input, (4|6) f s b h)
    replaced by the MoE input, fp32 router probabilities, and per chosen expert the permuted rows, the grouped
    MLP's activations and the expert outputs (module docstring of expert_activations)."""
    fwd = Forward(1, 4096, "bf16")
    s, h, f = 4096, 4096, 14336
    dense = block_bytes(MIXTRAL, fwd, "none", "korthikanti")
    moe = korthikanti_moe_block_bytes(MIXTRAL, fwd)
    assert moe - dense == pytest.approx(s * h * ((2 + 2 * (2 + 6 * f / h + 2) + 4 * 8 / h) - (2 + 6 * f / h)))
    assert korthikanti_moe_block_bytes(MIXTRAL, fwd, "full") == block_bytes(MIXTRAL, fwd, "full", "korthikanti")


# ---------------------------------------------------------------------- estimate_memory == what plait holds
@pytest.mark.parametrize(
    "overrides",
    [{}, {"mlp": "swiglu", "position": "rope", "norm": "rmsnorm"}, {"router_norm_topk": False, "moe_balance": "none"}],
)
def test_moe_estimate_equals_measured_on_one_rank(overrides):
    """plait's tiny MoE GPT in fp32 on one rank, AdamW: the activations a step keeps for backward equal
    ``estimate_memory`` to the byte under every recompute mode ("op" with GELU experts: with SwiGLU its kept
    outputs depend on which experts the rows went to), and the model states held at the step equal its figures."""
    config = GPTConfig(**{**TINY, **overrides})
    batch = tuple(torch.randint(0, 12, (4, 8), generator=torch.Generator().manual_seed(i)) for i in (1, 2))
    modes = ("none", "selective", "full", (1,)) + (("op",) if config.mlp == "gelu" else ())
    for stage, recompute in [(0, mode) for mode in modes] + [(1, "none"), (3, "full")]:
        saved, held, estimate = measured_step(config, Layout(zero=stage, recompute=recompute), batch, 4)
        assert saved == estimate.activations, (stage, recompute, saved, estimate.activations)
        for kind in ("parameters", "master_weights", "optimizer_states"):
            assert held[kind] == getattr(estimate, kind), (stage, recompute, kind)
        assert held["gradients"] == estimate.gradients_at_step


def _held_under_ep(world: int, ep: int, stages: tuple[int, ...]) -> dict:
    """Each rank's saved activations over a step and model states at the optimizer step, per ZeRO stage."""
    config = GPTConfig(**TINY)
    rank = torch.distributed.get_rank()
    batch = tuple(torch.randint(0, 12, (4, 8), generator=torch.Generator().manual_seed(10 * rank + i)) for i in (1, 2))
    out = {}
    kinds = ("activations", "parameters", "master_weights", "optimizer_states", "gradients_at_step")
    for stage in stages:
        saved, held, estimate = measured_step(config, Layout(dp=world, ep=ep, zero=stage), batch, 4)
        out[stage] = (saved, held, {k: getattr(estimate, k) for k in kinds})
    return out


@pytest.mark.distributed
def test_moe_estimate_equals_measured_under_expert_parallelism():
    """dp2 x ep2 on 2 CPU ranks (edp = 1), ZeRO 0-3: each rank's parameters, master weights, optimizer states and
    gradients at the step equal the estimate to the byte (experts split over ep, their states over edp; these
    sizes need no padding). Each rank's activations move with the rows its experts received; their mean over the
    ep group equals the estimate (uniform routing: n k rows per rank) to the byte, since every row one rank sends
    another receives."""
    results = run_distributed(_held_under_ep, 2, 2, 2, (0, 1, 2, 3), timeout=600)
    for stage in (0, 1, 2, 3):
        saved = [r[stage][0] for r in results]
        estimate = results[0][stage][2]
        assert sum(saved) == 2 * estimate["activations"], (stage, saved, estimate["activations"])
        assert len(set(saved)) > 1, "the ranks' routing should differ (the test would not see the mean)"
        for rank_result in results:
            held, est = rank_result[stage][1], rank_result[stage][2]
            for kind in ("parameters", "master_weights", "optimizer_states"):
                assert held[kind] == est[kind], (stage, kind, held, est)
            assert held["gradients"] == est["gradients_at_step"], (stage, held, est)


@pytest.mark.distributed
def test_moe_estimate_under_expert_parallelism_with_edp():
    """dp4 x ep2 (edp = 2): the experts' states sharded over 2 ranks under ZeRO-1/3, the rest over 4."""
    results = run_distributed(_held_under_ep, 4, 4, 2, (1, 3), timeout=900)
    for stage in (1, 3):
        assert sum(r[stage][0] for r in results) == 4 * results[0][stage][2]["activations"]
        for rank_result in results:
            held, est = rank_result[stage][1], rank_result[stage][2]
            assert [held[k] for k in ("parameters", "master_weights", "optimizer_states")] == [
                est[k] for k in ("parameters", "master_weights", "optimizer_states")
            ]


def test_estimate_for_a_module_splits_its_grouped_experts():
    """A GPT module (counted from its parameters) and its GPTConfig give the same estimate under ep."""
    config = GPTConfig(**TINY)
    layout = Layout(dp=4, ep=4, zero=1)
    model = GPT(config)
    from_module = estimate_memory(model, layout, device="cpu")
    from_config = estimate_memory(config, layout, device="cpu")
    routed = 2 * 8 * 2 * 16 * 8  # 2 MoE blocks x 8 GELU experts x (up, down) of 16 x 8
    dense = model.num_parameters() - routed
    assert from_module.parameters == from_config.parameters == 4 * dense + 4 * routed / 4  # ZeRO-1: whole params
    assert from_module.optimizer_states == from_config.optimizer_states == 8 * dense / 4 + 8 * routed / 4 / 1


def test_cli_plans_and_simulates_an_hf_moe_config(tmp_path, capsys):
    """plait plan --model config.json of a Mixtral-shaped model writes a run configuration with its ep; simulate
    takes ep in --layout and shows the exchange in the breakdown."""
    from plait.cli.main import main
    from plait.train.config import load_config

    config = {
        "model_type": "mixtral", "num_hidden_layers": 8, "hidden_size": 1024, "intermediate_size": 3584,
        "num_attention_heads": 16, "num_key_value_heads": 4, "num_local_experts": 8, "num_experts_per_tok": 2,
        "vocab_size": 32000, "max_position_embeddings": 4096, "hidden_act": "silu",
    }  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    out = tmp_path / "run.toml"
    args = ["plan", "--model", str(path), "--gpus", "16", "--gpu", "h100", "--global-batch", "64", "--out", str(out)]
    assert main(args) == 0
    assert "B active)" in capsys.readouterr().out  # the plan's title: total and active parameters
    run = load_config(out)
    assert run.model["hf_config"] == str(path) and run.layout.world_size == 16
    assert 8 % run.layout.ep == 0 and (run.layout.dp * run.layout.cp) % run.layout.ep == 0
    layout = "dp=16,ep=8,zero=1,microbatches=4"
    assert main(["simulate", "--model", str(path), "--gpu", "h100", "--global-batch", "64", "--layout", layout]) == 0
    assert "ep comm" in capsys.readouterr().out


def test_heads_wider_than_hidden_over_heads_are_counted():
    """A config's head_dim that is not hidden / heads (Qwen3: 128 with hidden 1024 and 16 heads in the 0.6B) sets
    the width of q and of the attention's output: the parameters transformers builds (the q/k norms aside), and
    4 s a d FLOPs for the scores. Before, the reader ignored head_dim and counted hidden-wide q and o."""
    transformers = pytest.importorskip("transformers")
    fields = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 2}
    config = transformers.Qwen3Config(
        **fields, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, head_dim=16
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    norms = sum(p.numel() for n, p in model.named_parameters() if "q_norm" in n or "k_norm" in n)
    spec = spec_from_hf_dict(config.to_dict(), "qwen3", "qwen3")
    assert spec.q_width == 64 and spec.parameters == sum(p.numel() for p in model.parameters()) - norms
    assert spec.attention_core_flops(1, 8) == 4 * 8 * 8 * 64
    with pytest.raises(ConfigError, match="head_dim = d_model / n_head"):
        spec.to_gpt_config()


# ---------------------------------------------------------------------- published MoE runs (docs/planner.md)
def test_published_moe_runs_are_predicted_with_nothing_fitted_on_them():
    """The MoE rows are test rows of their own sources: the fit (one efficiency per generation, each of the
    implementation it was fitted on) never sees them, they borrow Hopper's (Composer's) and say so, one is pending
    (a pipeline of more chunks than blocks), and their errors stay where docs/planner.md reports them (a change to
    the model that moves them must say so there: these bounds are today's, so a regression fails)."""
    from plait.planner.accuracy import default_evaluation, evaluate
    from plait.planner.hardware import EFFICIENCY_FITTED_ON
    from plait.planner.published_moe import published_moe_runs

    fitted, dense = default_evaluation()
    runs = published_moe_runs()
    labels = {run.label for run in runs}
    assert all(run.role == "test" for run in runs)
    assert not labels & {label for _, own in fitted.values() for label in own}
    scored = evaluate(runs, fitted)
    assert [s.run.label for s in scored if s.pending] == [next(r.label for r in runs if "PP32" in r.label)]
    predicted = [s for s in scored if not s.pending]
    assert all(s.borrowed == EFFICIENCY_FITTED_ON["hopper"] == "composer" for s in predicted)
    errors = {s.run.label.split(", ", 2)[-1]: s.error for s in predicted}
    assert errors["TP1 EP8 PP4 VP8"] == pytest.approx(-0.121, abs=0.01)  # Mixtral 8x7B
    assert max(abs(e) for e in errors.values() if e is not None) < 0.7
    # the dense table marks the rows that borrow another implementation's efficiency, and none of its fitting rows
    assert {s.run.source for s in dense if s.borrowed} >= {"llama3-2024-t4", "torchtitan-2024", "mt-nlg-2022"}
    assert not any(s.borrowed for s in dense if s.run.role == "fit" or s.run.source == "mosaicml-h100-nodes")


def test_plan_notes_whose_efficiency_it_borrows():
    """plan() on a catalogue GPU says its compute efficiency was fitted on another implementation's runs and that
    plait's own comes from plait calibrate."""
    result = plan("llama-7b", 8, "h100", seq=2048, global_batch=16, top=1)
    assert any("composer" in note and "plait calibrate" in note for note in result.notes)
