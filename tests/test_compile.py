"""``Layout(compile=...)``: torch.compile per block with DDP, ZeRO-1/2/3, tensor and context parallelism and
recomputation, against the same layout uncompiled.

- dp=2 (DDP with recomputation, ZeRO-1, 2, 3, ZeRO-3 with full and per-operator recomputation) and tp=2, cp=2
  (ring) under the ``aot_eager`` backend (dynamo's
  tracing and AOTAutograd's joint graph, the layers where ZeRO-3's hooks and saved tensors broke, without
  generating kernels): losses, gradients and parameters equal the uncompiled run within 1e-6 relative; the same
  aten ops run in the same order, only regrouped into graphs.
- world size 1 with inductor, ZeRO-3 and full recomputation (issue 14's failing case): within 1e-5 relative
  (inductor fuses elementwise chains and may reorder their fp32 roundings).
- dynamo never recompiles (``torch._dynamo.config.error_on_recompile``): every block of a class shares one graph,
  and ZeRO-3's gathers (new parameter storage each step) are graph inputs, not guards.
- ``torch.compile(model)`` before ``parallelize`` under ZeRO-3, the shape that failed on the H100, fails on CPU
  too and is refused up front; unknown backends are refused.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from helpers.gpt import GLOBAL_BATCH, OPTIMIZERS, make_model
from helpers.harness import run_distributed
from helpers.reference import Trajectory, assert_tensors_close, snapshot_grads

import plait
from plait import Layout, LayoutError
from plait.data import ShardedBatches
from plait.parallel.compile import is_compiled

STEPS = 3
AOT_TOLERANCE = {"rtol": 1e-6, "atol": 1e-7}
"""aot_eager: the same aten kernels as eager in the same order (bitwise equal when measured); 1e-6 leaves room
for a decomposition that a torch version rewrites."""
INDUCTOR_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
"""inductor: fused elementwise kernels round fp32 intermediates differently (measured: ~2e-7 relative on the
losses over 3 steps); 1e-5 is ~50 fp32 ulps."""


def _train(layout: Layout) -> Trajectory:
    model, task = make_model()
    engine = plait.parallelize(model, layout, optimizer=OPTIMIZERS["adamw"], max_grad_norm=0.05)
    out = Trajectory()
    whole = getattr(engine.strategy, "full_gradients", None)  # ZeRO: gathered; otherwise this rank's own
    engine.before_optimizer_step.append(lambda e: out.grads.append(whole() if whole else snapshot_grads(e.model)))
    loader = ShardedBatches(task, GLOBAL_BATCH, engine.mesh.index("dp"), engine.mesh.size("dp"))
    for step in range(STEPS):
        out.losses.append(engine.train_step(loader.batch_at(step)).loss)
        out.params.append(engine.strategy.full_parameters())
    return out


def _pair(layout: Layout, backend: str) -> tuple[Trajectory, Trajectory]:
    """The layout trained uncompiled and compiled, dynamo reset before and forbidden to recompile."""
    import torch._dynamo

    eager = _train(layout)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = _train(dataclasses.replace(layout, compile=backend))
    return eager, compiled


def _assert_same(compiled: Trajectory, eager: Trajectory, tolerance: dict[str, float], what: str) -> None:
    for step, (c, e) in enumerate(zip(compiled.losses, eager.losses)):
        assert c == pytest.approx(e, rel=tolerance["rtol"], abs=tolerance["atol"]), f"{what} step {step} loss"
        assert_tensors_close(compiled.grads[step], eager.grads[step], f"{what} step {step} grad", tolerance)
        assert_tensors_close(compiled.params[step], eager.params[step], f"{what} step {step} param", tolerance)


DISTRIBUTED = {
    "ddp-recompute": Layout(dp=2, zero=0, recompute="full", microbatches=2),
    "zero1": Layout(dp=2, zero=1),
    "zero2": Layout(dp=2, zero=2, microbatches=2),
    "zero3": Layout(dp=2, zero=3, microbatches=2),
    "zero3-recompute": Layout(dp=2, zero=3, recompute="full"),
    "zero3-op-recompute": Layout(dp=2, zero=3, recompute="op"),
    "tp2": Layout(dp=1, tp=2),
    "cp2-ring": Layout(dp=1, cp=2),
}


def _distributed_pairs(names: list[str]) -> dict[str, tuple[Trajectory, Trajectory]]:
    return {name: _pair(DISTRIBUTED[name], "aot_eager") for name in names}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, tuple[Trajectory, Trajectory]]]:
    return run_distributed(_distributed_pairs, 2, list(DISTRIBUTED), timeout=300)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(DISTRIBUTED))
def test_compiled_blocks_match_the_uncompiled_run(name, two_ranks):
    for rank, pairs in enumerate(two_ranks):
        eager, compiled = pairs[name]
        _assert_same(compiled, eager, AOT_TOLERANCE, f"rank {rank} {name}")
        assert compiled.losses == two_ranks[0][name][1].losses, f"rank {rank} reports a different loss"


def test_inductor_zero3_with_recomputation_matches_the_uncompiled_run():
    eager, compiled = _pair(Layout(zero=3, recompute="full", microbatches=2), "inductor")
    _assert_same(compiled, eager, INDUCTOR_TOLERANCE, "inductor zero3")


def test_each_block_is_compiled_with_hooks_outside_and_names_unchanged():
    model, _task = make_model()
    names = [name for name, _ in model.named_parameters()]
    engine = plait.parallelize(model, Layout(zero=3, compile="eager"), optimizer=OPTIMIZERS["sgd"])
    blocks = list(engine.model.blocks.values())
    assert all(is_compiled(block) for block in blocks)
    assert all(block._forward_pre_hooks for block in blocks), "ZeRO-3's gathers stay module hooks, outside"
    assert not is_compiled(engine.model), "the model itself is not compiled, its blocks are"
    assert [name for name, _ in engine.model.named_parameters()] == names
    assert "compiled:eager" in engine.layout.short()


def _whole_model_compiled_under_zero3() -> None:
    model, task = make_model()
    compiled = torch.compile(model, backend="aot_eager")
    engine = plait.parallelize(compiled, Layout(zero=3), optimizer=OPTIMIZERS["sgd"])
    loader = ShardedBatches(task, GLOBAL_BATCH)
    for step in range(3):
        engine.train_step(loader.batch_at(step))


def test_a_model_compiled_whole_is_refused_under_zero3_with_the_fix(monkeypatch):
    with pytest.raises(LayoutError, match="Layout\\(compile=True\\)"):
        _whole_model_compiled_under_zero3()
    # Without the check, the failure it prevents (reproduced on CPU, as on the H100 of issue 14). torch 2.14 no
    # longer fails here (make test-max-torch, docs/testing.md); plait keeps refusing until a ZeRO-3 parity test of
    # a whole-model compile exists.
    import torch._dynamo

    if torch.__version__ >= (2, 14):  # TorchVersion compares with tuples
        return
    monkeypatch.setattr(sys.modules["plait.parallelize"], "check_precompiled", lambda model, layout: None)
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _whole_model_compiled_under_zero3()
    torch._dynamo.reset()


def test_bad_compile_settings_are_refused_before_work():
    with pytest.raises(LayoutError, match="torch.compile backend"):
        Layout(compile=1)
    with pytest.raises(LayoutError, match="torch.compile backend"):
        Layout(compile="")
    with pytest.raises(LayoutError, match="not a torch.compile backend.*Fix"):
        plait.parallelize(make_model()[0], Layout(compile="no-such-backend"), optimizer=OPTIMIZERS["sgd"])
    assert Layout.from_dict(Layout(compile=True).to_dict()).compile is True
    assert Layout.from_dict({"compile": "aot_eager"}).compile == "aot_eager"
