"""``plait runs`` (issue 37, ``plait.train.run_info``): what a run folder holds, read without changing it: a
finished, a running and a stopped run, a damaged checkpoint (the resume line names the one a resume loads), a
malformed metrics file (a note, no traceback), a folder of runs (a table), and a path that is no folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from plait.cli.main import main
from plait.train.config import RunConfig
from plait.train.fault import RunFolderLock
from plait.train.run_info import FINISHED, RUNNING, STOPPED, describe, read_run


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from plait.train.loop import run

    out = tmp_path_factory.mktemp("runs") / "addition"
    train = {"steps": 4, "global_batch": 8, "save_every": 2, "eval_every": 2, "eval_batches": 1, "samples": 0}
    run(RunConfig.from_dict({"layout": {"dp": 1}, "train": {**train, "out": str(out)}}))
    return out


def _copy(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    return copy


def test_a_finished_run_shows_its_losses_checkpoints_picture_and_next_commands(finished: Path) -> None:
    before = {p: p.stat().st_mtime_ns for p in finished.rglob("*")}
    info = read_run(finished)
    assert info.status == FINISHED and info.last_step == info.steps == 4 and info.world_size == 1
    assert [(c.name, c.state, c.latest) for c in info.checkpoints] == [
        ("step-00000004", "intact", True),
        ("step-00000002", "intact", False),
    ]
    text = "\n".join(describe(info))
    assert "status       finished: 4 steps" in text and "loss.png" in text
    assert f"plait generate {finished} --prompt TEXT" in text and f"plait convert {finished}/ckpt" in text
    assert "--set train.steps=N" in text and "evaluation   loss" in text
    assert {p: p.stat().st_mtime_ns for p in finished.rglob("*")} == before  # read only


def test_a_run_whose_job_holds_the_lock_is_running(finished: Path, tmp_path: Path) -> None:
    copy = _copy(finished, tmp_path)
    lock = RunFolderLock.acquire(copy)
    try:
        info = read_run(copy)
        assert info.status == RUNNING and "pid" in info.holder
    finally:
        lock.release()
    assert read_run(copy).status == FINISHED  # a lock file nobody holds is not a running job


def test_a_stopped_run_names_the_step_and_the_checkpoint_a_resume_loads(finished: Path, tmp_path: Path) -> None:
    copy = _copy(finished, tmp_path)
    (copy / "summary.json").unlink()
    records = [json.loads(line) for line in (copy / "metrics.jsonl").read_text().splitlines()]
    kept = [r for r in records if r["step"] <= 3]
    (copy / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept) + '{"kind": "train", "st')
    shutil.rmtree(copy / "ckpt" / "step-00000004")
    info = read_run(copy)
    assert info.status == STOPPED and info.last_step == 3
    text = "\n".join(describe(info))
    assert "stopped at step 3 of 4" in text
    assert f"resume       plait train --config {copy}/config.toml --out {copy} --nproc 1   (from step 2)" in text
    assert f"metrics.jsonl line {len(kept) + 1} is not JSON" in text  # the cut record: a note, not a traceback


def test_a_damaged_checkpoint_is_named_with_verify_and_skipped_for_resume(finished: Path, tmp_path: Path) -> None:
    copy = _copy(finished, tmp_path)
    (copy / "summary.json").unlink()
    newest = copy / "ckpt" / "step-00000004"
    victim = max((p for p in newest.iterdir() if p.name != "plait.json"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only --verify (SHA-256) sees it
    victim.write_bytes(bytes(data))
    assert read_run(copy).checkpoints[0].state == "intact"
    info = read_run(copy, verify=True)
    assert info.checkpoints[0].state == "damaged" and info.resumable is not None
    assert info.resumable.name == "step-00000002"
    assert "(from step 2)" in "\n".join(describe(info, verify=True))


def test_a_folder_of_runs_is_a_table_and_a_bad_path_one_line(finished: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["runs", str(finished.parent)]) == 0
    shown = capsys.readouterr().out
    assert str(finished) in shown and "finished" in shown and "4/4" in shown and "step-00000004" in shown
    assert main(["runs", str(finished / "config.toml")]) == 2
    assert "is not a folder. Fix:" in capsys.readouterr().err


def test_a_checkpoint_copied_in_from_another_run_is_damaged_here(finished: Path, tmp_path: Path) -> None:
    """The run's ckpt/run-id binds its checkpoints (issue 39 N2): one of another run is not what a resume loads."""
    copy = _copy(finished, tmp_path)
    (copy / "ckpt" / "run-id").write_text("0" * 32 + "\n")
    info = read_run(copy)
    assert all(c.state == "damaged" and "another run" in c.problems[0] for c in info.checkpoints)
    assert info.resumable is None
    (copy / "summary.json").unlink()
    assert "a job on this folder refuses to start" in "\n".join(describe(read_run(copy)))
