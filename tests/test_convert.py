"""``plait convert``: checkpoints (any layout) -> one safetensors file or a Hugging Face folder, and back.

Exports are compared with the training engine's own whole weights bitwise (a conversion copies bytes, it computes
nothing); an exported HF folder is opened by transformers' ``from_pretrained`` and must give the same logits as
the model it came from; imports are loaded by engines of other layouts.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers.harness import run_distributed
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import plait
from plait import Layout
from plait.checkpoint.convert import convert
from plait.errors import ConfigError
from plait.models import GPT, GPTConfig
from plait.parallel.tensor.layers import gather_parameters

VOCAB, SEQ, BATCH = 32, 8, 4


def adamw(params):  # noqa: ANN001, ANN201 - a factory, as users pass it
    return torch.optim.AdamW(params, lr=1e-2)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=2, d_model=16))


def tiny_hf(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "gpt2":  # tied input and output embeddings
        return GPT2LMHeadModel(
            GPT2Config(
                n_layer=2,
                n_embd=16,
                n_head=2,
                vocab_size=VOCAB,
                n_positions=SEQ,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
        )
    return LlamaForCausalLM(
        LlamaConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=SEQ,
        )
    )


def trained(model: torch.nn.Module, root, layout: Layout | None = None) -> plait.Engine:  # noqa: ANN001
    engine = plait.parallelize(model, layout, optimizer=adamw)
    for step in range(2):
        engine.train_step(batch(step))
    engine.save(root)
    return engine


def whole(engine: plait.Engine) -> dict[str, torch.Tensor]:
    """The engine's parameters, whole, by name (tp slices gathered)."""
    return {name: tensor.detach().clone() for name, tensor in gather_parameters(engine.model, engine.comm).items()}


def test_reference_gpt_exports_one_file_and_imports_under_any_engine(tmp_path):
    engine = trained(tiny_gpt(), tmp_path / "ckpt")
    out = convert(tmp_path / "ckpt", tmp_path / "gpt.safetensors")
    exported = load_file(str(out))
    expected = whole(engine)
    assert set(exported) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(exported[name], tensor), name  # a copy of bytes: bitwise
    with safe_open(str(out), framework="pt") as handle:
        assert json.loads(handle.metadata()["plait"])["step"] == 2

    convert(out, tmp_path / "imported")  # import: a model-only checkpoint
    fresh = plait.parallelize(tiny_gpt(seed=1), optimizer=adamw)
    assert fresh.load(tmp_path / "imported") == 0  # a starting point: step 0, fresh optimizer state
    for name, tensor in fresh.model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    fresh.train_step(batch(2))  # trains on from the imported weights


def _tp_llama_rank(root: str) -> dict[str, torch.Tensor]:
    engine = trained(tiny_hf("llama"), root, Layout(tp=2))
    return whole(engine)


@pytest.mark.distributed
def test_tensor_parallel_llama_exports_an_hf_folder_from_pretrained_opens(tmp_path):
    expected = run_distributed(_tp_llama_rank, 2, str(tmp_path / "ckpt"))[0]
    folder = convert(tmp_path / "ckpt", tmp_path / "hf")
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(str(folder))
    for name, tensor in loaded.state_dict().items():
        if name in expected:
            assert torch.equal(tensor, expected[name]), name
    reference = tiny_hf("llama")
    reference.load_state_dict(expected, strict=False)
    inputs, _ = batch(5)
    with torch.no_grad():
        assert torch.equal(loaded(inputs).logits, reference(inputs).logits)


def test_gpt2_with_tied_embeddings_round_trips_through_an_hf_folder(tmp_path):
    engine = trained(tiny_hf("gpt2"), tmp_path / "ckpt")
    expected = whole(engine)
    folder = convert(tmp_path / "ckpt", tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(str(folder))
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # still tied
    convert(folder, tmp_path / "back")  # import the HF folder as a checkpoint
    fresh = plait.parallelize(tiny_hf("gpt2", seed=3), optimizer=adamw)
    fresh.load(tmp_path / "back")
    for name, tensor in fresh.model.named_parameters():
        assert torch.equal(tensor.detach(), expected[name]), name


def test_bad_conversions_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        convert(tmp_path / "nothing", tmp_path / "out.safetensors")
    trained(torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB)), tmp_path / "other")
    with pytest.raises(ConfigError, match="does not record a Hugging Face model config"):
        convert(tmp_path / "other", tmp_path / "hf")  # neither an HF model nor plait's GPT (test_convert_gpt.py)
    trained(tiny_gpt(), tmp_path / "ckpt")
    with pytest.raises(ConfigError, match="drop --hf-config"):
        convert(tmp_path / "ckpt", tmp_path / "x.safetensors", hf_config=tmp_path / "config.json")
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ConfigError, match="pickles, which plait does not load"):
        convert(tmp_path / "pickled", tmp_path / "ckpt2")
    (tmp_path / "weights.pt").write_bytes(b"x")
    with pytest.raises(ConfigError, match="not a .safetensors file or a Hugging Face folder"):
        convert(tmp_path / "weights.pt", tmp_path / "ckpt3")


@pytest.mark.cli
def test_plait_convert_command(tmp_path):
    trained(tiny_gpt(), tmp_path / "ckpt")
    ok = subprocess.run(
        [sys.executable, "-m", "plait", "convert", str(tmp_path / "ckpt"), str(tmp_path / "m.safetensors")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "m.safetensors").is_file()
    assert f"tensors (step 2) to {tmp_path / 'm.safetensors'}" in ok.stderr  # issue 37: it printed nothing
    folder = subprocess.run(  # plait's GPT as the transformers family that computes it (test_convert_gpt.py)
        [sys.executable, "-m", "plait", "convert", str(tmp_path / "ckpt"), str(tmp_path / "hf")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert folder.returncode == 0, folder.stderr
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    assert "as GPT2LMHeadModel, a Hugging Face folder" in folder.stderr  # issue 37: it printed nothing
