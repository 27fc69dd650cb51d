"""Bucketed DDP (plait.parallel.ddp.DistributedDataParallel): parity with single-device training over several
small buckets, all-reduces issued during backward, one call per bucket per step (no_sync included), ring
bytes, unused parameters (clear error / find_unused_parameters), and bad input."""

import os

import pytest
import torch
from helpers.gpt import GLOBAL_BATCH, OPTIMIZERS, STEPS, make_model, reference, train_plait
from helpers.harness import run_distributed
from helpers.reference import Trajectory, assert_trajectories_match, snapshot_grads, snapshot_params, train_reference
from torch import nn

import plait
from plait import Layout
from plait.comm import Comm
from plait.data import ShardedBatches
from plait.distributed import FIND_UNUSED_ENV
from plait.mesh import Mesh
from plait.parallel.buckets import assign_buckets
from plait.parallel.ddp import DistributedDataParallel

TINY_MB = 0.001
"""1048 bytes: about one weight matrix of the test GPT per bucket (~15 buckets)."""


def test_bucket_assignment_is_reverse_order_capped_and_one_dtype_each():
    sizes = [100, 100, 300, 50, 50, 40]
    keys = ["f32", "f32", "f32", "f16", "f32", "f16"]
    buckets = assign_buckets(sizes, keys, cap_bytes=200)
    assert buckets == [[5, 3], [4], [2], [1, 0]]  # 300 > cap: a bucket of its own (closing [4])
    for bucket in buckets:
        assert len({keys[i] for i in bucket}) == 1
        assert len(bucket) == 1 or sum(sizes[i] for i in bucket) <= 200
    assert sorted(i for b in buckets for i in b) == list(range(len(sizes)))


# ----------------------------------------------------------------- parity
CONFIGS = [(1, "adamw", None), (2, "sgd", 0.05), (2, "adamw", 0.05), (1, "sgd", None)]
"""(microbatches, optimizer, clip): with and without accumulation and clipping, for each optimizer."""


def _train_configs(world: int) -> list[Trajectory]:
    return [train_plait(Layout(dp=world, microbatches=m, bucket_mb=TINY_MB), opt, clip) for m, opt, clip in CONFIGS]


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_ddp_matches_single_device(world):
    per_rank = run_distributed(_train_configs, world, world)
    for (microbatches, optimizer, clip), *results in zip(CONFIGS, *per_rank):
        expected = reference(optimizer, clip)
        for rank, actual in enumerate(results):
            try:
                assert_trajectories_match(actual, expected)
            except AssertionError as error:
                raise AssertionError(
                    f"dp={world} mb={microbatches} {optimizer} clip={clip} rank {rank}: {error}"
                ) from error
            assert actual.losses == results[0].losses, f"rank {rank} reports a different loss"


# ----------------------------------------------------------------- overlap, calls, bytes
def _traffic(world: int) -> dict:
    """One step with mb=1 (recording the order of gradient hooks and all-reduce issues) and one with mb=4."""
    model, task = make_model()
    engine = plait.parallelize(model, Layout(dp=world, bucket_mb=TINY_MB), optimizer=OPTIMIZERS["sgd"])
    assert isinstance(engine.strategy, DistributedDataParallel)
    events: list[str] = []
    real_all_reduce = engine.comm.all_reduce

    def recording_all_reduce(tensor, axis, *args, **kwargs):
        events.append(f"all_reduce {tensor.numel()}")
        return real_all_reduce(tensor, axis, *args, **kwargs)

    engine.comm.all_reduce = recording_all_reduce
    for name, param in model.named_parameters():  # registered after the strategy's hooks, so run after them
        param.register_post_accumulate_grad_hook(lambda p, name=name: events.append(f"grad {name}"))
    loader = ShardedBatches(task, 16, engine.mesh.index("dp"), world)
    one = engine.train_step(loader.batch_at(0))
    buckets = len(engine.strategy.buckets)

    model4, _ = make_model()
    engine4 = plait.parallelize(
        model4, Layout(dp=world, microbatches=4, bucket_mb=TINY_MB), optimizer=OPTIMIZERS["sgd"]
    )
    four = engine4.train_step(loader.batch_at(0))
    return {
        "events": events,
        "buckets": buckets,
        "buckets4": len(engine4.strategy.buckets),
        "n_params": sum(p.numel() for p in model.parameters()),
        "stats": one.comm.to_dict(),
        "wire": one.comm.wire("dp_cp", "all_reduce"),
        "stats4": four.comm.to_dict(),
        "wire4": four.comm.wire("dp_cp", "all_reduce"),
    }


TRAFFIC_WORLD = 4


@pytest.fixture(scope="module")
def traffic() -> dict:
    return run_distributed(_traffic, TRAFFIC_WORLD, TRAFFIC_WORLD)[0]


@pytest.mark.distributed
def test_all_reduces_are_issued_during_backward(traffic):
    events, buckets = traffic["events"], traffic["buckets"]
    assert buckets >= 8, f"bucket_mb={TINY_MB} should give many buckets, got {buckets}"
    last_grad = max(i for i, e in enumerate(events) if e.startswith("grad "))
    issued_during = sum(e.startswith("all_reduce") for e in events[:last_grad])
    # Every bucket but the one holding the last gradient can be issued before backward ends.
    assert issued_during >= 1, f"no all-reduce was issued before backward finished: {events}"
    assert issued_during >= buckets // 2, f"only {issued_during} of {buckets} buckets overlapped backward: {events}"


@pytest.mark.distributed
def test_one_all_reduce_per_bucket_per_step(traffic):
    calls = traffic["stats"]["dp_cp/all_reduce"]["calls"]
    assert calls == traffic["buckets"] + 1, f"{calls} calls for {traffic['buckets']} buckets + the loss"


@pytest.mark.distributed
def test_no_sync_reduces_once_per_step_not_per_microbatch(traffic):
    calls = traffic["stats4"]["dp_cp/all_reduce"]["calls"]
    assert calls == traffic["buckets4"] + 1, f"microbatches=4: {calls} calls for {traffic['buckets4']} buckets + 1"
    assert traffic["wire4"] == traffic["wire"]


@pytest.mark.distributed
def test_bytes_per_step_equal_the_ring_theory(traffic):
    n = TRAFFIC_WORLD
    theory = 2 * (n - 1) / n * (traffic["n_params"] * 4 + 4)  # fp32 gradients + the 4-byte loss average
    measured = traffic["wire"]
    assert measured == pytest.approx(theory, rel=1e-12), (
        f"measured/theory = {measured / theory:.6f}: {traffic['stats']}"
    )


# ----------------------------------------------------------------- unused parameters
class WithUnusedBranch(nn.Module):
    """The test GPT plus a layer that forward never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt, _ = make_model()
        self.unused = nn.Linear(16, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gpt(x)


class PartlyUsed(nn.Module):
    """``b`` is used on rank 0 only, ``c`` on no rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = (nn.Linear(4, 1, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.a(x).sum() + (self.b(x).sum() if use_b else 0)


def _unused(world: int) -> dict:
    _, task = make_model()
    loader = ShardedBatches(task, GLOBAL_BATCH, torch.distributed.get_rank(), world)
    engine = plait.parallelize(WithUnusedBranch(), Layout(dp=world, bucket_mb=TINY_MB), optimizer=OPTIMIZERS["adamw"])
    with pytest.raises(RuntimeError) as info:
        engine.train_step(loader.batch_at(0))
    os.environ[FIND_UNUSED_ENV] = "1"  # the way to turn it on through plait.parallelize
    engine = plait.parallelize(WithUnusedBranch(), Layout(dp=world, bucket_mb=TINY_MB), optimizer=OPTIMIZERS["adamw"])
    trajectory = Trajectory()
    engine.before_optimizer_step.append(lambda e: trajectory.grads.append(snapshot_grads(e.model)))
    for step in range(STEPS):
        trajectory.losses.append(engine.train_step(loader.batch_at(step)).loss)
        trajectory.params.append(snapshot_params(engine.model))

    rank = torch.distributed.get_rank()
    model = PartlyUsed()
    ddp = DistributedDataParallel(
        model, Comm(Mesh.build(Layout(dp=world))), OPTIMIZERS["sgd"], find_unused_parameters=True
    )
    model(torch.full((2, 4), rank + 1.0), use_b=rank == 0).backward()
    ddp.finish_backward()
    partly = {name: None if p.grad is None else p.grad.tolist() for name, p in model.named_parameters()}
    return {"error": str(info.value), "trajectory": trajectory, "partly": partly}


@pytest.mark.distributed
def test_unused_parameters():
    world = 2
    results = run_distributed(_unused, world, world)
    _, task = make_model()
    loader = ShardedBatches(task, GLOBAL_BATCH)
    expected = train_reference(
        WithUnusedBranch(), [loader.global_batch_at(s) for s in range(STEPS)], OPTIMIZERS["adamw"]
    )
    for rank, result in enumerate(results):
        error = result["error"]
        assert "unused.weight" in error and "find_unused_parameters=True" in error and "gpt." not in error, error
        assert_trajectories_match(result["trajectory"], expected)  # unused.weight: no grad, never stepped
        # a: (2 + 4) / 2 per column; b: rank 0's 2 / 2 ranks; c: no rank used it -> None, as on one device.
        assert result["partly"] == {"a.weight": [[3.0] * 4], "b.weight": [[1.0] * 4], "c.weight": None}, rank


# ----------------------------------------------------------------- bad input
def _bad_input(world: int) -> dict:
    comm = Comm(Mesh.build(Layout(dp=world)))
    errors = {}
    model = nn.Linear(4, 4)
    model.register_parameter("scale8", nn.Parameter(torch.ones(4).to(torch.float8_e4m3fn)))
    with pytest.raises(TypeError) as info:
        DistributedDataParallel(model, comm, OPTIMIZERS["sgd"])
    errors["dtype"] = str(info.value)
    model.scale8.requires_grad_(False)  # frozen parameters are not bucketed: accepted
    DistributedDataParallel(model, comm, OPTIMIZERS["sgd"])
    with pytest.raises(TypeError) as info:
        DistributedDataParallel(nn.Embedding(10, 4, sparse=True), comm, OPTIMIZERS["sgd"])
    errors["sparse"] = str(info.value)
    model = nn.Linear(4, 1)
    DistributedDataParallel(model, comm, OPTIMIZERS["sgd"])
    model(torch.ones(2, 4)).sum().backward()
    with pytest.raises(RuntimeError) as info:  # a second backward outside no_sync before finish_backward
        model(torch.ones(2, 4)).sum().backward()
    errors["twice"] = str(info.value)
    return errors


@pytest.mark.distributed
def test_bad_input_is_a_clear_error():
    errors = run_distributed(_bad_input, 2, 2)[0]
    assert "scale8 (torch.float8_e4m3fn)" in errors["dtype"] and "gloo" in errors["dtype"], errors["dtype"]
    assert "sparse=False" in errors["sparse"], errors["sparse"]
    assert "no_sync" in errors["twice"], errors["twice"]
