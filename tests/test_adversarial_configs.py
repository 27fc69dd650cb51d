"""Hostile and careless configurations, model folders and full disks (issue 39; docs/security.md).

Each case asserts what docs/security.md promises: a refusal is one line (a ``plait.errors`` exception, or one
``plait: error:`` line and exit 2) naming the problem and the fix, before any work; nothing of the user's is lost.
"""

from __future__ import annotations

import errno
import importlib
import json
import math
import os
import stat
from pathlib import Path

import pytest
import torch
from helpers.full_disk import failing_open

from plait.data.tokenizer import refuse_remote_code
from plait.errors import ConfigError, DataError, PlaitError
from plait.models.build import check_model_section
from plait.models.hf_load import check_weights_folder, read_config, read_hf_weights
from plait.planner.hf_config import from_hf_config
from plait.train.config import FLOAT32_MAX, FLOAT32_TINY, load_config
from plait.train.optim import OPTIMIZERS, step_scale

pytestmark = [pytest.mark.adversarial]


def one_line(error: pytest.ExceptionInfo, *words: str) -> str:
    message = str(error.value)
    assert isinstance(error.value, PlaitError) and "\n" not in message and "Fix" in message, message
    assert all(word in message for word in words), (words, message)
    return message


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------ N5: a config.json's sizes
LLAMA = {
    "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 16, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 32, "vocab_size": 64, "max_position_embeddings": 32,
}  # fmt: skip
MIXTRAL = {**LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
QWEN_MOE = {
    **LLAMA, "model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
    "shared_expert_intermediate_size": 16, "decoder_sparse_step": 1,
}  # fmt: skip
GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 16, "n_head": 4, "vocab_size": 64, "n_positions": 32}


@pytest.mark.parametrize(
    ("base", "change", "words"),
    [
        (MIXTRAL, {"num_experts_per_tok": 9}, "num_experts_per_tok=9"),  # train: passed, failed at the forward
        (MIXTRAL, {"num_local_experts": 0}, "0 experts (num_local_experts)"),  # plan and train: passed
        (MIXTRAL, {"num_local_experts": 4.5}, "num_local_experts=4.5"),  # train: transformers' traceback
        (MIXTRAL, {"num_experts_per_tok": "2"}, "num_experts_per_tok='2'"),
        (MIXTRAL, {"num_attention_heads": 0}, "num_attention_heads=0"),  # train: ZeroDivisionError
        (QWEN_MOE, {"decoder_sparse_step": 0}, "decoder_sparse_step=0"),  # plan: taken as 1; train: ZeroDivision
        (QWEN_MOE, {"num_experts_per_tok": 0}, "num_experts_per_tok=0"),
        (LLAMA, {"hidden_size": 15}, "hidden_size=15"),  # train: transformers' validation traceback
        (LLAMA, {"hidden_size": -16}, "hidden_size=-16"),  # train: RuntimeError, negative dimension
        (LLAMA, {"num_hidden_layers": True}, "num_hidden_layers=True"),  # plan: a bool taken as 1
        (LLAMA, {"hidden_size": 16.0}, "hidden_size=16.0"),  # plan: taken as 16
        (LLAMA, {"num_key_value_heads": 3}, "num_key_value_heads=3"),  # train: fails at the forward
        (LLAMA, {"num_key_value_heads": 0}, "num_key_value_heads=0"),  # train: ZeroDivisionError
        (LLAMA, {"hidden_size": 2**40}, "hidden_size=1099511627776"),  # train: the allocator's traceback
        (GPT2, {"n_head": 0}, "n_head=0"),
        (GPT2, {"n_embd": 15}, "n_embd=15"),  # train: ValueError from the model's constructor
    ],
)
def test_hostile_config_sizes_are_one_line_for_planning_and_training(tmp_path, base, change, words):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**base, **change}))
    with pytest.raises(ConfigError) as planned:
        from_hf_config(path)
    one_line(planned, words, str(path))
    with pytest.raises(ConfigError) as trained:
        check_model_section({"hf_config": str(path)}, 64, 16)  # plait train's check before any process starts
    one_line(trained, words, "model.hf_config")


def test_a_config_transformers_refuses_is_one_line():
    """A field plait does not check (``rms_norm_eps`` as text) fails transformers' own validation, which raises
    huggingface_hub's StrictDataclassFieldValidationError (an Exception, neither ValueError nor TypeError) over
    several lines: one ConfigError line. (A stand-in for transformers raises it: importing transformers takes
    longer than this suite's cases may.)"""
    from huggingface_hub.errors import StrictDataclassFieldValidationError

    from plait.models.hf_load import hf_config

    class AutoConfig:
        @staticmethod
        def for_model(model_type, **fields):
            raise StrictDataclassFieldValidationError("rms_norm_eps", TypeError("Field 'rms_norm_eps' expected float"))

    class Transformers:
        pass

    Transformers.AutoConfig = AutoConfig
    with pytest.raises(ConfigError) as error:
        hf_config(Transformers, {**LLAMA, "rms_norm_eps": "tiny"}, "model.hf_config: config.json")
    one_line(error, "transformers refuses this config", "rms_norm_eps")


def test_sound_configs_still_pass(tmp_path):
    """Guards for the checks above: a Qwen-MoE config with no experts is dense, as transformers builds it."""
    for fields in (LLAMA, MIXTRAL, QWEN_MOE, GPT2, {**QWEN_MOE, "num_experts": 0}, {**LLAMA, "head_dim": 8}):
        path = tmp_path / "config.json"
        path.write_text(json.dumps(fields))
        assert read_config(path)["model_type"] == fields["model_type"]
        assert from_hf_config(path).layers == 2


# ------------------------------------------------------------------ N10: auto_map in every form
AUTO_MAPS = [
    ["tokenization_evil.EvilTokenizer", None],  # a tokenizer's [slow, fast] form, which transformers accepts
    7,
    0,
    False,
    "",
    [],
    {},
]
"""Each was a traceback (sorted() of a list holding None, of an int) or passed unrefused (a false value)."""


@pytest.mark.parametrize("auto_map", AUTO_MAPS, ids=lambda value: type(value).__name__ + repr(value)[:12])
def test_auto_map_in_any_form_is_refused_in_one_line(tmp_path, auto_map):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**GPT2, "auto_map": auto_map}))
    with pytest.raises(ConfigError) as error:
        check_model_section({"hf_config": str(model)}, 64, 16)
    one_line(error, "config.json", "auto_map", "never runs code")
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({"auto_map": auto_map}))
    with pytest.raises(DataError) as error:
        refuse_remote_code(tokenizer)
    one_line(error, "tokenizer_config.json", "auto_map", "never runs code")


# ------------------------------------------------------------------ N13: links and the cache folder
def tiny_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    state = {"transformer.wte.weight": torch.arange(6.0).reshape(3, 2)}
    save_file(state, str(path))
    return state


def hub_snapshot(root: Path) -> Path:
    """A Hugging Face hub cache entry: ``models--org--tiny/snapshots/REV/*`` links to ``../../blobs/SHA``."""
    repo = root / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo / "blobs" / "c0ffee").write_text(json.dumps(GPT2))
    tiny_weights(repo / "blobs" / "beef")
    (snapshot / "config.json").symlink_to("../../blobs/c0ffee")
    (snapshot / "model.safetensors").symlink_to("../../blobs/beef")
    return snapshot


def test_a_hugging_face_cache_snapshot_is_read_through_its_links(tmp_path):
    snapshot = hub_snapshot(tmp_path)
    check_weights_folder(snapshot)
    assert read_config(snapshot)["n_embd"] == 16
    assert read_hf_weights(snapshot)["transformer.wte.weight"].sum().item() == 15.0
    (tmp_path / "mine").symlink_to(snapshot)  # the user's own link to the folder is followed
    check_weights_folder(tmp_path / "mine")


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "notes.txt"])
def test_a_link_out_of_a_model_folder_is_refused(tmp_path, name):
    snapshot = hub_snapshot(tmp_path)
    secret = tmp_path / "secret"
    secret.write_text(json.dumps(GPT2))  # any file of the user's, even one that parses
    (snapshot / name).unlink(missing_ok=True)
    (snapshot / name).symlink_to(secret)
    with pytest.raises(ConfigError) as error:
        check_weights_folder(snapshot)
    one_line(error, f"{snapshot / name} is a symbolic link to {secret}", "cp -rL")


def test_a_link_into_another_models_blobs_is_refused(tmp_path):
    snapshot = hub_snapshot(tmp_path)
    other = tmp_path / "hub" / "models--evil--x" / "blobs"
    other.mkdir(parents=True)
    tiny_weights(other / "f00d")
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(other / "f00d")
    with pytest.raises(ConfigError) as error:
        check_weights_folder(snapshot)
    one_line(error, "symbolic link", "outside the folder")


def test_a_link_out_of_a_tokenizer_folder_is_refused(tmp_path):
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    secret = tmp_path / "secret.json"
    secret.write_text("{}")
    (folder / "tokenizer.json").symlink_to(secret)
    with pytest.raises(DataError) as error:
        refuse_remote_code(folder)
    one_line(error, "tokenizer.json is a symbolic link", "cp -rL")
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.json").symlink_to("../tokenizer/inner.json")  # a link inside the folder is followed
    (folder / "inner.json").write_text("{}")
    refuse_remote_code(folder)


def test_the_cache_folder_is_this_users_alone(tmp_path, monkeypatch):
    """The parameter server's local key folder ~/.cache/plait: created 0700, and an older 0755 one (plait's own)
    narrowed to 0700; plait's data cache alike."""
    from plait.param_server.keys import local_key

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PLAIT_PS_LOCAL_KEY_FILE", raising=False)
    monkeypatch.delenv("PLAIT_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    old = os.umask(0o022)
    try:
        local_key()
        cache = tmp_path / "home" / ".cache" / "plait"
        assert stat.S_IMODE(cache.stat().st_mode) == 0o700
        (cache / "ps-local.key").unlink()
        cache.chmod(0o755)  # as plait before issue 39 left it
        local_key()
        assert stat.S_IMODE(cache.stat().st_mode) == 0o700
        from plait.files import cache_folder

        data = cache_folder("data")
        assert data == cache / "data" and stat.S_IMODE(data.stat().st_mode) == 0o700
    finally:
        os.umask(old)


# ------------------------------------------------------------------ N8: a full disk (prepare's: test_adversarial_data)
def test_a_full_disk_during_convert_is_one_line_and_loses_nothing(tmp_path, monkeypatch):
    from plait.checkpoint import convert

    tiny_weights(tmp_path / "weights.safetensors")
    convert.import_weights(tmp_path / "weights.safetensors", tmp_path / "ckpt")
    writing = importlib.import_module("plait.checkpoint.safetensors_writer")
    monkeypatch.setattr(writing, "open", failing_open(errno.ENOSPC, room=16), raising=False)
    with pytest.raises(ConfigError) as error:
        convert.convert(tmp_path / "ckpt", tmp_path / "export" / "model.safetensors")
    one_line(error, "no space left on device at", str(tmp_path / "export"), "partial output is removed")
    assert list((tmp_path / "export").iterdir()) == []


# ------------------------------------------------------------------ N11: reals out of float32's range
@pytest.mark.parametrize(
    "overrides",
    [
        ["train.lr=1e300"],  # finite, but beyond float32: torch failed mid-step
        ["train.lr=1e38"],  # inside float32, but Adam's first step lr / (1 - beta1) is not
        ["train.lr=1e30", "train.betas=[0.99999999999, 0.999]"],
        ["train.lr=1e35", "train.optimizer=muon"],
        ["train.lr=1e-300"],  # rounds to 0 in float32: nothing trains
        ["train.eps=1e300"],
        ["train.eps=1e-300"],  # 0 in float32: Adam's 0 / 0 for a weight whose gradient is 0
        ["train.weight_decay=1e300"],  # Adam's L2 term overflowed
        ["train.max_grad_norm=1e300"],
        ["train.sample_temperature=1e300"],
        ["train.muon_lr=inf"],  # the muon settings were not checked for finiteness
        ["train.muon_weight_decay=inf"],
    ],
)
def test_reals_out_of_float32_range_are_refused(overrides):
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    one_line(error, overrides[0].split("=")[0])


def test_the_bound_is_float32s_and_every_optimizer_steps_just_inside_it():
    """The refusal's limit is float32's, and a setting just inside it steps every optimizer without torch's
    overflow error (the weights may become inf: the run then stops as diverged, in one line)."""
    assert FLOAT32_MAX == torch.finfo(torch.float32).max and FLOAT32_TINY == torch.finfo(torch.float32).tiny
    for name, cls in OPTIMIZERS.items():
        train = load_config(None, [f"train.optimizer={name!r}".replace("'", '"')]).train
        lr = FLOAT32_MAX / (step_scale(train) / train.lr) * 0.999
        edge = load_config(None, [f'train.optimizer="{name}"', f"train.lr={lr!r}"]).train
        weight = torch.nn.Parameter(torch.ones(4))
        kwargs = {key: value for key, value in vars(edge).items() if key in ("lr", "eps", "momentum")}
        kwargs = {k: v for k, v in kwargs.items() if k in cls.__init__.__code__.co_varnames}
        if "betas" in cls.__init__.__code__.co_varnames:
            kwargs["betas"] = tuple(edge.betas)
        optimizer = cls([weight], **kwargs)
        weight.grad = torch.tensor([1.0, 0.0, -1.0, 1e-3])
        optimizer.step()  # raised "value cannot be converted to type float without overflow" beyond the bound
        assert not math.isnan(weight[1].item()), name
