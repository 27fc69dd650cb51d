"""Checkpoints: save/load continues training exactly (single process and dp=2), a crash during save leaves
the previous checkpoint whole and loadable, and a missing checkpoint is a clear error."""

import os

import pytest
import torch

import plait
from harness import DistributedTestError, run_distributed
from plait import Layout
from plait.checkpoint import CheckpointError, latest
from plait.data import ShardedBatches
from test_engine import OPTIMIZERS, make_model


def _engine(layout: Layout):
    model, task = make_model()
    engine = plait.parallelize(model, layout, optimizer=OPTIMIZERS["adamw"])
    loader = ShardedBatches(task, 8, engine.mesh.index("dp"), engine.mesh.size("dp"))
    return engine, loader


def _save_train_reload(root: str, world: int, layout: Layout | None = None):
    """Train 3 steps, save, train 2 more (losses A); a fresh engine loads and trains the same 2 (losses B)."""
    layout = layout or Layout(dp=world)
    engine, loader = _engine(layout)
    for step in range(3):
        engine.train_step(loader.batch_at(step))
    engine.save(root)
    continued = [engine.train_step(loader.batch_at(step)).loss for step in (3, 4)]
    fresh, _ = _engine(layout)
    assert fresh.load(root) == 3
    resumed = [fresh.train_step(loader.batch_at(step)).loss for step in (3, 4)]
    same = all(torch.equal(a, b) for a, b in zip(engine.model.parameters(), fresh.model.parameters()))
    return continued, resumed, same


def test_resume_is_exact_single_process(tmp_path):
    continued, resumed, same = _save_train_reload(str(tmp_path / "ckpt"), 1)
    assert continued == resumed and same
    assert latest(tmp_path / "ckpt").name == "step-00000003"


@pytest.mark.distributed
def test_resume_is_exact_data_parallel(tmp_path):
    for continued, resumed, same in run_distributed(_save_train_reload, 2, str(tmp_path / "ckpt"), 2):
        assert continued == resumed and same


@pytest.mark.distributed
def test_resume_is_exact_pipeline_parallel(tmp_path):
    """Each stage saves only its own parameters and their optimizer state (flattened per parameter name)."""
    layout = Layout(pp=2, microbatches=2)
    for continued, resumed, same in run_distributed(_save_train_reload, 2, str(tmp_path / "ckpt"), 2, layout):
        assert continued == resumed and same


def _crash_during_second_save(root: str):
    engine, loader = _engine(Layout(dp=2))
    engine.train_step(loader.batch_at(0))
    engine.save(root)  # step 1: complete
    engine.train_step(loader.batch_at(1))
    import plait.checkpoint as checkpoint

    real_save = checkpoint.dcp.save

    def save_then_die(*args, **kwargs):
        real_save(*args, **kwargs)  # the partial folder is written ...
        os._exit(9)  # ... and the process dies before the rename

    checkpoint.dcp.save = save_then_die
    engine.save(root)


@pytest.mark.distributed
def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    with pytest.raises(DistributedTestError, match="exit code 9"):
        run_distributed(_crash_during_second_save, 2, str(root))
    assert (root / "step-00000002.partial").is_dir() and not (root / "step-00000002").exists()
    assert latest(root).name == "step-00000001"
    engine, _ = _engine(Layout())
    assert engine.load(root) == 1


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    engine, _ = _engine(Layout())
    with pytest.raises(CheckpointError, match="save one first"):
        engine.load(tmp_path / "nothing")


def _save_zero(root: str, zero: int):
    engine, loader = _engine(Layout(dp=2, zero=zero))
    engine.train_step(loader.batch_at(0))
    engine.save(root)


@pytest.mark.distributed
def test_sharded_checkpoint_under_another_sharding_is_refused_clearly(tmp_path):
    from plait import LayoutError

    run_distributed(_save_zero, 2, str(tmp_path / "ckpt"), 1)
    engine, _ = _engine(Layout())
    with pytest.raises(LayoutError, match=r"zero=1 over 2 .* zero=0 over 1"):
        engine.load(tmp_path / "ckpt")
