"""``plait ps``: a local job runs as a user types it (a run config's model and data, servers, workers, progress,
summary, plot, a checkpoint ``plait convert`` reads); bad input exits with 2 and a message naming the fix, before
any process starts."""

import json
import os
import re
import subprocess
import sys

import pytest

from plait.cli.main import main

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.mark.cli
@pytest.mark.timeout(180)
def test_plait_ps_trains_a_run_configs_model_and_data_and_reports(tmp_path):
    # the [model] and [data] sections of `plait train` (here a byte-level GPT on a text file); ASP, 2 workers x 4
    # steps: every push is applied on arrival, so each server ends at version 8
    (tmp_path / "notes.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    (tmp_path / "run.toml").write_text(
        f'[model]\nn_layer = 1\nn_head = 2\nd_model = 16\n[data]\nname = "bytes"\npath = "{tmp_path}/notes.txt"\n'
        "seq_len = 16\n"
    )
    out = tmp_path / "run"
    command = [sys.executable, "-m", "plait", "ps", "--config", str(tmp_path / "run.toml"), "--out", str(out)]
    command += ["--servers", "2", "--workers", "2", "--steps", "4", "--mode", "asp", "--optimizer", "SGD"]
    done = subprocess.run([*command, "--lr", "0.5"], capture_output=True, text=True, timeout=150, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"plait ps: ASP, 2 servers, 2 workers: held-out loss \d+\.\d{3}", done.stdout), done.stdout
    for server in (0, 1):
        assert re.search(
            rf"server {server}: version 8, .* 0 live workers, 0 duplicates ignored, 8 pushes applied", done.stdout
        ), done.stdout
    assert re.search(r"held-out loss \d\.\d{3} -> \d\.\d{3}", done.stdout)
    assert re.search(r"staleness of applied gradients: mean \d\.\d\d, max \d+, histogram \{0: \d+", done.stdout)
    # not a terminal: the progress view writes log lines with the same figures; each worker logs its own steps
    assert "plait.param_server.progress" in done.stderr
    assert re.search(r"worker1: step 4/4, loss \d+\.\d+, staleness mean", done.stderr), done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["updates"] == {"0": 8, "1": 8} and (out / "ps.png").is_file()
    assert main(["convert", str(out / "ckpt"), str(tmp_path / "model.safetensors")]) == 0  # a plait checkpoint
    from safetensors.torch import load_file

    assert load_file(tmp_path / "model.safetensors")["tok_embed.weight"].shape == (256, 16)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--servers", "0"], "at least one server"),
        (["--servers", "999"], "at most"),
        (["--mode", "bulk"], "consistency mode 'bulk' is unknown"),
        (["--mode", "asp", "--staleness", "2"], "only applies to mode 'ssp'"),
        (["--optimizer", "Adamm"], "not a torch.optim optimizer"),
        (["--workers", "0"], "workers=0"),
        (["--role", "worker", "--servers", "2", "--connect", "127.0.0.1:1"], "--connect lists 1 servers"),
        (["--role", "worker", "--servers", "1", "--connect", "nohost"], "is not HOST:PORT"),
        (["--config", "missing.toml"], "config file missing.toml does not exist"),
        (["--set", "data.name=bytes"], "needs a text file"),
        (["--set", "model.d_model=-3"], "[model] section"),
        (["--push-dtype", "int8"], "push_dtype='int8' is unknown"),
        (["keygen"], "needs a FILE"),
    ],
)
def test_bad_input_exits_2_with_the_fix(capsys, args, message):
    assert main(["ps", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
