"""ZeRO-1/2 with and without CPU/NVMe offload: parity with single-device training (loss, gradients,
parameters; dp=1 bitwise, dp=2 and dp=4 within tolerances; with micro-batches, clipping and
``Layout(recompute=...)``), the memory each rank holds, bytes per step against
2(N-1)/N x P x 4, checkpoints, offload placement, bad input.

The distributed runs are few and long: one gloo job per world size runs every configuration in turn (a job
costs seconds to start, a configuration tens of milliseconds to train), and the tests below read its results.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch
from helpers.gpt import GLOBAL_BATCH, OPTIMIZERS, STEPS, make_model
from helpers.harness import run_distributed
from helpers.reference import Trajectory, assert_trajectories_match, train_reference
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

import plait
from plait import Layout
from plait.data import ShardedBatches
from plait.parallel.zero.offload import is_file_backed
from plait.parallel.zero.optimizers import ELEMENTWISE

BUCKET_MB = 0.004  # ~1000 fp32 elements: the tiny GPT (6736 parameters) makes 8 ZeRO-2 buckets
CONFIGS = (
    [  # (stage, offload, optimizer, microbatches, clip, recompute)
        (stage, "none", opt, mb, clip, "none")
        for stage in (1, 2)
        for opt in ("adamw", "sgd")
        for mb in (1, 2)
        for clip in (None, 0.05)
    ]
    + [
        (stage, offload, opt, mb, clip, "none")
        for stage in (1, 2)
        for offload in ("cpu", "nvme")
        for opt, mb, clip in (("adamw", 2, 0.05), ("sgd", 1, None))
    ]
    + [(1, "none", "adamw", 2, 0.05, "full"), (2, "none", "sgd", 1, None, (1,)), (2, "cpu", "adamw", 2, 0.05, "full")]
)
"""dp=2 runs all of these: every combination without offload, each offload with two of them, and activation
recomputation through the Layout (every block, or block 1 only) under each stage."""
DP4_CONFIGS = [
    (1, "none", "adamw", 2, 0.05, "none"),
    (1, "none", "sgd", 1, None, "none"),
    (2, "none", "adamw", 1, None, "none"),
    (2, "none", "sgd", 2, 0.05, "none"),
    (1, "cpu", "adamw", 2, 0.05, "none"),
    (2, "cpu", "sgd", 1, None, "none"),
    (1, "nvme", "sgd", 1, None, "none"),
    (2, "nvme", "adamw", 2, 0.05, "none"),
    (1, "none", "sgd", 2, None, "full"),
    (2, "none", "adamw", 2, 0.05, "full"),
]
"""dp=4 (4 processes on a small machine) runs each stage, offload, optimizer, accumulation, clipping and
recomputation at least once, in 10 runs instead of 48."""


def layout_of(
    world: int, stage: int, offload: str = "none", microbatches: int = 1, recompute: str | tuple[int, ...] = "none"
) -> Layout:
    return Layout(
        dp=world, zero=stage, offload=offload, microbatches=microbatches, bucket_mb=BUCKET_MB, recompute=recompute
    )


def train(layout: Layout, optimizer: str, clip: float | None, forwards: list[int] | None = None) -> Trajectory:
    """Train the tiny GPT for STEPS steps; gradients are the reduced (and clipped) ones, gathered whole. Each
    forward of block 1's MLP (recomputation runs it again in backward) appends to ``forwards``."""
    model, task = make_model()
    if forwards is not None:
        model.blocks["1"].mlp.register_forward_pre_hook(lambda *_: forwards.append(1))
    engine = plait.parallelize(model, layout, optimizer=OPTIMIZERS[optimizer], max_grad_norm=clip)
    out = Trajectory()
    engine.before_optimizer_step.append(lambda e: out.grads.append(e.strategy.full_gradients()))
    loader = ShardedBatches(task, GLOBAL_BATCH, dp_rank=engine.mesh.index("dp"), dp_size=engine.mesh.size("dp"))
    for _step, batch in zip(range(STEPS), loader):
        out.losses.append(engine.train_step(batch).loss)
        out.params.append(engine.strategy.full_parameters())
    engine.strategy.close()
    return out


def reference(optimizer: str, clip: float | None) -> Trajectory:
    model, task = make_model()
    loader = ShardedBatches(task, GLOBAL_BATCH)
    batches = [loader.global_batch_at(step) for step in range(STEPS)]
    return train_reference(model, batches, OPTIMIZERS[optimizer], max_grad_norm=clip)


def padded_total(engine: plait.Engine) -> int:
    return sum(b.layout.padded for b in engine.strategy.buckets)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's per-element state (tensors with dim >= 1; the 0-dim step counters excluded)."""
    return sum(
        t.numel() * t.element_size()
        for s in optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim() >= 1
    )


# ------------------------------------------------------------------------------------------ worker pieces
def _memory(world: int, stage: int, offload: str) -> dict:
    """Held bytes after finish_backward (gradients) and after a step (optimizer state, placement split)."""
    model, task = make_model()
    full_optimizer = OPTIMIZERS["adamw"]([nn.Parameter(p.detach().clone()) for p in model.parameters()])
    for p in full_optimizer.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    full_optimizer.step()
    engine = plait.parallelize(model, layout_of(world, stage, offload), optimizer=OPTIMIZERS["adamw"])
    seen = {}

    def probe(e: plait.Engine) -> None:
        seen["model_grads"] = sum(p.grad is not None for p in e.model.parameters())
        seen["grad_bytes"] = sum(g.numel() * g.element_size() for g in e.strategy.owned_grads())

    engine.before_optimizer_step.append(probe)
    loader = ShardedBatches(task, GLOBAL_BATCH, engine.mesh.index("dp"), world)
    engine.train_step(loader.batch_at(0))
    strategy = engine.strategy
    masters = [b.master for b in strategy.buckets]
    states = [t for s in engine.optimizer.state.values() for t in s.values() if t.dim() >= 1]
    out = dict(
        seen,
        padded=padded_total(engine),
        n_params=sum(p.numel() for p in model.parameters()),
        state_bytes=state_bytes(engine.optimizer),
        full_state_bytes=state_bytes(full_optimizer),
        split=strategy.memory_split(),
        master_bytes=sum(m.numel() * 4 for m in masters),
        step_bytes=sum(
            t.numel() * t.element_size() for s in engine.optimizer.state.values() for t in s.values() if t.dim() == 0
        ),
        files_backed=[is_file_backed(t) for t in masters + states],
        files=sorted(str(Path(t.untyped_storage().filename).parent) for t in masters + states if is_file_backed(t)),
    )
    directory = strategy.placement.directory
    strategy.close()
    out["files_left"] = directory is not None and directory.exists()
    return out


def _bytes_per_step(world: int, stage: int, microbatches: int) -> dict:
    model, task = make_model()
    engine = plait.parallelize(model, layout_of(world, stage, microbatches=microbatches), optimizer=OPTIMIZERS["sgd"])
    stats = engine.train_step(ShardedBatches(task, GLOBAL_BATCH, engine.mesh.index("dp"), world).batch_at(0))
    return dict(
        wire=stats.comm.wire(),
        padded=padded_total(engine),
        detail=stats.comm.to_dict(),
        buckets=len(engine.strategy.buckets),
        n_params=sum(p.numel() for p in model.parameters()),
    )


def _zero2_during_backward(world: int) -> dict:
    """Run one synced backward by hand: every bucket's reduce-scatter is issued before backward returns."""
    model, task = make_model()
    engine = plait.parallelize(model, layout_of(world, 2), optimizer=OPTIMIZERS["sgd"])
    inputs, targets = ShardedBatches(task, GLOBAL_BATCH, engine.mesh.index("dp"), world).batch_at(0)
    before = engine.comm.stats.snapshot()
    nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
    issued = engine.comm.stats.since(before).to_dict().get("dp_cp/reduce_scatter", {}).get("calls", 0)
    held = sum(p.grad is not None for p in model.parameters())
    engine.strategy.finish_backward()
    return dict(issued=issued, buckets=len(engine.strategy.buckets), held_after_backward=held)


def _odd_sizes(world: int) -> tuple[Trajectory, Trajectory, dict]:
    """An MLP whose sizes (35, 7, 21, 3) need padding; ZeRO-2 with buckets of 100 bytes: [3 + 21], [7], [35]."""
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    x, y = torch.randn(STEPS, 8, 5), torch.randn(STEPS, 8, 3)
    optimizer = OPTIMIZERS["adamw"]
    expected = train_reference(model, list(zip(x, y)), optimizer, loss_fn=nn.functional.mse_loss)
    engine = plait.parallelize(
        model, Layout(dp=world, zero=2, bucket_mb=100 / 2**20), optimizer=optimizer, loss_fn=nn.functional.mse_loss
    )
    share, r = 8 // world, engine.mesh.index("dp")
    actual, wire = Trajectory(), []
    for step in range(STEPS):
        mine = slice(r * share, (r + 1) * share)
        stats = engine.train_step((x[step, mine], y[step, mine]))
        actual.losses.append(stats.loss)
        actual.params.append(engine.strategy.full_parameters())
        wire.append(stats.comm.wire())
    sizes = dict(
        wire=wire,
        padded=padded_total(engine),
        n_params=sum(p.numel() for p in model.parameters()),
        buckets=len(engine.strategy.buckets),
    )
    return actual, expected, sizes


def _mixed_dtypes(world: int, stage: int) -> tuple[Trajectory, Trajectory]:
    """fp32 and fp64 parameters: one bucket (and master dtype, and all-gather) per dtype."""
    model = TwoDtypes()
    x, y = torch.randn(STEPS, 4, 6), torch.randn(STEPS, 4, 2)
    expected = train_reference(model, list(zip(x, y)), OPTIMIZERS["adamw"], loss_fn=nn.functional.mse_loss)
    engine = plait.parallelize(
        model, Layout(dp=world, zero=stage), optimizer=OPTIMIZERS["adamw"], loss_fn=nn.functional.mse_loss
    )
    assert {b.master.dtype for b in engine.strategy.buckets} == {torch.float32, torch.float64}
    share, r = 4 // world, engine.mesh.index("dp")
    mine = slice(r * share, (r + 1) * share)
    actual = Trajectory()
    for step in range(STEPS):
        actual.losses.append(engine.train_step((x[step, mine], y[step, mine])).loss)
        actual.params.append(engine.strategy.full_parameters())
    return actual, expected


def _save_train_reload(root: str, world: int, stage: int, offload: str) -> tuple[list, list, bool]:
    """Train 3 steps, save, train 2 more (losses A); a fresh engine loads and trains the same 2 (losses B)."""

    def engine_and_loader():
        model, task = make_model()
        engine = plait.parallelize(model, layout_of(world, stage, offload), optimizer=OPTIMIZERS["adamw"])
        return engine, ShardedBatches(task, GLOBAL_BATCH, engine.mesh.index("dp"), world)

    engine, loader = engine_and_loader()
    for step in range(3):
        engine.train_step(loader.batch_at(step))
    engine.save(root)
    continued = [engine.train_step(loader.batch_at(step)).loss for step in (3, 4)]
    fresh, _ = engine_and_loader()
    assert fresh.load(root) == 3
    if offload == "nvme":
        assert all(is_file_backed(t) for s in fresh.optimizer.state.values() for t in s.values() if t.dim() >= 1)
    resumed = [fresh.train_step(loader.batch_at(step)).loss for step in (3, 4)]
    same = all(torch.equal(a, b) for a, b in zip(engine.model.parameters(), fresh.model.parameters()))
    buckets = zip(engine.strategy.buckets, fresh.strategy.buckets)
    same = same and all(torch.equal(a.master, b.master) for a, b in buckets)
    engine.strategy.close()
    fresh.strategy.close()
    return continued, resumed, same


def _error(call) -> str:
    try:
        call()
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - CheckpointException is a BaseException
        return f"{type(error).__name__}: {error}"
    return "no error"


def _suite(world: int, root: str, dp2_checkpoint: str | None = None) -> dict:
    os.environ["PLAIT_OFFLOAD_DIR"] = os.path.join(root, "offload")
    rank = torch.distributed.get_rank()
    out: dict = {"parity": {}, "mlp_forwards": {}}
    for config in CONFIGS if world == 2 else DP4_CONFIGS:
        stage, offload, opt, mb, clip, recompute = config
        forwards: list[int] = []
        trajectory = train(layout_of(world, stage, offload, mb, recompute), opt, clip, forwards)
        if rank:  # the other ranks: only what must equal rank 0's exactly
            trajectory = (trajectory.losses, trajectory.params[-1])
        out["parity"][config] = trajectory
        out["mlp_forwards"][config] = len(forwards)
    out["odd"] = _odd_sizes(world)
    out["mixed"] = {stage: _mixed_dtypes(world, stage) for stage in (1, 2)}
    out["memory"] = {(s, o): _memory(world, s, o) for s in (1, 2) for o in ("none", "cpu", "nvme")}
    out["bytes"] = {(s, mb): _bytes_per_step(world, s, mb) for s in (1, 2) for mb in (1, 2)}
    out["backward"] = _zero2_during_backward(world)
    if world == 2:
        out["checkpoint"] = {
            (s, o): _save_train_reload(os.path.join(root, f"ckpt-{s}-{o}"), world, s, o)
            for s, o in ((2, "none"), (1, "nvme"))
        }
        out["checkpoint_dir"] = os.path.join(root, "ckpt-2-none")
        out["bad_dtype"] = _error(lambda: _float8_model(world))
    if dp2_checkpoint is not None:
        out["other_dp"] = _load_other_dp(world, dp2_checkpoint)
    return out


def _float8_model(world: int) -> None:
    from plait.comm import Comm
    from plait.mesh import Mesh
    from plait.parallel.zero.sharded import ShardedOptimizerStrategy

    model = nn.Linear(4, 4)
    model.weight.data = model.weight.data.to(torch.float8_e4m3fn)
    layout = Layout(dp=world, zero=1).resolve(world)
    ShardedOptimizerStrategy(model, Comm(Mesh.build(layout)), OPTIMIZERS["sgd"], layout)


def _load_other_dp(world: int, root: str) -> dict:
    """A ZeRO-2 checkpoint saved at dp=2 loaded at dp=``world`` (resharded, docs/checkpoints.md): the step and the
    whole parameters, to compare with the saved ones."""
    from plait.checkpoint import load_full_state

    model, _task = make_model()
    engine = plait.parallelize(model, layout_of(world, 2), optimizer=OPTIMIZERS["adamw"])
    step = engine.load(root)
    saved, _meta = load_full_state(root)
    params = engine.strategy.full_parameters()
    return {"step": step, "same": all(torch.equal(params[name], saved[name]) for name in params)}


@pytest.fixture(scope="module")
def dp2(tmp_path_factory) -> list[dict]:
    return run_distributed(_suite, 2, 2, str(tmp_path_factory.mktemp("dp2")))


@pytest.fixture(scope="module")
def dp4(tmp_path_factory, dp2) -> list[dict]:
    return run_distributed(_suite, 4, 4, str(tmp_path_factory.mktemp("dp4")), dp2[0]["checkpoint_dir"])


@pytest.fixture(scope="module")
def references() -> dict:
    return {(opt, clip): reference(opt, clip) for opt in ("adamw", "sgd") for clip in (None, 0.05)}


# ------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("offload", ["none", "cpu", "nvme"])
def test_world_size_one_is_bitwise_single_device(stage, offload, monkeypatch, tmp_path, references):
    # Flattening changes no arithmetic: SGD and AdamW are elementwise, so the shard steps are the same floats.
    monkeypatch.setenv("PLAIT_OFFLOAD_DIR", str(tmp_path))
    for opt in ("adamw", "sgd"):
        assert_trajectories_match(train(layout_of(1, stage, offload), opt, None), references[(opt, None)], exact=True)
    assert list(tmp_path.iterdir()) == [], "offload files must be removed by close()"


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world, config",
    [(2, c) for c in CONFIGS] + [(4, c) for c in DP4_CONFIGS],
    ids=lambda v: (
        "zero{}-{}-{}-mb{}-clip{}-recompute-{}".format(*v[:5], v[5] if isinstance(v[5], str) else "block1")
        if isinstance(v, tuple)
        else f"dp{v}"
    ),
)
def test_matches_single_device(world, config, references, request):
    results = request.getfixturevalue(f"dp{world}")
    stage, offload, opt, mb, clip, recompute = config
    expected = references[(opt, clip)]
    assert_trajectories_match(results[0]["parity"][config], expected)
    # the recomputation happened: block 1 (chosen by "full" and by (1,)) ran forward again in each backward
    assert results[0]["mlp_forwards"][config] == STEPS * mb * (1 if recompute == "none" else 2)
    for rank, result in enumerate(results[1:], start=1):
        losses, params = result["parity"][config]
        assert losses == results[0]["parity"][config].losses, f"rank {rank} reports a different loss"
        for name, value in params.items():
            assert torch.equal(value, results[0]["parity"][config].params[-1][name]), f"rank {rank}: {name} differs"


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_padded_buckets_match_single_device(world, request):
    actual, expected, sizes = request.getfixturevalue(f"dp{world}")[0]["odd"]
    assert_trajectories_match(actual, expected)
    assert sizes["buckets"] == 3 and sizes["padded"] == 68 > sizes["n_params"] == 66, sizes
    ring = (world - 1) / world
    theory = 2 * ring * sizes["padded"] * 4 + 2 * ring * 4  # the padding travels too
    assert sizes["wire"] == [pytest.approx(theory, rel=1e-12)] * STEPS, f"measured {sizes['wire']} / theory {theory}"


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [1, 2])
def test_memory_held_per_rank(world, stage, request):
    for rank, result in enumerate(request.getfixturevalue(f"dp{world}")):
        m = result["memory"][(stage, "none")]
        # Optimizer state: AdamW keeps 2 fp32 tensors per element of the rank's shard, padding included.
        assert m["state_bytes"] == 2 * 4 * m["padded"] // world
        assert m["state_bytes"] * world == m["full_state_bytes"] * m["padded"] // m["n_params"], (
            f"rank {rank}: state {m['state_bytes']} B x {world} vs full {m['full_state_bytes']} B"
        )
        # Gradients after finish_backward: no full gradient on the model, the shard's fp32 gradient only.
        assert m["model_grads"] == 0, f"rank {rank}: {m['model_grads']} param.grad still held"
        assert m["grad_bytes"] == 4 * m["padded"] // world


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("microbatches", [1, 2])
def test_bytes_per_step_equal_the_theory(world, stage, microbatches, request):
    b = request.getfixturevalue(f"dp{world}")[0]["bytes"][(stage, microbatches)]
    ring = (world - 1) / world
    # reduce-scatter + all-gather of the padded flat parameters, plus the Engine's 4-byte loss all-reduce and its
    # all-reduce of the step's scored-token counts (one int64 per micro-batch, over dp: token-mean normalisation).
    theory = 2 * ring * b["padded"] * 4 + 2 * ring * 4 + 2 * ring * 8 * microbatches
    assert b["wire"] == pytest.approx(theory, rel=1e-12), f"measured {b['wire']} / theory {theory}: {b['detail']}"
    assert b["padded"] - b["n_params"] < world * b["buckets"]
    assert b["detail"]["dp_cp/reduce_scatter"]["calls"] == b["buckets"]
    assert b["detail"]["dp_cp/all_gather"]["calls"] == 1


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_zero2_reduces_buckets_during_backward(world, request):
    result = request.getfixturevalue(f"dp{world}")[0]["backward"]
    assert result["buckets"] == 8 and result["issued"] == result["buckets"], result
    assert result["held_after_backward"] == 0


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [1, 2])
def test_offload_places_shards_on_host_and_in_files(stage, dp2):
    for result in dp2:
        none, cpu, nvme = (result["memory"][(stage, o)] for o in ("none", "cpu", "nvme"))
        model_bytes = 4 * none["n_params"]
        shard_bytes = none["master_bytes"] + none["state_bytes"] + none["step_bytes"]
        assert none["split"] == {"device": model_bytes + shard_bytes, "host": 0, "files": 0}
        assert cpu["split"] == {"device": model_bytes, "host": shard_bytes, "files": 0}
        assert nvme["split"] == {
            "device": model_bytes,
            "host": nvme["step_bytes"],
            "files": nvme["master_bytes"] + nvme["state_bytes"],
        }
        assert all(nvme["files_backed"]) and not any(cpu["files_backed"])
        assert len(set(nvme["files"])) == 1 and "plait-offload-rank" in nvme["files"][0]
        assert not nvme["files_left"], "close() removes the offload folder"


@pytest.mark.distributed
def test_checkpoint_round_trip_continues_bitwise(dp2):
    for result in dp2:
        for (stage, offload), (continued, resumed, same) in result["checkpoint"].items():
            assert continued == resumed and same, f"zero{stage} offload={offload}: {continued} != {resumed}"


@pytest.mark.distributed
def test_checkpoint_under_another_dp_size_loads_resharded(dp4):
    for result in dp4:  # saved by ZeRO-2 at dp=2, loaded by ZeRO-2 at dp=4: every shard cut anew, bitwise
        assert result["other_dp"]["step"] > 0 and result["other_dp"]["same"], result["other_dp"]


@pytest.mark.distributed
def test_gradient_dtype_the_backend_cannot_reduce_is_refused(dp2):
    for result in dp2:
        assert "TypeError" in result["bad_dtype"] and "weight (torch.float8_e4m3fn)" in result["bad_dtype"]
        assert "gloo" in result["bad_dtype"]


def test_bad_input_is_refused():
    model, _task = make_model()
    with pytest.raises(plait.LayoutError, match="offload needs zero=1, 2 or 3"):
        plait.parallelize(model, Layout(offload="cpu"), optimizer=OPTIMIZERS["sgd"])
    with pytest.raises(TypeError, match="needs a factory"):
        plait.parallelize(model, Layout(zero=1), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="exactly the parameters it is given"):
        plait.parallelize(model, Layout(zero=2), optimizer=lambda params: torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="not a torch.optim.Optimizer"):
        plait.parallelize(model, Layout(zero=1), optimizer=lambda params: list(params))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_optimizers_that_cannot_run_are_refused(stage):
    """LBFGS needs a closure (refused at every stage); under ZeRO, torch.optim's optimizers that are not
    elementwise are refused: SparseAdam when parallelize builds it; one that needs whole tensors and does not take
    every parameter (Muon: matrices only) before any collective, naming WholeTensorOptimizer; one that does
    (Adafactor, a subclass too) is stepped whole on every parameter (docs/optimizers.md)."""
    with pytest.raises(TypeError, match=r"LBFGS.step\(closure\) needs a closure.*Fix: use an optimizer whose closure"):
        plait.parallelize(make_model()[0], Layout(zero=stage), optimizer=lambda params: torch.optim.LBFGS(params))
    if stage == 0:
        return  # DDP steps whole parameters: the optimizers below are fine there
    refused = {"SparseAdam": torch.optim.SparseAdam, "Muon": torch.optim.Muon}
    for name, optimizer in refused.items():
        pattern = (  # optimizers that need whole tensors are refused before any collective, naming the way to run them
            f"zero={stage} cannot run torch.optim.{name}.*Fix: use zero=0"
            if name == "SparseAdam"
            else f"builds {name}, which needs whole tensors, but not on every trainable.*Fix: optimizer=.*WholeTensor"
        )
        with pytest.raises(plait.LayoutError, match=pattern):
            plait.parallelize(make_model()[0], Layout(zero=stage), optimizer=lambda params, o=optimizer: o(params))

    class MyAdafactor(torch.optim.Adafactor):  # a subclass is still factored
        pass

    for factored in (torch.optim.Adafactor, MyAdafactor):
        model = make_model()[0]
        engine = plait.parallelize(model, Layout(zero=stage), optimizer=lambda params, o=factored: o(params))
        (part,) = engine.strategy.optimizer.parts  # whole tensors, every one of them: no elementwise part
        assert type(part) is factored and len(engine.strategy.optimizer.slots) == len(list(model.parameters()))


def test_adafactor_on_a_flat_shard_is_another_algorithm():
    """Why the rule exists: Adafactor on a matrix differs from Adafactor on the same values flattened (factored
    second moment, per-tensor RMS), while an elementwise optimizer (RAdam here) gives the same floats."""
    torch.manual_seed(0)
    values, grad = torch.randn(6, 4), torch.randn(6, 4)
    for optimizer, same in ((torch.optim.Adafactor, False), (torch.optim.RAdam, True)):
        matrix, flat = nn.Parameter(values.clone()), nn.Parameter(values.reshape(-1).clone())
        matrix.grad, flat.grad = grad.clone(), grad.reshape(-1).clone()
        optimizer([matrix], lr=0.1).step()
        optimizer([flat], lr=0.1).step()
        assert torch.equal(matrix.detach().reshape(-1), flat.detach()) is same, optimizer.__name__


@pytest.mark.parametrize("optimizer", ELEMENTWISE, ids=lambda c: c.__name__)
def test_every_elementwise_optimizer_runs_zero_exactly(optimizer):
    """Each optimizer the rule lets through takes the single-device steps under ZeRO-2 and ZeRO-3 at world size 1
    (one flat shard per bucket / unit), to the bit."""
    factory = functools.partial(optimizer, lr=0.01)
    model, task = make_model()
    loader = ShardedBatches(task, GLOBAL_BATCH)
    want = train_reference(model, [loader.global_batch_at(step) for step in range(3)], factory)
    for stage in (2, 3):
        engine = plait.parallelize(make_model()[0], Layout(zero=stage), optimizer=factory)
        actual = Trajectory()
        for step in range(3):
            actual.losses.append(engine.train_step(loader.batch_at(step)).loss)
            actual.params.append(engine.strategy.full_parameters())
        assert_trajectories_match(actual, want, exact=True)


def test_zero2_second_backward_without_finish_is_refused():
    model, task = make_model()
    plait.parallelize(model, Layout(zero=2), optimizer=OPTIMIZERS["sgd"])
    inputs, targets = ShardedBatches(task, GLOBAL_BATCH).batch_at(0)
    loss = nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second gradient before finish_backward"):
        loss.backward()


class TwoDtypes(nn.Module):
    """An fp32 and an fp64 layer: one ZeRO layout (and master dtype) per parameter dtype."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(5, 2).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)).double()).float()


@pytest.mark.parametrize("stage", [1, 2])
def test_mixed_parameter_dtypes_world_size_one_is_bitwise(stage):
    assert_trajectories_match(*_mixed_dtypes(1, stage), exact=True)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [1, 2])
def test_mixed_parameter_dtypes(world, stage, request):
    assert_trajectories_match(*request.getfixturevalue(f"dp{world}")[0]["mixed"][stage])
