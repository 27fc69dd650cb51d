"""The composition parity matrix (docs/composition.md): dp x tp x pp x cp (each 1 or 2) x ZeRO 0/1/3 against
single-device training of the tiny reference GPT (tests/composition.py).

Default suite: every one of the 48 cells is checked in one process to pass every check of ``plait.parallelize``
(none is refused), and the whole matrix trains 3 steps on gloo ranks (the 45 cells up to 8 ranks; the 16-rank
layout exceeds this machine's process budget) and must match single-device training: one test per cell of a
deterministic sample of 10 (world <= 4, every axis and every ZeRO stage) for a quick reading, and one test over
all 45 that writes the docs table with the measured worst errors to ``PLAIT_MATRIX_TABLE=path`` when set.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers.composition import (
    ALL_COMBOS,
    AXES,
    CLIP,
    EXTRA,
    MAX_WORLD,
    MUTANTS,
    SAMPLE,
    TRAINABLE,
    ZERO_STAGES,
    Combo,
    assert_combo_matches,
    axis_and_zero_coverage,
    check_in_one_process,
    markdown_table,
    max_errors,
    reference_trajectory,
    train_combos,
)
from helpers.harness import run_distributed

from plait.logging import get_logger

log = get_logger(__name__)


def _ids(combos: list[Combo]) -> list[str]:
    return [combo.name for combo in combos]


def run_grouped(combos: list[Combo], timeout: float) -> dict[str, list[dict]]:
    """Train ``combos``: one ``run_distributed`` per world size (each rank trains that size's cells in turn, so
    processes start once per size); returns name -> per-rank results."""
    names = [combo.name for combo in combos]
    out: dict[str, list[dict]] = {}
    for world in sorted({combo.world for combo in combos}):
        per_rank = run_distributed(train_combos, world, names, timeout=timeout, comm_timeout_s=60)
        for name in per_rank[0]:
            out[name] = [results[name] for results in per_rank]
    return out


@pytest.fixture(scope="module")
def reference():
    return reference_trajectory()


@pytest.fixture(scope="module")
def matrix_runs() -> dict[str, list[dict]]:
    """Every cell up to 8 ranks and the extra cells, trained once (one run_distributed per world size: 1, 2, 4, 8;
    ~25-30 s on 2 cores): the sampled-cell tests and the whole-matrix test read the same runs."""
    return run_grouped(TRAINABLE + EXTRA + MUTANTS, timeout=600)


# ----------------------------------------------------------------- the matrix itself (no processes)
def test_the_matrix_has_every_cell_and_the_sample_covers_every_axis_and_zero_stage():
    assert len(ALL_COMBOS) == len({combo.name for combo in ALL_COMBOS}) == 16 * len(ZERO_STAGES)
    assert len(TRAINABLE) == 45  # pinned: docs/composition.md (3 cells of 16 ranks are not trained here)
    axes, zeros = axis_and_zero_coverage(SAMPLE)
    assert axes == set(AXES) and zeros == set(ZERO_STAGES), (axes, zeros)
    assert all(combo.world <= 4 for combo in SAMPLE), "the default suite runs <= 4 ranks"
    assert {combo.world for combo in SAMPLE + EXTRA + MUTANTS} == {2, 4}, "no process start-up of their own"


def test_clipping_acts_at_every_reference_step(reference):
    """The clipped reference gradients have norm CLIP at every step: the global norm is part of every cell's
    check (reduced over dp_cp shards, pp stages and tp slices), not an inactive branch."""
    for step, grads in enumerate(reference.grads):
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
        assert abs(float(norm) - CLIP) < 1e-5, f"step {step}: clipped norm {float(norm)} (clipping inactive?)"


@pytest.mark.parametrize("combo", ALL_COMBOS, ids=_ids(ALL_COMBOS))
def test_every_cell_passes_every_check_of_parallelize(combo):
    check_in_one_process(combo.world, combo.layout())  # reaches Mesh.build: no LayoutError for any cell


# ----------------------------------------------------------------- training parity
@pytest.mark.distributed
@pytest.mark.parametrize("combo", MUTANTS, ids=_ids(MUTANTS))
def test_summing_instead_of_averaging_is_caught(combo, matrix_runs, reference):
    """Clipping to a norm below the gradients' at every step restores a uniformly scaled gradient's size, so losses,
    clipped gradients and parameters all match on a cell that sums over dp instead of averaging; the gradient norm
    before clipping (compared with the reference's at every step) does not, and fails the cell."""
    with pytest.raises(AssertionError, match="grad norm before clipping"):
        assert_combo_matches(combo, matrix_runs[combo.name], reference)
    runs = matrix_runs[combo.name]
    assert runs[0]["grad_norms"][0] == pytest.approx(2 * reference.grad_norms[0], rel=1e-5), "the mutation is x2"


@pytest.mark.distributed
@pytest.mark.parametrize("combo", SAMPLE + EXTRA, ids=_ids(SAMPLE + EXTRA))
def test_sampled_cell_matches_single_device(combo, matrix_runs, reference):
    assert_combo_matches(combo, matrix_runs[combo.name], reference)


@pytest.mark.distributed
def test_whole_matrix_matches_single_device(matrix_runs, reference):
    runs = matrix_runs
    outcomes, failures = {}, []
    for combo in ALL_COMBOS:
        if combo.world > MAX_WORLD:
            outcomes[combo.name] = f"not run ({combo.world} ranks)"
            continue
        try:
            assert_combo_matches(combo, runs[combo.name], reference)
        except AssertionError as error:
            failures.append(f"{combo.name}: {error}")
            outcomes[combo.name] = "**differs**"
            continue
        errors = max_errors(runs[combo.name], reference)
        outcomes[combo.name] = f"matches ({errors['loss']:.0e} / {errors['grad']:.0e} / {errors['param']:.0e})"
    table = markdown_table(outcomes)
    log.warning("composition matrix (worst |error| of loss / step-0 grad / final param):\n%s", table)
    if os.environ.get("PLAIT_MATRIX_TABLE"):
        Path(os.environ["PLAIT_MATRIX_TABLE"]).write_text(table + "\n")
    assert not failures, "\n".join(failures)
