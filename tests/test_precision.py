"""Mixed precision: bf16/fp16 autocast with fp32 master weights under data parallelism, close to the same
precision on one device and to fp32 training; fp16 dynamic loss scaling skips overflowing steps."""

import pytest
import torch

import plait
from harness import run_distributed
from plait import Layout
from plait.data import ShardedBatches
from plait.parallel.precision import DynamicLossScaler, MixedPrecision
from test_engine import GLOBAL_BATCH, OPTIMIZERS, make_model

STEPS = 12
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _losses(layout: Layout) -> list[float]:
    model, task = make_model()
    engine = plait.parallelize(model, layout, optimizer=OPTIMIZERS["adamw"], max_grad_norm=1.0)
    loader = ShardedBatches(task, GLOBAL_BATCH, engine.mesh.index("dp"), engine.mesh.size("dp"))
    stats = [engine.train_step(loader.batch_at(step)) for step in range(STEPS)]
    assert all(p.dtype == torch.float32 for p in engine.model.parameters()), "master weights stay fp32"
    return [s.loss for s in stats]


def _reference_losses(precision: str) -> list[float]:
    """Single-device training under the same autocast (or fp32)."""
    model, task = make_model()
    optimizer = OPTIMIZERS["adamw"](model.parameters())
    loader = ShardedBatches(task, GLOBAL_BATCH)
    policy = MixedPrecision(precision, torch.device("cpu"))
    losses = []
    for step in range(STEPS):
        x, y = loader.global_batch_at(step)
        with policy.autocast():
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        (loss * (policy.loss_scale or 1.0)).backward()
        for p in model.parameters():
            p.grad.div_(policy.loss_scale or 1.0)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.distributed
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_data_parallel_tracks_single_device(precision):
    actual = run_distributed(_losses, 2, Layout(dp=2, precision=precision))[0]
    same_precision = _reference_losses(precision)
    fp32 = _reference_losses("fp32")
    # Against the same autocast on one device, the only difference is the order of the gradient sum (dp
    # halves averaged): after rounding to the compute dtype that moves the loss by a few units of the dtype's
    # mantissa step (bf16 2^-8 = 0.4%, fp16 2^-11 = 0.05%); 2% bounds 12 steps of such drift with margin.
    assert actual == pytest.approx(same_precision, rel=0.02)
    # Against fp32 training, the low-precision matmuls themselves differ by about one mantissa step per op;
    # the loss curves agree within 3% over these steps (the model is tiny and the loss O(1)).
    assert actual == pytest.approx(fp32, rel=0.03)
    assert actual[-1] < actual[0], "it still learns"


def test_fp16_overflow_skips_the_step_and_lowers_the_scale():
    model, task = make_model()
    engine = plait.parallelize(model, Layout(precision="fp16"), optimizer=OPTIMIZERS["sgd"])
    engine.precision.scaler = DynamicLossScaler(init_scale=2.0**30)  # fp16 activations overflow (max 65504)
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    loader = ShardedBatches(task, GLOBAL_BATCH)
    stats = engine.train_step(loader.batch_at(0))
    assert stats.skipped and stats.grad_norm is None
    assert engine.precision.loss_scale == 2.0**29
    assert all(torch.equal(before[n], p) for n, p in engine.model.named_parameters()), "a skipped step changes nothing"
    for step in range(1, 40):  # the scale keeps halving until steps go through
        stats = engine.train_step(loader.batch_at(step))
        if not stats.skipped:
            break
    assert not stats.skipped and engine.precision.scaler.skipped_steps >= 2


def test_loss_scaler_grows_after_clean_steps():
    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=3)
    for _ in range(3):
        scaler.update(found_inf=False)
    assert scaler.scale == 16.0
    scaler.update(found_inf=True)
    assert scaler.scale == 8.0 and scaler.good_steps == 0


def test_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="fp8"):
        MixedPrecision("fp8", torch.device("cpu"))
