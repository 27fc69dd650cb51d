"""The benchmark runner works end to end (a few steps; the figures themselves live in BENCHMARKS.md)."""

import pytest

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("suite", ["overhead", "ddp"])
def test_benchmark_suite_runs_and_contenders_agree(suite):
    from benchmarks.run import run_suite

    rows = run_suite(suite, world=2, steps=2, warmup=1, rounds=1)
    assert len(rows) >= 2
    assert all(row["tokens_per_s"] > 0 for row in rows), rows
