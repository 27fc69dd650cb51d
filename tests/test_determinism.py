"""Deterministic mode (``plait.determinism``, ``train.deterministic``, ``--deterministic``): the environment a rank
gets (cuBLAS workspace, NCCL's ring and Simple protocol) and how a user's own values are treated; torch's flags
read back inside the ranks of ``plait.launch.run_local`` after ``plait.train.loop.run``; two such runs bitwise
equal (losses, parameters, optimizer state); ``plait train --deterministic`` hands the environment to the workers
its launcher starts. On CUDA, the cost and the bitwise reruns: tests/gpu/test_deterministic.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from helpers.harness import run_distributed
from helpers.runs import final_state, recorded_train_steps

from plait.cli.main import main
from plait.determinism import DETERMINISTIC_ENV, check_group, collectives_fixed, describe_state, export_env, state
from plait.errors import ConfigError
from plait.train.config import load_config

RUN = ["data.seq_len=16", "model.n_layer=1", "model.d_model=32", "train.global_batch=8", "train.steps=3"]
"""A tiny GPT for 3 steps (4 on every rank under dp=2): the addition task's default data, clipped, AdamW."""


def test_the_environment_set_and_a_users_own_values():
    environ = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "NCCL_ALGO": "Tree,Ring"}
    assert not collectives_fixed(environ)
    changed = export_env(environ)
    assert environ == {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}
    assert changed == {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}  # :16:8 is deterministic too: kept
    assert collectives_fixed(environ) and export_env(environ) == {}
    fresh: dict[str, str] = {}
    export_env(fresh)
    assert fresh == DETERMINISTIC_ENV


def test_an_nccl_group_started_without_the_environment_is_refused(monkeypatch):
    for name in ("NCCL_ALGO", "NCCL_PROTO"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="NCCL_ALGO=Ring.*Fix:") as error:
        check_group("nccl")
    assert "\n" not in str(error.value)
    check_group("gloo")  # gloo's order is fixed whatever the environment says
    monkeypatch.setenv("NCCL_ALGO", "ring")
    monkeypatch.setenv("NCCL_PROTO", "Simple")
    check_group("nccl")


def test_the_config_records_it(tmp_path):
    config = load_config(None, [*RUN, "train.deterministic=true"])
    assert config.train.deterministic is True and "deterministic = true" in config.dumps()
    with pytest.raises(ConfigError, match="train.deterministic=.*must be true or false"):
        load_config(None, ['train.deterministic="yes"'])


def _train_rank(overrides: list[str], out: str) -> dict:
    """``plait train``'s loop on this rank; what deterministic mode left in force here, read back afterwards."""
    from plait.train.loop import run

    run(load_config(None, [*overrides, f"train.out={json.dumps(out)}"]))
    return state()


@pytest.mark.distributed
def test_two_deterministic_runs_are_bitwise_equal_and_every_rank_is_set(tmp_path):
    """Two ranks (dp) under ``train.deterministic``, twice: every rank reports torch's deterministic algorithms on, cuDNN's
    settings and the environment (the launcher's, before the process group); losses, parameters and optimizer
    state bitwise equal."""
    overrides = [*RUN, "train.deterministic=true", "train.save_every=3", "train.eval_every=0"]
    runs = []
    for name in ("a", "b"):
        ranks = run_distributed(_train_rank, 2, overrides, str(tmp_path / name), env=dict(DETERMINISTIC_ENV))
        for rank in ranks:
            assert rank["deterministic_algorithms"] and rank["cudnn_deterministic"], rank
            assert not rank["cudnn_benchmark"] and rank["env"] == DETERMINISTIC_ENV and rank["backend"] == "gloo"
        assert "gloo: its collectives' order is fixed" in describe_state(ranks[0])
        runs.append(tmp_path / name)
    first, second = (recorded_train_steps(run) for run in runs)
    assert [r["loss"] for r in first] == [r["loss"] for r in second] and len(first) == 3
    a, b = (final_state(run) for run in runs)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "parameters or state differ"
    assert "deterministic = true" in (runs[0] / "config.toml").read_text()


def test_plait_train_hands_the_environment_to_its_workers(tmp_path, monkeypatch):
    """``plait train --deterministic --nproc 2``: torchrun's workers inherit the launcher's environment, so it holds
    DETERMINISTIC_ENV while they start (and not after); they get train.deterministic through --set."""
    import plait.cli.train as cli

    for name in DETERMINISTIC_ENV:
        monkeypatch.delenv(name, raising=False)
    seen: dict = {}

    def torchrun(args, forwarded):  # noqa: ANN001, ANN202 - stands in for torchrun's launcher
        seen["env"] = {name: os.environ.get(name) for name in DETERMINISTIC_ENV}
        seen["forwarded"] = forwarded
        return 0

    monkeypatch.setattr(cli, "_run_torchrun", torchrun)
    sets = sum((["--set", item] for item in RUN), [])
    assert main(["train", "--deterministic", "--nproc", "2", "--out", str(tmp_path / "run"), *sets]) == 0
    assert seen["env"] == DETERMINISTIC_ENV and "train.deterministic=true" in seen["forwarded"]
    assert all(name not in os.environ for name in DETERMINISTIC_ENV)
    assert Path(tmp_path / "run").is_dir()
