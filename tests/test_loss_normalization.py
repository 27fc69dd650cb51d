"""Token-mean losses over the global batch (issue 24): with rows that score uneven numbers of tokens, every layout
trains exactly like one device on the same global batch (losses, gradients, parameters, several steps, clipped
and unclipped), because each micro-batch differentiates its token *sum* over the global batch's token count
(``plait.parallel.loss_normalization``). A mean of per-micro-batch or per-rank means, what plait did before,
misses by ~1% here (``test_the_old_mean_of_means_would_miss``).

The composition matrix (tests/test_composition.py) trains its 45 cells on the same uneven masks; this file adds
what the matrix does not hold: every pipeline schedule (PipeDream included), ZeRO-2, Megatron-SP, Ulysses, micro-
batches at world 1, unclipped runs, a user's own ``MeanLoss``, evaluation, an all-masked batch and the units.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers.composition import make_model, optimizer, whole_gradients, whole_parameters
from helpers.harness import run_distributed
from helpers.reference import Trajectory, assert_trajectories_match, train_reference

import plait
from plait import Layout
from plait.data import ShardedBatches
from plait.models import lm_loss
from plait.models.loss import CrossEntropyMean, MeanLoss, as_mean_loss, mean_loss
from plait.parallel.loss_normalization import MicroMeanStep, TokenMeanStep, step_loss
from plait.parallel.pipeline.pipedream import PipeDreamOptions

STEPS = 3
GLOBAL_BATCH = 8
CLIP = 0.05


def batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    _, task = make_model()
    loader = ShardedBatches(task, GLOBAL_BATCH)
    return [loader.global_batch_at(step) for step in range(steps)]


def reference(clip: float | None, loss_fn=F.cross_entropy) -> Trajectory:
    model, _ = make_model()
    return train_reference(model, batches(), optimizer, loss_fn=loss_fn, max_grad_norm=clip)


def masked_sum(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A user's loss written as a sum: squared error of the target's logit against 1, over the scored tokens."""
    scored = target != -100
    picked = output.gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return ((picked - 1.0) ** 2 * scored).sum()


USER_LOSS = mean_loss(masked_sum, lambda target: (target != -100).sum())


def _train(layout: Layout, clip: float | None, loss: str = "default", pipedream: PipeDreamOptions | None = None):
    """One layout on this rank: losses, whole synchronised gradients and whole parameters after every step."""
    model, task = make_model()
    kwargs = {"loss_fn": USER_LOSS} if loss == "user" else {}
    engine = plait.parallelize(model, layout, optimizer=optimizer, max_grad_norm=clip, pipedream=pipedream, **kwargs)
    out = Trajectory()
    engine.before_optimizer_step.append(lambda e: out.grads.append(whole_gradients(e)))
    loader = ShardedBatches(task, GLOBAL_BATCH, dp_rank=engine.mesh.index("dp"), dp_size=engine.mesh.size("dp"))
    for step in range(STEPS):
        stats = engine.train_step(loader.batch_at(step))
        out.losses.append(stats.loss)
        out.params.append(whole_parameters(engine))
    out.evaluation = engine.evaluate([loader.batch_at(STEPS)]).loss  # type: ignore[attr-defined]
    return out


def _train_all(cases: list[tuple[str, Layout, float | None, str, PipeDreamOptions | None]]) -> dict[str, Trajectory]:
    """Every case of one world size in one process group."""
    return {name: _train(layout, clip, loss, pipedream) for name, layout, clip, loss, pipedream in cases}


def _merge(per_rank: list[Trajectory]) -> Trajectory:
    """The ranks' whole tensors by name (pipeline stages hold different names; replicas must agree)."""
    merged = Trajectory(losses=per_rank[0].losses)
    for step in range(STEPS):
        grads: dict[str, torch.Tensor] = {}
        params: dict[str, torch.Tensor] = {}
        for rank in per_rank:
            if rank.grads:
                grads.update(rank.grads[step])
            params.update(rank.params[step])
        merged.grads.append(grads)
        merged.params.append(params)
    return merged


def _check(name: str, per_rank: list[Trajectory], clip: float | None, loss: str) -> None:
    expected = reference(clip, USER_LOSS if loss == "user" else F.cross_entropy)
    for rank, run in enumerate(per_rank):
        assert run.losses == per_rank[0].losses, f"{name}: rank {rank} reports another loss"
    actual = _merge(per_rank)
    # PipeDream moves gradients into the live parameters after each backward: compare parameters and losses
    if "pipedream" in name:
        actual.grads = []
    assert_trajectories_match(actual, expected)  # fp32 tolerances: reordered sums (helpers/reference.py)


LAYOUTS: dict[int, list[tuple[str, Layout]]] = {
    1: [("micro4", Layout(microbatches=4))],
    2: [
        ("dp2-micro2", Layout(dp=2, microbatches=2)),
        ("dp2-zero2-micro2", Layout(dp=2, zero=2, microbatches=2)),
        ("dp2-zero3", Layout(dp=2, zero=3)),
        ("pp2-gpipe", Layout(pp=2, microbatches=4, schedule="gpipe")),
        ("pp2-1f1b", Layout(pp=2, microbatches=4, schedule="1f1b")),
        ("pp2-interleaved", Layout(pp=2, microbatches=4, schedule="interleaved", virtual_stages=2)),
        ("pp2-zero-bubble", Layout(pp=2, microbatches=4, schedule="zero-bubble")),
        ("pp2-naive", Layout(pp=2, microbatches=2, schedule="naive")),
        ("tp2-sp", Layout(tp=2, sequence_parallel=True, microbatches=2)),
        ("cp2-ulysses", Layout(cp=2, cp_mode="ulysses", microbatches=2)),
        ("cp2-ring", Layout(cp=2, microbatches=2)),
    ],
    4: [
        ("dp2-pp2-1f1b-zero1", Layout(dp=2, pp=2, microbatches=2, zero=1)),
        ("dp2-tp2-sp-zero3", Layout(dp=2, tp=2, sequence_parallel=True, zero=3, microbatches=2)),
        ("dp2-cp2-ring", Layout(dp=2, cp=2, microbatches=2)),
    ],
}
PIPEDREAM = {
    # one update per step (update_interval = m): synchronous, so equal to one device (PipeDream refuses clipping)
    "pp2-pipedream-window2": (
        2,
        Layout(pp=2, microbatches=2, schedule="pipedream"),
        PipeDreamOptions(update_interval=2),
    ),
    # 1F1B-RR: two replicas of each stage, one micro-batch each (replica d's rows are the dp split's); the update
    # averages them over dp, each normalised by both replicas' token count
    "dp2-pp2-pipedream-rr": (4, Layout(dp=2, pp=2, microbatches=1, schedule="pipedream"), PipeDreamOptions()),
}


def _cases(world: int, clips: tuple[float | None, ...]) -> list:
    cases = [(f"{name}-clip{clip}", layout, clip, "default", None) for name, layout in LAYOUTS[world] for clip in clips]
    cases += [
        (f"{name}-clip{clip}", layout, clip, "default", options)
        for name, (w, layout, options) in PIPEDREAM.items()
        if w == world
        for clip in clips
        if clip is None
    ]
    return cases


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2, 4])
def test_uneven_masks_train_exactly_like_one_device(world):
    """Every layout of ``LAYOUTS`` (and PipeDream with one update per step), clipped and unclipped (clipping
    rescales every gradient alike and so would hide a uniform scale error: the unclipped runs show it)."""
    cases = _cases(world, (None, CLIP))
    results = run_distributed(_train_all, world, cases, timeout=600) if world > 1 else [_train_all(cases)]
    for name, _layout, clip, loss, _options in cases:
        _check(name, [r[name] for r in results], clip, loss)


@pytest.mark.distributed
def test_a_users_mean_loss_is_normalised_over_the_global_batch():
    """``mean_loss(total, count)``: a loss that says what it averages over trains exactly under dp x micro-batches
    and pp, with uneven item counts per rank and micro-batch."""
    cases = [
        ("user-dp2-micro2", Layout(dp=2, microbatches=2), None, "user", None),
        ("user-pp2", Layout(pp=2, microbatches=2), CLIP, "user", None),
    ]
    results = run_distributed(_train_all, 2, cases, timeout=300)
    for name, _layout, clip, loss, _options in cases:
        _check(name, [r[name] for r in results], clip, loss)


@pytest.mark.distributed
def test_evaluation_is_a_mean_over_every_scored_token():
    """``Engine.evaluate`` over dp ranks whose batches score different numbers of tokens: the global token mean."""
    results = run_distributed(_train_all, 2, [("dp2", Layout(dp=2), None, "default", None)], timeout=300)
    model, task = make_model()
    trained = reference(None)
    model.load_state_dict(trained.params[-1])
    inputs, targets = ShardedBatches(task, GLOBAL_BATCH).global_batch_at(STEPS)
    with torch.no_grad():
        expected = float(lm_loss(model(inputs), targets))
    for rank in results:
        assert rank["dp2"].evaluation == pytest.approx(expected, rel=1e-6)


# ----------------------------------------------------------------- what a mean of means would do
def test_the_old_mean_of_means_would_miss():
    """The uneven masks of these tests are strong enough to fail a mean of per-micro-batch means: on the first
    global batch, split in 4 micro-batches, it differs from the token mean by more than 100 x the tolerance."""
    model, _ = make_model()
    inputs, targets = batches(1)[0]
    with torch.no_grad():
        logits = model(inputs)
        token_mean = float(lm_loss(logits, targets))
        pieces = zip(logits.chunk(4), targets.chunk(4))
        mean_of_means = sum(float(lm_loss(x, y)) for x, y in pieces) / 4
    assert abs(mean_of_means - token_mean) > 100 * 1e-6 * token_mean, (mean_of_means, token_mean)


def test_micro_batches_at_world_one_match_one_device_unclipped_and_clipped():
    """World 1, 4 micro-batches of uneven token counts: the plain runner alone (no collectives)."""
    for clip in (None, CLIP):
        assert_trajectories_match(_train(Layout(microbatches=4), clip), reference(clip))


def test_a_loss_that_is_not_a_mean_keeps_equal_micro_batch_weights():
    """An opaque ``loss_fn`` (not a ``MeanLoss``): each micro-batch's value is a mean of equal weight, as
    documented; the step reports the mean of the micro-batch losses."""
    model, task = make_model()

    def opaque(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target) * 1.0

    assert as_mean_loss(opaque) is None
    engine = plait.parallelize(model, Layout(microbatches=2), optimizer=optimizer, loss_fn=opaque)
    inputs, targets = batches(1)[0]
    with torch.no_grad():
        logits = model(inputs)
        expected = sum(float(lm_loss(x, y)) for x, y in zip(logits.chunk(2), targets.chunk(2))) / 2
    assert engine.train_step((inputs, targets)).loss == pytest.approx(expected, rel=1e-6)


def test_a_batch_without_a_scored_token_reports_nan_and_moves_nothing():
    """0/0 is NaN, and the gradient of an empty sum is zero (not NaN: the count is clamped to 1 in the scale), so
    SGD without weight decay leaves every parameter where it was; the step says it scored nothing, so that
    ``plait train`` records it (null) and goes on rather than stopping as diverged."""
    from plait.errors import PlaitError
    from plait.train.metrics import check_step

    model, _ = make_model()
    engine = plait.parallelize(
        model, Layout(microbatches=2), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=lm_loss
    )
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    inputs, targets = batches(1)[0]
    stats = engine.train_step((inputs, torch.full_like(targets, -100)))
    assert math.isnan(stats.loss) and stats.scored == 0
    check_step(stats)  # no error: nothing was scored, nothing diverged
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[name]), name
    scored = engine.train_step((inputs, targets))
    assert scored.scored == int((targets != -100).sum()) and math.isfinite(scored.loss)
    scored._loss = float("nan")  # a NaN over scored tokens is a divergence
    with pytest.raises(PlaitError, match="training diverged"):
        check_step(scored)


# ----------------------------------------------------------------- units
def test_lm_loss_is_torch_cross_entropy_in_fp32_and_splits_into_sum_and_count():
    logits = torch.randn(2, 5, 7, dtype=torch.bfloat16)
    targets = torch.tensor([[1, 2, -100, 4, 5], [-100, -100, 3, 0, 6]])
    flat = logits.reshape(-1, 7).float()
    assert torch.equal(lm_loss(logits, targets), F.cross_entropy(flat, targets.reshape(-1)))
    assert int(lm_loss.count(targets)) == 7
    total = lm_loss.total(logits, targets)
    assert torch.allclose(total / 7, lm_loss(logits, targets), rtol=1e-6)


def test_torch_cross_entropy_is_recognised_as_a_token_mean_and_others_are_not():
    assert isinstance(as_mean_loss(F.cross_entropy), CrossEntropyMean)
    assert as_mean_loss(torch.nn.CrossEntropyLoss(ignore_index=3)).ignore_index == 3  # type: ignore[union-attr]
    assert as_mean_loss(torch.nn.CrossEntropyLoss(label_smoothing=0.1)) is None
    assert as_mean_loss(torch.nn.CrossEntropyLoss(weight=torch.ones(3))) is None
    assert as_mean_loss(torch.nn.CrossEntropyLoss(reduction="sum")) is None
    assert as_mean_loss(F.mse_loss) is None
    assert as_mean_loss(lm_loss) is lm_loss and as_mean_loss(USER_LOSS) is USER_LOSS


def test_a_users_mean_loss_is_its_total_over_its_count():
    output, target = torch.randn(6, 4), torch.tensor([0, 1, -100, 3, -100, 2])
    assert isinstance(USER_LOSS, MeanLoss)
    assert torch.allclose(USER_LOSS(output, target), masked_sum(output, target) / 4)


def test_update_windows_divide_by_their_own_token_counts():
    """PipeDream updates every ``update_interval`` micro-batches: each window's gradients are its token mean."""
    model, _ = make_model()
    engine = plait.parallelize(model, Layout(), optimizer=optimizer)
    targets = [torch.tensor([[1, -100]]), torch.tensor([[1, 2]]), torch.tensor([[-100, -100]]), torch.tensor([[3, 4]])]
    windows = step_loss(lm_loss, engine.comm, targets, window=2)
    assert isinstance(windows, TokenMeanStep)
    one = torch.tensor(1.0)
    assert [float(windows.to_backward(k, one)) for k in range(4)] == pytest.approx([1 / 3, 1 / 3, 1 / 2, 1 / 2])
    whole = step_loss(lm_loss, engine.comm, targets, window=4)
    assert float(whole.to_backward(2, one)) == pytest.approx(1 / 5)
    assert float(whole.report(torch.tensor(10.0))) == pytest.approx(2.0)
    opaque = step_loss(lambda o, t: o, engine.comm, targets, window=2)
    assert isinstance(opaque, MicroMeanStep) and float(opaque.to_backward(0, one)) == 0.5
    with pytest.raises(ValueError, match="windows"):
        step_loss(lm_loss, engine.comm, targets, window=3)


# ----------------------------------------------------------------- the parameter server's BSP rounds
def ps_gpt() -> torch.nn.Module:
    """The parameter-server task's model (module level: the launcher hands the recipe to its processes)."""
    return make_model()[0]


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_parameter_server_bsp_rounds_are_token_means_over_every_worker():
    """BSP with 2 workers whose batches score different numbers of tokens: each worker pushes its summed gradient
    with its token count and the round divides their sum by the summed count, so every step equals synchronous
    training on the union of the batches (before: the mean of the two workers' means)."""
    from plait.param_server import Consistency, JobConfig, ModelTask, OptimizerSpec, run_local

    _, data = make_model()
    task = ModelTask(ps_gpt, data, lm_loss, batch=4, seed=0)
    sgd = OptimizerSpec("SGD", {"lr": 0.5})
    result = run_local(
        JobConfig(
            servers=1, workers=2, steps=3, consistency=Consistency("bsp"), optimizer=sgd, task=task,
            record_history=True, log_every_s=0, worker_log_every_s=0,
        )
    )  # fmt: skip
    model = task.build_model()
    opt = sgd.build(list(model.parameters()))
    for step, shard in enumerate(result.reports[0]["history"]):
        opt.zero_grad()
        task.loss(model, task.global_batch(2, step)).backward()
        opt.step()
        for name, param in model.named_parameters():
            # fp32: the two workers' sums are added in another order than one batch's (~1e-7 relative)
            torch.testing.assert_close(shard[name], param.detach(), rtol=1e-5, atol=1e-6, msg=f"step {step} {name}")
