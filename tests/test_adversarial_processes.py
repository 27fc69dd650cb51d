"""Hostile and faulty processes (issue 30, docs/security.md): ranks die with their launcher, one job per run folder,
and a parameter server that serves only its own user's processes and answers a malformed request with one line.

- Ranks die with their launcher (``plait.launch.die_with_parent``): a launcher killed with SIGKILL takes its
  ranks along within a second (the kernel's parent-death signal, and a watching thread where there is none), a
  rank whose launcher died before it armed the signal stops at once, and a real ``plait train --nproc 2`` whose
  launcher is killed leaves no rank running and nothing more written.
- One job per run folder (``plait.train.fault.RunFolderLock``): a second job on a live job's folder is refused
  before it starts anything, naming the holder; the lock of a killed holder is free at once.
- The parameter server without a key (loopback): another local user (who cannot read this user's local key) can
  neither stop it nor pull its shard, and is logged; this user's own workers need no setup. A malformed join spec
  is one line at both ends and the server goes on serving.

The kill -9 of a real training job and its resume run under ``long`` (make test-adversarial); the rest is in CI.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.processes import ENV, JOB, LINUX, alive, children

from plait.cli.main import main
from plait.errors import ConfigError
from plait.launch import ORPHANED_EXIT_CODE
from plait.param_server import AdditionGPT, PSWorker, ServerSettings, ShardServer
from plait.param_server.keys import LOCAL_KEY_FILE_ENV, local_key, local_key_path
from plait.param_server.service import Service
from plait.param_server.transport import connect, request
from plait.param_server.wire import ProtocolError
from plait.train import fault
from plait.train.fault import LOCK_NAME, RunFolderLock, describe_exit

pytestmark = [pytest.mark.adversarial]
TASK = AdditionGPT()


# ------------------------------------------------------------------------------------------------- processes


def _wait(condition, within_s: float, what: str) -> float:  # noqa: ANN001 - a callable returning a truth value
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < within_s, f"{what} within {within_s:g} s"
        time.sleep(0.05)
    return time.monotonic() - started


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder`` with its size and modification time (ns), the lock file left out."""
    return {
        str(path.relative_to(folder)): (path.stat().st_size, path.stat().st_mtime_ns)
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != LOCK_NAME
    }


LAUNCHER = textwrap.dedent(
    """
    import subprocess, sys, time
    children = [subprocess.Popen([sys.executable, "-c", sys.argv[1], mode, sys.argv[2]]) for mode in sys.argv[3:]]
    print(" ".join(str(child.pid) for child in children), flush=True)
    time.sleep(600)
    """
)
RANK = textwrap.dedent(
    """
    import pathlib, sys, time
    import plait.launch as launch
    mode, folder = sys.argv[1], pathlib.Path(sys.argv[2])
    if mode == "thread":  # a system without the kernel's parent-death signal: the watching thread alone
        launch._set_parent_death_signal = lambda sig: False
    launch.die_with_parent("rank " + mode)
    while True:  # a rank at work: it writes on and on
        with open(folder / mode, "a") as handle:
            handle.write("x")
        time.sleep(0.02)
    """
)


@pytest.mark.skipif(not LINUX, reason="Linux only: finds the launcher's processes and sockets in /proc")
@pytest.mark.timeout(120)
def test_ranks_die_with_a_launcher_killed_by_sigkill(tmp_path):
    """Both mechanisms: the kernel's SIGKILL at the parent's death, and the watching thread alone (exit 125)."""
    stderr = tmp_path / "stderr"
    with open(stderr, "w") as err:
        launcher = subprocess.Popen(
            [sys.executable, "-c", LAUNCHER, RANK, str(tmp_path), "signal", "thread"],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=ENV,
            start_new_session=True,
        )
    try:
        assert launcher.stdout is not None
        ranks = [int(pid) for pid in launcher.stdout.readline().split()]
        _wait(lambda: all((tmp_path / mode).exists() for mode in ("signal", "thread")), 90, "both ranks at work")
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(10)
        took = _wait(lambda: not any(alive(pid) for pid in ranks), 5, "no rank alive after the launcher's death")
        written = _snapshot(tmp_path)
        time.sleep(0.5)
        assert _snapshot(tmp_path) == written, "a rank wrote on after its launcher died"
    finally:
        for pid in [launcher.pid, *ranks]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert took < 3, f"the ranks outlived their launcher by {took:.1f} s"
    text = stderr.read_text()
    assert f"rank thread: its launcher (pid {launcher.pid}) is gone; stopping at once (exit code 125)" in text
    assert "rank signal:" not in text  # killed by the kernel before any thread could speak
    assert "Traceback" not in text


@pytest.mark.timeout(120)
def test_a_rank_whose_launcher_died_before_it_started_stops_at_once(tmp_path):
    """The launcher may die while its ranks import torch, before they can arm the signal: a rank then finds that
    its parent is no longer the launcher it was handed (PLAIT_LAUNCHER_PID) and exits with 125, training nothing."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    env = {**ENV, "PLAIT_LAUNCHER_PID": str(dead.pid), "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}
    result = subprocess.run(
        [sys.executable, "-m", "plait", "train", "--out", str(tmp_path / "run")],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert result.returncode == ORPHANED_EXIT_CODE, result.stderr[-2000:]
    assert f"rank 1: its launcher (pid {dead.pid}) is gone; stopping at once" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()
    assert describe_exit(ORPHANED_EXIT_CODE) == "exit code 125: stopped because its launcher died"


def _plait_train(args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as handle:
        return subprocess.Popen(
            [sys.executable, "-m", "plait", "train", *args],
            stdout=handle,
            stderr=subprocess.STDOUT,
            env=ENV,
            start_new_session=True,  # the test kills the launcher alone, as the OOM killer or kill -9 would
        )


def _kill_launcher_and_check(launcher: subprocess.Popen, run: Path) -> None:
    """SIGKILL the launcher; every rank is gone within 3 s and the run folder does not change afterwards."""
    ranks = children(launcher.pid)
    assert len(ranks) == 2, ranks
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait(10)
    try:
        _wait(lambda: not any(alive(pid) for pid in ranks), 3, "no rank alive after the launcher's death")
    finally:
        for pid in ranks:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    written = _snapshot(run)
    time.sleep(1.5)
    assert _snapshot(run) == written, "the run folder changed after the launcher and its ranks died"


@pytest.mark.skipif(not LINUX, reason="Linux only: finds the launcher's processes and sockets in /proc")
@pytest.mark.cli
@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_plait_train_ranks_die_with_their_launcher(tmp_path):
    """The fast case (CI): kill -9 the launcher of a real ``plait train --nproc 2`` once its ranks train."""
    run = tmp_path / "run"
    launcher = _plait_train([*JOB, "--set", "train.steps=100000", "--out", str(run)], tmp_path / "log")
    try:
        _wait(lambda: (run / "metrics.jsonl").exists(), 90, "the ranks training")
        _kill_launcher_and_check(launcher, run)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert "Traceback" not in (tmp_path / "log").read_text()


@pytest.mark.skipif(not LINUX, reason="Linux only: finds the launcher's processes and sockets in /proc")
@pytest.mark.long
@pytest.mark.cli
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_a_job_killed_mid_training_leaves_its_folder_to_the_resumed_job_alone(tmp_path):
    """kill -9 of a training launcher after checkpoints: while it lived a second job on its folder was refused;
    after the kill no rank survives, nothing more is written, and a resumed job continues from the checkpoint."""
    run = tmp_path / "run"
    job = [*JOB, "--set", "train.save_every=5", "--out", str(run)]
    launcher = _plait_train([*job, "--set", "train.steps=100000"], tmp_path / "log")
    try:
        _wait(lambda: (run / "ckpt" / "latest").exists(), 240, "a published checkpoint")
        second = subprocess.run(
            [sys.executable, "-m", "plait", "train", *job, "--set", "train.steps=100000"],
            env=ENV,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"the run folder {run} is in use by another plait train job (pid {launcher.pid} on" in second.stderr
        assert "Fix: wait for that job to end or stop it, or pass another --out." in second.stderr
        assert "Traceback" not in second.stderr
        _kill_launcher_and_check(launcher, run)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    # a save cut short by the kill leaves step-N.partial, which is not published
    published = sorted(int(p.name.split("-")[1]) for p in (run / "ckpt").glob("step-*") if p.name[5:].isdigit())
    assert published, "the job published checkpoints before it was killed"
    last = published[-1]
    resumed = subprocess.run(
        [sys.executable, "-m", "plait", "train", *job, "--set", f"train.steps={last + 2}"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [
        r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"
    ]
    assert steps[-3:] == [last, last + 1, last + 2] and len(steps) == len(set(steps))  # resumed, each step once


def _forkserver_children(launcher: int) -> list[int]:
    """The processes a forkserver started for ``launcher`` (the forkserver is the launcher's child)."""
    found = []
    for child in children(launcher):
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"multiprocessing.forkserver" in command:
            found += [child, *children(child)]
    return found


def _kill_and_expect_all_gone(launcher: subprocess.Popen, processes: list[int]) -> None:
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait(10)
    try:
        _wait(lambda: not any(alive(pid) for pid in processes), 5, f"none of {processes} alive after the launcher")
    finally:
        for pid in processes:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


FORKSERVER_JOBS = {
    "plait ps": (["-m", "plait", "ps", "--servers", "2", "--workers", "2", "--steps", "100000"], 4),
    "run_local": (["-c", "import time, plait.launch as l; l.run_local(time.sleep, 2, 600, timeout=900)"], 2),
}
"""A job whose processes come from a forkserver, and how many it starts (servers and workers, or ranks)."""


@pytest.mark.skipif(not LINUX, reason="Linux only: finds the launcher's processes and sockets in /proc")
@pytest.mark.long
@pytest.mark.timeout(180)
@pytest.mark.parametrize("job", sorted(FORKSERVER_JOBS))
def test_forkserver_processes_die_with_the_process_that_asked_for_them(tmp_path, job):
    """``plait ps``'s servers and workers and ``run_local``'s ranks come from a forkserver, which outlives its
    caller while any of its children lives: they watch the caller's pid, and all of them (the forkserver too)
    are gone within seconds of a kill -9 of the caller."""
    args, count = FORKSERVER_JOBS[job]
    env = {**ENV, LOCAL_KEY_FILE_ENV: str(tmp_path / "ps-local.key")}
    with open(tmp_path / "log", "w") as log:
        launcher = subprocess.Popen(
            [sys.executable, *args], cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        _wait(lambda: len(_forkserver_children(launcher.pid)) == 1 + count, 120, f"{job}: its processes started")
        time.sleep(3.0)  # past their start-up: serving and training
        _kill_and_expect_all_gone(launcher, _forkserver_children(launcher.pid))
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert "is gone; stopping at once" in (tmp_path / "log").read_text()


# ------------------------------------------------------------------------------------------- one job per folder
@pytest.mark.timeout(120)
def test_a_second_job_on_a_live_jobs_run_folder_is_refused_before_it_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    with RunFolderLock.acquire(run):  # a live job (this process stands in for its launcher)
        for nproc in ("2", "1"):  # through the launcher, and a lone process (its rank 0 takes the lock)
            assert main(["train", *JOB[2:], "--nproc", nproc, "--set", "train.steps=2", "--out", str(run)]) == 2
            err = capsys.readouterr().err
            assert f"the run folder {run} is in use by another plait train job (pid {os.getpid()} on" in err, err
            assert "Fix: wait for that job to end or stop it, or pass another --out." in err
            assert "Traceback" not in err and err.count("\n") == 1
            assert [p.name for p in run.iterdir()] == [LOCK_NAME]  # nothing written
    with RunFolderLock.acquire(run):  # free again once its holder let go
        pass
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from plait.train.fault import RunFolderLock as L; L.acquire({str(run)!r}); "
            "print('held', flush=True); import time; time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=f"in use by another plait train job \\(pid {holder.pid} on"):
            RunFolderLock.acquire(run)
    finally:
        holder.kill()
        holder.wait(10)
    RunFolderLock.acquire(run).release()  # the kernel dropped a SIGKILLed holder's lock: no stale lock


def test_a_run_folder_that_is_a_file_is_one_clear_error(tmp_path):
    (tmp_path / "file").write_text("mine")
    with pytest.raises(ConfigError, match="cannot use the run folder .*file.*Fix: pass --out with a folder"):
        RunFolderLock.acquire(tmp_path / "file")
    assert (tmp_path / "file").read_text() == "mine"


def test_a_file_system_without_locks_trains_unguarded_with_a_warning(tmp_path, monkeypatch, caplog):
    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fault.fcntl, "flock", no_locks)
    logger = logging.getLogger("plait.train.fault")
    monkeypatch.setattr(logger, "propagate", True)
    with caplog.at_level(logging.WARNING, logger="plait.train.fault"), RunFolderLock.acquire(tmp_path / "run"):
        pass
    assert "cannot lock the run folder" in caplog.text and "No locks available" in caplog.text


# --------------------------------------------------------------------------------- the keyless parameter server
@pytest.fixture
def server_log() -> Iterator[list[str]]:
    lines: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("plait.param_server")
    handler, level = Lines(logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def _keyless_server() -> Service:
    service = Service(ShardServer(TASK.build_model(), ServerSettings()), log_every_s=0, key=None)
    threading.Thread(target=service.serve_forever, daemon=True).start()
    return service


@pytest.mark.timeout(60)
def test_a_keyless_server_refuses_other_users_stop_and_pull(tmp_path, monkeypatch, server_log):
    """Another local user cannot read this user's local key (0600); with their own they are refused, and
    logged, before any request: no stop, no shard. This user's processes join with no setup."""
    mine = tmp_path / "me" / "ps-local.key"
    monkeypatch.setenv(LOCAL_KEY_FILE_ENV, str(mine))
    service = _keyless_server()
    try:
        assert local_key_path() == mine and (mine.stat().st_mode & 0o777) == 0o600
        monkeypatch.setenv(LOCAL_KEY_FILE_ENV, str(tmp_path / "other-user" / "ps-local.key"))
        for op in ("stop", "pull"):
            with pytest.raises(ConfigError, match="key differs"):
                channel = connect(service.address, None, 5, 1 << 30)
                request(channel, op, 5, **({"wid": "thief", "have": -1} if op == "pull" else {}))
        assert not service.stopped.is_set() and service.final_report is None
        _wait(lambda: service.refused == 2, 5, "both refusals counted")
        refusals = [line for line in server_log if "failed authentication" in line]
        assert len(refusals) == 2 and all("refused a message from 127.0.0.1:" in line for line in refusals)
        monkeypatch.setenv(LOCAL_KEY_FILE_ENV, str(mine))
        worker = PSWorker([service.address], TASK.build_model(), "mine", timeout_s=10)  # no key given
        assert worker.pull() == [0]
        worker.close()
        channel = connect(service.address, None, 5, 1 << 30)
        assert request(channel, "stop", 10)["version"] == 0  # this user's launcher may stop it: logged
        channel.close()
        assert any("stop requested by 127.0.0.1:" in line for line in server_log)
    finally:
        service.stopped.set()


def test_the_local_key_is_private_made_once_and_refused_when_readable_by_others(tmp_path, monkeypatch):
    path = tmp_path / "fresh" / "ps-local.key"
    monkeypatch.setenv(LOCAL_KEY_FILE_ENV, str(path))
    first = local_key()
    assert local_key() == first and len(first) == 64
    assert (path.stat().st_mode & 0o777) == 0o600 and (path.parent.stat().st_mode & 0o777) == 0o700
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="others may read it. Fix: chmod 600"):
        local_key()


@pytest.mark.timeout(60)
def test_a_malformed_join_spec_is_one_line_at_both_ends_and_the_server_serves_on(tmp_path, monkeypatch, server_log):
    monkeypatch.setenv(LOCAL_KEY_FILE_ENV, str(tmp_path / "ps-local.key"))
    service = _keyless_server()
    unhandled: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: unhandled.append(args.exc_value))
    try:
        specs = {
            "a list as dtype": [["x", [1], ["float32"]]],
            "an object as name": [[{"a": 1}, [1], "float32"]],
            "a negative size": [["x", [-1], "float32"]],
            "a string": "tok_embed",
        }
        for what, spec in specs.items():
            channel = connect(service.address, None, 5, 0)
            with pytest.raises(ProtocolError, match="request 'join': .*Fix: run the same plait version") as caught:
                request(channel, "join", 5, wid="w", name="w", spec=spec, settings=None)
            channel.close()
            assert "\n" not in str(caught.value), what
        worker = PSWorker([service.address], TASK.build_model(), "honest", timeout_s=10)
        assert worker.pull() == [0]
        worker.close()
    finally:
        service.stopped.set()
    assert not unhandled, unhandled  # no connection thread died with a traceback
    refused = [line for line in server_log if "refused a message" in line and "request 'join'" in line]
    assert len(refused) == len(specs) and all("\n" not in line for line in refused)
