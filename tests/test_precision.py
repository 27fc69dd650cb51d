"""Mixed precision: bf16/fp16 autocast with fp32 master weights under DDP and ZeRO-1/2/3, close to the same
precision on one device and to fp32 training; fp16 dynamic loss scaling skips overflowing steps (under every
ZeRO stage too), and the skip and the scale reach StepStats and metrics.jsonl.

One gloo job at dp=2 trains every (precision, stage) pair in turn and overflows fp16 under each ZeRO stage; the
tests below read its results."""

import functools

import pytest
import torch
from helpers.gpt import GLOBAL_BATCH, OPTIMIZERS, make_model
from helpers.harness import run_distributed

import plait
from plait import Layout
from plait.data import ShardedBatches
from plait.parallel.precision import DynamicLossScaler, MixedPrecision
from plait.train.metrics import MetricsWriter, read_metrics, step_record

STEPS = 12
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
MANTISSA_STEP = {"bf16": 2.0**-8, "fp16": 2.0**-11}
"""The relative spacing of the compute dtype's numbers (8 and 11 significant bits)."""
STAGES = (0, 1, 2, 3)
"""zero=0 is DDP."""


def _train(layout: Layout) -> tuple[list[float], dict]:
    """The loss curve, and the traffic of the last step by mesh axis and op."""
    model, task = make_model()
    engine = plait.parallelize(model, layout, optimizer=OPTIMIZERS["adamw"], max_grad_norm=1.0)
    loader = ShardedBatches(task, GLOBAL_BATCH, engine.mesh.index("dp"), engine.mesh.size("dp"))
    stats = [engine.train_step(loader.batch_at(step)) for step in range(STEPS)]
    assert all(p.dtype == torch.float32 for p in engine.model.parameters()), "master weights stay fp32"
    return [s.loss for s in stats], stats[-1].comm.to_dict()


@functools.cache
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


def _overflow(layout: Layout) -> dict:
    """fp16 with a loss scale of 2^30: the first step overflows (fp16's max is 65504) and must be skipped on every
    rank; then train until the halving scale lets a step through."""
    model, task = make_model()
    engine = plait.parallelize(model, layout, optimizer=OPTIMIZERS["sgd"])
    engine.precision.scaler = DynamicLossScaler(init_scale=2.0**30)
    before = engine.strategy.full_parameters()
    loader = ShardedBatches(task, GLOBAL_BATCH, engine.mesh.index("dp"), engine.mesh.size("dp"))
    first = engine.train_step(loader.batch_at(0))
    after = engine.strategy.full_parameters()
    out = {
        "first": first,
        "record": step_record(first, lr=0.1),
        "stepped": bool(engine.optimizer.state),
        "unchanged": all(torch.equal(before[name], after[name]) for name in before),
    }
    for step in range(1, 40):  # the scale keeps halving until steps go through
        stats = engine.train_step(loader.batch_at(step))
        if not stats.skipped:
            break
    out.update(through=stats, skipped_steps=engine.precision.scaler.skipped_steps)
    return out


def _suite() -> dict:
    """dp=2: the loss curve and traffic of every precision under every stage, reducing gradients in fp32 and in
    the compute dtype, and an fp16 overflow under each ZeRO stage."""
    runs = {
        (p, stage, reduce): _train(Layout(dp=2, zero=stage, precision=p, reduce_dtype=reduce))
        for p in DTYPES
        for stage in STAGES
        for reduce in ("fp32", "compute")
    }
    return {
        "losses": {key: losses for key, (losses, _) in runs.items()},
        "traffic": {key: traffic for key, (_, traffic) in runs.items()},
        "overflow": {stage: _overflow(Layout(dp=2, zero=stage, precision="fp16")) for stage in STAGES[1:]},
    }


@pytest.fixture(scope="module")
def dp2() -> list[dict]:
    return run_distributed(_suite, 2)


@pytest.mark.distributed
@pytest.mark.parametrize("reduce", ["fp32", "compute"], ids=lambda r: f"reduce-{r}")
@pytest.mark.parametrize("stage", STAGES, ids=lambda s: f"zero{s}")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_data_parallel_tracks_single_device(precision, stage, reduce, dp2):
    actual = dp2[0]["losses"][(precision, stage, reduce)]
    same_precision = _reference_losses(precision)
    fp32 = _reference_losses("fp32")
    # Tolerance: one mantissa step of the compute dtype, relative (bf16 2^-8 = 0.39%, fp16 2^-11 = 0.049%). The
    # loss is a mean of cross-entropies of logits from low-precision matmuls; rounding their inputs to the
    # compute dtype moves each logit by about one such step, and the errors of the batch's 64 tokens average
    # rather than add. Against the same autocast on one device, data parallelism adds the matmuls on half
    # batches and the order of the fp32 gradient sum (all-reduced by DDP, reduce-scattered by ZeRO-1/2/3;
    # ZeRO-3 gathers the same fp32 parameters): far less. reduce_dtype="compute" rounds each gradient and partial
    # sum to the compute dtype too, a relative 2^-8 / 2^-11 of the update, which Adam's normalisation keeps
    # from compounding. Measured over the 12 steps, any stage, either reduce dtype: at most 5e-5 (bf16) and
    # 7e-6 (fp16) against the same precision, 5e-5 / 6e-6 against fp32: ~80x margin.
    rel = MANTISSA_STEP[precision]
    assert actual == pytest.approx(same_precision, rel=rel)
    assert actual == pytest.approx(fp32, rel=rel)
    assert actual[-1] < actual[0], "it still learns"
    for rank, result in enumerate(dp2[1:], start=1):
        assert result["losses"][(precision, stage, reduce)] == actual, f"rank {rank} reports a different loss"


@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES, ids=lambda s: f"zero{s}")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reducing_in_the_compute_dtype_halves_the_gradient_bytes(precision, stage, dp2):
    """reduce_dtype="compute": the gradient reduction (DDP's all-reduce, ZeRO's reduce-scatter) carries 2-byte
    values instead of 4; every other collective (ZeRO's parameter all-gathers, the loss and norm all-reduces)
    is unchanged."""
    n_params = sum(p.numel() for p in make_model()[0].parameters())
    for rank, result in enumerate(dp2):
        fp32, compute = (result["traffic"][(precision, stage, reduce)] for reduce in ("fp32", "compute"))
        assert fp32.keys() == compute.keys()
        gradient_op = "dp_cp/all_reduce" if stage == 0 else "dp_cp/reduce_scatter"
        loss = 4 if stage == 0 else 0  # DDP's all-reduce also carries the 4-byte loss average
        if stage == 0:  # (the fp32 figures of ZeRO are checked against theory in test_zero.py / test_zero3.py)
            assert fp32[gradient_op]["payload_bytes"] == 4 * n_params + loss
        for op in fp32:
            want = dict(fp32[op])
            if op == gradient_op:
                want["payload_bytes"] = (fp32[op]["payload_bytes"] - loss) / 2 + loss
                want["wire_bytes"] = fp32[op]["wire_bytes"] * want["payload_bytes"] / fp32[op]["payload_bytes"]
            assert compute[op] == pytest.approx(want, rel=1e-12), f"rank {rank} {op}: {compute[op]} vs {want}"


def _check_overflow(result: dict, where: str) -> None:
    first, through = result["first"], result["through"]
    assert first.skipped and first.grad_norm is None, f"{where}: the overflowing step was not skipped"
    assert first.loss_scale == 2.0**29, f"{where}: StepStats.loss_scale {first.loss_scale}, want the halved 2^29"
    assert result["unchanged"] and not result["stepped"], f"{where}: a skipped step changed parameters or state"
    assert not through.skipped and through.loss_scale < 2.0**29 and result["skipped_steps"] >= 2, where
    assert result["record"]["skipped"] is True and result["record"]["loss_scale"] == 2.0**29, result["record"]


def test_fp16_overflow_skips_the_step_and_lowers_the_scale(tmp_path):
    result = _overflow(Layout(precision="fp16"))
    _check_overflow(result, "one device")
    writer = MetricsWriter(tmp_path)  # the skip and the scale survive metrics.jsonl
    writer.write(result["record"])
    writer.write(step_record(result["through"], lr=0.1))
    writer.close()
    records = read_metrics(writer.path)
    assert [(r["skipped"], r["loss_scale"]) for r in records] == [
        (True, 2.0**29),
        (False, result["through"].loss_scale),
    ]


@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES[1:], ids=lambda s: f"zero{s}")
def test_fp16_overflow_under_zero_is_skipped_on_every_rank(stage, dp2):
    """Under ZeRO each rank checks only its gradient shard: the inf check is all-reduced (max) over dp, so every
    rank skips the same step, steps nothing, and reports the same halved scale."""
    for rank, result in enumerate(dp2):
        _check_overflow(result["overflow"][stage], f"zero={stage} rank {rank}")


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
    with pytest.raises(plait.LayoutError, match="reduce_dtype='bf16' is unknown. Fix: use one of 'fp32', 'compute'"):
        Layout(precision="bf16", reduce_dtype="bf16")
