"""Preemption-safe stop and the loopback rendezvous (issue 39, N12; docs/launching.md "Stopping a run").

- SIGTERM (a scheduler's preemption) or SIGINT (Ctrl-C) to ``plait train``: every rank stops after the same step,
  which is saved; rank 0 says so in one line (step, how to resume); the exit status is 128 + the signal's number;
  no traceback. Resuming continues bitwise as the uninterrupted run would have. A second signal stops at once.
  Under ``--max-restarts`` a signal stops the job: no restart.
- The ranks agree through the per-step all-gather: one rank's signal stops them all after the same step.
- A local run's rendezvous listens on 127.0.0.1 only (nothing on 0.0.0.0 or ::).

The stop of a real two-rank job and the second signal run in CI; SIGINT with a bitwise resume and the stop under
``--max-restarts`` run under ``long`` (make test-adversarial).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from helpers.processes import ENV, JOB, LINUX, alive, children
from helpers.runs import final_state, recorded_train_steps

from plait.launch import run_local
from plait.train.fault import describe_exit

pytestmark = [pytest.mark.adversarial]


# ------------------------------------------------------------------------------------------------------ helpers
def _start(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    with open(log, "w") as handle:
        return subprocess.Popen(
            [sys.executable, "-m", "plait", "train", *args],
            stdout=handle,
            stderr=subprocess.STDOUT,
            env={**ENV, **(env or {})},
            start_new_session=True,  # a signal reaches the launcher alone, as from a scheduler or kill
        )


def _wait(condition, within_s: float, what: str) -> None:  # noqa: ANN001 - a callable returning a truth value
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {within_s:g} s"
        time.sleep(0.05)


def _steps_recorded(run: Path) -> int:
    """How many training steps rank 0 has recorded so far (a line being written is not counted)."""
    path, count = run / "metrics.jsonl", 0
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            count += json.loads(line).get("kind") == "train"
        except ValueError:
            continue
    return count


def _published(run: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (run / "ckpt").glob("step-*") if p.name[5:].isdigit())


def listening(pids: list[int]) -> list[str]:
    """Linux: the addresses ("127.0.0.1:PORT", "[::]:PORT") of the TCP sockets in LISTEN state that ``pids`` hold."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                hex_address, hex_port = fields[1].split(":")
                raw = bytes.fromhex(hex_address)
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # 32-bit words, host order
                address = socket.inet_ntop(family, raw)
                found.append(f"[{address}]:{int(hex_port, 16)}" if ":" in address else f"{address}:{int(hex_port, 16)}")
    return found


def _stop_lines(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if f"stopped by {name} at step" in line]


# ------------------------------------------------------------------------------------------- end to end (CI)
@pytest.mark.skipif(not LINUX, reason="Linux only: finds the launcher's processes and sockets in /proc")
@pytest.mark.cli
@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_sigterm_stops_every_rank_after_a_saved_step_on_a_loopback_rendezvous(tmp_path):
    """While the job trains only loopback sockets listen (launcher and ranks); SIGTERM to the launcher: exit 143,
    one line naming the step and the resume command, no traceback, the last recorded step saved."""
    run = tmp_path / "run"
    launcher = _start([*JOB, "--set", "train.steps=100000", "--out", str(run)], tmp_path / "log")
    try:
        _wait(lambda: _steps_recorded(run) >= 2, 120, "the ranks training")
        sockets = listening([launcher.pid, *children(launcher.pid)])
        assert sockets and all(s.startswith("127.0.0.1:") for s in sockets), sockets
        os.kill(launcher.pid, signal.SIGTERM)
        assert launcher.wait(120) == 143
    finally:
        if launcher.poll() is None:
            launcher.kill()
    text = (tmp_path / "log").read_text()
    assert "Traceback" not in text and "SignalException" not in text, text[-3000:]
    (line,) = _stop_lines(text, "SIGTERM")
    steps = [r["step"] for r in recorded_train_steps(run)]
    assert _published(run)[-1] == steps[-1] == len(steps), (steps, _published(run))  # the last step is the saved one
    assert f"at step {steps[-1]} (checkpoint saved in {run / 'ckpt'}); resume with: plait train --nproc 2 " in line
    assert f"--out {run}" in line and "--set train.steps=100000" in line
    assert not (run / "summary.json").exists()  # the run did not finish
    assert describe_exit(143) == "exit code 143: stopped by SIGTERM"


@pytest.mark.skipif(not LINUX, reason="Linux only: finds the launcher's processes and sockets in /proc")
@pytest.mark.cli
@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_a_second_signal_stops_at_once(tmp_path):
    """Rank 1 hangs before step 3 (its peer waits in a collective), so the first SIGTERM cannot end a step; the
    second ends the launcher at once (exit 143, one line) and no rank outlives it."""
    run = tmp_path / "run"
    hang = {"PLAIT_FAULT_INJECT": "rank=1,step=3,action=hang", "PLAIT_WATCHDOG_S": "0"}
    launcher = _start([*JOB, "--set", "train.steps=100", "--out", str(run)], tmp_path / "log", hang)
    try:
        _wait(lambda: "injects 'hang' before step 3" in (tmp_path / "log").read_text(), 120, "rank 1 hanging")
        ranks = children(launcher.pid)
        os.kill(launcher.pid, signal.SIGTERM)
        time.sleep(1.0)  # the first signal reached the workers, which cannot finish the step
        assert launcher.poll() is None, "the first signal should wait for the step (up to --stop-grace)"
        os.kill(launcher.pid, signal.SIGTERM)
        assert launcher.wait(30) == 143
        _wait(lambda: not any(alive(pid) for pid in ranks), 10, "no rank alive after the second signal")
    finally:
        if launcher.poll() is None:
            launcher.kill()
    text = (tmp_path / "log").read_text()
    assert text.count("plait: second SIGTERM: stopping at once; the workers are killed unsaved.") == 1, text[-3000:]
    assert "Traceback" not in text and not _stop_lines(text, "SIGTERM")


# -------------------------------------------------------------------------------------------------- long runs
@pytest.mark.long
@pytest.mark.cli
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_sigint_stop_resumes_bitwise_as_the_uninterrupted_run(tmp_path):
    """Ctrl-C (SIGINT) mid-run, then the same command again: the records and the final state equal those of a run
    never interrupted (dropout: the checkpoint restores every rank's random state)."""
    job = [*JOB, "--set", "train.steps=150", "--set", "model.dropout=0.1", "--set", "train.save_every=50"]
    stopped, reference = tmp_path / "stopped", tmp_path / "reference"
    launcher = _start([*job, "--out", str(stopped)], tmp_path / "log")
    try:
        _wait(lambda: _steps_recorded(stopped) >= 3, 180, "the ranks training")
        os.kill(launcher.pid, signal.SIGINT)
        assert launcher.wait(120) == 130
    finally:
        if launcher.poll() is None:
            launcher.kill()
    text = (tmp_path / "log").read_text()
    assert "Traceback" not in text and len(_stop_lines(text, "SIGINT")) == 1, text[-3000:]
    at = _published(stopped)[-1]
    assert 3 <= at < 150 and [r["step"] for r in recorded_train_steps(stopped)][-1] == at
    for folder in (stopped, reference):
        done = subprocess.run(
            [sys.executable, "-m", "plait", "train", *job, "--out", str(folder)],
            env=ENV,
            capture_output=True,
            text=True,
            timeout=400,
        )
        assert done.returncode == 0, done.stderr[-3000:]
    got, expected = recorded_train_steps(stopped), recorded_train_steps(reference)
    assert [r["step"] for r in got] == list(range(1, 151))  # each step once
    fields = ("loss", "grad_norm", "lr")
    assert [[r[f] for f in fields] for r in got] == [[r[f] for f in fields] for r in expected]
    reference_state, stopped_state = final_state(reference), final_state(stopped)
    assert reference_state.keys() == stopped_state.keys()
    for name, value in reference_state.items():
        assert torch.equal(stopped_state[name], value), name


@pytest.mark.long
@pytest.mark.cli
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_signal_under_max_restarts_stops_the_job_without_a_restart(tmp_path):
    run = tmp_path / "run"
    args = [*JOB, "--max-restarts", "2", "--set", "train.save_every=1000", "--set", "train.steps=100000"]
    launcher = _start([*args, "--out", str(run)], tmp_path / "log")
    try:
        _wait(lambda: _steps_recorded(run) >= 2, 120, "the ranks training")
        os.kill(launcher.pid, signal.SIGTERM)
        assert launcher.wait(120) == 143
    finally:
        if launcher.poll() is None:
            launcher.kill()
    text = (tmp_path / "log").read_text()
    assert "Traceback" not in text and len(_stop_lines(text, "SIGTERM")) == 1, text[-3000:]
    assert "--max-restarts 2" in _stop_lines(text, "SIGTERM")[0]  # the resume command is the launch command
    time.sleep(2.0)  # a restart would start workers again and write the folder
    assert "restart 1" not in (tmp_path / "log").read_text() and not children(launcher.pid)
    assert _published(run)[-1] == recorded_train_steps(run)[-1]["step"] < 1000  # saved at the stop, not at save_every


# ------------------------------------------------------------------------------------------------ the pieces
def _agree(stop_by_rank: list[int]) -> tuple[int, int]:
    """One training step of a 2-rank engine whose ranks hold ``stop_by_rank``; (agreed signal, memory field)."""
    import torch.distributed as dist

    import plait
    from plait.models import GPT, GPTConfig, lm_loss
    from plait.train.metrics import StepMeter

    config = GPTConfig(vocab_size=16, seq_len=8, d_model=16, n_head=2, n_layer=1)
    engine = plait.parallelize(
        GPT(config), plait.Layout(dp=2), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=lm_loss
    )
    meter = StepMeter(engine, config, config.seq_len)
    x = torch.randint(0, 16, (2, 8))
    record = meter.measure(engine.train_step((x, x)), stop_by_rank[dist.get_rank()])
    return meter.stop_signal, len(record[meter.memory_field])


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_one_ranks_signal_stops_every_rank_through_the_step_all_gather():
    assert run_local(_agree, 2, [0, int(signal.SIGTERM)]) == [(int(signal.SIGTERM), 2)] * 2
    assert run_local(_agree, 2, [0, 0]) == [(0, 2)] * 2


STOP_REQUEST = textwrap.dedent(
    """
    import os, signal, sys, time
    from plait.train.stop import StopRequest
    stop = StopRequest(lone=sys.argv[1] == "lone").install()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)
    print("first", stop.signum, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)
    print("second survived", flush=True)
    """
)


@pytest.mark.parametrize("lone", [True, False])
@pytest.mark.timeout(60)
def test_stop_request_records_the_first_signal_and_a_lone_process_dies_on_the_second(lone):
    """The handler only records the first signal; a second ends a lone process at once (default action), while a
    launched worker leaves the second to its launcher (a scheduler may signal it and the launcher both)."""
    done = subprocess.run(
        [sys.executable, "-c", STOP_REQUEST, "lone" if lone else "worker"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert f"first {int(signal.SIGTERM)}" in done.stdout, done.stderr
    if lone:
        assert done.returncode == -signal.SIGTERM and "second survived" not in done.stdout
    else:
        assert done.returncode == 0 and "second survived" in done.stdout


def test_the_loopback_rendezvous_listens_on_127_0_0_1_only_with_a_fresh_store_per_round():
    from plait.rendezvous import LoopbackRendezvous, register_loopback_backend

    assert register_loopback_backend() == register_loopback_backend() == "plait-local"  # idempotent
    before = set(listening([os.getpid()])) if LINUX else set()  # what earlier tests of this process left listening
    handler = LoopbackRendezvous("test")
    first = handler.next_rendezvous()
    assert (first.rank, first.world_size, first.bootstrap_store_info.master_addr) == (0, 1, "127.0.0.1")
    first.store.set("key", "attempt 0")
    if LINUX:
        opened = set(listening([os.getpid()])) - before
        assert opened == {f"127.0.0.1:{first.bootstrap_store_info.master_port}"}
    second = handler.next_rendezvous()  # a restart: the workers of attempt 1 must not read attempt 0's keys
    assert second.bootstrap_store_info.master_port != first.bootstrap_store_info.master_port
    assert second.store.num_keys() <= 1 and not second.store.check(["key"])
    assert handler.use_agent_store and handler.num_nodes_waiting() == 0 and handler.shutdown()
