"""The planner's inputs (issue 16, part 5): Hugging Face config.json of every supported family (ALiBi models planned
at --seq), custom clusters from --hardware FILE.toml (network levels, oversubscription), and the errors that name
what is missing and the fix. One process, no spawning."""

from __future__ import annotations

import dataclasses
import json

import pytest

from plait.errors import ConfigError
from plait.layout import Layout
from plait.models.spec import ModelSpec
from plait.planner import get_hardware, plan, predict, resolve_model
from plait.planner.costs import collective_time
from plait.planner.hardware import CATALOGUE, GB
from plait.planner.hardware_file import load_hardware_toml
from plait.train.config import load_config

BLOOM = {  # the keys of bigscience/bloom's config.json (model_type bloom: ALiBi, no context length)
    "model_type": "bloom",
    "n_layer": 70,
    "hidden_size": 14336,
    "n_head": 112,
    "vocab_size": 250880,
    "layer_norm_epsilon": 1e-05,
    "apply_residual_connection_post_layernorm": False,
}


def write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(json.dumps(data) if isinstance(data, dict) else data)
    return path


def test_bloom_config_without_context_length_is_planned_at_seq(tmp_path):
    path = write(tmp_path, "config.json", BLOOM)
    with pytest.raises(ConfigError, match=r"no context length.*ALiBi.*Fix: .*--seq"):
        resolve_model(str(path))
    spec = resolve_model(str(path), seq=2048)
    assert (spec.layers, spec.hidden, spec.heads, spec.seq, spec.ffn) == (70, 14336, 112, 2048, 4 * 14336)
    assert spec.tied_embeddings and spec.bias and not spec.learned_positions and not spec.gated
    assert spec.parameters / 1e9 == pytest.approx(176.2, rel=0.005)  # BLOOM-176B
    assert predict(spec, Layout(dp=8, tp=4, pp=12, microbatches=16, precision="bf16"), "a100-80gb").step_time > 0


@pytest.mark.parametrize(
    "data, expected",
    [
        (  # Falcon-7B: multi-query attention, parallel attention, 4h MLP, no bias
            {
                "model_type": "falcon",
                "num_hidden_layers": 32,
                "hidden_size": 4544,
                "num_attention_heads": 71,
                "multi_query": True,
                "vocab_size": 65024,
                "alibi": False,
                "bias": False,
            },
            dict(layers=32, kv=1, ffn=4 * 4544, seq=4096, gated=False, bias=False),
        ),
        (  # MPT-7B: ALiBi, expansion ratio, max_seq_len
            {
                "model_type": "mpt",
                "n_layers": 32,
                "d_model": 4096,
                "n_heads": 32,
                "expansion_ratio": 4,
                "max_seq_len": 2048,
                "vocab_size": 50432,
                "no_bias": True,
                "attn_config": {"alibi": True},
            },
            dict(layers=32, kv=32, ffn=16384, seq=2048, gated=False, bias=False),
        ),
        (  # OPT-1.3B: learned positions, ffn_dim
            {
                "model_type": "opt",
                "num_hidden_layers": 24,
                "hidden_size": 2048,
                "num_attention_heads": 32,
                "ffn_dim": 8192,
                "max_position_embeddings": 2048,
                "vocab_size": 50272,
            },
            dict(layers=24, kv=32, ffn=8192, seq=2048, gated=False, bias=True),
        ),
        (  # Mistral-7B: gated, GQA, untied by default
            {
                "model_type": "mistral",
                "num_hidden_layers": 32,
                "hidden_size": 4096,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "intermediate_size": 14336,
                "max_position_embeddings": 32768,
                "vocab_size": 32000,
            },
            dict(layers=32, kv=8, ffn=14336, seq=32768, gated=True, bias=False),
        ),
    ],
)
def test_hf_families_read_their_own_keys(tmp_path, data, expected):
    seq = 4096 if data["model_type"] == "falcon" else None  # Falcon-7B's config has no context key
    spec = resolve_model(str(write(tmp_path, "config.json", data)), seq=seq)
    got = dict(layers=spec.layers, kv=spec.kv, ffn=spec.ffn, seq=spec.seq, gated=spec.gated, bias=spec.bias)
    assert got == expected


def test_a_dropout_outside_zero_to_one_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"dropout=1.5 is outside \[0, 1\); use e.g. 0.0 or 0.1"):
        ModelSpec("m", 2, 64, 4, 256, 8, 16, dropout=1.5)


def test_hf_configs_give_their_dropout_so_the_activation_masks_count(tmp_path):
    base = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 8}
    gpt2 = {**base, "model_type": "gpt2", "n_positions": 16, "resid_pdrop": 0.1, "attn_pdrop": 0.05}
    mpt = {**base, "model_type": "mpt", "max_seq_len": 16, "attn_config": {"attn_pdrop": 0.2}}
    llama = {**base, "model_type": "llama", "max_position_embeddings": 16, "attention_dropout": 0.0}
    assert resolve_model(str(write(tmp_path, "gpt2.json", gpt2))).dropout == 0.1  # the largest one
    assert resolve_model(str(write(tmp_path, "mpt.json", mpt))).dropout == 0.2  # inside attn_config
    assert resolve_model(str(write(tmp_path, "llama.json", llama))).dropout == 0.0


@pytest.mark.parametrize(
    "data, words",
    [
        ({"model_type": "t5", "is_encoder_decoder": True, "d_model": 512}, "encoder-decoder.*Fix: .*decoder-only"),
        (
            {
                "model_type": "mixtral",
                "num_hidden_layers": 32,
                "hidden_size": 4096,
                "num_attention_heads": 32,
                "num_local_experts": 8,
                "vocab_size": 32000,
                "max_position_embeddings": 32768,
            },
            r"8 experts \(num_local_experts\) but no top-k key.*Fix: set num_experts_per_tok",
        ),
        (
            {
                "model_type": "llama",
                "hidden_size": 64,
                "num_attention_heads": 4,
                "vocab_size": 8,
                "max_position_embeddings": 16,
            },
            "no layer count: none of the keys num_hidden_layers",
        ),
        ("[1, 2]", "JSON list, not an object"),
        ("{not json", "cannot read model config"),
    ],
)
def test_bad_hf_configs_name_the_problem_and_the_fix(tmp_path, data, words):
    with pytest.raises(ConfigError, match=words):
        resolve_model(str(write(tmp_path, "config.json", data)))


CLUSTER = """
name = "test-cluster"
base = "h100"
generation = "hopper"
[[levels]]
name = "nvlink"
devices = 8
bandwidth_gb_s = 450
latency_us = 5
[[levels]]
name = "leaf"
devices = 64
bandwidth_gb_s = 50
latency_us = 10
[[levels]]
name = "spine"
bandwidth_gb_s = 50
latency_us = 20
oversubscription = 4
"""


def test_hardware_file_levels_and_oversubscription(tmp_path):
    path = write(tmp_path, "cluster.toml", CLUSTER)
    hw = get_hardware(str(path))
    assert (
        hw.name == "test-cluster" and hw.devices_per_node == 8 and hw.flops("bf16") == CATALOGUE["h100"].flops("bf16")
    )
    assert [lv.name for lv in hw.network()] == ["nvlink", "leaf", "spine"]
    nbytes, n = 1e9, 8
    inside, leaf, spine = (collective_time(hw, "all_reduce", nbytes, n, span) for span in (8, 64, 512))
    # alpha-beta: the ring at the level that joins the group; beyond the leaf, the spine's quarter bandwidth
    ring = lambda bw, lat: 2 * (n - 1) * lat + 2 * (n - 1) / n * nbytes / (bw * 0.8)  # noqa: E731
    assert inside == pytest.approx(ring(450 * GB, 5e-6)) and leaf == pytest.approx(ring(50 * GB, 10e-6))
    assert spine == pytest.approx(ring(50 * GB / 4, 20e-6))  # one rank per leaf: 64 such groups share the spine
    # 512 consecutive ranks (8 per node, 64 per leaf): the ring's crossings ride the 8 NICs of a node; the
    # spine's quarter share is not reached (every leaf's 64 devices sit in this one group), so 8 x 50 GB/s
    whole = collective_time(hw, "all_gather", nbytes, 512, 512)
    assert whole == pytest.approx(511 * 20e-6 + 511 / 512 * nbytes / (8 * 50 * GB * 0.8))
    # all-to-all gets one device's share of the level it crosses, oversubscribed
    assert collective_time(hw, "all_to_all", nbytes, 8, 512) == pytest.approx(
        7 * 20e-6 + 7 / 8 * nbytes / (50 * GB / 4 * 0.8)
    )
    assert plan("llama-7b", 16, hw, seq=2048, global_batch=32, top=1).best.world_size == 16


@pytest.mark.parametrize(
    "text, words",
    [
        ('name = "x"\nbase = "h100"\ncolour = "red"', r"unknown key\(s\) \['colour'\].*Fix: use only these keys"),
        ('name = "x"', "peak_tflops, memory_gb, memory_bandwidth_tb_s, levels missing.*base = "),
        ('name = "x"\nbase = "tpu"', "base = 'tpu' is not in the catalogue"),
        ('name = "x"\nbase = "h100"\nmemory_gb = -80', "memory_gb = -80 must be a number > 0"),
        (
            'name = "x"\nbase = "h100"\ncompute_efficiency = 1.5',
            "compute_efficiency = 1.5 must be a number > 0 and <= 1",
        ),
        (  # code in a value is only a string: never run, refused as a number
            'name = "x"\nbase = "h100"\npeak_tflops = "__import__(\'os\').system(\'true\')"',
            "peak_tflops = .* must be a number",
        ),
        (
            'name = "x"\nbase = "h100"\n[[levels]]\ndevices = 8\nbandwidth_gb_s = 450\nlatency_us = 5\n'
            "[[levels]]\ndevices = 4\nbandwidth_gb_s = 50\nlatency_us = 10",
            "devices = 4 does not grow past the level inside it",
        ),
        ('name = "x"\nbase = "h100"\n[[levels]]\ndevices = 8\nlatency_us = 5', "bandwidth_gb_s missing"),
        ("name = [", "cannot read hardware file"),
        (
            'name = "x"\npeak_tflops = 100\nmemory_gb = 40\nmemory_bandwidth_tb_s = 1\n'
            "[[levels]]\ndevices = 4\nbandwidth_gb_s = 100\nlatency_us = 5",
            "no compute efficiency.*generation",
        ),
    ],
)
def test_bad_hardware_files_name_the_key_and_the_fix(tmp_path, text, words):
    with pytest.raises(ConfigError, match=words):
        load_hardware_toml(write(tmp_path, "cluster.toml", text))


def test_cli_plan_from_an_hf_config_on_a_custom_cluster_writes_a_complete_run_config(tmp_path, capsys, monkeypatch):
    from plait.cli.main import main

    config = write(
        tmp_path, "config.json", {**BLOOM, "n_layer": 4, "hidden_size": 256, "n_head": 4, "vocab_size": 1024}
    )
    cluster = write(tmp_path, "cluster.toml", CLUSTER)
    out = tmp_path / "run.toml"
    args = ["plan", "--model", str(config), "--seq", "1024", "--gpus", "8", "--hardware", str(cluster)]
    assert main([*args, "--global-batch", "16", "--out", str(out)]) == 0
    run = load_config(out)
    assert run.model["hf_config"] == str(config) and run.train.global_batch == 16
    assert run.layout.world_size == 8
    assert "test-cluster" in capsys.readouterr().out
    monkeypatch.chdir(tmp_path)  # a relative --model stays relative (issue 37: the plan named an absolute path)
    assert main(["plan", "--model", "config.json", *args[3:], "--global-batch", "16", "--out", "rel.toml"]) == 0
    assert load_config("rel.toml").model["hf_config"] == "config.json"
    assert main(["plan", "--model", str(config), "--gpus", "8"]) == 2  # no --seq for an ALiBi config
    assert "--seq" in capsys.readouterr().err
    sim = ["simulate", "--model", "llama-7b", "--hardware", str(cluster), "--layout", "dp=8,microbatches=2"]
    assert main([*sim, "--global-batch", "16"]) == 0
    assert "test-cluster" in capsys.readouterr().out
    cuts = ["simulate", "--model", "gpt2-medium", "--layout", "dp=1,pp=2,microbatches=4,pipeline_cuts=[20]"]
    assert main(cuts) == 0
    assert "0-19 | 20-23" in capsys.readouterr().out  # the given stage cuts, not the planner's


def test_hardware_round_trips_through_json_with_levels():
    from plait.planner.hardware import Hardware
    from plait.planner.published import JEAN_ZAY

    again = Hardware.from_dict(json.loads(json.dumps(JEAN_ZAY.to_dict())))
    assert again == JEAN_ZAY and again.level(16).name == "omni-path"
    assert dataclasses.replace(again, levels=()).level(16).bandwidth == again.inter_node_bandwidth
