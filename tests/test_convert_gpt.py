"""``plait convert CKPT FOLDER`` on a checkpoint of plait's own GPT: a Hugging Face folder of the family that
computes the same function (plait/checkpoint/export_gpt.py), opened by ``from_pretrained`` and compared on logits.

Each model is trained a few steps through plait's Engine (so weights, biases and an aux-free selection bias are
no longer their initial values), saved with ``engine.save``, exported, loaded with transformers and run on the
same tokens as the trained GPT.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers.harness import run_distributed
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import plait
from plait import Layout
from plait.checkpoint.convert import convert
from plait.checkpoint.export_gpt import ARCHITECTURES, hf_architecture
from plait.checkpoint.outputs import MARKER
from plait.cli.main import main
from plait.errors import ConfigError
from plait.models import GPT, GPTConfig
from plait.models.generate import generate
from plait.models.moe import moe_layers

VOCAB, SEQ, BATCH = 32, 8, 4
# init_std 0.3: activations of order 1 (logits up to ~4), where a wrong choice shows: GPT-2's tanh GELU in place of
# plait's exact one moves logits by ~1e-3, while with the default 0.02 it would hide under the tolerance
SIZES = {"vocab_size": VOCAB, "seq_len": SEQ, "n_layer": 2, "n_head": 4, "d_model": 16, "init_std": 0.3}
# fp32 on both sides, but the same operations in other kernels and orders (GPT-2's fused qkv Conv1D addmm vs three
# linears, transformers' per-expert loop vs plait's sorted groups): rounding differences, measured up to 1.6e-6
RTOL, ATOL = 1e-5, 1e-5


def adamw(params):  # noqa: ANN001, ANN201 - a factory, as users pass it
    return torch.optim.AdamW(params, lr=1e-2)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def trained(config: GPTConfig, root, layout: Layout | None = None) -> plait.Engine:  # noqa: ANN001
    torch.manual_seed(0)
    engine = plait.parallelize(GPT(config), layout, optimizer=adamw)
    for step in range(3):
        engine.train_step(batch(step))
    engine.save(root)
    return engine


CONFIGS = {
    "gpt2": GPTConfig(**SIZES, n_kv_head=2),  # grouped-query attention: GPT-2 gets the kv heads repeated
    "gpt2-no-bias": GPTConfig(**SIZES, bias=False),  # zero biases
    "llama": GPTConfig.llama_style(**SIZES, n_kv_head=2, rope_theta=500.0),
    "llama-bias": GPTConfig.llama_style(**SIZES, bias=True),
    "mixtral": GPTConfig.llama_style(**SIZES, n_experts=4, top_k=2),
    "qwen2_moe": GPTConfig.llama_style(
        **{**SIZES, "n_layer": 3}, n_kv_head=2, n_experts=4, top_k=2, n_shared_experts=1, moe_every=2
    ),
    "qwen2_moe-unnormalised": GPTConfig.llama_style(**SIZES, n_experts=4, top_k=2, router_norm_topk=False),
    "glm4_moe": GPTConfig.llama_style(
        **SIZES, n_experts=4, top_k=2, n_shared_experts=1, moe_start=1, router_score="sigmoid", moe_balance="aux_free"
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_plait_gpt_exports_a_folder_transformers_loads_with_equal_logits(tmp_path, name):
    config = CONFIGS[name]
    engine = trained(config, tmp_path / "ckpt")
    model = engine.model.eval()
    assert isinstance(model, GPT)
    if config.moe_balance == "aux_free":  # the selection bias moved in training, so its export is tested too
        assert any(bool(layer.router.expert_bias.any()) for layer in moe_layers(model))
    folder = convert(tmp_path / "ckpt", tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    assert type(loaded).__name__ == ARCHITECTURES[name.split("-")[0]]
    inputs, _ = batch(7)
    with torch.no_grad():
        expected, got = model(inputs), loaded(inputs).logits
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)


def test_greedy_generation_is_the_same_in_transformers(tmp_path):
    config = CONFIGS["llama"]
    model = trained(config, tmp_path / "ckpt").model.eval()
    loaded = AutoModelForCausalLM.from_pretrained(str(convert(tmp_path / "ckpt", tmp_path / "hf")))
    prompt = batch(9)[0][:2, :3]
    ours = generate(model, prompt, max_new_tokens=4, temperature=0)  # plait generate's decoding, with its KV cache
    theirs = loaded.generate(prompt, max_new_tokens=4, do_sample=False)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"position": "rope"}, "norm='layernorm'"),  # rope + layernorm: neither GPT-2 nor Llama
        ({"position": "rope", "norm": "rmsnorm", "mlp": "gelu"}, "mlp='gelu'"),
        ({"mlp": "swiglu"}, "mlp='swiglu'"),  # learned positions + a gated MLP
        ({"n_experts": 4}, "mlp='gelu'"),  # the MoE families' experts are SwiGLU
        ({**GPTConfig.llama_style().to_dict(), "bias": True, "n_experts": 4}, "bias=True"),
        ({**GPTConfig.llama_style().to_dict(), "n_experts": 4, "capacity_factor": 1.25}, "capacity_factor=1.25"),
        ({**GPTConfig.llama_style().to_dict(), "n_experts": 4, "moe_balance": "aux_free"}, "moe_balance='aux_free'"),
        (
            {
                **GPTConfig.llama_style().to_dict(),
                "n_layer": 3,
                "n_experts": 4,
                "moe_every": 2,
                "router_score": "sigmoid",
            },
            "moe_every=2",
        ),
        ({**GPTConfig.llama_style().to_dict(), "n_experts": 1, "top_k": 1, "router_score": "sigmoid"}, "n_experts=1"),
    ],
)
def test_configs_without_an_equal_family_are_refused_naming_the_field(overrides, field):
    config = GPTConfig.from_dict({**SIZES, **{key: value for key, value in overrides.items() if key not in SIZES}})
    with pytest.raises(ConfigError, match=re.escape(f"plait's GPT with {field} has no exactly-equal")) as error:
        hf_architecture(config)
    assert "\n" not in str(error.value) and "OUT ending in .safetensors" in str(error.value)


def test_plait_convert_refuses_a_gpt_without_an_equal_family_in_one_line(tmp_path, capsys):
    trained(GPTConfig(**SIZES, position="rope"), tmp_path / "ckpt")
    capsys.readouterr()  # what training logged (when an earlier test set plait's logging up): not the CLI's output
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "norm='layernorm' has no exactly-equal" in lines[0], lines
    assert not (tmp_path / "hf").exists()


def test_export_logs_the_folder_and_architecture_and_overwrites_only_with_overwrite(tmp_path, caplog):
    trained(CONFIGS["mixtral"], tmp_path / "ckpt")
    with caplog.at_level("INFO", logger="plait"):
        convert(tmp_path / "ckpt", tmp_path / "hf")
    assert any(
        "MixtralForCausalLM" in record.message and str(tmp_path / "hf") in record.message for record in caplog.records
    )
    marker = json.loads((tmp_path / "hf" / MARKER).read_text())
    assert marker["step"] == 3 and {"config.json", "model.safetensors"} <= set(marker["files"])
    with pytest.raises(ConfigError, match="exists"):
        convert(tmp_path / "ckpt", tmp_path / "hf")
    convert(tmp_path / "ckpt", tmp_path / "hf", overwrite=True)  # an earlier output of plait convert: replaced


def _sharded_rank(root: str) -> None:
    trained(CONFIGS["glm4_moe"], root, Layout(ep=2, zero=3))


@pytest.mark.distributed
def test_a_checkpoint_of_a_sharded_layout_exports_the_same_model(tmp_path):
    run_distributed(_sharded_rank, 2, str(tmp_path / "ckpt"))
    folder = convert(tmp_path / "ckpt", tmp_path / "hf")
    weights = convert(tmp_path / "ckpt", tmp_path / "whole.safetensors")  # the checkpoint's whole tensors
    reference = GPT(CONFIGS["glm4_moe"]).eval()
    reference.load_state_dict(load_file(str(weights)))
    loaded = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    inputs, _ = batch(7)
    with torch.no_grad():
        torch.testing.assert_close(loaded(inputs).logits, reference(inputs), rtol=RTOL, atol=ATOL)
