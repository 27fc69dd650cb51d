"""``plait schedule``: simulate, summarise, draw and trace a pipeline schedule from the command line; bad input
(unknown schedule, deadlocking or unreadable custom schedule, malformed costs) exits with 2 and a message, no
traceback. Most tests call ``plait.cli.main.main`` in this process; one runs ``python -m plait`` to check the entry."""

import json
import os
import subprocess
import sys

import pytest

from plait.cli.main import main
from plait.cli.schedule import parse_costs
from plait.parallel.pipeline import Schedule, build_schedule

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["schedule", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_1f1b_summary_picture_and_trace(capsys, tmp_path):
    png, trace = tmp_path / "1f1b.png", tmp_path / "1f1b.json"
    code, out, err = run(
        capsys, "--schedule", "1f1b", "--pp", "4", "--microbatches", "8", "--out", str(png), "--trace", str(trace)
    )
    assert code == 0, err
    # F=1, B=2 by default: makespan (m + p - 1)(tF + tB) = 33, bubble (p-1)/(m+p-1) = 27.3%, rank r holds p - r.
    assert "1f1b p=4 m=8 v=1: makespan 33, bubble 27.3%, peak activations per rank [4, 3, 2, 1]" in out
    assert "rank 3: busy 24, idle 9" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 4 * 8 * 2  # one F and one B per rank and micro-batch
    assert {e["tid"] for e in events} == {0, 1, 2, 3}


def test_interleaved_with_costs_and_virtual_stages(capsys):
    code, out, _ = run(
        capsys,
        "--schedule",
        "interleaved",
        "--pp",
        "4",
        "--microbatches",
        "8",
        "--virtual-stages",
        "2",
        "--costs",
        "F=1,B=1",
    )
    assert code == 0
    assert "bubble 15.8%" in out  # (p-1)/(v m + p - 1) = 3/19


def test_per_stage_costs_and_p2p(capsys):
    code, out, _ = run(
        capsys, "--schedule", "gpipe", "--pp", "2", "--microbatches", "2", "--costs", "F=1:3,B=2:6,p2p=0.5"
    )
    assert code == 0
    # Rank 0's F0 ends at 1 and lands at 1.5; rank 1 then runs F0, F1 (3 each) and B0, B1 (6 each) back to back
    # until 19.5; rank 0 runs B0 when its gradient lands (14 -> 16) and B1 at 20 -> 22.
    assert "makespan 22," in out


def test_custom_text_schedule_and_save_text(capsys, tmp_path):
    source = tmp_path / "mine.txt"
    source.write_text("0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1\n")
    saved = tmp_path / "saved.txt"
    code, out, _ = run(capsys, "--text", str(source), "--save-text", str(saved), "--lowered")
    assert code == 0
    assert out.startswith("mine p=2 m=2 v=1: makespan")
    assert "0SF0" in out and "1RF0" in out  # the lowered schedule is printed
    assert Schedule.from_text(saved.read_text()).actions == Schedule.from_text(source.read_text()).actions


def test_custom_csv_schedule(capsys, tmp_path):
    path = build_schedule("zero-bubble", 3, 4).to_csv(tmp_path / "zb.csv")
    code, out, _ = run(capsys, "--csv", str(path), "--costs", "F=1,B=2,I=1,W=1")
    assert code == 0
    assert "zero-bubble p=3 m=4 v=1" in out


@pytest.mark.parametrize(
    "args, words",
    [
        (["--schedule", "zb"], "unknown pipeline schedule 'zb'. Fix: use one of"),
        (["--schedule", "interleaved", "--pp", "4", "--microbatches", "6"], "multiple of pp"),
        (["--costs", "F=fast"], "--costs item 'F=fast' is not KEY=NUMBER"),
        (["--costs", "X=1"], "unknown cost(s) X"),
        (["--costs", "F=1:2"], "costs give 2 per-stage values, but stage 2 exists"),
        (["--text", "does-not-exist.txt"], "cannot read the schedule file does-not-exist.txt"),
        (["--out", "no-such-folder/x.png"], "cannot write no-such-folder/x.png"),
        (["--pp", "0"], "p=0 must be an integer >= 1"),
    ],
)
def test_bad_input_exits_2_with_the_message(capsys, tmp_path, monkeypatch, args, words):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, *args)
    assert code == 2
    assert words in err and "Traceback" not in err
    assert out == ""


def test_deadlocking_custom_schedule_is_refused(capsys, tmp_path):
    path = tmp_path / "bad.txt"
    path.write_text("0F0 0B0 0F1 0B1\n1F1 1F0 1B0 1B1\n")  # rank 1 waits for 0F1, rank 0 for 1B0
    png = tmp_path / "bad.png"
    code, _, err = run(capsys, "--text", str(path), "--out", str(png))
    assert code == 2
    assert "ScheduleError: deadlock in schedule 'bad'" in err
    assert "rank 1 is at 1F1, waiting for 0F1 on rank 0" in err
    assert not png.exists()


def test_parse_costs():
    assert parse_costs("F=1, B=2:2:3:3 ,p2p=0.1") == {"F": 1.0, "B": [2.0, 2.0, 3.0, 3.0], "p2p": 0.1}
    assert parse_costs("") == {}


@pytest.mark.cli
def test_python_m_plait_schedule(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("0F0 0B0 0F1 0B1\n1F1 1F0 1B0 1B1\n")
    ok = subprocess.run(
        [
            sys.executable,
            "-m",
            "plait",
            "schedule",
            "--schedule",
            "zero-bubble",
            "--pp",
            "4",
            "--microbatches",
            "8",
            "--out",
            "zb.png",
        ],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert "bubble 11.1%" in ok.stdout and (tmp_path / "zb.png").exists()  # (p-1)/(3m+p-1), F=1, I=W=1
    failed = subprocess.run(
        [sys.executable, "-m", "plait", "schedule", "--text", str(bad)],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert failed.returncode == 2
    assert "deadlock" in failed.stderr and "Traceback" not in failed.stderr
