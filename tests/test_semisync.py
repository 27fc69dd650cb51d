"""Semi-synchronous training (``plait.parallel.semisync``): LocalSGD and DiLoCo over HSDP replica groups, against
the one-process simulation of the same algorithm (tests/helpers/semisync_reference.py).

- Parity: R = 2 replica groups of 1 rank (zero=0) and of 2 ranks (ZeRO-3, ZeRO-1 or DDP inside a group), H = 2 or 3,
  6 steps (2 or 3 outer steps), the tiny GPT's rows scoring uneven numbers of tokens, clipped and unclipped: every
  step's reported loss, and every rank's whole parameters after every step, mid-window (its own group's copy)
  and after each outer step (every replica bitwise equal).
- Bytes: on ``replicate`` nothing on inner steps; at each outer step exactly what synchronous HSDP sends there per
  step (the same shards, fp32), so a window of H steps sends 1/H of synchronous HSDP's (zero=0: 2(R-1)/R x 4 P).
- ``plait train``'s loop: checkpoints at outer-step boundaries only, a resume with the same losses.
- Checkpoints: DiLoCo saved at an outer-step boundary and resumed continues bitwise (every group's AdamW state and
  the outer momentum restored); a save mid-window is refused.
- Errors: one-line LayoutErrors with the fix, before any work.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest
import torch
from helpers import composition
from helpers.composition import CLIP, GLOBAL_BATCH, LOSS_RTOL, PARAM_TOL, make_model, merge_ranks, optimizer
from helpers.harness import run_distributed
from helpers.reference import assert_tensors_close
from helpers.semisync_reference import Simulation, simulate

import plait
from plait import Layout, LayoutError
from plait.data import ShardedBatches
from plait.errors import ConfigError
from plait.parallel.semisync import SemiSync
from plait.train.config import TrainConfig

STEPS = 6
CASES: dict[str, tuple[dict, str, int, float | None]] = {
    "r2x1-zero0-localsgd-h2-clipped": (dict(dp=2, dp_replicate=2, zero=0), "localsgd", 2, CLIP),
    "r2x1-zero0-diloco-h3-unclipped": (dict(dp=2, dp_replicate=2, zero=0), "diloco", 3, None),
    "r2x2-zero3-localsgd-h3-unclipped": (dict(dp=4, dp_replicate=2, zero=3), "localsgd", 3, None),
    "r2x2-zero0-localsgd-h2-clipped": (dict(dp=4, dp_replicate=2, zero=0), "localsgd", 2, CLIP),  # DDP in a group
    "r2x2-zero3-diloco-h2-clipped": (dict(dp=4, dp_replicate=2, zero=3), "diloco", 2, CLIP),
    "r2x2-zero1-diloco-h3-clipped-mb2": (dict(dp=4, dp_replicate=2, zero=1, microbatches=2), "diloco", 3, CLIP),
}
LONG_CASES: dict[str, tuple[dict, str, int, float | None]] = {
    "r2-pp2-zero1-1f1b-diloco": (dict(dp=2, dp_replicate=2, pp=2, zero=1, microbatches=2), "diloco", 2, CLIP),
    "r2-cp2-zero3-localsgd": (dict(dp=2, dp_replicate=2, cp=2, zero=3), "localsgd", 3, CLIP),  # shard: the cp pair
    "r2-tp2-zero0-diloco": (dict(dp=2, dp_replicate=2, tp=2, zero=0), "diloco", 3, None),
}
"""``long``: compositions at world 4 (R = 2 groups of one data rank each split over pp, cp or tp)."""
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
        params.append(composition.whole_parameters(engine))
        replicate.append(sum(c.wire_bytes for (axis, _op), c in stats.comm.counts.items() if axis == "replicate"))
    return {"losses": losses, "params": params, "replicate": replicate, "group": engine.mesh.index("replicate")}


def _checkpoint(root: str, fields: dict) -> dict:
    """DiLoCo (H=2): 4 steps, a save at step 4, 2 more steps; a fresh engine loads and trains the same 2. A save
    at step 3 (mid-window) is refused. Synchronous HSDP loads the same checkpoint (group 0's optimizer state)."""
    every = 2
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
    saved = composition.whole_parameters(engine)
    continued = [engine.train_step(loader.batch_at(step)).loss for step in (4, 5)]
    after = composition.whole_parameters(engine)
    fresh, _ = _engine(fields, "diloco", every, CLIP)
    assert fresh.load(os.path.join(root, "diloco")) == 4
    resumed = [fresh.train_step(loader.batch_at(step)).loss for step in (4, 5)]
    same = _equal(after, fresh)
    synchronous, _ = _engine(fields, None, 1, CLIP)
    assert synchronous.load(os.path.join(root, "diloco")) == 4
    loaded = _equal(saved, synchronous)
    synchronous.train_step(loader.batch_at(4))
    return {"refused": refused, "continued": continued, "resumed": resumed, "same": same, "sync_loads": loaded}


def _equal(expected: dict[str, torch.Tensor], engine: plait.Engine) -> bool:
    actual = composition.whole_parameters(engine)
    return actual.keys() == expected.keys() and all(torch.equal(actual[k], expected[k]) for k in expected)


def _suite(world: int, root: str) -> dict:
    cases = {name: _train(*CASES[name]) for name in CASES if CASES[name][0]["dp"] == world}
    if world == 4:  # synchronous HSDP's bytes on replicate, per step, for the same shards
        cases["sync-zero3"] = _train(dict(dp=4, dp_replicate=2, zero=3), None, 1, None)
        cases["sync-zero1-mb2"] = _train(dict(dp=4, dp_replicate=2, zero=1, microbatches=2), None, 1, None)
    # the outer momentum as whole tensors (zero=0, groups of one rank) and as ZeRO-3 shards (groups of two)
    return {
        "cases": cases,
        "checkpoint": _checkpoint(root, dict(dp=world, dp_replicate=2, zero=3 if world == 4 else 0)),
    }


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    root = tmp_path_factory.mktemp(f"semisync{request.param}")
    return run_distributed(_suite, request.param, request.param, str(root), timeout=600, comm_timeout_s=60)


@functools.cache
def _simulation(name: str) -> Simulation:
    fields, mode, every, clip = {**CASES, **LONG_CASES}[name]
    return simulate(mode, every, fields["dp_replicate"], fields["dp"] // fields["dp_replicate"], STEPS, clip)


def assert_matches_simulation(name: str, fields: dict, every: int, per_rank: list[dict], expected: Simulation) -> None:
    """Every rank reports the same losses, equal to the simulation's; every rank's parameters after every step
    equal its group's copy (bitwise with groups of one rank and nothing else split: ``EXACT``), every replica
    bitwise equal after each outer step, and the groups really apart inside a window."""
    exact = fields["dp"] == fields["dp_replicate"] and all(fields.get(a, 1) == 1 for a in ("tp", "pp", "cp"))
    tol = EXACT if exact else PARAM_TOL
    losses = per_rank[0]["losses"]
    for rank, mine in enumerate(per_rank):
        assert mine["losses"] == losses, f"{name}: rank {rank} reports another loss"
        for step in range(STEPS):
            wanted = expected.params[step][mine["group"]]
            wanted = {key: value for key, value in wanted.items() if key in mine["params"][step]}  # pp: its stages
            assert_tensors_close(mine["params"][step], wanted, f"{name} rank {rank} step {step}", tol)
    for step in range(STEPS):
        if (step + 1) % every == 0:  # after an outer step every replica is bitwise the same, every name held
            merged = merge_ranks([r["params"][step] for r in per_rank], f"{name} after the outer step {step}")
            assert merged.keys() == expected.params[step][0].keys(), f"{name}: parameters on no rank"
    for step, (actual, wanted) in enumerate(zip(losses, expected.losses, strict=True)):
        # the (S, N) sums are float64 but each group's S_g is an fp32 sum: exact groups agree to fp32 rounding
        assert abs(actual - wanted) <= LOSS_RTOL * abs(wanted), f"{name} step {step}: loss {actual} != {wanted}"
    first = {}  # step 0 (inside a window): the groups' parameters differ, or the test could not see the algorithm
    for mine in per_rank:
        first.setdefault(mine["group"], {}).update(mine["params"][0])
    assert not all(torch.equal(first[0][k], first[1][k]) for k in first[0]), f"{name}: groups equal mid-window"


@pytest.mark.distributed
def test_semisync_matches_the_one_process_simulation(runs: list[dict]) -> None:
    names = [name for name in runs[0]["cases"] if not name.startswith("sync")]
    assert names, "no case ran"
    for name in names:
        fields, _mode, every, _clip = CASES[name]
        assert_matches_simulation(name, fields, every, [r["cases"][name] for r in runs], _simulation(name))


@pytest.mark.distributed
@pytest.mark.long
def test_semisync_compositions_match_the_simulation() -> None:
    per_rank = run_distributed(_long_suite, 4, timeout=900, comm_timeout_s=120)
    for name, (fields, _mode, every, _clip) in LONG_CASES.items():
        assert_matches_simulation(name, fields, every, [r[name] for r in per_rank], _simulation(name))


def _long_suite() -> dict:
    return {name: _train(*LONG_CASES[name]) for name in LONG_CASES}


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
            if fields["zero"] == 0:  # every parameter, fp32, all-reduced over R = 2: 2(R-1)/R x 4 P = 4 P
                params = sum(p.numel() for p in make_model()[0].parameters())
                assert outer == [4 * params] * len(outer), f"{name} rank {rank}: {sent} != 4 x {params} per outer step"
            else:  # the same shards as synchronous HSDP's per-step all-reduce: 1/H of it per window
                sync = per_rank["cases"]["sync-zero3" if fields["zero"] == 3 else "sync-zero1-mb2"]["replicate"]
                assert sync[0] > 0 and sync == [sync[0]] * STEPS, f"synchronous HSDP sent {sync} on replicate"
                assert outer == [sync[0]] * len(outer), (name, rank, sent, sync)
                assert sum(sent) * every == sum(sync), (name, rank)


@pytest.mark.distributed
def test_diloco_resumes_bitwise_at_an_outer_step_boundary(runs: list[dict]) -> None:
    for rank, result in enumerate(runs):
        check = result["checkpoint"]
        assert "mid-window" in check["refused"] and "save_every" in check["refused"], check["refused"]
        assert check["resumed"] == check["continued"], f"rank {rank}: {check}"
        assert check["same"], f"rank {rank}: resumed parameters differ"
        assert check["sync_loads"], f"rank {rank}: synchronous HSDP loaded other parameters"


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


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        (dict(sync="async"), ["train.sync", "localsgd"]),
        (dict(sync="diloco"), ["train.sync_every", "Fix"]),
        (dict(sync="localsgd", sync_every=4, save_every=10), ["save_every=10", "multiple", "train.save_every=8"]),
        (dict(sync="diloco", sync_every=4, outer_lr=-1.0), ["train.outer_lr"]),
        (dict(sync="diloco", sync_every=4, outer_momentum=1.5), ["train.outer_momentum"]),
    ],
)
def test_bad_train_sync_settings_are_refused(fields: dict, words: list[str]) -> None:
    with pytest.raises(ConfigError) as error:
        TrainConfig(**fields)
    assert all(word in str(error.value) for word in words), str(error.value)


def test_train_sync_builds_the_semisync() -> None:
    assert TrainConfig().semisync() is None
    built = TrainConfig(sync="diloco", sync_every=4, save_every=8, outer_lr=0.5).semisync()
    assert built == SemiSync("diloco", every=4, outer_lr=0.5, outer_momentum=0.9)


def _losses(root: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if r["kind"] == "train"}


def _run_job(root: str) -> dict[int, float]:
    """``plait train``'s loop under DiLoCo (R = 2 groups of one rank, H = 2): 5 steps, then resumed to 7. Returns
    the first run's losses."""
    from plait.distributed import init
    from plait.train.config import RunConfig
    from plait.train.loop import run

    world = init()
    train = {"global_batch": 8, "eval_every": 0, "samples": 0, "tensorboard": False, "log_every": 1, "out": root}
    train |= {"sync": "diloco", "sync_every": 2, "save_every": 2}
    first: dict[int, float] = {}
    for steps in (5, 7):
        run(RunConfig.from_dict({"layout": {"dp": 2, "dp_replicate": 2}, "train": {**train, "steps": steps}}), world)
        first = first or _losses(Path(root))
    return first


@pytest.mark.distributed
def test_the_training_loop_saves_at_boundaries_and_resumes(tmp_path: Path) -> None:
    """Checkpoints at steps 2, 4 and 6 only (the last steps, 5 and 7, fall inside a window: not saved); the resumed
    run redoes step 5 from step 4's checkpoint with the same loss, and records every step once."""
    first = run_distributed(_run_job, 2, str(tmp_path), timeout=300)[0]
    losses = _losses(tmp_path)
    assert list(losses) == list(range(1, 8)) and list(first) == list(range(1, 6)), (first, losses)
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")) == [f"step-{n:08d}" for n in (2, 4, 6)]
    assert [losses[step] for step in range(1, 6)] == [first[step] for step in range(1, 6)], (first, losses)
