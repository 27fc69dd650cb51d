"""HSDP (``Layout(dp_replicate=R)``, docs/zero.md): the dp ranks form R replica groups; ZeRO-1/2/3 shard inside a
group (mesh axis ``shard``) and each reduced shard is averaged over the groups (mesh axis ``replicate``).

- Layout and mesh (no processes): R must divide dp; an ep group must lie inside one replica group; the sub-axes
  ``replicate`` (outer) and ``shard`` (inner) and, with ep, ``edp_shard`` partition the data ranks as documented.
- Parity with one device (losses, the norm before clipping, step-0 gradients, final parameters, evaluation; rows
  scoring uneven numbers of tokens) at dp=4 R=2 under ZeRO-1 (accumulation, clipped), ZeRO-2 (several buckets,
  unclipped) and ZeRO-3 (clipped); composed with cp, pp, tp, ep, recomputation, offload and compile (``long``).
  Every replica's whole parameters are bitwise equal (``merge_ranks``): the replica groups step alike.
- Bytes per axis per step equal the ring theory exactly: on ``shard`` (N = dp/R x cp ranks) the ZeRO traffic of N
  ranks, on ``replicate`` 2(R-1)/R x P/N x 4 (each rank's shard all-reduced), nothing on ``dp_cp`` but the loss
  normalisation's scalars.
- Checkpoints are layout-free: HSDP -> plain ZeRO-3 (dp=4) -> HSDP and HSDP <-> one process give bitwise equal
  tensors (parameters and optimizer states), and a resumed HSDP run continues bitwise.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch
from helpers.composition import (
    CLIP,
    GLOBAL_BATCH,
    GRAD_TOL,
    LOSS_RTOL,
    NORM_RTOL,
    PARAM_TOL,
    STEPS,
    make_model,
    merge_ranks,
    optimizer,
    whole_gradients,
    whole_parameters,
)
from helpers.harness import run_distributed
from helpers.moe import Cell, assert_cell_matches, train_cells
from helpers.moe import reference as moe_reference
from helpers.reference import assert_tensors_close, train_reference
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import plait
from plait import Layout, LayoutError
from plait.data import ShardedBatches
from plait.mesh import RankGrid
from plait.models.loss import apply_loss

CASES: dict[str, tuple[dict, float | None]] = {
    "dp4-r2-zero1-mb2": (dict(dp=4, dp_replicate=2, zero=1, microbatches=2), CLIP),
    "dp4-r2-zero2-buckets-unclipped": (dict(dp=4, dp_replicate=2, zero=2, bucket_mb=0.004), None),
    "dp4-r2-zero3": (dict(dp=4, dp_replicate=2, zero=3), CLIP),
}
"""Default suite: world 4, one job (with the bytes and the checkpoints)."""
LONG_CASES: dict[str, tuple[dict, float | None]] = {
    "dp2-cp2-r2-zero3": (dict(dp=2, cp=2, dp_replicate=2, zero=3), CLIP),  # shard = the cp pair
    "dp2-r2-pp2-zero3": (dict(dp=2, dp_replicate=2, pp=2, zero=3, microbatches=2), CLIP),
    "dp2-r2-pp2-zero1": (dict(dp=2, dp_replicate=2, pp=2, zero=1, microbatches=2), None),
    "dp2-r2-tp2-sp-zero3": (dict(dp=2, dp_replicate=2, tp=2, zero=3, sequence_parallel=True), CLIP),
    "dp4-r2-zero2-recompute-offload": (dict(dp=4, dp_replicate=2, zero=2, recompute="full", offload="cpu"), CLIP),
    "dp4-r2-zero3-offload-mb2": (dict(dp=4, dp_replicate=2, zero=3, offload="cpu", microbatches=2), None),
    "dp4-r2-zero3-compiled": (dict(dp=4, dp_replicate=2, zero=3, compile="aot_eager"), CLIP),
    "dp4-r4-zero3": (dict(dp=4, dp_replicate=4, zero=3), CLIP),  # shard groups of one rank: all-reduce only
    "dp4-r2-zero0": (dict(dp=4, dp_replicate=2, zero=0), CLIP),  # nothing sharded: plain data parallelism
}
"""``long``: the compositions (4 processes each: shard groups of one or two ranks)."""
MOE_CELLS = [Cell("dp4-r2-ep2-zero3", {"dp": 4, "dp_replicate": 2, "ep": 2, "zero": 3})]
"""Default suite (in the world-4 job): the tiny MoE GPT (tests/helpers/moe.py) with its experts split over ep=2
inside each replica group; expert slices sharded over ``edp_shard`` (here one rank) and averaged over the groups."""
LONG_MOE_CELLS = [
    Cell("dp4-r2-ep2-zero1-mb2", {"dp": 4, "dp_replicate": 2, "ep": 2, "zero": 1, "microbatches": 2}),
    Cell("dp8-r2-ep2-zero3", {"dp": 8, "dp_replicate": 2, "ep": 2, "zero": 3}),  # edp_shard of 2 ranks
    Cell("dp8-r2-ep2-zero2", {"dp": 8, "dp_replicate": 2, "ep": 2, "zero": 2, "bucket_mb": 0.004}),
]
"""``long``: ZeRO-1 with accumulation; at 8 ranks, expert slices sharded over two ranks of each replica group."""


# ----------------------------------------------------------------- layout and mesh (no processes)
def test_replica_groups_fold_the_data_ranks() -> None:
    """j = replicate x S + shard (S = dp/R x cp): replica groups are consecutive data ranks, dp outermost."""
    grid = RankGrid.from_layout(Layout(dp=4, dp_replicate=2).resolve(4))
    assert grid.groups("shard") == [[0, 1], [2, 3]] and grid.groups("replicate") == [[0, 2], [1, 3]]
    assert grid.coords(3) == {"pp": 0, "dp": 3, "cp": 0, "tp": 0, "replicate": 1, "shard": 1}
    grid = RankGrid.from_layout(Layout(dp=4, cp=2, pp=2, dp_replicate=2).resolve(16))
    assert grid.groups("shard")[:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # dp/R x cp = 2 x 2 ranks
    assert grid.groups("replicate")[:2] == [[0, 4], [1, 5]] and grid.size("replicate") == 2
    for axis in ("shard", "replicate"):
        assert sorted(r for g in grid.groups(axis) for r in g) == list(range(16))
    grid = RankGrid.from_layout(Layout(dp=4, tp=2, dp_replicate=2, ep=2).resolve(8))
    assert grid.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]  # inside a replica group ...
    assert grid.groups("shard") == grid.groups("ep") and grid.size("edp_shard") == 1
    grid = RankGrid.from_layout(Layout(dp=8, dp_replicate=2, ep=2).resolve(8))
    assert grid.groups("edp_shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]  # ... and experts sharded inside it
    assert grid.groups("edp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert "replicate" not in RankGrid.from_layout(Layout(dp=4).resolve(4)).axes
    assert "replicate2" in Layout(dp=4, dp_replicate=2).short()


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"dp": 4, "dp_replicate": 3}, ["dp_replicate=3 must divide dp=4", "[1, 2, 4]"]),
        ({"dp_replicate": 0}, ["dp_replicate=0", ">= 1"]),
        ({"dp_replicate": True}, ["dp_replicate=True"]),
        ({"dp": 4, "dp_replicate": 2, "ep": 4}, ["ep=4 must divide", "replica group", "[1, 2]"]),
    ],
)
def test_bad_replica_degrees_are_refused(kwargs: dict, words: list[str]) -> None:
    with pytest.raises(LayoutError) as info:
        Layout(**kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_inferred_dp_is_checked_and_toml_round_trips() -> None:
    with pytest.raises(LayoutError, match="dp_replicate=3 must divide dp=4"):
        Layout(dp=-1, dp_replicate=3).resolve(4)
    layout = Layout(dp=-1, dp_replicate=2, zero=3).resolve(4)
    assert Layout.from_dict(layout.to_dict()) == layout and layout.to_dict()["dp_replicate"] == 2


# ----------------------------------------------------------------- training (ranks)
def _train(fields: dict, clip: float | None) -> dict:
    """The composition matrix's run (tiny GPT, uneven masks, 3 AdamW steps) under ``fields``: losses, norms,
    step-0 gradients and final parameters (whole), evaluation loss, and each step's traffic by (axis, op)."""
    model, task = make_model()
    engine = plait.parallelize(model, Layout(**fields), optimizer=optimizer, max_grad_norm=clip)
    grads: list[dict[str, torch.Tensor]] = []
    engine.before_optimizer_step.append(lambda e: grads.append(whole_gradients(e)) if not grads else None)
    loader = ShardedBatches(task, GLOBAL_BATCH, dp_rank=engine.mesh.index("dp"), dp_size=engine.mesh.size("dp"))
    stats = [engine.train_step(loader.batch_at(step)) for step in range(STEPS)]
    strategy = engine.strategy
    flats = (getattr(strategy, "units", None) or strategy.buckets) if strategy.sharded else []
    out = {
        "losses": [s.loss for s in stats],
        "grad_norms": [s.grad_norm for s in stats],
        "comm": [{key: (c.calls, c.wire_bytes) for key, c in s.comm.counts.items()} for s in stats],
        "padded": sum(f.layout.padded for f in flats if f.layout.numel),
        "numel": sum(f.layout.numel for f in flats),
        "flats": sum(1 for f in flats if f.layout.numel),
        "grads": grads[0],
        "eval": engine.evaluate([loader.batch_at(STEPS)]).loss,
        "params": whole_parameters(engine),
    }
    if hasattr(strategy, "close"):
        strategy.close()
    return out


def _checkpoints(root: str, one_process: str) -> dict:
    """HSDP trains 3 steps and saves ("hsdp"), continues 2 steps; a fresh HSDP engine loads and trains the same 2
    (bitwise the same losses). Plain ZeRO-3 at dp=4 loads "hsdp" and saves "zero3"; HSDP loads "zero3" and saves
    "back"; HSDP loads the one-process checkpoint ``one_process`` and saves "from-one". Every save's tensors are
    compared in the test process."""
    hsdp = Layout(dp=4, dp_replicate=2, zero=3)

    def engine_of(layout: Layout) -> tuple[plait.Engine, ShardedBatches]:
        model, task = make_model()
        engine = plait.parallelize(model, layout, optimizer=optimizer, max_grad_norm=CLIP)
        return engine, ShardedBatches(task, GLOBAL_BATCH, engine.mesh.index("dp"), engine.mesh.size("dp"))

    engine, loader = engine_of(hsdp)
    for step in range(3):
        engine.train_step(loader.batch_at(step))
    engine.save(os.path.join(root, "hsdp"))
    continued = [engine.train_step(loader.batch_at(step)).loss for step in (3, 4)]
    fresh, _ = engine_of(hsdp)
    assert fresh.load(os.path.join(root, "hsdp")) == 3
    resumed = [fresh.train_step(loader.batch_at(step)).loss for step in (3, 4)]
    for source, layout, target in (
        ("hsdp", Layout(dp=4, zero=3), "zero3"),
        ("zero3", hsdp, "back"),
        (one_process, hsdp, "from-one"),
    ):
        other, _ = engine_of(layout)
        other.load(os.path.join(root, source))
        other.save(os.path.join(root, target))
    return {"continued": continued, "resumed": resumed}


def _suite(root: str, one_process: str) -> dict:
    return {
        "cases": {name: _train(*CASES[name]) for name in CASES},
        "checkpoints": _checkpoints(root, one_process),
        "moe": train_cells(MOE_CELLS),
    }


def _long_suite() -> dict:
    return {name: _train(*LONG_CASES[name]) for name in LONG_CASES}


@functools.cache
def reference(clip: float | None) -> dict:
    """One device on the whole global batches: losses, norms before clipping, step-0 gradients, final
    parameters, evaluation loss."""
    model, task = make_model()
    loader = ShardedBatches(task, GLOBAL_BATCH)
    trajectory = train_reference(
        model, [loader.global_batch_at(step) for step in range(STEPS)], optimizer, max_grad_norm=clip
    )
    model.load_state_dict(trajectory.params[-1])
    inputs, targets = loader.global_batch_at(STEPS)
    with torch.no_grad():
        evaluation = float(apply_loss(torch.nn.functional.cross_entropy, model(inputs), targets))
    return {"trajectory": trajectory, "eval": evaluation}


def _one_process_checkpoint(root: Path) -> str:
    """A one-process run (zero=0) of 3 steps, saved under ``root``."""
    model, task = make_model()
    engine = plait.parallelize(model, Layout(), optimizer=optimizer, max_grad_norm=CLIP)
    loader = ShardedBatches(task, GLOBAL_BATCH)
    for step in range(3):
        engine.train_step(loader.batch_at(step))
    engine.save(root)
    return str(root)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    root = tmp_path_factory.mktemp("hsdp")
    one = _one_process_checkpoint(root / "one")
    per_rank = run_distributed(_suite, 4, str(root), one, timeout=600, comm_timeout_s=60)
    for result in per_rank:
        result["root"], result["one"] = root, one
    return per_rank


def assert_matches(name: str, per_rank: list[dict], clip: float | None) -> None:
    """Losses and evaluation (the same on every rank), norms before clipping, step-0 gradients and final parameters
    (every replica bitwise equal) against one device. fp32 tolerances of the composition matrix (docs/composition.md):
    HSDP averages over shard then replicate, another order of the same sums (a few ulps)."""
    expected = reference(clip)
    trajectory = expected["trajectory"]
    for rank, result in enumerate(per_rank):
        assert result["losses"] == per_rank[0]["losses"], f"{name}: rank {rank} reports another loss"
        assert result["eval"] == per_rank[0]["eval"], f"{name}: rank {rank} reports another evaluation loss"
    losses = per_rank[0]["losses"] + [per_rank[0]["eval"]]
    for step, (actual, wanted) in enumerate(zip(losses, trajectory.losses + [expected["eval"]], strict=True)):
        assert abs(actual - wanted) <= LOSS_RTOL * abs(wanted), f"{name} step {step}: loss {actual!r} != {wanted!r}"
    if clip:  # the norm before clipping: a double count over the replicas would be sqrt(2) too large
        for step, (actual, wanted) in enumerate(zip(per_rank[0]["grad_norms"], trajectory.grad_norms, strict=True)):
            assert abs(actual - wanted) <= NORM_RTOL * wanted, f"{name} step {step}: norm {actual!r} != {wanted!r}"
    grads = merge_ranks([r["grads"] for r in per_rank], f"{name} step-0 grads")
    params = merge_ranks([r["params"] for r in per_rank], f"{name} final params")
    assert params.keys() == trajectory.params[-1].keys(), f"{name}: parameters on no rank"
    assert_tensors_close(grads, trajectory.grads[0], f"{name} step 0 grad", GRAD_TOL)
    assert_tensors_close(params, trajectory.params[-1], f"{name} final param", PARAM_TOL)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(CASES))
def test_hsdp_matches_one_device(name: str, runs: list[dict]) -> None:
    assert_matches(name, [r["cases"][name] for r in runs], CASES[name][1])


@pytest.mark.distributed
@pytest.mark.long
def test_hsdp_compositions_match_one_device() -> None:
    per_rank = run_distributed(_long_suite, 4, timeout=900, comm_timeout_s=120)
    for name, (_fields, clip) in LONG_CASES.items():
        assert_matches(name, [r[name] for r in per_rank], clip)


@pytest.mark.distributed
@pytest.mark.parametrize("cell", MOE_CELLS, ids=lambda c: c.name)
def test_hsdp_with_experts_matches_one_device(cell: Cell, runs: list[dict]) -> None:
    assert_cell_matches(cell, [r["moe"][cell.name] for r in runs], moe_reference(cell))


@pytest.mark.distributed
@pytest.mark.long
@pytest.mark.parametrize("world", [4, 8])
def test_hsdp_with_experts_matches_one_device_long(world: int) -> None:
    cells = [cell for cell in LONG_MOE_CELLS if cell.world == world]
    per_rank = run_distributed(train_cells, world, cells, timeout=900, comm_timeout_s=120)
    for cell in cells:
        assert_cell_matches(cell, [r[cell.name] for r in per_rank], moe_reference(cell))


def ring(op: str, n: int) -> float:
    """What one rank sends per byte of payload in a ring of n ranks (docs/design.md, communication layer)."""
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(CASES))
def test_bytes_per_axis_equal_the_theory(name: str, runs: list[dict]) -> None:
    """Per step, with P the padded flat parameters (4 bytes each), N = 2 ranks per replica group, R = 2 groups,
    m micro-batches: on ``shard`` the reduce-scatter (N-1)/N x P x 4 and the all-gather (N-1)/N x P x 4 (ZeRO-3:
    2m all-gathers, forward and backward of each micro-batch), plus the 8-byte norm all-reduce when clipping (over
    one replica group only: the replicas hold equal shards); on ``replicate`` one all-reduce of this rank's
    shards, 2(R-1)/R x P/N x 4; besides, only the loss normalisation's scalars over all 4 data ranks (an 8-byte
    token count per micro-batch over ``dp``, the 4-byte loss sum over ``dp_cp``)."""
    fields, clip = CASES[name]
    n, r, m, stage = 2, 2, fields.get("microbatches", 1), fields["zero"]
    model, _ = make_model()
    for rank, result in enumerate(runs):
        run = result["cases"][name]
        padded = run["padded"]
        assert run["numel"] == sum(p.numel() for p in model.parameters())
        assert padded % n == 0 and padded - run["numel"] <= (n - 1) * run["flats"]  # per unit or bucket: < N
        gathers = 2 * m if stage == 3 else 1
        theory = {
            ("shard", "reduce_scatter"): ring("reduce_scatter", n) * padded * 4,
            ("shard", "all_gather"): gathers * ring("all_gather", n) * padded * 4,
            ("replicate", "all_reduce"): ring("all_reduce", r) * padded / n * 4,
            ("dp_cp", "all_reduce"): ring("all_reduce", 4) * 4,
            ("dp", "all_reduce"): ring("all_reduce", 4) * 8 * m,
        }
        if clip:
            theory[("shard", "all_reduce")] = ring("all_reduce", n) * 8
        for step, measured in enumerate(run["comm"][1:], start=1):  # step 0 also gathers the gradients to check
            wire = {key: wire for key, (_calls, wire) in measured.items()}
            assert wire.keys() == theory.keys(), f"rank {rank} step {step}: {measured}"
            for key, expected in theory.items():
                assert wire[key] == pytest.approx(expected, rel=1e-12), f"rank {rank} step {step} {key}: {measured}"


def checkpoint_tensors(root: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the newest checkpoint under ``root`` (model, masters, optimizer states), whole, read in
    this process."""
    from plait.checkpoint import _choose, storage
    from plait.checkpoint.chunks import Chunked, Piece

    folder = _choose(root)
    stored = storage.read_metadata(folder).state_dict_metadata
    whole = {
        key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for key, meta in stored.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    state = {key: Chunked(stored[key].size, [Piece((0,) * t.dim(), t)]) for key, t in whole.items()}
    storage.read(state, folder, no_dist=True)
    return whole


def assert_same_state(a: Path, b: Path) -> None:
    left, right = checkpoint_tensors(a), checkpoint_tensors(b)
    assert left.keys() == right.keys(), sorted(left.keys() ^ right.keys())
    assert any(key.startswith("optim/") for key in left) and any(key.startswith("model/") for key in left)
    for key in left:
        assert torch.equal(left[key], right[key]), f"{a.name} vs {b.name}: {key} differs"


@pytest.mark.distributed
def test_checkpoints_move_between_hsdp_zero3_and_one_process(runs: list[dict], tmp_path: Path) -> None:
    """Bitwise: HSDP -> ZeRO-3 (dp=4) -> HSDP, one process -> HSDP, HSDP -> one process; HSDP resumes bitwise."""
    root = runs[0]["root"]
    for result in runs:
        assert result["checkpoints"]["resumed"] == result["checkpoints"]["continued"]
    assert_same_state(root / "hsdp", root / "zero3")
    assert_same_state(root / "hsdp", root / "back")
    assert_same_state(Path(runs[0]["one"]), root / "from-one")
    model, _ = make_model()
    engine = plait.parallelize(model, Layout(), optimizer=optimizer, max_grad_norm=CLIP)
    assert engine.load(root / "hsdp") == 3
    engine.save(tmp_path / "one")
    assert_same_state(root / "hsdp", tmp_path / "one")


# ----------------------------------------------------------------- estimate_memory and the planner (no processes)
def test_estimate_memory_shards_over_one_replica_group() -> None:
    """Model states under HSDP at dp=8, R=2 are those of plain ZeRO at dp=4 (shards over dp/R); zero=0 ignores R."""
    from plait.planner.memory import estimate_memory

    fields = ("parameters", "gradients", "optimizer_states", "master_weights", "gradients_at_step")
    for zero in (1, 2, 3):
        hsdp = estimate_memory(10**6, Layout(dp=8, zero=zero, dp_replicate=2))
        plain = estimate_memory(10**6, Layout(dp=4, zero=zero))
        assert all(getattr(hsdp, f) == getattr(plain, f) for f in fields), zero
        assert hsdp.optimizer_states > estimate_memory(10**6, Layout(dp=8, zero=zero)).optimizer_states
    ddp = estimate_memory(10**6, Layout(dp=8, dp_replicate=2))
    assert all(getattr(ddp, f) == getattr(estimate_memory(10**6, Layout(dp=8)), f) for f in fields)


def test_predict_prices_the_replica_all_reduce_on_the_links_it_crosses() -> None:
    """dp=32 on 4 nodes of 8 H100s with R=4: ZeRO works inside a node (8 ranks); each rank's gradient shard (Psi/8)
    is all-reduced over one rank per node. The step's data-parallel time is plain ZeRO's at dp=8 (the same per-rank
    batch) plus exactly that all-reduce, priced on the inter-node links (dearer than within a node)."""
    from plait.planner import IMPLEMENTATIONS, get_hardware, predict, resolve_model
    from plait.planner.costs import collective_time
    from plait.planner.experts import gradient_groups, replica_group, stage_parameters

    hw, impl = get_hardware("h100"), IMPLEMENTATIONS["plait"]
    layout = Layout(dp=32, zero=1, dp_replicate=4, microbatches=2)
    assert gradient_groups(layout)[0] == (8, 8) and replica_group(layout) == (4, 32)
    assert replica_group(Layout(dp=32, dp_replicate=4)) == (1, 1)  # zero=0: one all-reduce over dp
    spec = resolve_model("llama-7b", 2048)
    psi = stage_parameters(spec, range(spec.layers), True, True)[0]
    hsdp = predict(spec, layout, hw, global_batch=64)
    zero = predict(spec, Layout(dp=8, zero=1, microbatches=2), hw, global_batch=16)
    price = functools.partial(collective_time, hw, comm_efficiency=impl.comm_efficiency, rails=impl.rail_collectives)
    across = price("all_reduce", psi / 8 * impl.grad_bytes, 4, 32)
    assert hsdp.time["dp_comm"] - zero.time["dp_comm"] == pytest.approx(across, rel=1e-9)
    assert across > price("all_reduce", psi / 8 * impl.grad_bytes, 4, 4)
    assert hsdp.memory.optimizer_states == zero.memory.optimizer_states


def test_the_search_includes_replica_groups() -> None:
    """R runs over the divisors of dp that leave ZeRO more than one rank (and an ep group inside a group)."""
    from plait.planner import plan
    from plait.planner.search import replica_options

    assert replica_options(8, 1, 3, 1) == [1, 2, 4] and replica_options(8, 2, 1, 1) == [1, 2, 4, 8]
    assert replica_options(8, 1, 0, 1) == [1] and replica_options(8, 1, 3, 4) == [1, 2]
    result = plan("llama-7b", 32, "a100-40gb", seq=2048, global_batch=64, top=30)
    assert any(c.layout.dp_replicate > 1 for c in result.candidates)
