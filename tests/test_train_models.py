"""Real models in ``plait train``: Hugging Face GPT-2 and Llama folders (saved with ``save_pretrained`` from random
tiny configs) fine-tuned under tp=2 and pp=2 (Llama also cp=2) start at the folder's loss (the first step's loss
equals the model run plainly on the same batch) and write samples under pp and cp; ``train.init_from`` starts from a plait checkpoint saved under
tp=2 (here loaded under pp=2), from a ``.safetensors`` file (under dp=2) and from an HF folder; presets; each bad
input (pickle-only folder, tokenizer larger than the vocabulary, samples longer than the context, a checkpoint of
another model, unknown preset / keys) refused with the fix.

One gloo job (2 ranks) runs every distributed configuration; the tests read the run folders it wrote.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.harness import run_distributed
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from plait.checkpoint import load_full_state
from plait.checkpoint.convert import export_safetensors
from plait.data import AdditionTask, ShardedBatches
from plait.errors import ConfigError
from plait.models import GPT, GPTConfig, lm_loss
from plait.models.build import build_model, model_config
from plait.models.presets import PRESETS
from plait.train.config import RunConfig
from plait.train.weights import load_weights, read_weights

BATCH = 4
TASK = AdditionTask(digits=2, seed=0)  # the default [data]: vocab 12, samples of 8 tokens


def hf_model(kind: str, **overrides: object) -> torch.nn.Module:
    torch.manual_seed(99)
    if kind == "gpt2":
        fields = {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 64, "n_positions": 16}
        fields.update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **overrides)
        return GPT2LMHeadModel(GPT2Config(**fields))
    fields = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    fields.update(num_key_value_heads=2, vocab_size=64, max_position_embeddings=16, **overrides)
    return LlamaForCausalLM(LlamaConfig(**fields))


def first_batch() -> tuple[torch.Tensor, torch.Tensor]:
    return ShardedBatches(TASK, BATCH).global_batch_at(0)


def plain_loss(model: torch.nn.Module) -> float:
    inputs, targets = first_batch()
    with torch.no_grad():
        output = model(inputs)
    return float(lm_loss(getattr(output, "logits", output), targets))


def run_config(out: str, layout: dict, model: dict, **train: object) -> RunConfig:
    fields = {"steps": 2, "global_batch": BATCH, "eval_every": 0, "eval_batches": 1, "samples": 0}
    fields.update(out=out, tensorboard=False, **train)
    return RunConfig.from_dict({"layout": layout, "model": model, "train": fields})


RUNS = {  # name -> (layout, model section (root-relative paths), train overrides)
    "gpt2-tp2": ({"tp": 2}, {"hf": "gpt2"}, {}),
    "gpt2-pp2": ({"pp": 2, "microbatches": 2}, {"hf": "gpt2"}, {"samples": 1, "sample_tokens": 3, "save_every": 2}),
    "llama-tp2": ({"tp": 2}, {"hf": "llama"}, {}),
    "llama-pp2": ({"pp": 2, "microbatches": 2}, {"hf": "llama"}, {}),
    "llama-cp2": ({"cp": 2}, {"hf": "llama"}, {"samples": 1, "sample_tokens": 3}),
    "gpt-tp2": ({"tp": 2}, {"n_layer": 2, "n_head": 2, "d_model": 16}, {"save_every": 2}),
    "gpt-from-tp2-under-pp2": ({"pp": 2, "microbatches": 2}, {"n_layer": 2, "n_head": 2, "d_model": 16}, {}),
    "gpt-from-file-under-dp2": ({"dp": 2}, {"n_layer": 2, "n_head": 2, "d_model": 16}, {}),
    "llama-cfg-from-folder": ({"dp": 2, "zero": 3}, {"hf_config": "llama/config.json"}, {"init_from": "llama"}),
}


def _job(root: str) -> None:
    from plait.distributed import init
    from plait.train.loop import run

    world = init()
    for name, (layout, model, train) in RUNS.items():
        model = {k: f"{root}/{v}" if k in ("hf", "hf_config") else v for k, v in model.items()}
        train = {k: f"{root}/{v}" if k == "init_from" else v for k, v in train.items()}
        if name == "gpt-from-tp2-under-pp2":
            train["init_from"] = f"{root}/gpt-tp2/ckpt"
        if name == "gpt-from-file-under-dp2":
            if world.rank == 0:
                export_safetensors(f"{root}/gpt-tp2/ckpt", f"{root}/gpt.safetensors")
            torch.distributed.barrier()
            train["init_from"] = f"{root}/gpt.safetensors"
        run(run_config(f"{root}/{name}", layout, model, **train), world)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    for kind in ("gpt2", "llama"):
        hf_model(kind).save_pretrained(root / kind)
    run_distributed(_job, 2, str(root), timeout=300)
    return root


def first_loss(run: Path) -> float:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return next(r["loss"] for r in records if r["kind"] == "train" and r["step"] == 1)


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["gpt2-tp2", "gpt2-pp2", "llama-tp2", "llama-pp2", "llama-cp2"])
def test_hf_folder_fine_tunes_from_its_own_loss(root: Path, name: str) -> None:
    from transformers import AutoModelForCausalLM

    folder = root / RUNS[name][1]["hf"]
    expected = plain_loss(AutoModelForCausalLM.from_pretrained(folder))
    # fp32; tp splits the matmuls' sums and pp sends the same activations: a few ulps of the loss
    assert first_loss(root / name) == pytest.approx(expected, rel=1e-5)


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["gpt2-pp2", "llama-cp2"])
def test_samples_are_written_under_pipeline_and_context_parallelism(root: Path, name: str) -> None:
    records = [json.loads(line) for line in (root / name / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2]  # the final evaluation (eval_every=0)
    # decoded with the addition task's symbols: ids beyond its 12 are never drawn from the model's 64 logits
    assert len(records[0]["prompt"]) == TASK.prompt_len and len(records[0]["completion"]) == 3


@pytest.mark.distributed
def test_init_from_a_checkpoint_of_another_layout_and_a_safetensors_file(root: Path) -> None:
    state, meta = load_full_state(root / "gpt-tp2" / "ckpt")
    model = GPT(GPTConfig.from_dict(meta["model"]["config"]))
    load_weights(model, state)
    expected = plain_loss(model)  # the tp=2 run's weights after its 2 steps
    assert first_loss(root / "gpt-from-tp2-under-pp2") == pytest.approx(expected, rel=1e-5)
    assert first_loss(root / "gpt-from-file-under-dp2") == pytest.approx(expected, rel=1e-5)
    assert first_loss(root / "gpt-tp2") != pytest.approx(expected, rel=1e-3)  # the weights did change


@pytest.mark.distributed
def test_init_from_an_hf_folder_into_hf_config_under_zero3(root: Path) -> None:
    from transformers import AutoModelForCausalLM

    expected = plain_loss(AutoModelForCausalLM.from_pretrained(root / "llama"))
    assert first_loss(root / "llama-cfg-from-folder") == pytest.approx(expected, rel=1e-5)


# ------------------------------------------------------------------ presets and bad input (one process)
def test_presets_take_vocab_and_context_from_the_data_and_keys_override() -> None:
    config = model_config({"preset": "llama-style-1b", "n_layer": 2}, vocab_size=300, seq_len=128)
    assert (config.vocab_size, config.seq_len, config.n_layer, config.d_model, config.kv_heads) == (
        300,
        128,
        2,
        2048,
        8,
    )
    assert config.position == "rope" and config.mlp == "swiglu" and not config.bias
    one_block = model_config({"preset": "gpt2-small", "n_layer": 1}, 100, 64)  # GPT-2 small's shapes, cheaply
    params = (12 * 768 * 768 + 13 * 768) + 2 * 100 * 768 + 64 * 768 + 2 * 768  # a block, wte + head, wpe, ln_f
    assert GPT(one_block).num_parameters() == params
    assert set(PRESETS) >= {"gpt2-small", "gpt2-medium", "gpt2-large", "llama-style-125m"}
    run = RunConfig.from_dict({"model": {"preset": "gpt2-medium"}})
    assert run.model == {"preset": "gpt2-medium"}  # the tiny defaults do not override a preset
    with pytest.raises(ConfigError, match="model.preset='gpt5' is unknown. Fix: use one of tiny, gpt2-small"):
        model_config({"preset": "gpt5"}, 12, 8)


def test_hf_config_builds_fresh_weights_and_checks_the_data(tmp_path: Path) -> None:
    hf_model("llama").config.to_json_file(tmp_path / "config.json")
    model = build_model({"hf_config": str(tmp_path / "config.json")}, 12, 8)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.vocab_size == 64
    with pytest.raises(ConfigError, match="tokenizer has 65 token ids but the model's vocabulary has 64"):
        build_model({"hf_config": str(tmp_path)}, 65, 8)
    with pytest.raises(ConfigError, match="samples have 17 tokens but the model has 16 positions"):
        build_model({"hf_config": str(tmp_path)}, 12, 17)
    with pytest.raises(ConfigError, match="exactly one of hf / hf_config"):
        build_model({"hf_config": str(tmp_path), "n_layer": 2}, 12, 8)


def test_pickle_only_folder_is_refused_with_the_fix(tmp_path: Path) -> None:
    hf_model("gpt2").config.to_json_file(tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    for load in (lambda: build_model({"hf": str(tmp_path)}, 12, 8), lambda: read_weights(tmp_path)):
        with pytest.raises(ConfigError, match=r"only pickle weights \(pytorch_model.bin\).*safe_serialization=True"):
            load()
    with pytest.raises(ConfigError, match="is not a folder"):
        build_model({"hf": str(tmp_path / "missing")}, 12, 8)


def test_a_checkpoint_of_another_model_names_the_first_mismatching_tensor(tmp_path: Path) -> None:
    small = GPT(GPTConfig(vocab_size=12, seq_len=8, n_layer=2, n_head=2, d_model=16))
    wider = GPT(GPTConfig(vocab_size=12, seq_len=8, n_layer=2, n_head=2, d_model=32))
    with pytest.raises(ConfigError, match=r"tensor 'tok_embed.weight' has shape \(12, 32\) there and \(12, 16\)"):
        load_weights(small, wider.state_dict())
    deeper = GPT(GPTConfig(vocab_size=12, seq_len=8, n_layer=3, n_head=2, d_model=16))
    with pytest.raises(ConfigError, match=r"tensor 'blocks.2.norm1.weight' is not the model's"):
        load_weights(small, deeper.state_dict())
    with pytest.raises(ConfigError, match=r"the model's tensor 'blocks.2.norm1.weight' \(16,\) is missing"):
        load_weights(deeper, small.state_dict())
    with pytest.raises(ConfigError, match="does not exist"):
        read_weights(tmp_path / "nothing")


def test_bad_model_input_is_refused_before_launch(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from plait.cli.main import main

    hf_model("gpt2").config.to_json_file(tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    cases = [
        (["model.preset=gpt5"], "model.preset='gpt5' is unknown"),
        ([f"model.hf={tmp_path}"], "only pickle weights"),
        ([f"model.hf_config={tmp_path / 'none.json'}"], "does not exist. Fix: give a Hugging Face config.json"),
        (["model.seq_len=4"], "is above the model's context model.seq_len=4"),
        ([f"train.init_from={tmp_path / 'ckpt'}"], "train.init_from="),
    ]
    for overrides, message in cases:
        argv = ["train", "--nproc", "2", *[item for o in overrides for item in ("--set", o)]]
        assert main(argv) == 2  # refused in this process: no worker was launched
        assert message in capsys.readouterr().err


@pytest.mark.distributed
def test_plait_generate_from_an_hf_run_saved_under_pp2(root: Path, capsys: pytest.CaptureFixture) -> None:
    from plait.cli.main import main

    argv = ["generate", str(root / "gpt2-pp2"), "--prompt", "12+34=", "--max-new-tokens", "3", "--seed", "1"]
    assert main(argv) == 0 and main(argv) == 0
    first, second = capsys.readouterr().out.splitlines()
    assert first == second and len(first) == 3 and set(first) <= set("0123456789+=")  # the task's symbols only
