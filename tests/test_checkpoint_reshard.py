"""Checkpoints reshard: saved under one layout, loaded under another (other dp / tp / pp degrees, ZeRO stage,
world size, or one process without a process group), training continues as if uninterrupted.

A V-shaped pipeline (DualPipeV: rank 0 holds the first and the last of 2p stages) saves stage-placed parameters
under their whole-model names; 1F1B (another placement) and one process load them bitwise (issue 36).

The "done when" of issue 8: train 5 steps at layout A, save, load at layout B, train 5 more; the loss curve
equals 10 uninterrupted steps at A. Each A run trains 10 steps and saves at step 5 (its curve is the reference),
so 4 process starts serve 6 (A, B) pairs. Also: the pieces each rank holds map to whole tensors exactly
(pure functions, no processes), random states are restored bitwise at the same layout (dropout), the
``plait convert`` helpers, and refusals (grid tensor parallelism, a non-elementwise state of a tp slice).
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers.composition import (
    CLIP,
    GLOBAL_BATCH,
    LOSS_RTOL,
    PARAM_TOL,
    make_model,
    merge_ranks,
    optimizer,
    whole_parameters,
)
from helpers.harness import run_distributed
from helpers.reference import assert_tensors_close

import plait
from plait import Layout
from plait.checkpoint import load_full_state, save_model_state
from plait.checkpoint.chunks import flat_range_boxes, global_shape, tp_pieces
from plait.data import ShardedBatches

SAVE_AT, STEPS = 5, 10

LAYOUTS = {
    "dp2-tp2-zero1": Layout(dp=2, tp=2, zero=1),
    "pp2-dp2-zero0": Layout(pp=2, dp=2, zero=0, microbatches=2),
    "dp2-zero3": Layout(dp=2, zero=3),
    "single": Layout(dp=1),
    "pp2-zero1": Layout(dp=1, pp=2, zero=1, microbatches=2),
    "dp4-zero3": Layout(dp=4, zero=3),
    "tp2-zero0": Layout(dp=1, tp=2, zero=0),
    "tp2-dp2-zero1": Layout(tp=2, dp=2, zero=1),
    "dp4-zero1": Layout(dp=4, zero=1),
    "dp2-zero1": Layout(dp=2, zero=1),
    "tp2-dp2-zero3": Layout(tp=2, dp=2, zero=3),
    "pp2-dualpipev": Layout(dp=1, pp=2, schedule="dualpipev", microbatches=4),
}
PAIRS = [  # (saved at A, loaded at B): world size changes in 5, pp in 5, tp in 4, ZeRO stage in 6, placement in 2
    ("dp2-tp2-zero1", "pp2-dp2-zero0"),
    ("dp2-zero3", "single"),
    ("pp2-zero1", "dp4-zero3"),
    ("tp2-zero0", "tp2-dp2-zero1"),
    ("dp4-zero1", "dp2-zero1"),
    ("tp2-dp2-zero3", "pp2-zero1"),  # ZeRO-3 flat shards of tp slices -> whole parameters on pipeline stages
    ("pp2-dualpipev", "pp2-zero1"),  # a V (rank 0: stages 0 and 3) -> 1F1B (rank 0: stages 0 and 1)
    ("pp2-dualpipev", "single"),
]


def _scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """The lr halves every 3 steps: a resumed run with the scheduler's state lost would take other steps."""
    return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)


def _engine(name: str) -> tuple[plait.Engine, ShardedBatches]:
    model, task = make_model()
    engine = plait.parallelize(model, LAYOUTS[name], optimizer=optimizer, max_grad_norm=CLIP, lr_scheduler=_scheduler)
    loader = ShardedBatches(task, GLOBAL_BATCH, dp_rank=engine.mesh.index("dp"), dp_size=engine.mesh.size("dp"))
    return engine, loader


def _run_a(names: list[str], root: str) -> dict:
    """Layout A, uninterrupted: 10 steps, saving after step 5: the loss curve and the whole parameters then."""
    out = {}
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    for name in names:
        if _world(name) != world:
            continue
        engine, loader = _engine(name)
        losses = [engine.train_step(loader.batch_at(step)).loss for step in range(SAVE_AT)]
        engine.save(f"{root}/{name}")
        saved = whole_parameters(engine)
        losses += [engine.train_step(loader.batch_at(step)).loss for step in range(SAVE_AT, STEPS)]
        out[name] = {"losses": losses, "saved": saved, "final": whole_parameters(engine)}
    return out


def _run_b(pairs: list[tuple[str, str]], root: str) -> dict:
    """Layout B: load A's checkpoint, then train steps 5..9."""
    out = {}
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    for a, b in pairs:
        if _world(b) != world:
            continue
        engine, loader = _engine(b)
        assert engine.load(f"{root}/{a}") == SAVE_AT
        loaded = whole_parameters(engine)
        losses = [engine.train_step(loader.batch_at(step)).loss for step in range(SAVE_AT, STEPS)]
        out[(a, b)] = {
            "losses": losses,
            "loaded": loaded,
            "final": whole_parameters(engine),
            "lr": engine.optimizer.param_groups[0]["lr"],
        }
    return out


def _world(name: str) -> int:
    layout = LAYOUTS[name]  # every degree given (dp=-1 would mean "the rest of the world")
    return layout.dp * layout.tp * layout.pp * layout.cp


@pytest.fixture(scope="module")
def resharded(tmp_path_factory) -> dict:
    """Run every A (grouped by world size), then every B; merge each rank's whole tensors."""
    root = str(tmp_path_factory.mktemp("reshard"))
    a_names = sorted({a for a, _ in PAIRS})
    runs_a: dict = {}
    for world in (4, 2):
        per_rank = run_distributed(_run_a, world, a_names, root, timeout=240)
        for name in per_rank[0]:
            runs_a[name] = {
                "losses": per_rank[0][name]["losses"],
                "saved": merge_ranks([r[name]["saved"] for r in per_rank], f"{name} saved"),
                "final": merge_ranks([r[name]["final"] for r in per_rank], f"{name} final"),
            }
    runs_b: dict = {}
    for world in (4, 2):
        per_rank = run_distributed(_run_b, world, PAIRS, root, timeout=240)
        for pair in per_rank[0]:
            runs_b[pair] = {
                "losses": per_rank[0][pair]["losses"],
                "lr": per_rank[0][pair]["lr"],
                "loaded": merge_ranks([r[pair]["loaded"] for r in per_rank], f"{pair} loaded"),
                "final": merge_ranks([r[pair]["final"] for r in per_rank], f"{pair} final"),
            }
    runs_b.update(_run_b(PAIRS, root))  # B = one process, no process group
    return {"root": root, "a": runs_a, "b": runs_b}


@pytest.mark.distributed
@pytest.mark.parametrize("pair", PAIRS, ids=[f"{a}-to-{b}" for a, b in PAIRS])
def test_resume_under_another_layout_continues_the_loss_curve(resharded, pair):
    a, b = pair
    run_a, run_b = resharded["a"][a], resharded["b"][pair]
    # Loading copies values: the whole parameters after the load are bitwise those A saved.
    for name, tensor in run_a["saved"].items():
        assert torch.equal(run_b["loaded"][name], tensor), f"{a} -> {b}: {name} changed by save/load"
    assert run_b["loaded"].keys() == run_a["saved"].keys()
    # fp32: A and B sum the same terms in another order (other dp / tp splits of the reductions), a few ulps per
    # step; 5 AdamW steps (eps 1e-5, docs/composition.md) keep that at ~1e-7 relative: LOSS_RTOL = 1e-6 as in the
    # composition matrix. A lost optimizer state, lr schedule or step would move the loss by > 1e-4.
    for step, (got, want) in enumerate(zip(run_b["losses"], run_a["losses"][SAVE_AT:]), start=SAVE_AT):
        assert abs(got - want) <= LOSS_RTOL * abs(want), f"{a} -> {b} step {step}: loss {got!r} != {want!r}"
    assert_tensors_close(run_b["final"], run_a["final"], f"{a} -> {b} final param", PARAM_TOL)
    assert run_b["lr"] == pytest.approx(1e-3 * 0.5**3)  # StepLR restored: 10 steps = 3 halvings


@pytest.mark.distributed
def test_whole_model_of_a_sharded_checkpoint_in_one_process(resharded, tmp_path):
    """load_full_state reads a dp2 x tp2 ZeRO-1 checkpoint whole, bitwise; save_model_state writes a model-only
    checkpoint that an engine of any layout loads, with a fresh optimizer."""
    state, meta = load_full_state(f"{resharded['root']}/dp2-tp2-zero1")
    saved = resharded["a"]["dp2-tp2-zero1"]["saved"]
    assert state.keys() == saved.keys() and meta["step"] == SAVE_AT and meta["layout"]["tp"] == 2
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name
    save_model_state(tmp_path / "imported", state, {"step": 0, "note": "imported"})
    engine, loader = _engine("single")
    assert engine.load(tmp_path / "imported") == 0
    assert not engine.optimizer.state
    for name, param in engine.model.named_parameters():
        assert torch.equal(param.detach(), saved[name]), name
    engine.train_step(loader.batch_at(0))  # a fresh AdamW takes its first step from here
    assert int(engine.optimizer.state[next(iter(engine.model.parameters()))]["step"]) == 1


# ----------------------------------------------------------------- random states (dropout)
def _dropout_engine(layout: Layout) -> tuple[plait.Engine, ShardedBatches]:
    from plait.data import AdditionTask
    from plait.models import GPT, GPTConfig

    task = AdditionTask(digits=2, seed=1)
    torch.manual_seed(1234)
    random.seed(99)
    config = GPTConfig(
        vocab_size=task.vocab_size, seq_len=task.seq_len, n_layer=2, n_head=2, d_model=16, bias=False, dropout=0.2
    )
    engine = plait.parallelize(GPT(config), layout, optimizer=optimizer, max_grad_norm=CLIP)
    loader = ShardedBatches(task, GLOBAL_BATCH, dp_rank=engine.mesh.index("dp"), dp_size=engine.mesh.size("dp"))
    return engine, loader


def _dropout_curves(root: str, world: int) -> tuple[list[float], list[float]]:
    """10 uninterrupted steps, and 5 + save + (a fresh engine, reseeded) load + 5."""
    layout = Layout(dp=world)
    engine, loader = _dropout_engine(layout)
    straight = [engine.train_step(loader.batch_at(step)).loss for step in range(STEPS)]
    engine, loader = _dropout_engine(layout)
    resumed = [engine.train_step(loader.batch_at(step)).loss for step in range(SAVE_AT)]
    engine.save(root)
    engine, loader = _dropout_engine(layout)  # reseeds: without the saved states the masks would repeat steps 0..4
    engine.load(root)
    resumed += [engine.train_step(loader.batch_at(step)).loss for step in range(SAVE_AT, STEPS)]
    return straight, resumed


def test_random_states_restored_bitwise_single_process(tmp_path, monkeypatch):
    straight, resumed = _dropout_curves(str(tmp_path / "a"), 1)
    assert resumed == straight  # bitwise: the same layout replays the same dropout masks
    import plait.checkpoint.extras as extras

    monkeypatch.setattr(extras, "load_rng", lambda folder, rank: False)
    straight, lost = _dropout_curves(str(tmp_path / "b"), 1)
    assert lost[SAVE_AT:] != straight[SAVE_AT:]  # the control: without restoring, dropout draws other masks


@pytest.mark.distributed
def test_random_states_restored_bitwise_data_parallel(tmp_path):
    for straight, resumed in run_distributed(_dropout_curves, 2, str(tmp_path / "ckpt"), 2):
        assert resumed == straight


# ----------------------------------------------------------------- pieces -> whole tensors, without processes
def test_flat_ranges_decompose_into_contiguous_rectangles():
    """Every [s, e) of a row-major tensor is covered exactly, in order, by the rectangles, each a contiguous run."""
    generator = random.Random(0)
    for shape in [(), (7,), (3, 5), (2, 3, 4), (4, 1, 3, 2)]:
        numel = int(torch.tensor(shape).prod()) if shape else 1
        index = torch.arange(numel).reshape(shape)
        for _ in range(40):
            s = generator.randrange(numel)
            e = generator.randrange(s, numel) + 1
            covered = []
            for offsets, sizes, first in flat_range_boxes(shape, s, e):
                block = index[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))].reshape(-1)
                assert block.tolist() == list(range(first, first + block.numel()))  # contiguous from ``first``
                covered += block.tolist()
            assert covered == list(range(s, e)), (shape, s, e)
            assert len(flat_range_boxes(shape, s, e)) <= max(1, 2 * len(shape) - 1)


def test_tensor_parallel_slices_map_to_their_global_rectangles():
    """A fused q|k|v slice lands in 3 blocks; a padded vocabulary is clipped; a rectangle of a slice maps too."""
    whole = torch.arange(12 * 4).reshape(12, 4).float()  # fused [q; k; v], 4 rows each, split over tp=2
    for rank in range(2):
        local = torch.cat([block.chunk(2)[rank] for block in whole.chunk(3)])
        param = torch.nn.Parameter(local.clone())
        param.tp_sharded, param.tp_shard_dim, param.tp_fused_parts = True, 0, 3
        assert global_shape(param, local.shape, 2) == whole.shape
        for lo, rows in ((0, 6), (1, 4)):
            pieces = tp_pieces(param, local.shape, (lo, 0), local[lo : lo + rows], rank, 2)
            assert sum(p.view.shape[0] for p in pieces) == rows
            for piece in pieces:
                (row, col), (n, m) = piece.offsets, piece.sizes
                assert torch.equal(whole[row : row + n, col : col + m], piece.view)
    vocab = torch.arange(5 * 2).reshape(5, 2).float()  # 5 rows padded to 6 over tp=2: rank 1 holds 1 pad row
    for rank in range(2):
        local = torch.cat([vocab, torch.zeros(1, 2)]).chunk(2)[rank]
        param = torch.nn.Parameter(local.clone())
        param.tp_sharded, param.tp_shard_dim, param.tp_full_size = True, 0, 5
        pieces = tp_pieces(param, local.shape, (0, 0), local, rank, 2)
        assert [p.offsets for p in pieces] == [(3 * rank, 0)] and pieces[0].sizes == ((3, 2) if rank == 0 else (2, 2))
        assert torch.equal(vocab[3 * rank : 3 * rank + pieces[0].sizes[0]], pieces[0].view)


def test_grid_tensor_parallel_is_refused_clearly():
    from types import SimpleNamespace

    from plait.checkpoint.canonical import check_layout

    with pytest.raises(plait.LayoutError, match="tp_mode='2d'.*gather_parameters"):
        check_layout(SimpleNamespace(layout=SimpleNamespace(tp=4, tp_mode="2d")))
