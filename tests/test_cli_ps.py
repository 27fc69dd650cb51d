"""``plait ps``: a local job runs as a user types it (servers, workers, progress, summary); bad input exits with 2
and a message naming the fix, before any process starts."""

import os
import re
import subprocess
import sys

import pytest

from plait.cli.main import main

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.mark.cli
@pytest.mark.timeout(180)
def test_plait_ps_trains_and_reports_every_server():
    # ASP, 2 workers x 6 steps: every push is applied on arrival, so each server ends at version 12
    command = [
        sys.executable,
        "-m",
        "plait",
        "ps",
        "--servers",
        "2",
        "--workers",
        "2",
        "--steps",
        "6",
        "--mode",
        "asp",
        "--optimizer",
        "SGD",
        "--lr",
        "0.5",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=150, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"plait ps: ASP, 2 servers, 2 workers: held-out loss \d+\.\d{3}", done.stdout), done.stdout
    for server in (0, 1):
        assert re.search(
            rf"server {server}: version 12, .* 0 live workers, 0 duplicates ignored, 12 pushes applied", done.stdout
        ), done.stdout
    # not a terminal: the progress view writes log lines with the same figures while the job runs
    assert "plait.param_server.progress" in done.stderr


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
    ],
)
def test_bad_input_exits_2_with_the_fix(capsys, args, message):
    assert main(["ps", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
