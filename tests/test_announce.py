"""What a run says once (issue 37, ``plait.train.announce``): a resume names its step and what changed since the
run before; a run from ``init_from`` names those weights; a finished run says what to run next; the job's time
across restarts; the progress bar never cuts the step's figures at 80 columns."""

from __future__ import annotations

import io
import logging
import time
from pathlib import Path

import pytest

from plait import logging as plait_logging
from plait.train import announce
from plait.train.config import RunConfig

TINY = {"model": {"n_layer": 1, "d_model": 32}, "data": {"seq_len": 16}}


def _train(out: Path, steps: int, **train: object) -> None:
    from plait.train.loop import run

    cadence = {"steps": steps, "global_batch": 8, "save_every": 2, "eval_every": 0, "eval_batches": 1, "samples": 0}
    run(RunConfig.from_dict({**TINY, "layout": {"dp": 1}, "train": {**cadence, **train, "out": str(out)}}))


@pytest.fixture
def said():
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    keep = Keep(logging.INFO)
    plait_logging.configure(0)
    logging.getLogger("plait").addHandler(keep)
    yield lines
    logging.getLogger("plait").removeHandler(keep)


def test_config_changes_name_each_setting_with_both_values() -> None:
    before = '[train]\nsteps = 300\nlr = 0.003\nout = "runs/a"\n[layout]\ndp = 2\n'
    after = {"train": {"steps": 600, "lr": 0.003, "out": "./runs/a"}, "layout": {"dp": 2, "tp": 2}}
    assert announce.config_changes(before, after) == ["layout.tp (unset) -> 2", "train.steps 300 -> 600"]
    assert announce.config_changes("not toml [", after) == []


def test_a_resume_says_its_step_and_what_changed_then_what_to_run_next(tmp_path: Path, said: list[str]) -> None:
    _train(tmp_path / "run", 2)
    assert any(line.startswith(f"next: plait generate {tmp_path / 'run'} --prompt TEXT") for line in said)
    said.clear()
    _train(tmp_path / "run", 4, lr=0.002)
    resumed = [line for line in said if line.startswith("resuming ")]
    assert resumed == [
        f"resuming {tmp_path / 'run'} at step 2 of 4 (changed since its last run: train.lr 0.003 -> 0.002; "
        f"train.steps 2 -> 4)"
    ]
    said.clear()
    _train(tmp_path / "run", 6, lr=0.002)
    assert f"resuming {tmp_path / 'run'} at step 4 of 6 (changed since its last run: train.steps 4 -> 6)" in said


def test_a_run_from_init_from_names_the_weights(tmp_path: Path, said: list[str]) -> None:
    _train(tmp_path / "base", 2)
    said.clear()
    _train(tmp_path / "tuned", 2, init_from=str(tmp_path / "base" / "ckpt"))
    assert any(
        line.startswith("starting from the weights of ") and "base" in line and line.endswith("(train.init_from)")
        for line in said
    )


def test_the_jobs_time_counts_from_the_launchers_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(announce.JOB_STARTED_ENV, str(time.time() - 100))
    seconds = announce.job_seconds()
    assert seconds is not None and 100 <= seconds < 200
    monkeypatch.setenv(announce.JOB_STARTED_ENV, "yesterday")
    assert announce.job_seconds() is None


def test_the_progress_bar_wraps_the_steps_figures_at_80_columns() -> None:
    from rich.console import Console

    from plait.train.loop import progress_bar

    info = "loss 2.2094  1,680 tok/s  MFU 1.2%  eval loss 2.1599, accuracy 0.8% (256 samples) (step 300)"
    shown = io.StringIO()
    console = Console(file=shown, width=80, force_terminal=True, color_system=None)
    bar = progress_bar(console)
    bar.add_task("train", total=600, completed=300, info=info)
    console.print(bar.make_tasks_table(bar.tasks))
    text = " ".join(shown.getvalue().split())
    assert "300/600" in text and " ".join(info.split()) in text  # every figure, none cut with an ellipsis
    assert "…" not in text
