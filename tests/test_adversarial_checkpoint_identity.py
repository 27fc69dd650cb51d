"""Checkpoint identity and keys (issue 39, docs/checkpoints.md "Identity"): N2, a step copied under another step's
name or a checkpoint of another run is damaged and resume falls back to this run's newest intact step, keeping its
records; N11, a step out of range; N3 + N9, a bad checkpoint key stops a job before any work, in one line, and key
files and keygen never end in a traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.harness import run_distributed
from helpers.hostile_checkpoints import KEY, cli, engine, one_line, reseal, snapshot, step, trained

from plait.checkpoint import load_full_state
from plait.errors import CheckpointError, PlaitError

pytestmark = [pytest.mark.adversarial]


# ----------------------------------------------------------------- issue 39: a checkpoint's step, run and key
def _two_steps(root: Path) -> tuple[Path, Path]:
    """A root with the checkpoints of steps 1 and 2 of one run."""
    built = engine()
    step(built)
    first = built.save(root)
    step(built)
    return first, built.save(root)


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
def test_a_step_copied_under_a_newer_steps_name_is_damaged(tmp_path, monkeypatch, capsys, signed):
    """N2: step 1's folder copied as step 5 (a `cp -r`, or someone replaying a signed checkpoint): its plait.json
    and signature still check out, so it was resumed as step 5, from step 1's weights."""
    if signed:
        monkeypatch.setenv("PLAIT_CHECKPOINT_KEY", KEY)
    first, _second = _two_steps(tmp_path / "ckpt")
    copied = tmp_path / "ckpt" / "step-00000005"
    shutil.copytree(first, copied)
    assert engine().load(tmp_path / "ckpt") == 2  # the newest intact step of the run, not "step 5"
    with pytest.raises(CheckpointError) as refused:
        engine().load(copied)  # named directly: refused, not loaded as step 1 or 5
    one_line(str(refused.value), "recorded step 1 in folder step-00000005", "copied or renamed")
    code, out, _err = cli(capsys, "checkpoint", "verify", str(tmp_path / "ckpt"))
    assert code == 1 and "step-00000005: recorded step 1 in folder step-00000005" in out
    if signed:
        code, _out, err = cli(capsys, "checkpoint", "sign", str(copied))
        assert code == 1 and "recorded step 1" in err  # and `sign` does not bless it


@pytest.mark.parametrize(
    ("value", "named"),
    [(10**30, "step is 1000000000000000000000000000000,"), (-1, "step is -1"), ("2", "step is '2'"), (2.5, "2.5")],
    ids=["10**30", "negative", "text", "fraction"],
)
def test_a_step_out_of_range_is_damaged_and_resume_falls_back(tmp_path, capsys, value, named):
    """N11: a step of 10**30 was accepted (a whole number >= 0) and ended in TensorBoard's ValueError (and any
    other 64-bit counter); each of these makes the checkpoint damaged, named in one line."""
    _first, second = _two_steps(tmp_path / "ckpt")
    reseal(second, lambda meta: meta.update(step=value))
    assert engine().load(tmp_path / "ckpt") == 1
    with pytest.raises(CheckpointError) as refused:
        engine().load(second)
    one_line(str(refused.value), "malformed", named)
    code, out, _err = cli(capsys, "checkpoint", "verify", str(second))
    assert code == 1 and named in out and len(out.strip().splitlines()) == 1


def test_a_checkpoint_of_another_run_is_refused_on_resume_but_loads_by_name(tmp_path, monkeypatch, capsys):
    """A signed checkpoint of another run (same user, same key) copied into this run's folder was resumed.
    Weights-only uses of the copied folder (init_from, generate, convert) still work: they name it."""
    monkeypatch.setenv("PLAIT_CHECKPOINT_KEY", KEY)
    _first, other = _two_steps(tmp_path / "other" / "ckpt")
    trained(tmp_path / "run" / "ckpt")  # this run: step 1
    copied = tmp_path / "run" / "ckpt" / other.name
    shutil.copytree(other, copied)
    before = snapshot(tmp_path)
    assert engine().load(tmp_path / "run" / "ckpt") == 1  # was 2: the other run's
    run_ids = {(tmp_path / name / "ckpt" / "run-id").read_text().strip() for name in ("run", "other")}
    assert len(run_ids) == 2 and all(len(run) == 32 for run in run_ids)
    code, out, _err = cli(capsys, "checkpoint", "verify", str(tmp_path / "run"))
    assert code == 1 and "step-00000002: it is from another run" in out and "run-id names" in out
    assert engine().load(copied) == 2  # named directly: the user chose it
    state, meta = load_full_state(copied)
    assert meta["step"] == 2 and state
    assert snapshot(tmp_path) == before
    (tmp_path / "run" / "ckpt" / "step-00000001").rename(tmp_path / "run" / "step-1")
    with pytest.raises(CheckpointError) as refused:
        engine().load(tmp_path / "run" / "ckpt")  # nothing of this run left: refused, nothing deleted
    one_line(str(refused.value), "no intact checkpoint", "from another run", "back where it came from")


def test_a_resumed_root_without_a_run_id_keeps_the_run_it_resumed(tmp_path):
    """A root whose run-id is gone (or a root assembled by hand) takes the run of the checkpoint resumed from at
    its next save, so an older checkpoint of that run stays a fallback; a malformed run-id is one line."""
    _first, second = _two_steps(tmp_path / "ckpt")
    run = (tmp_path / "ckpt" / "run-id").read_text().strip()
    (tmp_path / "ckpt" / "run-id").unlink()
    resumed = engine()
    assert resumed.load(tmp_path / "ckpt") == 2
    step(resumed)
    resumed.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "run-id").read_text().strip() == run
    assert json.loads((tmp_path / "ckpt" / "step-00000003" / "plait.json").read_text())["run"] == run
    (tmp_path / "ckpt" / "run-id").write_text("not a run id\n")
    with pytest.raises(CheckpointError) as refused:
        engine().load(tmp_path / "ckpt")
    one_line(str(refused.value), "run-id holds 'not a run id'", "32 hex digits")


def _resume_over_copies(out: str, key: str) -> dict[str, object]:
    """Train 6 steps (saving at 2, 4, 6), copy step 2 as step 8 and another run's step 10 in, resume to step 7 (saved
    as the last step): which step it resumed from and the records before and after."""
    from plait.train.config import load_config
    from plait.train.loop import run

    if key:
        os.environ["PLAIT_CHECKPOINT_KEY"] = key
    settings = ["train.global_batch=8", "train.eval_every=0", "train.save_every=2", "train.keep_checkpoints=0"]
    settings += ["model.n_layer=2", "model.n_head=4", "model.d_model=16"]
    other = ["train.steps=10", "train.save_every=10", f"train.out={json.dumps(out + '-other')}"]
    run(load_config(None, [*settings, *other]))
    run(load_config(None, [*settings, "train.steps=6", f"train.out={json.dumps(out)}"]))
    ckpt = Path(out) / "ckpt"
    shutil.copytree(ckpt / "step-00000002", ckpt / "step-00000008")
    shutil.copytree(Path(out + "-other") / "ckpt" / "step-00000010", ckpt / "step-00000010")
    before = (Path(out) / "metrics.jsonl").read_text().splitlines()
    summary = run(load_config(None, [*settings, "train.steps=7", f"train.out={json.dumps(out)}"]))
    after = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return {"steps": summary.steps, "before": before, "after": after}


@pytest.mark.parametrize("key", ["", pytest.param(KEY, marks=pytest.mark.long)], ids=["unsigned", "signed"])
def test_plait_train_resumes_from_its_own_newest_step_and_keeps_the_records(tmp_path, key):
    """N2 as a user met it: `plait train` resumed a step-2 checkpoint copied as step 8 and deleted the metrics
    records of steps 3-6; with another run's checkpoint copied in, it resumed that run."""
    from plait.checkpoint import catalog

    (result,) = run_distributed(_resume_over_copies, 1, str(tmp_path / "run"), key, timeout=180)
    assert result["steps"] == 7
    assert result["after"][: len(result["before"])] == result["before"]  # steps 1-6: kept, not written again
    assert [json.loads(line)["step"] for line in result["after"]] == [1, 2, 3, 4, 5, 6, 6, 7, 7]
    folder, skipped = catalog.choose(tmp_path / "run" / "ckpt")
    assert folder.name == "step-00000007", skipped  # the resumed run's last step, saved (and nothing newer taken)
    assert "step-00000010 is damaged: it is from another run" in skipped[0]
    assert "step-00000008 is damaged: recorded step 2 in folder step-00000008" in skipped[1]


# ----------------------------------------------------------------- N3 + N9: a bad key, at once, in one line
def _bad_key(kind: str, folder: Path) -> dict[str, str]:
    """The environment of an unusable checkpoint key of ``kind`` (files made under ``folder``)."""
    if kind == "short":
        return {"PLAIT_CHECKPOINT_KEY": "too-short"}
    path = folder / f"{kind}.key"
    if kind == "folder":
        path.mkdir()
    elif kind != "deleted":
        path.write_text("a-key-that-is-long-enough-for-plait\n")
        path.chmod(0o644)
    return {"PLAIT_CHECKPOINT_KEY_FILE": str(path)}


BAD_KEYS = {
    "mode-644": r"PLAIT_CHECKPOINT_KEY_FILE: key file .* has mode 644: others may read it.*chmod 600",
    "folder": r"PLAIT_CHECKPOINT_KEY_FILE: key file .* is a folder, not a key file",
    "deleted": r"PLAIT_CHECKPOINT_KEY_FILE: key file .* does not exist",
    "short": r"PLAIT_CHECKPOINT_KEY has 9 characters, fewer than 16",
}


def _train_with_bad_keys(base: str) -> dict[str, tuple[str, str, bool, bool]]:
    """For each bad key: plait train's error (type, message), and whether a step ran or anything was saved."""
    from plait.train.config import load_config
    from plait.train.loop import run

    settings = ["train.steps=2", "train.global_batch=8", "train.eval_every=0", "train.save_every=1"]
    settings += ["model.n_layer=1", "model.n_head=2", "model.d_model=8"]
    found = {}
    for kind in BAD_KEYS:
        out = Path(base) / kind
        out.mkdir(parents=True)
        os.environ.update(_bad_key(kind, Path(base)))
        try:
            run(load_config(None, [*settings, f"train.out={json.dumps(str(out))}"]))
            error = ("none", "trained")
        except PlaitError as failure:
            error = (type(failure).__name__, str(failure))
        finally:
            os.environ.pop("PLAIT_CHECKPOINT_KEY", None)
            os.environ.pop("PLAIT_CHECKPOINT_KEY_FILE", None)
        found[kind] = (*error, (out / "metrics.jsonl").exists(), (out / "ckpt").exists())
    return found


def test_a_bad_checkpoint_key_stops_plait_train_before_its_first_step(tmp_path):
    """N3: a bad key was found at the first save, `save_every` steps of work later, and no checkpoint was written
    (a folder: a traceback). Now every rank reads it first of all: one line naming the variable and the fix."""
    (found,) = run_distributed(_train_with_bad_keys, 1, str(tmp_path), timeout=180)
    for kind, named in BAD_KEYS.items():
        kind_name, message, stepped, saved = found[kind]
        assert kind_name == "ConfigError", (kind, found[kind])
        one_line(message, named)
        assert not stepped and not saved, kind  # refused before the model was built: no record, no ckpt/


@pytest.mark.cli
def test_plait_train_with_a_key_folder_is_one_line_and_exits_before_training(tmp_path):
    env = {**os.environ, **_bad_key("folder", tmp_path), "PYTHONPATH": os.pathsep.join(sys.path)}
    settings = ["train.steps=2", "train.global_batch=8", "train.save_every=1", "model.n_layer=1", "model.d_model=8"]
    sets = [arg for setting in settings for arg in ("--set", setting)]
    result = subprocess.run(
        [sys.executable, "-m", "plait", "train", "--nproc", "1", "--out", str(tmp_path / "run"), *sets],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    one_line(errors[0], "PLAIT_CHECKPOINT_KEY_FILE", "is a folder")
    assert not (tmp_path / "run" / "ckpt").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_key_files_and_keygen_fail_in_one_line(tmp_path, monkeypatch, capsys):
    """N9: a key file that is a folder and `keygen` into a missing folder ended in tracebacks."""
    _engine, folder = trained(tmp_path / "ckpt")
    for kind, named in BAD_KEYS.items():
        for name in ("PLAIT_CHECKPOINT_KEY", "PLAIT_CHECKPOINT_KEY_FILE"):
            monkeypatch.delenv(name, raising=False)
        for name, value in _bad_key(kind, tmp_path).items():
            monkeypatch.setenv(name, value)
        for action in ("verify", "sign"):
            code, _out, err = cli(capsys, "checkpoint", action, str(folder))
            assert code == 2, (kind, action, err)
            one_line(err, named)
    before = snapshot(tmp_path)
    for path, named in [
        (tmp_path / "missing" / "deeper" / "ckpt.key", r"missing/deeper does not exist.*mkdir -p -m 700"),
        (tmp_path / "folder.key" / "inner" / "ckpt.key", "does not exist"),
        (tmp_path / "mode-644.key" / "ckpt.key", "mode-644.key is not a folder"),
        (tmp_path / "folder.key", r"exists \(a folder\); keygen never overwrites"),
    ]:
        code, _out, err = cli(capsys, "checkpoint", "keygen", str(path))
        assert code == 2, (path, err)
        one_line(err, named)
    assert snapshot(tmp_path) == before  # no folder invented, nothing overwritten
