"""Semi-synchronous training (``plait.parallel.semisync``): LocalSGD and DiLoCo over HSDP replica groups, against
the one-process simulation of the same algorithm (tests/helpers/semisync_reference.py).

- Parity: R = 2 replica groups of 1 rank (zero=0) and of 2 ranks (ZeRO-3 / ZeRO-1 inside a group), H = 2 or 3,
  6 steps (2 or 3 outer steps), the tiny GPT's rows scoring uneven numbers of tokens, clipped and unclipped: every
  step's reported loss, and every rank's whole parameters after every step, mid-window (its own group's copy)
  and after each outer step (every replica bitwise equal).
- Bytes: on ``replicate`` nothing on inner steps; at each outer step exactly what synchronous HSDP sends there per
  step (the same shards, fp32), so a window of H steps sends 1/H of synchronous HSDP's.
- Checkpoints: DiLoCo saved at an outer-step boundary and resumed continues bitwise (every group's AdamW state and
  the outer momentum restored); a save mid-window is refused.
- Errors: one-line LayoutErrors with the fix, before any work.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from helpers.composition import CLIP, GLOBAL_BATCH, LOSS_RTOL, PARAM_TOL, make_model, optimizer, whole_parameters
from helpers.harness import run_distributed
from helpers.reference import assert_tensors_close
from helpers.semisync_reference import simulate

import plait
from plait import Layout, LayoutError
from plait.data import ShardedBatches
from plait.parallel.semisync import SemiSync

STEPS = 6
CASES: dict[str, tuple[dict, str, int, float | None]] = {
    "r2x1-zero0-localsgd-h2-clipped": (dict(dp=2, dp_replicate=2, zero=0), "localsgd", 2, CLIP),
    "r2x1-zero0-diloco-h3-unclipped": (dict(dp=2, dp_replicate=2, zero=0), "diloco", 3, None),
    "r2x2-zero3-localsgd-h3-unclipped": (dict(dp=4, dp_replicate=2, zero=3), "localsgd", 3, None),
    "r2x2-zero3-diloco-h2-clipped": (dict(dp=4, dp_replicate=2, zero=3), "diloco", 2, CLIP),
    "r2x2-zero1-diloco-h3-clipped-mb2": (dict(dp=4, dp_replicate=2, zero=1, microbatches=2), "diloco", 3, CLIP),
}
EXACT = {"rtol": 0.0, "atol": 0.0}
"""Groups of one rank: each inner step is one device's step on the group's rows (no reduction to reorder) and the
outer step's sum over R = 2 is commutative: bitwise. Groups of two ranks reduce-scatter inside the group, the same
sums in another order: the composition matrix's fp32 tolerances (``PARAM_TOL``, ``LOSS_RTOL``)."""


def _engine(fields: dict, mode: str | None, every: int, clip: float | None) -> tuple[plait.Engine, ShardedBatches]:
    model, task = make_model()
    sync = SemiSync(mode, every=every) if mode is not None else None
    engine = plait.parallelize(model, Layout(**fields), optimizer=optimizer, max_grad_norm=clip, sync=sync)
    return engine, ShardedBatches(task, GLOBAL_BATCH, engine.mesh.index("dp"), engine.mesh.size("dp"))


def _train(fields: dict, mode: str | None, every: int, clip: float | None) -> dict:
    """Losses, this rank's whole parameters after every step, and each step's bytes on ``replicate``."""
    engine, loader = _engine(fields, mode, every, clip)
    losses, params, replicate = [], [], []
    for step in range(STEPS):
        stats = engine.train_step(loader.batch_at(step))
        losses.append(stats.loss)
        params.append(whole_parameters(engine))
        replicate.append(sum(c.wire_bytes for (axis, _op), c in stats.comm.counts.items() if axis == "replicate"))
    return {"losses": losses, "params": params, "replicate": replicate, "group": engine.mesh.index("replicate")}


def _checkpoint(root: str) -> dict:
    """DiLoCo (ZeRO-3, H=2): 4 steps, a save at step 4, 2 more steps; a fresh engine loads and trains the same 2.
    A save at step 3 (mid-window) is refused."""
    fields, every = dict(dp=4, dp_replicate=2, zero=3), 2
    engine, loader = _engine(fields, "diloco", every, CLIP)
    for step in range(3):
        engine.train_step(loader.batch_at(step))
    try:
        engine.save(os.path.join(root, "mid"))
        refused = ""
    except LayoutError as error:
        refused = str(error)
    engine.train_step(loader.batch_at(3))
    engine.save(os.path.join(root, "diloco"))
    continued = [engine.train_step(loader.batch_at(step)).loss for step in (4, 5)]
    after = whole_parameters(engine)
    fresh, _ = _engine(fields, "diloco", every, CLIP)
    assert fresh.load(os.path.join(root, "diloco")) == 4
    resumed = [fresh.train_step(loader.batch_at(step)).loss for step in (4, 5)]
    return {"refused": refused, "continued": continued, "resumed": resumed, "same": _equal(after, fresh)}


def _equal(expected: dict[str, torch.Tensor], engine: plait.Engine) -> bool:
    actual = whole_parameters(engine)
    return actual.keys() == expected.keys() and all(torch.equal(actual[k], expected[k]) for k in expected)


def _suite(world: int, root: str) -> dict:
    cases = {name: _train(*CASES[name]) for name in CASES if CASES[name][0]["dp"] == world}
    if world == 4:  # synchronous HSDP's bytes on replicate, per step, for the same shards
        cases["sync-zero3"] = _train(dict(dp=4, dp_replicate=2, zero=3), None, 1, None)
        cases["sync-zero1-mb2"] = _train(dict(dp=4, dp_replicate=2, zero=1, microbatches=2), None, 1, None)
        return {"cases": cases, "checkpoint": _checkpoint(root)}
    return {"cases": cases}


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    root = tmp_path_factory.mktemp(f"semisync{request.param}")
    return run_distributed(_suite, request.param, request.param, str(root), timeout=600, comm_timeout_s=60)


@functools.cache
def _simulation(name: str):  # noqa: ANN202 - a Simulation
    fields, mode, every, clip = CASES[name]
    return simulate(mode, every, fields["dp_replicate"], fields["dp"] // fields["dp_replicate"], STEPS, clip)


@pytest.mark.distributed
def test_semisync_matches_the_one_process_simulation(runs: list[dict]) -> None:
    for name, result in runs[0]["cases"].items():
        if name.startswith("sync"):
            continue
        fields, _mode, every, _clip = CASES[name]
        exact = fields["dp"] == fields["dp_replicate"]
        expected = _simulation(name)
        for rank, per_rank in enumerate(runs):
            mine = per_rank["cases"][name]
            assert mine["losses"] == result["losses"], f"{name}: rank {rank} reports another loss"
            for step in range(STEPS):
                wanted = expected.params[step][mine["group"]]
                tol = EXACT if exact else PARAM_TOL
                assert_tensors_close(mine["params"][step], wanted, f"{name} rank {rank} step {step}", tol)
                if (step + 1) % every == 0:  # after an outer step every replica is bitwise the same
                    for key, value in mine["params"][step].items():
                        assert torch.equal(value, runs[0]["cases"][name]["params"][step][key]), (name, step, key)
        for step, (actual, wanted) in enumerate(zip(result["losses"], expected.losses, strict=True)):
            rtol = 1e-12 if exact else LOSS_RTOL  # float64 (S, N) sums; the groups' losses are fp32
            assert abs(actual - wanted) <= max(rtol, 1e-7) * abs(wanted), f"{name} step {step}: {actual} != {wanted}"
        # the groups really diverge inside a window (or the test could not tell the algorithms apart)
        if every > 1:
            groups = {per_rank["cases"][name]["group"]: per_rank["cases"][name]["params"][0] for per_rank in runs}
            assert not all(torch.equal(groups[0][k], groups[1][k]) for k in groups[0]), f"{name}: groups equal"


@pytest.mark.distributed
def test_replicate_bytes_are_the_outer_steps_only(runs: list[dict]) -> None:
    for name in runs[0]["cases"]:
        if name.startswith("sync"):
            continue
        fields, _mode, every, _clip = CASES[name]
        for rank, per_rank in enumerate(runs):
            sent = per_rank["cases"][name]["replicate"]
            inner = [b for step, b in enumerate(sent) if (step + 1) % every]
            assert inner == [0] * len(inner), f"{name} rank {rank}: inner steps crossed replica groups: {sent}"
            outer = [b for step, b in enumerate(sent) if (step + 1) % every == 0]
            assert all(b > 0 for b in outer), f"{name} rank {rank}: no outer step: {sent}"
            if fields["dp"] == 4:  # the same shards as synchronous HSDP's per-step all-reduce: 1/H of it per window
                sync = per_rank["cases"]["sync-zero3" if fields["zero"] == 3 else "sync-zero1-mb2"]["replicate"]
                assert sync == [sync[0]] * STEPS and outer == [sync[0]] * len(outer), (name, rank, sent, sync)
                assert sum(sent) * every == sum(sync), (name, rank)


@pytest.mark.distributed
def test_diloco_resumes_bitwise_at_an_outer_step_boundary(runs: list[dict]) -> None:
    if "checkpoint" not in runs[0]:
        pytest.skip("the checkpoint case runs in the world-4 job")
    for rank, result in enumerate(runs):
        check = result["checkpoint"]
        assert "mid-window" in check["refused"] and "save_every" in check["refused"], check["refused"]
        assert check["resumed"] == check["continued"], f"rank {rank}: {check}"
        assert check["same"], f"rank {rank}: resumed parameters differ"


# ----------------------------------------------------------------- errors (no processes)
@pytest.mark.parametrize(
    ("kwargs", "layout", "words"),
    [
        (dict(mode="diloco", every=2), Layout(dp=2, zero=3).resolve(2), ["dp_replicate", "Fix"]),
        (dict(mode="localsgd", every=2), Layout(dp=2, dp_replicate=2, precision="fp16").resolve(2), ["bf16"]),
        (
            dict(mode="localsgd", every=2),
            Layout(dp=1, pp=2, dp_replicate=1, schedule="pipedream").resolve(2),
            ["dp_replicate"],
        ),
    ],
)
def test_layouts_it_cannot_run_on_are_refused(kwargs: dict, layout: Layout, words: list[str]) -> None:
    with pytest.raises(LayoutError) as error:
        SemiSync(**kwargs).check(layout)
    assert all(word in str(error.value) for word in words), str(error.value)


def test_pipedream_is_refused() -> None:
    layout = Layout(dp=2, pp=2, dp_replicate=2, schedule="pipedream", microbatches=2).resolve(4)
    with pytest.raises(LayoutError, match="pipedream"):
        SemiSync("diloco", every=2).check(layout)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(mode="sync"), ["semi-synchronous", "localsgd"]),
        (dict(mode="async"), ["diloco"]),
        (dict(every=0), ["sync_every", ">= 1"]),
        (dict(every=2.0), ["sync_every"]),
        (dict(outer_lr=0.0), ["outer_lr"]),
        (dict(outer_momentum=1.0), ["outer_momentum"]),
    ],
)
def test_bad_settings_are_refused(kwargs: dict, words: list[str]) -> None:
    with pytest.raises(LayoutError) as error:
        SemiSync(**kwargs)
    assert all(word in str(error.value) for word in words), str(error.value)
