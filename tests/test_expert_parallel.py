"""Expert parallelism (docs/expert_parallel.md): Layout.ep, the ep/edp mesh sub-axes, the uneven all-to-all, the
refusals, and parity with one device (losses, norms, balance loss, tokens per expert, dropped tokens, gradients,
parameters, aux-free biases, evaluation) alone and composed with DDP, ZeRO-1/2/3, tp (+SP), pp, cp (ring and
Ulysses), recomputation, capacity drops and starved experts (tests/helpers/moe.py).

Default suite: one process start-up per world size (2, 4 and 8) trains that size's cells; further schedules,
recomputation modes, ZeRO stages and degrees are under ``long``.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
from helpers.composition import ChecksPassed
from helpers.harness import run_distributed
from helpers.moe import CLIP, Cell, assert_cell_matches, make_model, reference, train_cells

import plait
from plait import Layout, LayoutError
from plait.comm import Comm, CommStats, all_to_all_v
from plait.mesh import Mesh, RankGrid

CELLS = [
    # world 2
    Cell("ep2", {"dp": 2, "ep": 2}),
    Cell("ep2-zero1-starved-unclipped", {"dp": 2, "ep": 2, "zero": 1}, {"moe_balance": "aux_free"}, None, True),
    Cell(
        "ep2-zero2-capacity-sigmoid-swiglu",
        {"dp": 2, "ep": 2, "zero": 2, "microbatches": 2},
        {"capacity_factor": 1.0, "router_score": "sigmoid", "mlp": "swiglu", "moe_balance": "none"},
    ),
    Cell("cp2-ep2", {"dp": 1, "cp": 2, "ep": 2}),
    Cell("ep2-recompute-full-mb2", {"dp": 2, "ep": 2, "recompute": "full", "microbatches": 2}),
    # world 4
    Cell("dp4-ep2-zero3", {"dp": 4, "ep": 2, "zero": 3}),
    Cell("dp2-tp2-ep2", {"dp": 2, "tp": 2, "ep": 2}),
    Cell("dp2-tp2-sp-ep2-zero1", {"dp": 2, "tp": 2, "ep": 2, "sequence_parallel": True, "zero": 1}),
    Cell("dp2-pp2-ep2", {"dp": 2, "pp": 2, "ep": 2, "microbatches": 2}, {"moe_balance": "aux_free"}, CLIP, True),
    Cell("dp2-cp2-ep4-ulysses", {"dp": 2, "cp": 2, "ep": 4, "cp_mode": "ulysses"}),
    # a V: 4 stages of one block, each rank one dense and one MoE block (rank 0: blocks 0 and 3; rank 1: 1 and 2)
    Cell("dp2-pp2-ep2-dualpipev", {"dp": 2, "pp": 2, "ep": 2, "microbatches": 4, "schedule": "dualpipev"}),
    # world 8
    Cell("dp2-tp2-pp2-ep2", {"dp": 2, "tp": 2, "pp": 2, "ep": 2, "microbatches": 2}),
]
LONG_CELLS = [
    Cell("dp2-tp2-pp2-ep2-zero3", {"dp": 2, "tp": 2, "pp": 2, "ep": 2, "microbatches": 2, "zero": 3}),
    Cell("dp4-ep4", {"dp": 4, "ep": 4}, {"moe_balance": "aux_free"}, CLIP, True),
    Cell("dp4-ep2-zero2", {"dp": 4, "ep": 2, "zero": 2}),
    Cell("dp2-pp2-ep2-gpipe", {"dp": 2, "pp": 2, "ep": 2, "microbatches": 2, "schedule": "gpipe"}),
    Cell(
        "dp2-pp2-ep2-interleaved",
        {"dp": 2, "pp": 2, "ep": 2, "microbatches": 2, "schedule": "interleaved", "virtual_stages": 2},
        {"n_layer": 8},
    ),
    Cell("dp2-pp2-ep2-zero-bubble", {"dp": 2, "pp": 2, "ep": 2, "microbatches": 2, "schedule": "zero-bubble"}),
    Cell("dp2-pp2-ep2-zero3", {"dp": 2, "pp": 2, "ep": 2, "microbatches": 2, "zero": 3}),
    Cell(
        "dp2-pp2-ep2-zb-v-starved",
        {"dp": 2, "pp": 2, "ep": 2, "microbatches": 2, "schedule": "zb-v"},
        {"moe_balance": "aux_free"},
        CLIP,
        True,
    ),
    Cell(
        "dp2-pp2-ep2-dualpipev-zero3",
        {"dp": 2, "pp": 2, "ep": 2, "microbatches": 4, "schedule": "dualpipev", "zero": 3},
    ),
    Cell("dp2-cp2-ep2-ring-zero3", {"dp": 2, "cp": 2, "ep": 2, "zero": 3}),
    Cell("ep2-recompute-selective", {"dp": 2, "ep": 2, "recompute": "selective"}),
    Cell("ep2-recompute-op", {"dp": 2, "ep": 2, "recompute": "op"}),
    Cell(
        "dp2-tp2-sp-ep2-recompute-full-zero3",
        {"dp": 2, "tp": 2, "ep": 2, "sequence_parallel": True, "zero": 3, "recompute": "full"},
    ),
    Cell("ep2-zero1-offload-cpu", {"dp": 2, "ep": 2, "zero": 1, "offload": "cpu"}),
    Cell("ep2-zero3-offload-cpu", {"dp": 2, "ep": 2, "zero": 3, "offload": "cpu"}),
    Cell("ep2-compiled-aot-eager", {"dp": 2, "ep": 2, "compile": "aot_eager"}),
]
BY_NAME = {cell.name: cell for cell in CELLS + LONG_CELLS}


@functools.cache
def _runs(world: int, names: tuple[str, ...]) -> dict[str, list[dict]]:
    """Train the named cells of ``world`` ranks in one job; name -> per-rank results."""
    cells = [BY_NAME[name] for name in names]
    per_rank = run_distributed(train_cells, world, cells, timeout=600, comm_timeout_s=60)
    return {name: [results[name] for results in per_rank] for name in per_rank[0]}


def _check(cell: Cell, group: list[Cell]) -> None:
    names = tuple(c.name for c in group if c.world == cell.world)
    assert_cell_matches(cell, _runs(cell.world, names)[cell.name], reference(cell))


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.name)
def test_expert_parallel_matches_one_device(cell: Cell) -> None:
    _check(cell, CELLS)


@pytest.mark.long
@pytest.mark.parametrize("cell", LONG_CELLS, ids=lambda c: c.name)
def test_expert_parallel_matches_one_device_long(cell: Cell) -> None:
    _check(cell, LONG_CELLS)


def test_the_cells_exercise_what_they_claim() -> None:
    """The starved cells route no token to the starved experts, the capacity cell drops tokens, the others route
    every expert: the parity above is uneven routing, drops included (a check of the references)."""
    starved = reference(BY_NAME["ep2-zero1-starved-unclipped"])
    assert all(row[6] == row[7] == 0 for step in starved["load"] for row in step)
    assert all(sum(row) == 2 * 8 * 8 for step in starved["load"] for row in step)  # 64 tokens x top-2 per layer
    capacity = reference(BY_NAME["ep2-zero2-capacity-sigmoid-swiglu"])
    assert all(d > 0 for step in capacity["dropped"] for d in step)
    assert all(v > 0 for step in reference(BY_NAME["ep2"])["load"] for row in step for v in row)
    assert reference(BY_NAME["ep2"])["aux"][0] > 0


# ----------------------------------------------------------------- layout, mesh, refusals (no processes)
def test_ep_folds_into_the_data_ranks() -> None:
    grid = RankGrid.from_layout(Layout(dp=4, ep=2).resolve(4))
    assert grid.groups("ep") == [[0, 1], [2, 3]] and grid.groups("edp") == [[0, 2], [1, 3]]
    grid = RankGrid.from_layout(Layout(dp=2, cp=2, tp=2, ep=2).resolve(8))
    assert grid.groups("ep") == grid.groups("cp")  # ep innermost of the data ranks: here the cp pairs
    assert grid.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    grid = RankGrid.from_layout(Layout(dp=2, cp=2, ep=4).resolve(4))
    assert grid.groups("ep") == [[0, 1, 2, 3]] and grid.size("edp") == 1
    assert Layout(dp=2, tp=2, ep=2).world_size == 4  # ep is no factor of the world size
    assert "ep" not in RankGrid.from_layout(Layout().resolve(2)).coords(0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dp": 3, "ep": 2}, "ep=2 must divide the data-parallel ranks dp x cp = 3 x 1 = 3"),
        ({"ep": 0}, "ep=0 must be an integer >= 1"),
        ({"dp": 2, "pp": 2, "ep": 2, "schedule": "pipedream"}, "ep=2 with schedule='pipedream'"),
    ],
)
def test_layout_refuses_bad_ep(kwargs: dict, message: str) -> None:
    with pytest.raises(LayoutError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Layout(**kwargs)
    with pytest.raises(LayoutError, match="ep=3 must divide"):
        Layout(ep=3).resolve(4)


def _parallelize_checks(world: int, layout: Layout, model: torch.nn.Module, optimizer: object = None) -> None:
    """``plait.parallelize``'s checks as a rank of ``world``: returns when accepted (it reached Mesh.build, where
    the first process group would be made), raises its LayoutError when refused: before any collective."""
    from unittest import mock

    with (
        mock.patch("plait.parallelize.dist.is_initialized", return_value=True),
        mock.patch("plait.parallelize.dist.get_world_size", return_value=world),
        mock.patch("plait.parallelize.Mesh.build", side_effect=ChecksPassed),
    ):
        try:
            plait.parallelize(model, layout, optimizer=optimizer or (lambda p: torch.optim.AdamW(p)))
        except ChecksPassed:
            return


@pytest.mark.parametrize(
    ("world", "layout", "model", "message"),
    [
        (4, {"dp": 4, "ep": 4}, {"n_experts": 6}, "ep=4 does not divide the 6 experts of blocks.1.mlp"),
        (2, {"dp": 2, "ep": 2}, {"n_experts": 0}, "ep=2 splits the experts of Mixture-of-Experts layers, but GPT"),
        (2, {"cp": 2, "ep": 2}, {"capacity_factor": 1.0}, "capacity_factor=1.0: an expert's capacity is counted"),
        (4, {"dp": 2, "pp": 2}, {}, None),
        (4, {"tp": 4, "tp_mode": "2d"}, {}, "tp_mode='2d' are not implemented"),
        (2, {"dp": 1, "pp": 2, "schedule": "pipedream"}, {}, "schedule='pipedream' are not implemented"),
    ],
)
def test_parallelize_refuses_before_any_collective(world: int, layout: dict, model: dict, message: str | None):
    gpt, _ = make_model(model)
    if message is None:
        _parallelize_checks(world, Layout(**layout), gpt)  # accepted (dp2-pp2: both stages have an MoE block)
        return
    with pytest.raises(LayoutError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _parallelize_checks(world, Layout(**layout), gpt)


def test_whole_tensor_optimizer_choosing_experts_under_zero_is_refused_before_any_collective() -> None:
    from plait.parallel.whole_tensor import WholeTensorOptimizer

    gpt, _ = make_model()
    muon = WholeTensorOptimizer(whole=torch.optim.SGD, rest=torch.optim.SGD, select=lambda name, p: p.dim() >= 2)
    with pytest.raises(LayoutError, match=r"chooses expert weights \(blocks.1.mlp.experts.w_up"):
        _parallelize_checks(2, Layout(dp=2, ep=2, zero=1), gpt, muon)
    _parallelize_checks(2, Layout(dp=2, ep=2, zero=0), gpt, muon)  # DDP: accepted (each rank steps its slice)


def test_gpt_tp_plan_splits_shared_experts_and_dense_mlps_only() -> None:
    from plait.parallel.tensor.plan import gpt_plan, resolve_plan

    gpt, _ = make_model({"mlp": "swiglu"})
    styles = resolve_plan(gpt, gpt_plan(gpt), tp=2).styles
    assert styles["blocks.0.mlp"] == "enter" and "blocks.1.mlp" not in styles  # the MoE layer is no tp region
    assert styles["blocks.1.mlp.shared"] == "enter" and styles["blocks.1.mlp.shared.gate"] == "colwise"
    assert not any(".router" in path or ".experts" in path for path in styles)


# ----------------------------------------------------------------- the uneven all-to-all (gloo, with autograd)
def _all_to_all_v_rank() -> dict:
    mesh = Mesh.build(Layout(dp=2, ep=2))
    comm = Comm(mesh, CommStats(), timeout_s=60)
    rank = mesh.index("ep")
    send = [[1, 3], [0, 2]][rank]  # rank 0 sends 1 row to itself, 3 to rank 1; rank 1 sends 0 to rank 0
    recv = [[1, 0], [3, 2]][rank]
    x = (torch.arange(sum(send) * 2, dtype=torch.float32).view(-1, 2) + 100 * rank).requires_grad_()
    y = all_to_all_v(x, comm, "ep", send, recv)
    (y * torch.arange(1, y.numel() + 1, dtype=torch.float32).view_as(y)).sum().backward()
    return {"y": y.detach(), "grad": x.grad, "stats": comm.stats.to_dict()}


def test_uneven_all_to_all_with_autograd_and_exact_bytes() -> None:
    zero, one = run_distributed(_all_to_all_v_rank, 2, timeout=120)
    assert zero["y"].tolist() == [[0.0, 1.0]]  # rank 1 sent nothing to rank 0
    assert one["y"].tolist() == [[2.0, 3.0], [4.0, 5.0], [6.0, 7.0], [100.0, 101.0], [102.0, 103.0]]
    # backward: each row's gradient goes back to its sender (weights 1.. over the receiver's output)
    assert zero["grad"].tolist() == [[1.0, 2.0], [1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
    assert one["grad"].tolist() == [[7.0, 8.0], [9.0, 10.0]]
    row = 2 * 4  # bytes of one row
    assert zero["stats"]["ep/all_to_all_v"] == {"calls": 2, "payload_bytes": 4 * row + 1 * row, "wire_bytes": 3 * row}
    assert one["stats"]["ep/all_to_all_v"] == {"calls": 2, "payload_bytes": 2 * row + 5 * row, "wire_bytes": 3 * row}


# ----------------------------------------------------------------- bytes against theory, all-to-all in traces
def _traced_step() -> dict:
    """One step of dp2 x ep2, traced, with the routers' choices recorded (the routing decides the bytes)."""
    from helpers.composition import optimizer
    from helpers.moe import GLOBAL_BATCH

    from plait.data import ShardedBatches
    from plait.models.moe import moe_layers
    from plait.observe.trace import Tracer

    model, task = make_model()
    engine = plait.parallelize(model, Layout(dp=2, ep=2), optimizer=optimizer)
    chosen: dict[int, torch.Tensor] = {}

    def record(layer: int, module: torch.nn.Module, args: tuple, out: tuple) -> None:
        chosen.setdefault(layer, out[1])

    shared: list[tuple[int, int]] = []  # (start, end) ns of each shared-experts forward

    def shared_began(module: torch.nn.Module, args: tuple) -> None:
        shared.append((time.perf_counter_ns(), 0))

    def shared_ended(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        shared[-1] = (shared[-1][0], time.perf_counter_ns())

    for layer in moe_layers(engine.model):
        layer.router.register_forward_hook(functools.partial(record, layer.layer))
        layer.shared.register_forward_pre_hook(shared_began)
        layer.shared.register_forward_hook(shared_ended)
    loader = ShardedBatches(task, GLOBAL_BATCH, dp_rank=engine.mesh.index("dp"), dp_size=2)
    tracer = Tracer(engine).start()
    stats = engine.train_step(loader.batch_at(0))
    tracer.stop()
    spans = [span[2] for span in tracer.spans] + [flight[0] for flight in tracer.flights]
    flights = [(f[1], f[2]) for f in tracer.flights if f[0] == "all_to_all_v ep"]
    return {"comm": stats.comm.to_dict(), "chosen": chosen, "spans": spans, "flights": flights, "shared": shared}


def test_token_exchange_bytes_equal_theory_and_appear_in_traces() -> None:
    """Per MoE layer and micro-batch a rank sends, in the forward dispatch and the backward of the combine, the
    rows it routes to the other ep rank's experts, and in the forward combine and the backward of the dispatch,
    the rows the other rank routed to its experts: 2 (sent + received) x d_model x 4 bytes, from the routing.
    The forward dispatch is in flight (asynchronous, counted alike) while the layer's shared experts compute."""
    results = run_distributed(_traced_step, 2, timeout=120)
    local = 8 // 2  # experts per ep rank
    for rank, result in enumerate(results):
        other = results[1 - rank]
        sent = sum(int((c // local != rank).sum()) for c in result["chosen"].values())
        received = sum(int((c // local == rank).sum()) for c in other["chosen"].values())
        layers = len(result["chosen"])
        exchange = result["comm"]["ep/all_to_all_v"]
        assert exchange["calls"] == 4 * layers
        assert exchange["wire_bytes"] == 2 * (sent + received) * 16 * 4
        counts = result["comm"]["ep/all_to_all"]  # the [P, L] count matrix, forward only
        assert counts == {"calls": layers, "payload_bytes": layers * 8 * 8, "wire_bytes": layers * (2 - 1) / 2 * 64}
        assert sum(name.startswith("all_to_all_v ep") for name in result["spans"]) == 4 * layers
        assert sent > 0 and received > 0
        # overlap: each layer's dispatch is issued asynchronously and its shared experts run while the rows travel
        assert len(result["flights"]) == layers and len(result["shared"]) == layers
        for (launched, arrived), (began, ended) in zip(result["flights"], result["shared"], strict=True):
            assert launched <= began <= ended <= arrived, (launched, began, ended, arrived)


# ----------------------------------------------------------------- mixed precision
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PRECISION_MODEL = {"aux_loss_coef": 1.0}
"""A balance loss as large as the cross-entropy's gradient on the routers: a balance gradient that missed fp16's
loss scale (or kept it after unscaling) would be 65536 x off there."""


def _precision_run(precision: str) -> dict:
    from helpers.composition import optimizer, whole_gradients
    from helpers.moe import GLOBAL_BATCH, STEPS

    from plait.data import ShardedBatches

    model, task = make_model(PRECISION_MODEL)
    engine = plait.parallelize(model, Layout(dp=2, ep=2, precision=precision), optimizer=optimizer)
    exchanged: set[torch.dtype] = set()
    send = engine.comm.all_to_all_v
    engine.comm.all_to_all_v = lambda x, *a, **k: exchanged.add(x.dtype) or send(x, *a, **k)  # type: ignore
    grads: list[dict] = []
    engine.before_optimizer_step.append(lambda e: grads.append(whole_gradients(e)) if not grads else None)
    loader = ShardedBatches(task, GLOBAL_BATCH, dp_rank=engine.mesh.index("dp"), dp_size=2)
    stats = [engine.train_step(loader.batch_at(step)) for step in range(STEPS)]
    aux = [s.moe.aux_loss for s in stats]  # type: ignore[union-attr]
    return {"losses": [s.loss for s in stats], "aux": aux, "grads": grads[0], "exchanged": exchanged}


def _precision_runs() -> dict[str, dict]:
    return {precision: _precision_run(precision) for precision in ("bf16", "fp16")}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_with_experts_tracks_fp32(precision: str) -> None:
    """bf16 / fp16 autocast (experts' matmuls in the compute dtype, the router in fp32) at dp2 x ep2 against fp32
    on one device: losses and balance losses within one mantissa step of the compute dtype (the tolerance of
    tests/test_precision.py), the routers' step-0 gradients (mostly the balance loss's here) within 1%. The
    tokens travel in the compute dtype (half the bytes of the fp32 residual stream)."""
    runs = _precision_runs_cached()
    assert runs[precision]["exchanged"] == {DTYPES[precision]}
    expected = reference(Cell("fp32", {"dp": 1}, PRECISION_MODEL, None))
    step = {"bf16": 2.0**-8, "fp16": 2.0**-11}[precision]
    assert runs[precision]["losses"] == pytest.approx(expected["losses"], rel=step)
    assert runs[precision]["aux"] == pytest.approx(expected["aux"], rel=step)
    for name, grad in expected["grads"].items():
        if ".router." in name:
            error = float((runs[precision]["grads"][name] - grad).norm() / grad.norm())
            assert error < 1e-2, f"{precision}: {name} step-0 gradient off by {error:.2g} (relative norm)"


@functools.cache
def _precision_runs_cached() -> dict[str, dict]:
    return run_distributed(_precision_runs, 2, timeout=300)[0]
