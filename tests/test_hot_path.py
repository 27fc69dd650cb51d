"""The training step's hot path (issue 14): no host sync per micro-batch or per gradient, gradient maths on the
gradients' own device, ZeRO on one rank without a second fp32 copy.

- A host sync is plait code reading a tensor's value on the host (``.item()``, ``float()``, ``bool()``,
  ``int()``, ``.tolist()``): on a GPU each waits for every queued kernel and stops the host from queueing the next
  step. Counted here by wrapping those Tensor methods and keeping the calls made from plait's own files: none
  in an fp32/bf16 step (clipping included), exactly one in an fp16 step (the loss scaler's inf flag), at any
  number of micro-batches; ``StepStats.loss`` reads the loss only when asked.
- With ZeRO-Offload the gradients live in host memory while the compute device (the norm's all-reduce) is the
  accelerator: clipping scaled host gradients by a device scalar and crashed on CUDA ("scalar tensor is expected
  to be on cpu but is on cuda:0"). Reproduced device-agnostically: the strategy's compute device is ``meta`` while
  its offloaded gradients are on the CPU, and every foreach call checks that its scalar tensor is on its list's
  device.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import pytest
import torch
from helpers.gpt import GLOBAL_BATCH, OPTIMIZERS, make_model, reference
from helpers.reference import Trajectory, assert_trajectories_match

import plait
from plait import Layout
from plait.comm import Comm, CommStats
from plait.data import ShardedBatches
from plait.mesh import Mesh
from plait.observe.memory import measure_held
from plait.parallel.kernels import fast_optimizer_kwargs, supports_fused
from plait.parallel.precision import MixedPrecision
from plait.parallel.zero.fsdp import FullyShardedStrategy
from plait.parallel.zero.sharded import ShardedOptimizerStrategy

PLAIT_DIR = os.path.dirname(plait.__file__)
SYNCING = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")
"""Tensor methods that read a value on the host (a device sync on a GPU)."""


@contextlib.contextmanager
def host_syncs() -> Iterator[list[str]]:
    """Record ``file:line method`` for every SYNCING call made from plait's own code while active."""
    calls: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in SYNCING}

    def wrap(name: str):
        original = originals[name]

        def counted(self, *args, **kwargs):
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(PLAIT_DIR):
                calls.append(f"{os.path.relpath(caller.f_code.co_filename, PLAIT_DIR)}:{caller.f_lineno} {name}")
            return original(self, *args, **kwargs)

        return counted

    for name in SYNCING:
        setattr(torch.Tensor, name, wrap(name))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _steps(layout: Layout, steps: int = 3, clip: float | None = 0.05) -> tuple[list[list[str]], list]:
    model, task = make_model()
    engine = plait.parallelize(model, layout, optimizer=OPTIMIZERS["adamw"], max_grad_norm=clip)
    loader = ShardedBatches(task, GLOBAL_BATCH)
    engine.train_step(loader.batch_at(0))  # optimizer state and lazy set-up exist from here on
    syncs, stats = [], []
    for step in range(1, steps + 1):
        with host_syncs() as calls:
            stats.append(engine.train_step(loader.batch_at(step)))
        syncs.append(calls)
    return syncs, stats


@pytest.mark.parametrize(
    "layout",
    [
        Layout(microbatches=4),
        Layout(microbatches=2, precision="bf16"),
        Layout(zero=1, microbatches=2),
        Layout(zero=2, precision="bf16"),
        Layout(zero=3, microbatches=2, recompute="full"),
    ],
    ids=["ddp-mb4", "ddp-bf16", "zero1", "zero2-bf16", "zero3-recompute"],
)
def test_a_step_never_reads_a_tensor_on_the_host(layout):
    syncs, stats = _steps(layout)
    assert syncs == [[], [], []], f"host syncs in the step: {syncs}"
    assert not stats[0].materialized, "the loss and the norm stay tensors until read"
    with host_syncs() as calls:
        loss, norm = stats[0].loss, stats[0].grad_norm
    assert len(calls) == 2 and stats[0].materialized, calls  # read once each, then cached
    assert isinstance(loss, float) and isinstance(norm, float) and norm > 0
    with host_syncs() as calls:
        assert (stats[0].loss, stats[0].grad_norm) == (loss, norm)
    assert calls == []


@pytest.mark.parametrize("layout", [Layout(microbatches=4, precision="fp16"), Layout(zero=1, precision="fp16")])
def test_an_fp16_step_reads_one_flag_whatever_the_gradients_and_micro_batches(layout):
    """Before: one ``isfinite(grad).all()`` read per gradient (per parameter under DDP), a float of the norm and
    one of the loss."""
    syncs, stats = _steps(layout)
    for calls in syncs:
        assert len(calls) == 1 and "parallel/precision.py" in calls[0], calls
    assert not any(s.skipped for s in stats)


def test_unscale_and_find_inf_flags_one_bad_element_and_unscales_the_rest():
    model, _task = make_model()
    engine = plait.parallelize(model, Layout(), optimizer=OPTIMIZERS["sgd"])
    params = [p for p in model.parameters()]
    for p in params:
        p.grad = torch.full_like(p, 8.0)
    flag = engine.strategy.unscale_and_find_inf(0.25)
    assert float(flag) == 0 and all(torch.equal(p.grad, torch.full_like(p, 2.0)) for p in params)
    params[-1].grad.view(-1)[3] = float("nan")
    assert float(engine.strategy.unscale_and_find_inf(1.0)) > 0


# ------------------------------------------------------------------------------------------ gradients' device
@contextlib.contextmanager
def foreach_device_check() -> Iterator[None]:
    """Make ``torch._foreach_mul_`` refuse a scalar tensor on another device than its list (CUDA's rule; the
    CPU kernel would accept a meta scalar silently)."""
    original = torch._foreach_mul_

    def checked(tensors, scalar):
        if isinstance(scalar, torch.Tensor):
            devices = {t.device for t in tensors}
            assert devices == {scalar.device}, f"foreach over {devices} scaled by a scalar on {scalar.device}"
        return original(tensors, scalar)

    torch._foreach_mul_ = checked
    try:
        yield
    finally:
        torch._foreach_mul_ = original


def _offloaded_strategy(stage: int, offload: str, tmp_path):
    """A ZeRO strategy whose compute device is ``meta`` while its offloaded masters (and their gradients) live on
    the CPU: the shape of a CUDA run with offload, without a GPU."""
    model, _task = make_model()
    layout = Layout(zero=stage, offload=offload).resolve(1)
    comm = Comm(Mesh.build(layout), CommStats(), device="meta")
    kind = FullyShardedStrategy if stage == 3 else ShardedOptimizerStrategy
    strategy = kind(model, comm, OPTIMIZERS["adamw"], layout, offload_dir=str(tmp_path))
    masters = strategy.optimizer.param_groups[0]["params"]
    generator = torch.Generator().manual_seed(stage)
    for master in masters:
        assert master.device.type == "cpu"
        master.grad = torch.randn(master.shape, generator=generator)
    return strategy, masters


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offloaded_clipping_and_loss_scaling_stay_on_the_gradients_device(stage, offload, tmp_path):
    strategy, masters = _offloaded_strategy(stage, offload, tmp_path)
    grads = [m.grad.clone() for m in masters]
    expected_norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads]))
    with foreach_device_check():
        norm = strategy.clip_grad_norm(0.5)
        assert norm.device.type == "cpu" and float(norm) == pytest.approx(float(expected_norm), rel=1e-6)
        factor = 0.5 / (float(expected_norm) + 1e-6)
        for master, grad in zip(masters, grads):
            torch.testing.assert_close(master.grad, grad * factor, rtol=1e-6, atol=0)  # fp32: a few ulps
        fp16 = MixedPrecision("fp16", torch.device("meta"))
        assert fp16.unscale_and_check(strategy) is True  # divides by 2^16 on the CPU, no inf
        for master, grad in zip(masters, grads):
            torch.testing.assert_close(master.grad, grad * factor / 2.0**16, rtol=1e-6, atol=0)
    strategy.close()


def _train(layout: Layout, clip: float | None) -> Trajectory:
    model, task = make_model()
    engine = plait.parallelize(model, layout, optimizer=OPTIMIZERS["adamw"], max_grad_norm=clip)
    out = Trajectory()
    loader = ShardedBatches(task, GLOBAL_BATCH)
    for _step, batch in zip(range(3), loader):
        out.losses.append(engine.train_step(batch).loss)
        out.params.append(engine.strategy.full_parameters())
    engine.strategy.close()
    return out


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_with_clipping_matches_single_device(stage, offload, monkeypatch, tmp_path):
    monkeypatch.setenv("PLAIT_OFFLOAD_DIR", str(tmp_path))
    expected = reference("adamw", 0.05)
    expected.losses, expected.params, expected.grads = expected.losses[:3], expected.params[:3], []
    assert_trajectories_match(_train(Layout(zero=stage, offload=offload), 0.05), expected)


# ------------------------------------------------------------------------------------------ ZeRO on one rank
def _held(layout: Layout) -> dict[str, int]:
    model, task = make_model()
    engine = plait.parallelize(model, layout, optimizer=OPTIMIZERS["adamw"])
    held: dict[str, int] = {}
    engine.before_optimizer_step.append(lambda e: held.update(measure_held(e)))
    loader = ShardedBatches(task, GLOBAL_BATCH)
    for step in range(2):
        engine.train_step(loader.batch_at(step))
    return held


def test_zero12_on_one_rank_hold_no_second_fp32_copy():
    """One rank owns every shard: the parameters are views of the master, so ZeRO-1/2 hold what DDP holds
    (before: a master of 4 bytes per parameter on top)."""
    ddp = _held(Layout())
    for stage in (1, 2):
        assert _held(Layout(zero=stage)) == ddp, f"zero={stage}"
    assert ddp["master_weights"] == 0 and ddp["parameters"] == 4 * sum(p.numel() for p in make_model()[0].parameters())
    assert _held(Layout(zero=1, offload="cpu"))["master_weights"] == ddp["parameters"], "offloaded: a host master"


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_on_one_rank_resume_from_a_checkpoint_with_the_parameters_still_views_of_the_master(stage, tmp_path):
    def build() -> plait.Engine:
        return plait.parallelize(make_model()[0], Layout(zero=stage), optimizer=OPTIMIZERS["adamw"])

    engine, loader = build(), ShardedBatches(make_model()[1], GLOBAL_BATCH)
    for step in range(2):
        engine.train_step(loader.batch_at(step))
    engine.save(tmp_path)
    continued = [engine.train_step(loader.batch_at(step)).loss for step in (2, 3)]
    resumed = build()
    resumed.load(tmp_path)
    bucket = resumed.strategy.buckets[0]
    master = bucket.master.untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == master for p in bucket.params), "loading keeps the aliasing"
    assert [resumed.train_step(loader.batch_at(step)).loss for step in (2, 3)] == continued


def test_parameter_count_is_the_whole_model_under_zero3():
    model, _task = make_model()
    whole = sum(p.numel() for p in model.parameters())
    engine = plait.parallelize(model, Layout(zero=3), optimizer=OPTIMIZERS["sgd"])
    assert sum(p.numel() for p in engine.model.parameters()) == 0, "ZeRO-3 empties the model's own tensors"
    assert engine.strategy.parameter_count() == whole
    assert plait.parallelize(make_model()[0], Layout(), optimizer=OPTIMIZERS["sgd"]).strategy.parameter_count() == whole


# ------------------------------------------------------------------------------------------ plait train and kernels
def _train_and_watch_reads(monkeypatch, tmp_path, accelerator: bool, fail_at: int | None = None) -> list:
    """Run ``plait train`` in this process (7 steps, log_every 3) and return (record step, steps trained) for
    every read of a step's loss; ``accelerator``: the loop treats the device as one the host runs ahead of."""
    import plait.train.loop as loop
    from plait.engine import Engine, StepStats
    from plait.train.config import load_config

    trained, reads = [0], []
    train_step, loss = Engine.train_step, StepStats.loss

    def counted_step(self, batch):
        if trained[0] + 1 == fail_at:
            raise RuntimeError("injected failure")
        stats = train_step(self, batch)
        trained[0] = stats.step
        return stats

    def counted_loss(stats):
        reads.append((stats.step, trained[0]))
        return loss.fget(stats)

    monkeypatch.setattr(Engine, "train_step", counted_step)
    monkeypatch.setattr(StepStats, "loss", property(counted_loss))
    monkeypatch.setattr(loop, "runs_ahead", lambda device: accelerator)
    overrides = ["train.steps=7", "train.log_every=3", "train.eval_every=0", "train.global_batch=8"]
    loop.run(load_config(None, [*overrides, f'train.out="{tmp_path}"']))
    return reads


def test_plait_train_reads_the_losses_once_per_log_interval_on_an_accelerator(monkeypatch, tmp_path):
    """The loop keeps each step's StepStats and writes their records (reading their losses) every log_every steps
    and at the end: between those points the host never waits for the device."""
    first_read: dict[int, int] = {}  # record's step -> steps trained when its loss was first read
    for step, at in _train_and_watch_reads(monkeypatch, tmp_path, accelerator=True):
        first_read.setdefault(step, at)
    assert first_read == {1: 3, 2: 3, 3: 3, 4: 6, 5: 6, 6: 6, 7: 7}, "read only at the flushes"
    first_read = {}
    for step, at in _train_and_watch_reads(monkeypatch, tmp_path / "cpu", accelerator=False):
        first_read.setdefault(step, at)
    assert first_read == {step: step for step in range(1, 8)}, "on the CPU each record is written at once"


def test_a_failing_run_still_writes_the_records_of_its_finished_steps(monkeypatch, tmp_path):
    from plait.train.metrics import read_metrics

    with pytest.raises(RuntimeError, match="injected failure"):
        _train_and_watch_reads(monkeypatch, tmp_path, accelerator=True, fail_at=5)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4]


def test_fused_kernels_are_chosen_on_cuda_only_and_step_host_masters():
    assert fast_optimizer_kwargs(torch.optim.AdamW, "cpu") == {}
    assert fast_optimizer_kwargs(torch.optim.AdamW, "cuda") == {"fused": True}
    assert fast_optimizer_kwargs(torch.optim.Adadelta, "cuda") == (
        {"fused": True} if supports_fused(torch.optim.Adadelta) else {}
    )
    master = torch.nn.Parameter(torch.ones(8))  # an offloaded master lives on the host
    optimizer = torch.optim.AdamW([master], lr=0.1, **fast_optimizer_kwargs(torch.optim.AdamW, "cuda"))
    master.grad = torch.ones(8)
    optimizer.step()
    assert optimizer.defaults["fused"] and torch.all(master < 1)
