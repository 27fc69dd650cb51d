"""Checkpoints a long job can trust (issue 18): every file's size and SHA-256 in plait.json, checked on load;
a damaged or incomplete newest checkpoint skipped with one warning and training resumed bitwise from the newest
intact one; retention that never removes the only intact checkpoint; asynchronous saves that leave the previous
checkpoint loadable when the process dies mid-write; ``plait checkpoint verify`` / ``list``.

One 2-rank job (dp=2) trains 6 steps, saving at 3 and 6, and then, for each kind of damage done to step 6 in a
copy, loads a fresh engine and trains steps 4..6 again: losses and parameters must equal the uninterrupted run
bitwise (same layout, same arithmetic, random states restored)."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers.gpt import OPTIMIZERS, make_model
from helpers.harness import DistributedTestError, run_distributed

import plait
from plait import Layout
from plait.checkpoint import Checkpointer, CheckpointError, latest
from plait.checkpoint.catalog import INCOMPLETE, INTACT, Entry, choose, prune, status
from plait.cli.main import main
from plait.data import ShardedBatches

STEP3, STEP6 = "step-00000003", "step-00000006"
DAMAGES = ("truncated", "missing file", "flipped byte", "no .metadata", "no plait.json")


def _engine(layout: Layout):
    model, task = make_model()
    engine = plait.parallelize(model, layout, optimizer=OPTIMIZERS["adamw"])
    loader = ShardedBatches(task, 8, engine.mesh.index("dp"), engine.mesh.size("dp"))
    return engine, loader


class _Records(logging.Handler):
    """The plait log records of level WARNING and above, while attached."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> _Records:
        logging.getLogger("plait").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("plait").removeHandler(self)


def damage(folder: Path, kind: str) -> str:
    """Damage the checkpoint in ``folder``; returns what the report must say about it."""
    files = json.loads((folder / "plait.json").read_text())["files"]
    data = sorted((n for n in files if n.endswith(".distcp") and files[n]["bytes"]), key=lambda n: -files[n]["bytes"])
    by_rank1 = next(n for n in data if files[n]["rank"] == 1)
    if kind == "truncated":  # a copy cut short
        path = folder / by_rank1
        path.write_bytes(path.read_bytes()[: files[by_rank1]["bytes"] // 2])
        return f"{by_rank1} (written by rank 1) has {files[by_rank1]['bytes'] // 2} bytes"
    if kind == "missing file":
        (folder / "rng-rank00001.safetensors").unlink()
        return "rng-rank00001.safetensors (written by rank 1) is missing"
    if kind == "flipped byte":  # a failing disk: same size, one bit off
        path = folder / data[0]
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        path.write_bytes(bytes(raw))
        return f"{data[0]} (written by rank {files[data[0]]['rank']}) has the right size but not its recorded sha256"
    if kind == "no .metadata":
        (folder / ".metadata").unlink()
        return ".metadata (written by rank 0) is missing"
    (folder / "plait.json").unlink()
    return "plait.json is missing"


def _damage_and_resume(base: str) -> dict:
    """Train 6 steps saving at 3 and 6; per damage to a copy's step 6: load, train 4..6 again (every rank)."""
    base_path = Path(base)
    engine, loader = _engine(Layout(dp=2))
    losses = []
    for step in range(6):
        losses.append(engine.train_step(loader.batch_at(step)).loss)
        if step + 1 in (3, 6):
            engine.save(base_path / "pristine")
    params = [p.detach().clone() for p in engine.model.parameters()]
    out: dict = {"losses": losses[3:], "cases": {}}
    for kind in DAMAGES:
        root = base_path / kind
        if engine.mesh.rank == 0:
            shutil.copytree(base_path / "pristine", root)
            out["cases"][kind] = {"expected": damage(root / STEP6, kind)}
        engine.comm.barrier()
        fresh, _ = _engine(Layout(dp=2))
        with _Records() as records:
            step = fresh.load(root)
        resumed = [fresh.train_step(loader.batch_at(s)).loss for s in (3, 4, 5)]
        same = all(torch.equal(a, b) for a, b in zip(params, fresh.model.parameters()))
        out["cases"].setdefault(kind, {}).update(step=step, resumed=resumed, same=same, warnings=records.messages)
    return out


@pytest.mark.distributed
def test_damaged_newest_checkpoint_resumes_bitwise_from_the_previous_one(tmp_path, capsys):
    rank0, rank1 = run_distributed(_damage_and_resume, 2, str(tmp_path), timeout=240)
    for kind in DAMAGES:
        case, other = rank0["cases"][kind], rank1["cases"][kind]
        assert case["step"] == other["step"] == 3, kind  # every rank chose step 3
        assert case["resumed"] == other["resumed"] == rank0["losses"], kind  # bitwise (floats compared exactly)
        assert case["same"] and other["same"], kind  # and the parameters after step 6
        assert len(case["warnings"]) == 1 and not other["warnings"], (kind, case["warnings"], other["warnings"])
        assert STEP6 in case["warnings"][0] and case["expected"] in case["warnings"][0], (kind, case)
        assert "resuming from step-00000003" in case["warnings"][0]

    # plait checkpoint verify: each damage found (exit 1, a line naming file and rank), the intact ones pass
    capsys.readouterr()
    for kind in DAMAGES:
        assert main(["checkpoint", "verify", str(tmp_path / kind / STEP6)]) == 1, kind
        out = capsys.readouterr().out
        assert rank0["cases"][kind]["expected"] in out, (kind, out)
        assert main(["checkpoint", "verify", str(tmp_path / kind / STEP3)]) == 0
        assert "intact" in capsys.readouterr().out
    assert main(["checkpoint", "verify", str(tmp_path / "pristine")]) == 0  # a whole root: both intact
    assert capsys.readouterr().out.count(": intact, ") == 2
    assert main(["checkpoint", "verify", str(tmp_path / "truncated")]) == 1  # a root with one damaged
    assert main(["checkpoint", "list", str(tmp_path / "flipped byte")]) == 0
    listing = capsys.readouterr().out
    assert "damaged" in listing and "intact" in listing and "<- latest" in listing and "dp2" in listing, listing

    # none intact: a clear refusal, and nothing is deleted
    root = tmp_path / "none intact"
    shutil.copytree(tmp_path / "truncated", root)
    damage(root / STEP3, "flipped byte")
    engine, _ = _engine(Layout())
    with pytest.raises(
        CheckpointError, match=r"no intact checkpoint.*step-00000006 is damaged.*step-00000003 is damaged"
    ):
        engine.load(root)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "run-id", STEP3, STEP6]
    with pytest.raises(CheckpointError, match=r"is damaged.*\(written by rank 1\).*Fix: "):
        engine.load(root / STEP6)  # one folder named: no fallback, the file, its rank and the fix


# ----------------------------------------------------------------------------------------------- retention
def _saves(root: Path, steps: list[int], keep: int, keep_every: int = 0) -> None:
    engine, _ = _engine(Layout())
    saver = Checkpointer(engine, root, keep=keep, keep_every=keep_every)
    for step in steps:
        engine.step = step
        saver.save()


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))


def test_retention_keeps_the_newest_every_kth_and_never_the_only_intact(tmp_path):
    root = tmp_path / "ckpt"
    _saves(root, [1, 2, 3, 4, 5, 6], keep=2, keep_every=4)
    assert _names(root) == ["step-00000004", "step-00000005", STEP6] and latest(root).name == STEP6
    # the newest two damaged: the intact one behind them stays, whatever keep says
    for name in ("step-00000005", STEP6):
        path = root / name / "rng-rank00000.safetensors"
        path.write_bytes(path.read_bytes()[:10])
    (root / "step-00000007.partial").mkdir()  # a save in flight (or cut short), newer than any intact one: kept
    (root / "step-00000002.partial").mkdir()  # a leftover older than the newest intact one: removed
    # keep=1, but the newest intact one is step 4: it and everything newer stay
    assert prune(root, keep=1) == [root / "step-00000002.partial"]
    assert _names(root) == ["step-00000004", "step-00000005", STEP6, "step-00000007.partial"]
    assert status(Entry(root / "step-00000004", 4)).state == INTACT
    (root / "step-00000004" / "plait.json").unlink()  # now none is intact: nothing may go
    assert prune(root, keep=1) == []
    assert _names(root) == ["step-00000004", "step-00000005", STEP6, "step-00000007.partial"]
    _saves(root, [8], keep=1)  # a new intact one: everything older may go now
    assert _names(root) == ["step-00000008"]


# ----------------------------------------------------------------------------------------------- asynchronous saves
def _async_save_overlaps_training(root: str) -> dict:
    """Save at step 2 asynchronously; rank 0's write waits until step 3 has trained, so the save can only complete
    if training went on while it was in flight. The checkpoint holds step 2's state, not step 3's."""
    import threading

    from plait.checkpoint import integrity

    engine, loader = _engine(Layout(dp=2, zero=1))  # ZeRO-1: flat master and optimizer shards are staged too
    saver = Checkpointer(engine, root, async_save=True)
    for step in range(2):
        engine.train_step(loader.batch_at(step))
    at_save = [p.detach().clone() for p in engine.model.parameters()]
    trained_meanwhile = threading.Event()
    real_write = integrity.ChecksumWriter.write_data

    def gated(self, plan, planner):  # noqa: ANN001, ANN202
        if not trained_meanwhile.wait(60):
            raise RuntimeError("the training loop did not go on while the save was in flight")
        return real_write(self, plan, planner)

    integrity.ChecksumWriter.write_data = gated
    saver.save()
    assert saver.in_flight and not (Path(root) / "step-00000002").exists()
    loss3 = engine.train_step(loader.batch_at(2)).loss  # changes every live tensor the save is writing
    trained_meanwhile.set()
    final = saver.wait()
    integrity.ChecksumWriter.write_data = real_write
    fresh, _ = _engine(Layout(dp=2, zero=1))
    step = fresh.load(root)
    same = all(torch.equal(a, b) for a, b in zip(at_save, fresh.model.parameters()))
    return {
        "final": str(final),
        "step": step,
        "same": same,
        "loss3": [loss3, fresh.train_step(loader.batch_at(2)).loss],
    }


@pytest.mark.distributed
def test_asynchronous_save_runs_while_training_and_holds_the_state_at_its_step(tmp_path):
    for result in run_distributed(_async_save_overlaps_training, 2, str(tmp_path / "ckpt"), timeout=180):
        assert result["final"].endswith("step-00000002") and result["step"] == 2 and result["same"], result
        assert result["loss3"][0] == result["loss3"][1], result  # resumed step 3 is the uninterrupted step 3
    assert main(["checkpoint", "verify", str(tmp_path / "ckpt")]) == 0


def _killed_during_async_save(root: str) -> None:
    from plait.checkpoint import integrity

    engine, loader = _engine(Layout(dp=2))
    saver = Checkpointer(engine, root, async_save=True)
    engine.train_step(loader.batch_at(0))
    saver.save()
    saver.wait()  # step 1: published
    engine.train_step(loader.batch_at(1))
    real_write = integrity.ChecksumWriter.write_data

    def write_then_die(self, plan, planner):  # noqa: ANN001, ANN202
        real_write(self, plan, planner)  # this rank's data files are written (and digested) ...
        os._exit(9)  # ... and the process dies before .metadata, plait.json and the rename

    integrity.ChecksumWriter.write_data = write_then_die
    saver.save()  # step 2, in the background
    for step in range(2, 200):  # training goes on until the background write kills the process
        engine.train_step(loader.batch_at(step))


@pytest.mark.distributed
def test_process_killed_during_asynchronous_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    root = tmp_path / "ckpt"
    with pytest.raises(DistributedTestError, match="exit code 9"):
        run_distributed(_killed_during_async_save, 2, str(root), timeout=180)
    assert any((root / "step-00000002.partial").glob("*.distcp")) and latest(root).name == "step-00000001"
    folder, skipped = choose(root)
    assert folder.name == "step-00000001" and skipped == [
        "step-00000002.partial is incomplete (a save that never completed)"
    ]
    assert status(Entry(root / "step-00000002.partial", 2, ".partial")).state == INCOMPLETE
    assert main(["checkpoint", "verify", str(root / "step-00000002.partial")]) == 1
    assert main(["checkpoint", "verify", str(root)]) == 0  # the root's one complete checkpoint is intact
    engine, _ = _engine(Layout())
    with _Records() as records:
        assert engine.load(root) == 1
    assert len(records.messages) == 1 and "step-00000002.partial is incomplete" in records.messages[0]


# ----------------------------------------------------------------------------------------------- plait train
def _train(out: str, steps: int, *extra: str) -> list[str]:
    from plait.train.config import load_config
    from plait.train.loop import run

    settings = [f"train.steps={steps}", "train.global_batch=8", "train.eval_every=0", "train.eval_batches=1"]
    settings += ["train.save_every=2", "model.n_layer=1", "model.d_model=16", "model.dropout=0.1", *extra]
    with _Records() as records:
        run(load_config(None, [*settings, f"train.out={json.dumps(out)}"]))
    return records.messages


def _train_jobs(base: str) -> list[str]:
    """Synchronous run; asynchronous run with retention; its newest checkpoint damaged; the same job again."""
    _train(f"{base}/sync", 8, "train.keep_checkpoints=0")
    _train(f"{base}/async", 8, "train.async_save=true", "train.keep_checkpoints=2")
    if torch.distributed.get_rank() == 0:
        damage(Path(base) / "async" / "ckpt" / "step-00000008", "truncated")
    torch.distributed.barrier()
    return _train(f"{base}/async", 8, "train.async_save=true", "train.keep_checkpoints=2")


@pytest.mark.distributed
def test_plait_train_async_save_retention_and_resume_from_the_newest_intact(tmp_path):
    warnings = run_distributed(_train_jobs, 2, str(tmp_path), timeout=240)
    assert len(warnings[0]) == 1 and "resuming from step-00000006" in warnings[0][0] and not warnings[1], warnings

    def records(run: str) -> list[tuple]:
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in map(json.loads, lines) if r["kind"] == "train"]

    # asynchronous saves, retention and a resume past a damaged checkpoint change nothing: the same run, bitwise
    assert records("async") == records("sync") and [r[0] for r in records("async")] == list(range(1, 9))
    assert _names(tmp_path / "sync" / "ckpt") == ["step-00000002", "step-00000004", STEP6, "step-00000008"]
    assert _names(tmp_path / "async" / "ckpt") == [STEP6, "step-00000008"]  # keep 2; step 8 saved again, intact
    assert main(["checkpoint", "verify", str(tmp_path / "async")]) == 0


def test_checkpoint_settings_are_validated():
    from plait.errors import ConfigError
    from plait.train.config import load_config

    config = load_config(None, ["train.keep_checkpoints=5", "train.keep_every=100", "train.async_save=true"])
    assert (config.train.keep_checkpoints, config.train.keep_every, config.train.async_save) == (5, 100, True)
    assert load_config().train.keep_checkpoints == 3 and not load_config().train.async_save  # the defaults
    with pytest.raises(ConfigError, match="keep_checkpoints=-1 must be an integer >= 0"):
        load_config(None, ["train.keep_checkpoints=-1"])
    with pytest.raises(ConfigError, match="async_save='yes' must be true or false"):
        load_config(None, ["train.async_save=yes"])
