"""Pipeline runtime: parity with single-device training (loss, gradients and parameters every step) for every
schedule at pp=2 and pp=4, interleaved chunks, m < p, pp x dp (DDP and ZeRO-1), pp x tp, an nn.Sequential model,
int64 and bool tensors crossing stages; split backward (I + W == B, without re-running the input path);
forward-only evaluation; a measured run's gathered timeline, trace and picture; 1F1B holding fewer activations
than GPipe; bad input rejected before anything runs."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from helpers.harness import run_distributed
from helpers.reference import (
    TOLERANCES,
    Trajectory,
    assert_trajectories_match,
    snapshot_grads,
    snapshot_params,
    train_reference,
)
from torch import nn

import plait
from plait import Layout, LayoutError
from plait.data import AdditionTask, ShardedBatches
from plait.errors import ConfigError, ScheduleError
from plait.models import GPT, GPTConfig
from plait.parallel.pipeline import Schedule
from plait.parallel.pipeline.apply import plan_pipeline
from plait.parallel.pipeline.runtime import PipelineRunner
from plait.parallel.pipeline.split import split_model
from plait.parallel.pipeline.stage import PipelineStage
from plait.parallel.tensor.layers import gather_parameters, gather_slice, is_tp_sharded
from plait.train.config import RunConfig
from plait.train.loop import build

STEPS = 5
GLOBAL_BATCH = 8
N_LAYER = 8
"""Eight blocks: enough for pp=4 x virtual_stages=2."""
OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
}


def make_gpt() -> tuple[GPT, AdditionTask]:
    task = AdditionTask(digits=2, seed=1)
    torch.manual_seed(1234)
    # bias=False: the key bias's gradient is analytically zero, i.e. rounding noise (see tests/test_engine.py)
    config = GPTConfig(
        vocab_size=task.vocab_size, seq_len=task.seq_len, n_layer=N_LAYER, n_head=2, d_model=16, bias=False
    )
    return GPT(config), task


def train_pipeline(layout: Layout, optimizer: str, clip: float | None) -> Trajectory:
    """This rank's view: losses, and its stages' gradients and parameters by (full-model) name, per step."""
    model, task = make_gpt()
    engine = plait.parallelize(model, layout, optimizer=OPTIMIZERS[optimizer], max_grad_norm=clip)
    out = Trajectory()
    engine.before_optimizer_step.append(lambda e: out.grads.append(whole_grads(e)))
    loader = ShardedBatches(task, GLOBAL_BATCH, dp_rank=engine.mesh.index("dp"), dp_size=engine.mesh.size("dp"))
    for _step, batch in zip(range(STEPS), loader):
        out.losses.append(engine.train_step(batch).loss)
        out.params.append(
            snapshot_params(engine.model) if layout.tp == 1 else gather_parameters(engine.model, engine.comm)
        )
    return out


def whole_grads(engine: plait.Engine) -> dict[str, torch.Tensor]:
    """This rank's gradients by name; with tp > 1 the slices of split parameters gathered over tp."""
    if engine.mesh.size("tp") == 1:
        return snapshot_grads(engine.model)
    return {
        name: (gather_slice(p.grad, p, engine.comm) if is_tp_sharded(p) else p.grad).detach().clone()
        for name, p in engine.model.named_parameters()
        if p.grad is not None
    }


def reference(optimizer: str, clip: float | None) -> Trajectory:
    model, task = make_gpt()
    loader = ShardedBatches(task, GLOBAL_BATCH)
    return train_reference(
        model, [loader.global_batch_at(s) for s in range(STEPS)], OPTIMIZERS[optimizer], max_grad_norm=clip
    )


def merge(parts: list[Trajectory]) -> Trajectory:
    """The whole model's trajectory from the stages' parts (union by name; replicas must agree exactly)."""
    whole = Trajectory(losses=parts[0].losses)
    for field in ("grads", "params"):
        for step in range(len(getattr(parts[0], field))):
            merged: dict[str, torch.Tensor] = {}
            for part in parts:
                for name, tensor in getattr(part, field)[step].items():
                    if name in merged:
                        assert torch.equal(merged[name], tensor), f"dp replicas differ on {name} at step {step}"
                    merged[name] = tensor
            getattr(whole, field).append(merged)
    whole.grads = [g for g in whole.grads if g]  # ZeRO-1 holds no model .grad after the reduction
    return whole


CONFIGS = {
    2: [
        (dict(pp=2, microbatches=4, schedule="gpipe"), "sgd", None),
        (dict(pp=2, microbatches=4, schedule="1f1b"), "adamw", 0.05),
        (dict(pp=2, microbatches=4, schedule="interleaved", virtual_stages=2), "adamw", None),
        (dict(pp=2, microbatches=4, schedule="zero-bubble"), "sgd", 0.05),
        (dict(pp=2, microbatches=2, schedule="naive"), "adamw", None),
    ],
    4: [
        (dict(pp=4, microbatches=4, schedule="gpipe"), "adamw", None),
        (dict(pp=4, microbatches=2, schedule="1f1b"), "sgd", 0.05),  # m < p
        (dict(pp=4, microbatches=4, schedule="interleaved", virtual_stages=2), "sgd", None),
        (dict(pp=4, microbatches=4, schedule="zero-bubble"), "adamw", 0.05),
        (dict(pp=2, dp=2, microbatches=2, schedule="1f1b"), "adamw", 0.05),
        (dict(pp=2, dp=2, microbatches=2, schedule="interleaved", virtual_stages=2, zero=1), "adamw", None),
        (dict(pp=2, dp=2, microbatches=2, schedule="gpipe"), "sgd", 0.05),
        (dict(pp=2, dp=2, microbatches=4, schedule="zero-bubble", zero=1), "adamw", 0.05),
        (dict(pp=2, tp=2, microbatches=2, schedule="gpipe"), "adamw", None),
        (dict(pp=2, tp=2, microbatches=4, schedule="zero-bubble"), "adamw", 0.05),
    ],
}
"""(layout, optimizer, clip) per world size: every schedule, clipping (global norm over pp), m < p, pp x dp and
pp x tp (every schedule but naive at pp=2 with dp=2; GPipe and zero-bubble with tp=2)."""


def _train_all(world: int) -> list[Trajectory]:
    return [train_pipeline(Layout(**{"dp": 1, "tp": 1, **layout}), opt, clip) for layout, opt, clip in CONFIGS[world]]


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_matches_single_device(world):
    per_rank = run_distributed(_train_all, world, world, timeout=240)
    for index, (layout, optimizer, clip) in enumerate(CONFIGS[world]):
        parts = [results[index] for results in per_rank]
        for rank, part in enumerate(parts):
            assert part.losses == parts[0].losses, f"{layout}: rank {rank} reports another loss"
        try:
            # fp32: micro-batching reorders the batch sums (TOLERANCES in tests/reference.py)
            assert_trajectories_match(merge(parts), reference(optimizer, clip))
        except AssertionError as error:
            raise AssertionError(f"{layout} {optimizer} clip={clip}: {error}") from error


# ----------------------------------------------------------------- posting receives ahead
def _posting(layout: dict) -> dict[str, object]:
    """The same steps with receives posted ahead (gloo's default) and where lowered (the order NCCL needs)."""
    out: dict[str, object] = {}
    for lookahead in ("default", None):
        model, task = make_gpt()
        engine = plait.parallelize(model, Layout(dp=1, **layout), optimizer=OPTIMIZERS["adamw"], max_grad_norm=0.05)
        runner = engine.pipeline
        out[f"chosen {lookahead}"] = (runner.recv_lookahead, engine.comm.p2p_progresses_independently("pp"))
        if lookahead is None:
            runner.recv_lookahead = None
        loader = ShardedBatches(task, GLOBAL_BATCH)
        out[f"losses {lookahead}"] = [engine.train_step(loader.global_batch_at(step)).loss for step in range(3)]
        out[f"params {lookahead}"] = snapshot_params(engine.model)
        out[f"batches {lookahead}"] = sum(len(item) for item in runner.program if isinstance(item, tuple))
    return out


@pytest.mark.distributed
@pytest.mark.parametrize(
    "layout",
    [dict(pp=2, microbatches=4, schedule="1f1b"), dict(pp=2, microbatches=4, schedule="interleaved", virtual_stages=2)],
)
def test_receives_posted_ahead_train_bitwise_like_receives_posted_where_lowered(layout):
    """Posting order moves no number: losses and parameters are bitwise equal with receives posted ahead (what
    gloo gets) and where the lowering put them (what NCCL gets, run here on gloo)."""
    for rank, out in enumerate(run_distributed(_posting, 2, layout)):
        assert out["chosen default"] == (PipelineRunner.RECV_LOOKAHEAD, True), "gloo posts receives ahead"
        assert out["losses default"] == out["losses None"], rank
        for name, tensor in out["params default"].items():
            assert torch.equal(tensor, out["params None"][name]), (rank, name)
        assert out["batches default"] > out["batches None"], "receives ahead are batches of their own"


# ----------------------------------------------------------------- mixed precision
def _mixed_precision() -> dict[str, list[tuple[float, float | None]]]:
    out = {}
    for precision in ("bf16", "fp16"):
        model, task = make_gpt()
        layout = Layout(pp=2, dp=1, microbatches=4, schedule="zero-bubble", precision=precision)
        engine = plait.parallelize(model, layout, optimizer=OPTIMIZERS["adamw"])
        loader = ShardedBatches(task, GLOBAL_BATCH)
        stats = [engine.train_step(loader.global_batch_at(step)) for step in range(STEPS)]
        out[precision] = [(s.loss, s.loss_scale) for s in stats]
    return out


@pytest.mark.distributed
def test_mixed_precision_autocasts_stages_and_scales_the_loss():
    results = run_distributed(_mixed_precision, 2)
    expected = reference("adamw", None).losses
    for precision, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        assert results[0][precision] == results[1][precision]
        tolerance = TOLERANCES[dtype]  # a few steps of the dtype's mantissa (tests/reference.py)
        for step, ((loss, scale), want) in enumerate(zip(results[0][precision], expected)):
            assert abs(loss - want) <= tolerance["atol"] + tolerance["rtol"] * abs(want), (precision, step, loss, want)
            assert (scale is not None) == (precision == "fp16")


# ----------------------------------------------------------------- nn.Sequential, cuts, evaluate, bad batch
def make_mlp() -> nn.Sequential:
    torch.manual_seed(7)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    )


def regression_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator)) for _ in range(STEPS)]


def _train_mlp(trace: str, png: str) -> dict:
    engine = plait.parallelize(
        make_mlp(),
        Layout(pp=2, dp=1, microbatches=4, schedule="1f1b"),
        optimizer=OPTIMIZERS["adamw"],
        loss_fn=nn.functional.mse_loss,
        pipeline_cuts=[5],
    )
    out = Trajectory()
    engine.before_optimizer_step.append(lambda e: out.grads.append(snapshot_grads(e.model)))
    for batch in regression_batches():
        out.losses.append(engine.train_step(batch).loss)
        out.params.append(snapshot_params(engine.model))
    timeline = engine.save_pipeline_trace(trace, png=png)  # the last step, measured on both ranks
    evaluation = engine.evaluate(regression_batches()[:2])
    try:
        engine.train_step((torch.randn(6, 6), torch.randn(6, 3)))
        bad_batch = None
    except LayoutError as error:
        bad_batch = str(error)
    return {"trajectory": out, "eval": evaluation.loss, "bad_batch": bad_batch, "timeline": timeline}


@pytest.mark.distributed
def test_sequential_model_with_cuts_evaluate_and_bad_batch(tmp_path):
    results = run_distributed(_train_mlp, 2, str(tmp_path / "trace.json"), str(tmp_path / "trace.png"))
    check_measured_timeline(results, tmp_path)
    assert sorted(results[1]["trajectory"].params[0]) == ["6.bias", "6.weight"], "cuts=[5]: stage 1 is children 5, 6"
    expected = train_reference(make_mlp(), regression_batches(), OPTIMIZERS["adamw"], loss_fn=nn.functional.mse_loss)
    assert_trajectories_match(merge([r["trajectory"] for r in results]), expected)  # fp32 micro-batch reordering
    final = make_mlp()
    final.load_state_dict(expected.params[-1])
    with torch.no_grad():
        losses = [nn.functional.mse_loss(final(x), y) for x, y in regression_batches()[:2]]
    for result in results:  # the whole batch in one pass (no micro-batches): same sums as the reference
        assert result["eval"] == pytest.approx(float(sum(losses) / 2), rel=1e-6)
        assert "does not split into microbatches=4" in result["bad_batch"] and "Fix" in result["bad_batch"]


def check_measured_timeline(results: list[dict], tmp_path) -> None:  # noqa: ANN001
    """The gathered timeline is the same on both ranks; each rank ran its schedule's compute actions in order,
    without overlap; a stage-1 forward starts after stage 0's forward of that micro-batch ended (one clock);
    the trace on disk has those spans for every rank and the measured bubble; the PNG exists."""
    timeline = results[0]["timeline"]
    assert [[(s.action, s.start) for s in spans] for spans in results[1]["timeline"].timelines] == [
        [(s.action, s.start) for s in spans] for spans in timeline.timelines
    ]
    schedule = timeline.schedule
    ends = {}
    for rank, spans in enumerate(timeline.timelines):
        assert [s.action for s in spans] == [a for a in schedule.actions[rank] if not a.is_comm]
        assert all(0 <= a.start <= a.end <= b.start for a, b in zip(spans, spans[1:])), f"rank {rank} overlaps"
        ends.update({(s.action.stage, s.action.kind, s.action.microbatch): s.end for s in spans})
    for span in timeline.timelines[1]:
        if span.action.kind == "F":
            assert span.start >= ends[(0, "F", span.action.microbatch)], f"{span.action} before its input existed"
    busy = sum(timeline.busy)
    assert 0 < timeline.bubble_fraction < 1
    assert timeline.bubble_fraction == pytest.approx(1 - busy / (2 * timeline.makespan))
    trace = json.loads((tmp_path / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted({e["tid"] for e in spans}) == [0, 1] and len(spans) == 2 * 2 * 4  # F and B of 4 micro-batches
    assert trace["otherData"]["bubble_fraction"] == pytest.approx(timeline.bubble_fraction)
    assert (tmp_path / "trace.png").stat().st_size > 1000


def test_pipeline_timeline_needs_pp_and_a_step():
    engine = plait.parallelize(make_mlp(), Layout(dp=1), optimizer=OPTIMIZERS["sgd"], loss_fn=nn.functional.mse_loss)
    with pytest.raises(LayoutError, match="pp=1. Fix: train with Layout"):
        engine.pipeline_timeline()
    config = RunConfig.from_dict({"train": {"pipeline_trace": "run/pipeline.json"}})
    with pytest.raises(ConfigError, match="needs pipeline parallelism.*Fix: set layout.pp > 1"):
        build(config, SimpleNamespace(world_size=1))


# ----------------------------------------------------------------- integer and bool tensors between stages
class Bucketize(nn.Module):
    """Parameter-free: each input value's bucket index (int64), the next stage's embedding ids."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.bucketize(x, torch.linspace(-1.5, 1.5, 7))


class Positive(nn.Module):
    """Parameter-free: a bool mask."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x > 0


class AsFloat(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float()


def make_discrete(dtype: str) -> nn.Sequential:
    """Stage 0 (children 0-1, cuts=[2]) sends int64 bucket ids or a bool mask; stage 1 trains on them. Stage 0's
    linear layer gets no gradient (nothing differentiable crosses), here as on one device."""
    torch.manual_seed(5)
    if dtype == "int64":
        return nn.Sequential(nn.Linear(6, 6), Bucketize(), nn.Embedding(8, 4), nn.Flatten(), nn.Linear(4 * 6, 3))
    return nn.Sequential(nn.Linear(6, 6), Positive(), AsFloat(), nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _train_discrete() -> dict[tuple[str, str], Trajectory]:
    out = {}
    for schedule, dtype in [(schedule, dtype) for schedule in ("1f1b", "zero-bubble") for dtype in ("int64", "bool")]:
        engine = plait.parallelize(
            make_discrete(dtype),
            Layout(pp=2, dp=1, microbatches=4, schedule=schedule, pipeline_cuts=(2,)),  # the cut from the layout
            optimizer=OPTIMIZERS["adamw"],
            loss_fn=nn.functional.mse_loss,
            find_unused_parameters=True,
        )
        trajectory = out[schedule, dtype] = Trajectory()
        engine.before_optimizer_step.append(lambda e, t=trajectory: t.grads.append(snapshot_grads(e.model)))
        for batch in regression_batches():
            trajectory.losses.append(engine.train_step(batch).loss)
            trajectory.params.append(snapshot_params(engine.model))
        trajectory.metas = engine.pipeline._shapes(regression_batches()[0][0][:2])  # type: ignore[attr-defined]
    return out


@pytest.mark.distributed
def test_integer_and_bool_tensors_between_stages():
    per_rank = run_distributed(_train_discrete, 2)
    for schedule, dtype in per_rank[0]:
        assert per_rank[1][schedule, dtype].metas[0].dtype == getattr(torch, dtype), "stage 0 must send that dtype"
        expected = train_reference(
            make_discrete(dtype), regression_batches(), OPTIMIZERS["adamw"], loss_fn=nn.functional.mse_loss
        )
        # fp32 micro-batch reordering (tests/reference.py)
        assert_trajectories_match(merge([r[schedule, dtype] for r in per_rank]), expected)


# ----------------------------------------------------------------- memory: 1F1B vs GPipe
def _peak_first_stage(schedule: str) -> int:
    model, task = make_gpt()
    engine = plait.parallelize(
        model, Layout(pp=4, dp=1, microbatches=8, schedule=schedule), optimizer=OPTIMIZERS["sgd"]
    )
    assert engine.pipeline is not None
    engine.pipeline.count_activations()
    engine.train_step(ShardedBatches(task, 16).global_batch_at(0))
    return engine.pipeline.peak_activation_bytes().get(0, 0)


def _peaks() -> dict[str, int]:
    return {schedule: _peak_first_stage(schedule) for schedule in ("gpipe", "1f1b")}


@pytest.mark.distributed
def test_1f1b_holds_fewer_activations_than_gpipe_on_the_first_stage():
    peaks = run_distributed(_peaks, 4)[0]
    # stage 0 holds all m=8 micro-batches under GPipe, at most p=4 under 1F1B: the ratio is 4/8 exactly when
    # every micro-batch saves the same bytes (same shapes)
    assert peaks["1f1b"] * 2 == peaks["gpipe"], peaks


# ----------------------------------------------------------------- split backward (no processes)
class CountBackward(torch.autograd.Function):
    """Identity whose backward counts its calls (marks the input path of the graph)."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        CountBackward.calls += 1
        return grad


class Counted(nn.Module):
    def forward(self, x):
        return CountBackward.apply(x)


@pytest.mark.parametrize("split", [False, True])
def test_input_then_weight_backward_equals_full_backward(split):
    torch.manual_seed(0)
    body = nn.Sequential(Counted(), nn.Linear(8, 8), nn.GELU(), Counted(), nn.LayerNorm(8), nn.Linear(8, 4))
    stage = PipelineStage(body, index=1, num_stages=3)
    x, grad_out = torch.randn(5, 8), torch.randn(5, 4)
    stage.forward(0, x)
    CountBackward.calls = 0
    if split:
        grad_in = stage.backward_input(0, grad_out)
        calls_in_i = CountBackward.calls
        assert all(p.grad is None for p in body.parameters()), "I must not touch the weight gradients"
        stage.backward_weight(0)
        assert CountBackward.calls == calls_in_i == 2, "W must not run the input path again"
    else:
        grad_in = stage.backward(0, grad_out)
    grads = {name: p.grad.clone() for name, p in body.named_parameters()}
    expected_x = x.clone().requires_grad_(True)
    for p in body.parameters():
        p.grad = None
    torch.autograd.backward(body(expected_x), grad_out)
    assert torch.equal(grad_in, expected_x.grad)  # the same kernels on the same values: bitwise
    for name, p in body.named_parameters():
        assert torch.equal(grads[name], p.grad), name
    assert stage.in_flight == 0 and stage.held_bytes == 0


def test_weight_used_twice_falls_back_to_an_exact_second_pass():
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    body = nn.Sequential(shared, nn.Tanh(), shared)
    stage = PipelineStage(body, index=1, num_stages=2)
    x = torch.randn(3, 4)
    stage.forward(0, x)
    stage.set_loss(0, stage._held[0].output.square().sum())
    grad_in = stage.backward_input(0, None)
    stage.backward_weight(0)
    expected_x = x.clone().requires_grad_(True)
    got = {n: p.grad.clone() for n, p in body.named_parameters()}
    body.zero_grad(set_to_none=True)
    body(expected_x).square().sum().backward()
    assert torch.allclose(grad_in, expected_x.grad, rtol=1e-6, atol=1e-7)  # fp32, another summation order
    for n, p in body.named_parameters():
        assert torch.allclose(got[n], p.grad, rtol=1e-6, atol=1e-7), n


# ----------------------------------------------------------------- bad input (no processes)
def test_bad_pipeline_layouts_are_rejected_before_any_collective():
    model, _ = make_gpt()
    with pytest.raises(LayoutError, match=r"stage 0 \(stage 0: units\[0:1\]\) holds no trainable parameters.*Fix"):
        plan_pipeline(nn.Sequential(Bucketize(), nn.Embedding(8, 4)), Layout(pp=2, microbatches=2).resolve(2))
    with pytest.raises(LayoutError, match=r"16 stages, but the model has only 8 blocks.*Fix"):
        plan_pipeline(model, Layout(pp=8, dp=1, microbatches=8, schedule="interleaved", virtual_stages=2).resolve(8))
    with pytest.raises(LayoutError, match=r"multiple of pp.*Fix"):
        plan_pipeline(model, Layout(pp=4, dp=1, microbatches=6, schedule="interleaved", virtual_stages=2).resolve(4))


def test_deadlocking_custom_schedule_is_rejected_before_running():
    deadlock = Schedule.from_text("0F0 0B0 0F1 0B1\n1F1 1F0 1B0 1B1")  # rank 1 waits for 0F1 behind 0B0
    model, _ = make_gpt()
    with pytest.raises(ScheduleError, match="deadlock"):
        plan_pipeline(model, Layout(pp=2, dp=1, microbatches=2).resolve(2), schedule=deadlock)
    with pytest.raises(LayoutError, match="m=2 .* microbatches=4"):
        plan_pipeline(model, Layout(pp=2, dp=1, microbatches=4).resolve(2), schedule=deadlock)


def test_stage_outputs_must_be_one_tensor():
    stages = split_model(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), 2)
    stage = PipelineStage(nn.ModuleList(stages), 0, 2)
    stage.module.forward = lambda x: (x, x)  # type: ignore[method-assign]
    with pytest.raises(TypeError, match="single tensor"):
        stage.forward(0, torch.randn(1, 2))
