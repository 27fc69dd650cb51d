"""On one GPU (issue 14, "Done when"): every Layout that runs on CPU at world size 1 runs on CUDA and matches
single-device training on the same GPU, with and without offload and clipping; the hot path never syncs with the
host (fp16: once per step); 2 ranks on one GPU with gloo pass the dp, tp, ZeRO, pp and cp parity checks of the
composition matrix.

Tolerances, and why they are looser than on CPU: cuBLAS picks its matmul algorithms (split-K reductions) by
shape and the embedding backward accumulates with atomics, so a CUDA run and its single-device CUDA reference
add the same numbers in a different order wherever plait changes a shape (micro-batches, shards): a few ulps
per reduction, which Adam can raise for near-zero coordinates. fp32: losses 1e-5 relative, parameters rtol 1e-4 /
atol 1e-5 after 3 steps of lr 1e-3 (1% of a step); bf16 / fp16: the loss within a few mantissa steps of the
same autocast on one device.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from helpers.composition import BY_NAME, Combo, merge_ranks, reference_trajectory, train_combo
from helpers.gpt import OPTIMIZERS, make_model
from helpers.harness import run_distributed
from helpers.reference import Trajectory, assert_tensors_close, snapshot_params, train_reference

import plait
from plait import Layout
from plait.data import ShardedBatches

DEVICE = os.environ.get("PLAIT_GPU_TEST_DEVICE", "cuda")
"""Where these tests train (tests/gpu/conftest.py: "cpu" dry-runs this file without a GPU)."""
STEPS = 3
GLOBAL_BATCH = 8
CLIP = 0.05
FP32 = {"loss_rtol": 1e-5, "params": {"rtol": 1e-4, "atol": 1e-5}}
LOW_PRECISION_LOSS_RTOL = {"bf16": 4 * 2.0**-8, "fp16": 4 * 2.0**-11}
"""Four mantissa steps of the compute dtype: the CPU suite's one step (tests/test_precision.py) plus the GPU's
reordered reductions inside autocast matmuls."""

WORLD_ONE = (
    [Layout(zero=zero, offload="none") for zero in (0, 1, 2, 3)]
    + [Layout(zero=zero, offload=offload) for zero in (1, 2, 3) for offload in ("cpu", "nvme")]
    + [Layout(zero=zero, microbatches=2, recompute=mode) for zero in (0, 3) for mode in ("full", "op")]
    + [Layout(zero=zero, compile=True) for zero in (0, 1, 3)]
)
"""Every data-parallel strategy at world size 1, each offload, accumulation with recomputation (full, and per
operator: on CUDA its policy keeps the flash / memory-efficient kernels' outputs), compilation."""


def _name(layout: Layout) -> str:
    return layout.short().replace(" ", "-") + f"-offload-{layout.offload}-recompute-{layout.recompute}"


def _batches(task, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    loader = ShardedBatches(task, GLOBAL_BATCH)
    return [tuple(t.to(DEVICE) for t in loader.global_batch_at(step)) for step in range(steps)]


def _plait(layout: Layout, clip: float | None, optimizer: str = "adamw") -> Trajectory:
    model, task = make_model()
    engine = plait.parallelize(model, layout, optimizer=OPTIMIZERS[optimizer], max_grad_norm=clip, device=DEVICE)
    out = Trajectory()
    for batch in _batches(task):
        out.losses.append(engine.train_step(batch).loss)
        out.params.append({n: t.cpu() for n, t in engine.strategy.full_parameters().items()})
    getattr(engine.strategy, "close", lambda: None)()
    return out


def _reference(clip: float | None, optimizer: str = "adamw") -> Trajectory:
    model, task = make_model()
    return train_reference(model.to(DEVICE), _batches(task), OPTIMIZERS[optimizer], max_grad_norm=clip)


@pytest.mark.parametrize("clip", [None, CLIP], ids=["no-clip", "clip"])
@pytest.mark.parametrize("layout", WORLD_ONE, ids=_name)
def test_world_size_one_matches_single_device_on_the_gpu(layout, clip, tmp_path, monkeypatch):
    monkeypatch.setenv("PLAIT_OFFLOAD_DIR", str(tmp_path))
    actual, expected = _plait(layout, clip), _reference(clip)
    for step, (a, e) in enumerate(zip(actual.losses, expected.losses)):
        assert a == pytest.approx(e, rel=FP32["loss_rtol"]), f"step {step}: loss {a} != {e}"
    assert_tensors_close(actual.params[-1], expected.params[-1], "final param", FP32["params"])


def _autocast_losses(precision: str) -> list[float]:
    """Single-device training on the GPU under the same autocast, loss scaling by hand for fp16."""
    model, task = make_model()
    model.to(DEVICE)
    optimizer = OPTIMIZERS["adamw"](model.parameters())
    scale = 2.0**16 if precision == "fp16" else 1.0
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    losses = []
    for inputs, targets in _batches(task):
        with torch.autocast(torch.device(DEVICE).type, dtype=dtype):
            loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        (loss * scale).backward()
        for p in model.parameters():
            p.grad.div_(scale)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize(
    "zero, offload", [(0, "none")] + [(zero, offload) for zero in (1, 2, 3) for offload in ("none", "cpu")]
)  # offload moves ZeRO's shards: without ZeRO there is nothing to offload (parallelize refuses it)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_on_the_gpu_tracks_the_same_autocast(precision, zero, offload):
    actual = _plait(Layout(zero=zero, offload=offload, precision=precision), clip=1.0).losses
    assert actual == pytest.approx(_autocast_losses(precision), rel=LOW_PRECISION_LOSS_RTOL[precision])


@pytest.mark.parametrize(
    "layout, syncs",
    [
        (Layout(precision="bf16"), 0),
        (Layout(zero=1, precision="bf16", microbatches=2), 0),
        (Layout(zero=3, precision="bf16", recompute="full"), 0),
        (Layout(precision="fp16", microbatches=2), 1),
    ],
    ids=["ddp-bf16", "zero1-bf16", "zero3-bf16-recompute", "ddp-fp16"],
)
def test_steps_run_back_to_back_without_host_syncs(layout, syncs):
    """torch's sync debug mode warns at every operation that makes the host wait for the GPU: none in a bf16 step
    (clipping included), one in an fp16 step (the loss scaler's inf flag)."""
    if torch.device(DEVICE).type != "cuda":
        pytest.skip("torch.cuda.set_sync_debug_mode needs CUDA")
    model, task = make_model()
    engine = plait.parallelize(model, layout, optimizer=OPTIMIZERS["adamw"], max_grad_norm=1.0, device=DEVICE)
    batches = _batches(task)
    engine.train_step(batches[0])  # lazy state (optimizer moments, caches) is created here
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            stats = [engine.train_step(batch) for batch in batches[1:]]
        finally:
            torch.cuda.set_sync_debug_mode(0)
    synced = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(synced) == syncs * len(stats), synced
    assert all(s.loss > 0 for s in stats)


# ------------------------------------------------------------------------------------------ 2 ranks, 1 GPU, gloo
TWO_RANKS = [
    *(BY_NAME[f"{axis}-zero{zero}"] for axis in ("dp2", "tp2", "pp2", "cp2") for zero in (0, 1, 3)),
    Combo(dp=2, tp=1, pp=1, cp=1, zero=2),
    Combo(dp=1, tp=1, pp=1, cp=2, zero=0, cp_mode="ulysses"),
]
"""The composition matrix's world-2 cells (dp, tp, pp, ring cp; ZeRO 0, 1, 3), ZeRO-2 and Ulysses. Both ranks
use cuda:0 (LOCAL_RANK modulo one GPU) over gloo: its collectives take CUDA tensors; pipeline and ring attention's
point-to-point messages are staged through host memory by plait.comm."""


def _train_two_ranks(combos: list[Combo]) -> dict[str, dict]:
    return {combo.name: train_combo(combo) for combo in combos}


@pytest.fixture(scope="module")
def two_ranks_on_one_gpu() -> list[dict[str, dict]]:
    return run_distributed(_train_two_ranks, 2, TWO_RANKS, timeout=900)


@pytest.mark.distributed
@pytest.mark.parametrize("combo", TWO_RANKS, ids=lambda c: c.name)
def test_two_ranks_on_one_gpu_with_gloo_match_single_device(combo, two_ranks_on_one_gpu):
    per_rank = [result[combo.name] for result in two_ranks_on_one_gpu]
    expected = reference_trajectory()  # on the CPU: GPU tolerances below cover the device difference
    for rank, result in enumerate(per_rank):
        assert result["losses"] == per_rank[0]["losses"], f"{combo.name}: rank {rank} reports another loss"
    assert per_rank[0]["losses"] == pytest.approx(expected.losses, rel=FP32["loss_rtol"])
    params = merge_ranks([r["params"] for r in per_rank], f"{combo.name} final params")
    assert_tensors_close(params, expected.params[-1], f"{combo.name} final param", FP32["params"])


def test_the_reference_itself_runs_on_the_device():
    """The references above really train on DEVICE (not silently on the CPU)."""
    model, task = make_model()
    trajectory = train_reference(model.to(DEVICE), _batches(task, 1), OPTIMIZERS["sgd"])
    assert next(model.parameters()).device.type == torch.device(DEVICE).type
    assert trajectory.losses[0] > 0 and snapshot_params(model)
