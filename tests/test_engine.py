"""Engine parity: world size 1, dp=2 and dp=4 (with micro-batches and clipping) equal single-device training
on the global batch, step by step (loss, gradients, parameters); evaluate and bad input."""

import pytest
import torch
from helpers.gpt import GLOBAL_BATCH, OPTIMIZERS, make_model, reference, train_plait
from helpers.harness import run_distributed
from helpers.reference import assert_trajectories_match

import plait
from plait import Layout, LayoutError
from plait.data import ShardedBatches


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_world_size_one_is_bitwise_single_device(optimizer):
    assert_trajectories_match(train_plait(Layout(), optimizer), reference(optimizer), exact=True)


def test_world_size_one_with_microbatches_and_clipping():
    actual = train_plait(Layout(microbatches=4), "adamw", max_grad_norm=0.05)
    assert_trajectories_match(actual, reference("adamw", max_grad_norm=0.05))


def test_world_size_one_clipping_is_bitwise_torch():
    """The norm and the scaling use torch's own foreach kernels, so clipping is bitwise torch.clip_grad_norm_."""
    assert_trajectories_match(train_plait(Layout(), "adamw", 0.05), reference("adamw", 0.05), exact=True)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world, microbatches, optimizer, clip",
    [(2, 1, "adamw", None), (2, 2, "sgd", 0.05), (4, 1, "adamw", 0.05), (4, 2, "sgd", None)],
)
def test_data_parallel_matches_single_device(world, microbatches, optimizer, clip):
    results = run_distributed(train_plait, world, Layout(dp=world, microbatches=microbatches), optimizer, clip)
    expected = reference(optimizer, clip)
    for rank, actual in enumerate(results):
        assert_trajectories_match(actual, expected)
        assert actual.losses == results[0].losses, f"rank {rank} reports a different loss"


def _comm_per_step(world: int):
    model, task = make_model()
    engine = plait.parallelize(model, Layout(dp=world), optimizer=OPTIMIZERS["sgd"])
    stats = engine.train_step(ShardedBatches(task, GLOBAL_BATCH, engine.mesh.index("dp"), world).batch_at(0))
    n_params = sum(p.numel() for p in model.parameters())
    return stats.comm.wire(op="all_reduce"), n_params, stats.comm.to_dict()


@pytest.mark.distributed
def test_bytes_per_step_equal_the_ring_theory():
    world = 4
    (wire, n_params, detail), *_ = run_distributed(_comm_per_step, world, world)
    # DDP theory: 2(N-1)/N x P x 4 bytes for the fp32 gradients, plus the 4-byte loss sum and the 8-byte count of
    # the step's scored tokens (one int64 per micro-batch, over dp: the token-mean normalisation).
    theory = 2 * (world - 1) / world * (n_params * 4 + 4 + 8)
    assert wire == pytest.approx(theory, rel=1e-12), detail


def test_evaluate_counts_accuracy():
    model, task = make_model()
    engine = plait.parallelize(model, Layout(), optimizer=OPTIMIZERS["sgd"])
    loader = ShardedBatches(task, 8, offset=10**6)
    stats = engine.evaluate([loader.batch_at(0), loader.batch_at(1)], metric=task.accuracy_counts)
    assert stats.total == 16 and 0 <= stats.correct <= 16
    x, y = loader.batch_at(0)
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    assert stats.loss == pytest.approx((float(expected) + engine.evaluate([loader.batch_at(1)]).loss) / 2, rel=1e-6)


def test_bad_input_is_refused_before_work():
    model, task = make_model()
    with pytest.raises(TypeError, match="factory"):
        plait.parallelize(model, Layout(), optimizer="adam")
    with pytest.raises(ValueError, match="max_grad_norm"):
        plait.parallelize(model, Layout(), optimizer=OPTIMIZERS["sgd"], max_grad_norm=0)
    with pytest.raises(ValueError, match="not the model's"):
        plait.parallelize(model, Layout(), optimizer=torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1))
    engine = plait.parallelize(model, Layout(microbatches=3), optimizer=OPTIMIZERS["sgd"])
    with pytest.raises(LayoutError, match="microbatches=3"):
        engine.train_step(ShardedBatches(task, 8).batch_at(0))
    with pytest.raises(TypeError, match="inputs, targets"):
        engine.train_step(torch.zeros(2))


def _rank_dies_mid_backward(victim: int):
    model, task = make_model()
    engine = plait.parallelize(model, Layout(), optimizer=OPTIMIZERS["sgd"], timeout_s=20)
    loader = ShardedBatches(task, GLOBAL_BATCH, engine.mesh.index("dp"), engine.mesh.size("dp"))
    engine.train_step(loader.batch_at(0))
    if engine.mesh.rank == victim:
        import os

        model.lm_head.weight.register_hook(lambda grad: os._exit(4))  # dies inside step 2's backward
    engine.train_step(loader.batch_at(1))


@pytest.mark.distributed
def test_rank_killed_mid_step_fails_the_others_fast_with_names():
    import time

    from helpers.harness import DistributedTestError

    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_rank_dies_mid_backward, 4, 2, timeout=90)
    assert time.monotonic() - start < 60, "survivors must fail within the collective timeout, not hang"
    failures = info.value.failures
    assert "exit code 4" in failures[2]
    for rank in (0, 1, 3):
        assert "CommError" in failures[rank] and f"rank {rank}: all_reduce on mesh axis 'dp_cp'" in failures[rank]
