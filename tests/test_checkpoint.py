"""Checkpoints: save/load continues training exactly (single process, dp=2, pp=2, ZeRO-3), a crash while writing
leaves the previous checkpoint whole and loadable, a missing or old-format checkpoint is a clear error, and
loading never runs pickled code. Resharding to other layouts: tests/test_checkpoint_reshard.py."""

import json
import os
import pickle
import warnings

import pytest
import torch
from helpers.gpt import OPTIMIZERS, make_model
from helpers.harness import DistributedTestError, run_distributed

import plait
from plait import Layout
from plait.checkpoint import CheckpointError, latest, load_full_state
from plait.checkpoint.integrity import digest_file, seal
from plait.data import ShardedBatches


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
def test_resume_is_exact_zero3(tmp_path):
    """ZeRO-3 writes parameters and optimizer states from its flat shards, each rank only its own range."""
    layout = Layout(dp=2, zero=3)
    for continued, resumed, same in run_distributed(_save_train_reload, 2, str(tmp_path / "ckpt"), 2, layout):
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
    from torch.distributed.checkpoint import FileSystemWriter

    real_write = FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        real_write(self, plan, planner).wait()  # this rank's data files are written ...
        os._exit(9)  # ... and the process dies before DCP's .metadata, plait.json and the rename

    FileSystemWriter.write_data = write_then_die
    engine.save(root)


@pytest.mark.distributed
def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    with pytest.raises(DistributedTestError, match="exit code 9"):
        run_distributed(_crash_during_second_save, 2, str(root))
    partial = root / "step-00000002.partial"
    assert any(partial.glob("*.distcp")) and not (root / "step-00000002").exists()
    assert latest(root).name == "step-00000001"
    engine, _ = _engine(Layout())
    assert engine.load(root) == 1


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    engine, _ = _engine(Layout())
    with pytest.raises(CheckpointError, match="save one first"):
        engine.load(tmp_path / "nothing")


def test_checkpoint_of_the_old_format_is_a_clear_error(tmp_path):
    engine, loader = _engine(Layout())
    folder = engine.save(tmp_path / "ckpt")
    meta = json.loads((folder / "plait.json").read_text())
    del meta["format"]  # what plait wrote before layout-free checkpoints
    (folder / "plait.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="format 1.*Fix"):
        engine.load(tmp_path / "ckpt")


def rerecord(folder) -> None:
    """Record the files' current sizes and digests in plait.json, as someone rewriting a checkpoint would."""
    meta = json.loads((folder / "plait.json").read_text())
    for name, record in meta["files"].items():
        record["bytes"], record["sha256"] = digest_file(folder / name)
    (folder / "plait.json").write_text(json.dumps(seal(meta)))


class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_malicious_metadata_is_refused_without_running_it(tmp_path):
    """DCP's .metadata is a pickle: plait's unpickler names only DCP's metadata classes, so a file naming
    os.system (or anything else) is refused before any of it runs."""
    engine, _ = _engine(Layout())
    folder = engine.save(tmp_path / "ckpt")
    marker = tmp_path / "ran"
    (folder / ".metadata").write_bytes(pickle.dumps(_RunsCode(str(marker))))
    with pytest.raises(CheckpointError, match=r"\.metadata \(written by rank 0\) has \d+ bytes"):
        engine.load(tmp_path / "ckpt")  # first line of defence: the file is not the one plait.json records
    rerecord(folder)  # an attacker who also rewrites plait.json: the unpickler still refuses it
    with pytest.raises(CheckpointError, match=r"names (posix|os|nt)\.system.*refusing"):
        engine.load(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="refusing"):
        load_full_state(tmp_path / "ckpt")
    assert not marker.exists()


def test_pickled_entries_are_never_loaded(tmp_path):
    """A checkpoint entry stored as a pickled object (DCP's bytes entries) is refused, not torch.load()ed."""
    import torch.distributed.checkpoint as dcp

    engine, _ = _engine(Layout())
    folder = engine.save(tmp_path / "ckpt")
    state, _meta = load_full_state(tmp_path / "ckpt")
    entries = {f"model/{name}": tensor for name, tensor in state.items()}
    entries["model/lm_head.weight"] = _RunsCode(str(tmp_path / "ran"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(entries, checkpoint_id=str(folder), no_dist=True)
    rerecord(folder)  # past the checksums (plait.json rewritten to match): the entry itself is refused
    with pytest.raises(CheckpointError, match="lm_head.weight.*pickled"):
        engine.load(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="lm_head.weight.*not a tensor"):
        load_full_state(tmp_path / "ckpt")
    assert not (tmp_path / "ran").exists()


def test_tensor_parallel_non_elementwise_state_is_refused_clearly():
    """A state shaped unlike its parameter has no whole-tensor form when the parameter is a tp slice."""
    from types import SimpleNamespace

    from plait import LayoutError
    from plait.checkpoint.canonical import EngineState

    param = torch.nn.Parameter(torch.zeros(4, 3))
    param.tp_sharded, param.tp_shard_dim = True, 0
    model = torch.nn.Module()
    model.weight = param
    opt = torch.optim.SGD([param], lr=0.1)
    opt.state[param]["row_norms"] = torch.zeros(4)
    mesh = SimpleNamespace(index=lambda axis: 0, size=lambda axis: 2)
    state = EngineState(SimpleNamespace(strategy=SimpleNamespace(model=model, optimizer=opt, sharded=False), mesh=mesh))
    with pytest.raises(LayoutError, match="row_norms.*weight.*tp=1"):
        state.add_optimizer()


def test_fp32_masters_of_16_bit_parameters_are_kept(tmp_path):
    """ZeRO over bf16 parameters keeps fp32 masters: saved as ``master/<name>`` and loaded back bitwise (not
    re-derived from the rounded bf16 values); a zero=0 engine loads the bf16 parameters and ignores them."""

    def bf16_engine(zero: int):
        model, task = make_model()
        engine = plait.parallelize(model.to(torch.bfloat16), Layout(zero=zero), optimizer=OPTIMIZERS["adamw"])
        return engine, ShardedBatches(task, 8, 0, 1)

    engine, loader = bf16_engine(1)
    for step in range(2):
        engine.train_step(loader.batch_at(step))
    engine.save(tmp_path / "ckpt")
    at_save = {name: param.detach().clone() for name, param in engine.model.named_parameters()}
    masters = [b.master.detach().clone() for b in engine.strategy.buckets]
    assert any(not torch.equal(m, m.bfloat16().float()) for m in masters)  # the masters hold more than bf16
    fresh, _ = bf16_engine(1)
    fresh.load(tmp_path / "ckpt")
    assert all(torch.equal(b.master, m) for b, m in zip(fresh.strategy.buckets, masters))
    following = engine.train_step(loader.batch_at(2)).loss
    assert fresh.train_step(loader.batch_at(2)).loss == following
    replicated, _ = bf16_engine(0)
    replicated.load(tmp_path / "ckpt")
    for name, param in replicated.model.named_parameters():
        assert param.dtype == torch.bfloat16 and torch.equal(param.detach(), at_save[name]), name
