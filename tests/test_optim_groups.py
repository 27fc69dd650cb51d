"""Optimizer parameter groups (no weight decay for norms / embeddings) under DDP and ZeRO-1/2/3: parity with
single-device ``torch.optim`` on the same groups, with and without clipping, over 5 steps on dp=2 (and ZeRO-3
under pp=2); what the strategies build (each flat buffer laid out group after group, one view per buffer and
group, a rank holding none of a group's elements); checkpoints of grouped ZeRO runs load under another stage;
bad input.

One gloo job (dp=2) runs every configuration in turn; the tests read its results.
"""

from __future__ import annotations

import functools

import pytest
import torch
from helpers.gpt import GLOBAL_BATCH, STEPS, make_model
from helpers.harness import run_distributed
from helpers.reference import Trajectory, assert_trajectories_match, snapshot_params

import plait
from plait import Layout
from plait.data import ShardedBatches
from plait.models.loss import apply_loss
from plait.parallel.param_groups import assign_groups, torch_groups
from plait.train.optim import decay_groups, parameter_kinds

SKIP = ("norms", "embeddings")
OPTIMIZERS = {  # L2-coupled decay (Adam, SGD) and decoupled decay (AdamW) take different code paths in torch
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.5),
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=0.5),
}
CONFIGS = [  # (zero, optimizer, clip, offload or "pp2")
    (0, "adamw", None, "none"),
    (0, "sgd", 0.05, "none"),
    (1, "adamw", None, "none"),
    (1, "adamw", 0.05, "none"),
    (2, "sgd", None, "none"),
    (2, "adamw", 0.05, "none"),
    (3, "adamw", None, "none"),
    (3, "adamw", 0.05, "cpu"),
    (3, "sgd", 0.05, "none"),
    (3, "adamw", 0.05, "pp2"),  # pp=2 (dp=1): each stage's ZeRO-3 units gathered by the pipeline runner
]
BUCKET_MB = 0.004  # ZeRO-2: several buckets, some of one group only


def grouped(optimizer: str, model: torch.nn.Module):
    """The single-device optimizer over the model's parameters in the same groups ``decay_groups`` makes."""
    named = [(n, p) for n, p in model.named_parameters()]
    options, ids = assign_groups(named, decay_groups(model, SKIP))
    members = [[p for (_, p), g in zip(named, ids) if g == i] for i in range(len(options))]
    return OPTIMIZERS[optimizer](torch_groups(options, members))


def reference(optimizer: str, clip: float | None) -> Trajectory:
    """Single-device training on each whole global batch with ``grouped``'s torch optimizer (and torch's clip)."""
    model, task = make_model()
    loader = ShardedBatches(task, GLOBAL_BATCH)
    opt = grouped(optimizer, model)
    out = Trajectory()
    for step in range(STEPS):
        inputs, targets = loader.global_batch_at(step)
        loss = apply_loss(torch.nn.functional.cross_entropy, model(inputs), targets)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.losses.append(float(loss.detach()))
        out.params.append(snapshot_params(model))
    return out


def _train(zero: int, optimizer: str, clip: float | None, offload: str) -> dict:
    model, task = make_model()
    if offload == "pp2":
        layout = Layout(pp=2, zero=zero, microbatches=2)
    else:
        layout = Layout(dp=2, zero=zero, offload=offload, bucket_mb=BUCKET_MB)
    engine = plait.parallelize(
        model, layout, optimizer=OPTIMIZERS[optimizer], max_grad_norm=clip, param_groups=decay_groups(model, SKIP)
    )
    out = Trajectory()
    loader = ShardedBatches(task, GLOBAL_BATCH, dp_rank=engine.mesh.index("dp"), dp_size=engine.mesh.size("dp"))
    for _step, batch in zip(range(STEPS), loader):
        out.losses.append(engine.train_step(batch).loss)
        out.params.append(engine.strategy.full_parameters())
    groups = engine.optimizer.param_groups
    views = getattr(engine.strategy, "group_views", [])
    info = {
        "trajectory": out,
        "decays": [g["weight_decay"] for g in groups],
        "group_sizes": [sum(p.numel() for p in g["params"]) for g in groups],
        "empty_views": sum(v.lo == v.hi for v in views),
        "views": len(views),
    }
    if hasattr(engine.strategy, "close"):
        engine.strategy.close()
    return info


def _checkpoint(root: str) -> dict:
    """Grouped ZeRO-3 AdamW: 3 steps, save; load into grouped ZeRO-1 and ungrouped DDP, 2 more steps each."""
    losses = {}
    model, task = make_model()
    loader = ShardedBatches(task, GLOBAL_BATCH, dp_rank=plait.init().rank, dp_size=2)
    engine = plait.parallelize(
        model, Layout(dp=2, zero=3), optimizer=OPTIMIZERS["adamw"], param_groups=decay_groups(model, SKIP)
    )
    for step in range(5):
        loss = engine.train_step(loader.batch_at(step)).loss
        if step == 2:
            engine.save(root)
        losses.setdefault("zero3", []).append(loss)
    for name, zero in (("zero1", 1), ("zero0", 0)):
        model, _ = make_model()
        other = plait.parallelize(
            model, Layout(dp=2, zero=zero), optimizer=OPTIMIZERS["adamw"], param_groups=decay_groups(model, SKIP)
        )
        other.load(root)
        losses[name] = [other.train_step(loader.batch_at(step)).loss for step in (3, 4)]
    return losses


def _job(root: str) -> dict:
    return {"runs": [_train(*config) for config in CONFIGS], "checkpoint": _checkpoint(root)}


@functools.lru_cache(maxsize=1)
def results(root: str) -> list[dict]:
    return run_distributed(_job, 2, root, timeout=240)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return results(str(tmp_path_factory.mktemp("groups") / "ckpt"))


@pytest.mark.distributed
@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=[f"zero{c[0]}-{c[1]}-clip{c[2]}-{c[3]}" for c in CONFIGS])
def test_groups_match_single_device(job: list[dict], index: int) -> None:
    zero, optimizer, clip, placement = CONFIGS[index]
    expected = reference(optimizer, clip)
    runs = [job[rank]["runs"][index] for rank in range(2)]
    if placement == "pp2":  # each rank holds one stage: its parameters, merged, are the whole model's
        merged = Trajectory(losses=runs[0]["trajectory"].losses)
        merged.params = [{**a, **b} for a, b in zip(runs[0]["trajectory"].params, runs[1]["trajectory"].params)]
        runs = [{**runs[0], "trajectory": merged}]
    for run in runs:
        assert run["decays"] == [0.0, 0.5]  # 0 for the embeddings / norms (seen first), the factory's for weights
        assert_trajectories_match(run["trajectory"], expected)  # fp32 tolerances of tests/reference.py


@pytest.mark.distributed
def test_zero_steps_one_view_per_buffer_and_group(job: list[dict]) -> None:
    model, _ = make_model()
    kinds = parameter_kinds(model)
    skipped = sum(p.numel() for n, p in model.named_parameters() if kinds[n] in SKIP)
    for index, (zero, _optimizer, _clip, placement) in enumerate(CONFIGS):
        if placement == "pp2":
            continue  # one stage per rank: no sharding over dp=1
        sizes = [job[rank]["runs"][index]["group_sizes"] for rank in range(2)]
        if zero == 0:
            assert sizes[0][0] == skipped  # DDP: the model's own parameters, grouped (group 0: no decay)
            continue
        # the two ranks' views of each group cover the group exactly once (padding belongs to no group)
        total = sum(p.numel() for p in model.parameters())
        assert sizes[0][0] + sizes[1][0] == skipped
        assert sizes[0][1] + sizes[1][1] == total - skipped
        assert job[0]["runs"][index]["views"] >= 2
    # ZeRO-1's one bucket is [embeddings, norms | weights]: one rank's half holds no element of a group
    zero1 = next(i for i, c in enumerate(CONFIGS) if c[0] == 1)
    assert job[0]["runs"][zero1]["empty_views"] + job[1]["runs"][zero1]["empty_views"] >= 1


@pytest.mark.distributed
def test_grouped_checkpoint_loads_under_other_stages(job: list[dict]) -> None:
    losses = job[0]["checkpoint"]
    # the same weights and (layout-free) optimizer state continue the same curve under ZeRO-1 and DDP
    assert losses["zero1"] == pytest.approx(losses["zero3"][3:], rel=1e-5)
    assert losses["zero0"] == pytest.approx(losses["zero3"][3:], rel=1e-5)


def test_group_of_must_not_name_params() -> None:
    model, _ = make_model()
    with pytest.raises(ValueError, match="hyper-parameters only"):
        assign_groups(list(model.named_parameters()), lambda name, p: {"params": []})


def test_param_groups_need_a_factory() -> None:
    model, _ = make_model()
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(TypeError, match="needs an optimizer factory"):
        plait.parallelize(model, Layout(), optimizer=optimizer, param_groups=decay_groups(model, SKIP))


def test_parameter_kinds_of_the_reference_gpt() -> None:
    model, _ = make_model()
    kinds = parameter_kinds(model)
    assert kinds["tok_embed.weight"] == "embeddings" and kinds["blocks.0.norm1.weight"] == "norms"
    assert kinds["blocks.0.attn.q.weight"] == "weights" and kinds["lm_head.weight"] == "weights"
    assert decay_groups(model, ()) is None
