"""Fault tolerance: a killed rank under ``plait train --max-restarts 1`` is restarted and the job ends exactly as an
uninterrupted run would; without restarts the same kill fails the job fast, naming the rank; a rank hung outside
any collective is named by the watchdog. Plus the pieces on their own: fault injection, the watchdog, metrics
resumption and the CLI's refusals."""

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers.runs import final_state, recorded_train_steps

from plait.cli.main import main
from plait.errors import ConfigError
from plait.train.fault import (
    WATCHDOG_EXIT_CODE,
    Fault,
    RankGuard,
    Watchdog,
    describe_exit,
    resume_metrics,
    watchdog_seconds,
)

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PLAIT_TIMEOUT_S": "120"}
# A tiny job: 2 ranks (dp=2), 9 steps, a checkpoint every 3 steps. Killed before step 8 it resumes from step 6 and
# replays step 7, which rank 0 had already recorded: metrics.jsonl must hold it once.
TINY = [
    "--nproc",
    "2",
    "--set",
    "train.steps=9",
    "--set",
    "train.save_every=3",
    "--set",
    "train.eval_every=0",
    "--set",
    "train.global_batch=8",
    "--set",
    "model.n_layer=1",
    "--set",
    "model.d_model=32",
]


def plait(
    *args: str,
    cwd: Path,
    env: dict[str, str] | None = None,
    timeout: float = 240,
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "plait", *args],
        cwd=cwd,
        env={**ENV, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ----------------------------------------------------------------------------------- end to end, through torchrun
@pytest.mark.cli
@pytest.mark.distributed
def test_killed_rank_is_restarted_and_the_run_matches_an_uninterrupted_one(tmp_path):
    # dropout: the resumed steps draw the same masks only if the checkpoint restores every rank's RNG state
    job = [*TINY, "--set", "model.dropout=0.1"]
    reference = plait("train", *job, "--out", str(tmp_path / "reference"), cwd=tmp_path)
    assert reference.returncode == 0, reference.stderr[-3000:]
    started = time.monotonic()
    result = plait(
        "train",
        *job,
        "--max-restarts",
        "1",
        "--out",
        str(tmp_path / "killed"),
        cwd=tmp_path,
        env={"PLAIT_FAULT_INJECT": "rank=1,step=8,action=kill"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "rank 1: PLAIT_FAULT_INJECT injects 'kill' before step 8 (attempt 0)" in result.stderr
    assert "restart 1 of 1: resuming at step 6" in result.stderr  # the kill happened and the job came back
    assert "resuming at step 6: dropped 1 record(s) after it" in result.stderr  # step 7's first record
    assert time.monotonic() - started < 120, "a restart should cost one worker start-up, not a timeout"

    expected, got = recorded_train_steps(tmp_path / "reference"), recorded_train_steps(tmp_path / "killed")
    assert [r["step"] for r in got] == list(range(1, 10))  # step 7 (recorded, then replayed) appears once
    fields = ("loss", "grad_norm", "lr")  # exact: same data order, same arithmetic on CPU (no timing fields)
    assert [[r[f] for f in fields] for r in got] == [[r[f] for f in fields] for r in expected]
    summaries = [json.loads((tmp_path / run / "summary.json").read_text()) for run in ("reference", "killed")]
    assert summaries[1]["steps"] == 9 and summaries[1]["eval_loss"] == summaries[0]["eval_loss"]

    reference_state, killed_state = final_state(tmp_path / "reference"), final_state(tmp_path / "killed")
    assert reference_state.keys() == killed_state.keys() and any(k.startswith("optimizer.") for k in killed_state)
    for name, value in reference_state.items():
        assert torch.equal(killed_state[name], value), name  # bitwise: deterministic CPU arithmetic, same order


@pytest.mark.cli
@pytest.mark.distributed
def test_killed_rank_without_restarts_fails_fast_naming_it(tmp_path):
    started = time.monotonic()
    result = plait(
        "train", *TINY, "--out", str(tmp_path / "r"), cwd=tmp_path, env={"PLAIT_FAULT_INJECT": "rank=1,step=5,code=7"}
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stderr[-3000:]
    assert re.search(r"plait: error: training failed on .*rank 1 \(exit code 7\)", result.stderr), result.stderr[-3000:]
    assert "rank 1: PLAIT_FAULT_INJECT injects 'exit' before step 5 (attempt 0)" in result.stderr
    assert "restart 1" not in result.stderr
    assert elapsed < 90, f"{elapsed:.0f} s: a dead peer must fail the job at once, not after PLAIT_TIMEOUT_S=120"
    assert [r["step"] for r in recorded_train_steps(tmp_path / "r")] == [1, 2, 3, 4]


@pytest.mark.cli
@pytest.mark.distributed
def test_rank_hung_outside_collectives_is_named_by_the_watchdog(tmp_path):
    started = time.monotonic()
    result = plait(
        "train",
        *TINY,
        "--out",
        str(tmp_path / "r"),
        cwd=tmp_path,
        env={"PLAIT_FAULT_INJECT": "rank=1,step=5,action=hang", "PLAIT_WATCHDOG_S": "4"},
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stderr[-3000:]
    report = re.search(
        r"rank 1: hang watchdog: no progress for [\d.]+ s outside any collective "
        r"\(PLAIT_WATCHDOG_S=4\); last operation: step 5: loading the batch",
        result.stderr,
    )
    assert report, result.stderr[-3000:]
    assert "fire_if_due" in result.stderr  # where rank 1's main thread was stuck
    assert "rank 0: hang watchdog" not in result.stderr  # rank 0 waited as long, but inside a collective
    assert f"rank 1 (exit code {WATCHDOG_EXIT_CODE}: stopped by the hang watchdog)" in result.stderr
    assert elapsed < 90, f"{elapsed:.0f} s: the watchdog (4 s) must fail the job before PLAIT_TIMEOUT_S=120"


# ------------------------------------------------------------------------------------------- the CLI's refusals
def test_cli_refuses_bad_restart_settings_before_launch(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--nproc", "2", "--max-restarts", "-1"]) == 2
    assert "--max-restarts -1 must be >= 0" in capsys.readouterr().err
    # restarts without checkpoints would start over from step 0: refused, with the fix
    assert main(["train", "--nproc", "2", "--max-restarts", "2"]) == 2
    assert "train.save_every is 0" in (err := capsys.readouterr().err) and "--set train.save_every=" in err
    monkeypatch.setenv("PLAIT_FAULT_INJECT", "rank=1,when=7")
    assert main(["train", "--nproc", "2"]) == 2
    assert "'when=7' is not rank=, step=" in capsys.readouterr().err
    monkeypatch.setenv("PLAIT_FAULT_INJECT", "rank=2,step=7")
    assert main(["train", "--nproc", "2"]) == 2
    assert "names rank 2, but the job has ranks 0..1" in capsys.readouterr().err
    monkeypatch.setenv("PLAIT_FAULT_INJECT", "rank=1,step=7")
    monkeypatch.setenv("PLAIT_WATCHDOG_S", "soon")
    assert main(["train", "--nproc", "2"]) == 2
    assert "PLAIT_WATCHDOG_S='soon' must be a number of seconds" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # nothing was launched


# ----------------------------------------------------------------------------------------------- the pieces
def test_fault_parse_and_when_it_fires():
    assert Fault.parse("rank=1,step=8") == Fault(rank=1, step=8)
    assert Fault.parse(" rank=0, step=3, action=hang, code=9, attempt=1 ") == Fault(0, 3, "hang", 9, 1)
    for bad, message in [
        ("rank=1", "needs both rank= and step="),
        ("rank=1,step=x", "step='x' is not an integer"),
        ("rank=1,step=2,action=explode", "action='explode' is not one of"),
        ("rank=1,step=0", "step >= 1"),
        ("step", "'step' is not rank="),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            Fault.parse(bad)
    assert Fault.from_env({}) is None and Fault.from_env({"PLAIT_FAULT_INJECT": "rank=0,step=1"}) == Fault(0, 1)
    fault = Fault(rank=1, step=8)
    for rank, step, attempt in [(0, 8, 0), (1, 7, 0), (1, 8, 1)]:  # another rank, step or restart: no-op
        fault.fire_if_due(rank, step, attempt)
    guard = RankGuard.from_env(1, {"PLAIT_FAULT_INJECT": "rank=1,step=8", "TORCHELASTIC_RESTART_COUNT": "1"})
    assert guard.attempt == 1 and guard.fault == fault  # a restarted worker does not fire again


def test_watchdog_seconds():
    assert watchdog_seconds({}) == 150.0 and watchdog_seconds({"PLAIT_TIMEOUT_S": "60"}) == 30.0
    assert watchdog_seconds({"PLAIT_WATCHDOG_S": "0"}) == 0.0  # off
    with pytest.raises(ConfigError, match="must be a number of seconds >= 0"):
        watchdog_seconds({"PLAIT_WATCHDOG_S": "-3"})


def _busy_until(event: threading.Event, seconds: float) -> None:
    """A Python loop that makes no progress (the deadlocked-loop case)."""
    deadline = time.monotonic() + seconds
    while not event.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_watchdog_names_rank_operation_and_stack_of_a_stuck_thread():
    reports: list[str] = []
    fired = threading.Event()
    watchdog = Watchdog(3, 0.3, on_hang=lambda r: (reports.append(r), fired.set()), poll_s=0.02)
    with watchdog:
        watchdog.beat("step 12: loading the batch")
        _busy_until(fired, 10)
    assert fired.is_set() and len(reports) == 1
    assert reports[0].startswith("rank 3: hang watchdog: no progress for 0.")
    assert "last operation: step 12: loading the batch" in reports[0] and "_busy_until" in reports[0]


def test_watchdog_is_quiet_inside_collectives_and_while_beating():
    fired = threading.Event()
    # frames of threading.py stand for a collective here: a wait inside one is the collective's timeout's business
    watchdog = Watchdog(0, 0.3, on_hang=lambda r: fired.set(), collective_paths=("threading.py",), poll_s=0.02)
    with watchdog:
        threading.Event().wait(0.6)
        for step in range(6):
            watchdog.beat(f"step {step}")
            time.sleep(0.1)
        watchdog.beat("building the model", timed=False)  # unbounded work: not timed until the next beat
        time.sleep(0.6)
    assert not fired.is_set()
    disabled = Watchdog(0, 0.0).start()  # PLAIT_WATCHDOG_S=0: no thread at all
    assert disabled._thread is None


def test_resume_metrics_drops_what_the_resumed_run_writes_again(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [{"kind": "train", "step": s} for s in range(1, 8)] + [{"kind": "eval", "step": 6}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"kind": "train", "st')  # torn last line
    assert resume_metrics(path, step=6, total_steps=9) == 2
    assert [(r["kind"], r["step"]) for r in map(json.loads, path.read_text().splitlines())] == (
        [("train", s) for s in range(1, 7)] + [("eval", 6)]
    )
    # a finished run resumed at its last step repeats only the final evaluation
    path.write_text("".join(json.dumps(r) + "\n" for r in [{"kind": "train", "step": 9}, {"kind": "eval", "step": 9}]))
    assert resume_metrics(path, step=9, total_steps=9) == 1
    assert json.loads(path.read_text()) == {"kind": "train", "step": 9}
    assert resume_metrics(tmp_path / "absent.jsonl", 3, 9) == 0


def test_describe_exit():
    assert describe_exit(1) == "exit code 1"
    assert describe_exit(WATCHDOG_EXIT_CODE) == "exit code 124: stopped by the hang watchdog"
    assert describe_exit(-9) == "exit code -9: killed by SIGKILL"
