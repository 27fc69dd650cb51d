"""Hugging Face Mixtral under the V-shaped schedules (ZB-V, DualPipeV; issue 36): parity with one device (losses,
norms before clipping, the balance loss, tokens per expert, step-0 gradients, final parameters, evaluation:
``helpers.moe.assert_cell_matches``) at pp = 2, alone and with dp2 x ep2 (and ZeRO-3), uneven loss masks, clipped
and not, starved experts; DualPipeV's overlapped pairs (``plait/parallel/pipeline/overlap.py``) run under ep = 2
(ZeRO-3 included) and not without it; and the refusal of a V on a model with fewer blocks than its 2p chunks.

The model is ``tests/helpers/hf_moe.py``'s tiny Mixtral with 4 decoder layers (a V at pp = 2 runs 2p = 4 chunks of
one layer: rank 0 holds layers 0 and 3 with the embedding and the head, rank 1 layers 1 and 2), 8 rows of 16
tokens, 3 AdamW steps. One process start-up per world size (2 and 4).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from helpers.harness import run_distributed
from helpers.hf_moe import Cell, make_model, reference, train_cell
from helpers.moe import assert_cell_matches

from plait import Layout, LayoutError

LAYERS = {"num_hidden_layers": 4}
CELLS = [
    # world 2: the V alone
    Cell("mixtral-pp2-zb-v-mb4", {"dp": 1, "pp": 2, "microbatches": 4, "schedule": "zb-v"}, LAYERS),
    Cell(
        "mixtral-pp2-zb-v-mb2-unclipped", {"dp": 1, "pp": 2, "microbatches": 2, "schedule": "zb-v"}, LAYERS, clip=None
    ),
    Cell(
        "mixtral-pp2-dualpipev-mb4-unclipped",
        {"dp": 1, "pp": 2, "microbatches": 4, "schedule": "dualpipev"},
        LAYERS,
        clip=None,
    ),
    # world 4: dp2 x pp2, experts split over ep2 (each rank 2 of the 4 experts of its two layers)
    Cell("mixtral-dp2-pp2-ep2-zb-v-mb2", {"dp": 2, "pp": 2, "ep": 2, "microbatches": 2, "schedule": "zb-v"}, LAYERS),
    Cell(
        "mixtral-dp2-pp2-ep2-dualpipev-mb4",
        {"dp": 2, "pp": 2, "ep": 2, "microbatches": 4, "schedule": "dualpipev"},
        LAYERS,
    ),
    Cell(
        "mixtral-dp2-pp2-ep2-dualpipev-mb4-starved-unclipped",
        {"dp": 2, "pp": 2, "ep": 2, "microbatches": 4, "schedule": "dualpipev"},
        LAYERS,
        clip=None,
        starve=True,
    ),
    # ZeRO-3: each chunk of an overlapped pair gathers its own stage's units; rank 0's pairs share the root unit
    Cell(
        "mixtral-dp2-pp2-ep2-dualpipev-mb4-zero3",
        {"dp": 2, "pp": 2, "ep": 2, "microbatches": 4, "schedule": "dualpipev", "zero": 3},
        LAYERS,
    ),
    Cell(
        "mixtral-dp2-pp2-ep2-zb-v-mb2-zero3-unclipped",
        {"dp": 2, "pp": 2, "ep": 2, "microbatches": 2, "schedule": "zb-v", "zero": 3},
        LAYERS,
        clip=None,
    ),
]
BY_NAME = {cell.name: cell for cell in CELLS}


def _train_counting_pairs(cell: Cell) -> dict[str, Any]:
    """``helpers.hf_moe.train_cell``, with the number of DualPipeV pairs this rank ran overlapped."""
    import plait.parallel.pipeline.runtime as runtime

    original, pairs = runtime.run_pair, [0]

    def counting(*args: Any, **kwargs: Any) -> None:
        pairs[0] += 1
        original(*args, **kwargs)

    runtime.run_pair = counting
    try:
        return {**train_cell(cell), "pairs": pairs[0]}
    finally:
        runtime.run_pair = original


def _train_cells(cells: list[Cell]) -> dict[str, dict[str, Any]]:
    import torch

    world = torch.distributed.get_world_size()
    return {cell.name: _train_counting_pairs(cell) for cell in cells if cell.world == world}


@functools.cache
def _trained(world: int) -> dict[str, list[dict[str, Any]]]:
    """Every cell of ``world`` ranks in one job: name -> per-rank results."""
    cells = [cell for cell in CELLS if cell.world == world]
    per_rank = run_distributed(_train_cells, world, cells, timeout=600, comm_timeout_s=60)
    return {cell.name: [results[cell.name] for results in per_rank] for cell in cells}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.name)
def test_mixtral_under_a_v_matches_one_device(cell: Cell) -> None:
    per_rank = _trained(cell.world)[cell.name]
    assert_cell_matches(cell, per_rank, reference(cell))
    pairs = [result["pairs"] for result in per_rank]
    if cell.layout["schedule"] == "dualpipev" and cell.layout.get("ep", 1) > 1:
        # the steady state's (forward, backward) pairs ran overlapped on every rank, switching at the all-to-alls
        assert all(n > 0 for n in pairs), pairs
    else:  # nothing to overlap without ep (and ZB-V has no pairs): the chunks run one after the other
        assert pairs == [0] * len(pairs)


def test_the_cells_exercise_what_they_claim() -> None:
    """Every cell of the V's: 4 layers (2p chunks at pp = 2), the balance loss on; the starved cell routes no token
    to experts 2 and 3 (the second ep rank receives no row), the others route to every expert."""
    for cell in CELLS:
        assert cell.model["num_hidden_layers"] == 2 * cell.layout["pp"]
    starved = reference(BY_NAME["mixtral-dp2-pp2-ep2-dualpipev-mb4-starved-unclipped"])
    assert all(row[2] == row[3] == 0 and sum(row) == 2 * 8 * 16 for step in starved["load"] for row in step)
    balanced = reference(BY_NAME["mixtral-pp2-zb-v-mb4"])
    assert all(v > 0 for step in balanced["load"] for row in step for v in row) and balanced["aux"][0] > 0
    assert {cell.layout["schedule"] for cell in CELLS} == {"zb-v", "dualpipev"}
    assert {cell.clip is None for cell in CELLS} == {True, False}


@pytest.mark.parametrize("schedule", ["zb-v", "dualpipev"])
def test_a_v_on_a_mixtral_with_fewer_layers_than_its_chunks_is_refused_with_the_fix(schedule: str) -> None:
    """A V at pp = 2 runs 4 chunks; the 2-layer Mixtral has 2. The fix names what runs instead: a model with 4
    layers, or a schedule of one stage per rank (which the 2 layers do run)."""
    from helpers.composition import check_in_one_process

    layout = {"dp": 2, "pp": 2, "ep": 2, "microbatches": 4}
    with pytest.raises(LayoutError, match=rf"schedule='{schedule}' runs two chunks per rank") as info:
        check_in_one_process(4, Layout(**layout, schedule=schedule), model=make_model("mixtral"))
    assert "Fix: use a model with at least 4 layers, or a schedule of one stage per rank" in str(info.value)
    check_in_one_process(4, Layout(**layout, schedule="zero-bubble"), model=make_model("mixtral"))
    check_in_one_process(4, Layout(**layout, schedule=schedule), model=make_model("mixtral", **LAYERS))
