"""CPU threads per rank (issue 37, ``plait.threads``): cores / local ranks unless OMP_NUM_THREADS chose, never
raising torch's pool, logged; ``plait train``'s launcher hands the same default to its workers."""

from __future__ import annotations

import argparse
import logging
import os

import pytest
import torch

from plait import threads


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """torch's pool and OMP_NUM_THREADS as they were (the launcher under test sets the variable itself)."""
    before, variable = torch.get_num_threads(), os.environ.get(threads.THREADS_ENV)
    yield
    torch.set_num_threads(before)
    if variable is None:
        os.environ.pop(threads.THREADS_ENV, None)
    else:
        os.environ[threads.THREADS_ENV] = variable


@pytest.fixture
def eight_cores(monkeypatch):  # noqa: ANN001
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)


@pytest.mark.parametrize(("local_ranks", "expected"), [(1, 8), (2, 4), (3, 2), (8, 1), (16, 1)])
def test_each_local_rank_gets_its_share_of_the_usable_cores(eight_cores, local_ranks, expected) -> None:  # noqa: ANN001
    assert threads.per_rank_default(local_ranks) == expected


def test_the_default_lowers_an_oversubscribed_pool_and_says_so(eight_cores, monkeypatch, caplog) -> None:  # noqa: ANN001
    monkeypatch.delenv(threads.THREADS_ENV, raising=False)
    torch.set_num_threads(8)
    with caplog.at_level(logging.INFO, logger="plait"):
        assert threads.configure_threads(4) == 2
    assert torch.get_num_threads() == 2
    assert "2 CPU thread(s) per rank (8 usable cores / 4 local rank(s)); set OMP_NUM_THREADS" in caplog.text


def test_a_lower_count_set_by_the_program_stays(eight_cores, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.delenv(threads.THREADS_ENV, raising=False)
    torch.set_num_threads(1)
    assert threads.configure_threads(2) == 1 and torch.get_num_threads() == 1


def test_omp_num_threads_is_the_users_choice(eight_cores, monkeypatch, caplog) -> None:  # noqa: ANN001
    monkeypatch.setenv(threads.THREADS_ENV, "3")
    torch.set_num_threads(3)
    with caplog.at_level(logging.INFO, logger="plait"):
        assert threads.configure_threads(8) == 3
    assert torch.get_num_threads() == 3 and "(OMP_NUM_THREADS=3)" in caplog.text


def test_plait_train_hands_its_workers_the_per_rank_default(eight_cores, monkeypatch) -> None:  # noqa: ANN001
    """torchrun alone would set OMP_NUM_THREADS=1 for several processes per node, whatever the cores."""
    import torch.distributed.run as torchrun

    from plait.cli import train

    seen: list[str | None] = []
    monkeypatch.delenv(threads.THREADS_ENV, raising=False)
    monkeypatch.setattr(torchrun, "run", lambda parsed: seen.append(os.environ.get(threads.THREADS_ENV)))
    args = argparse.Namespace(nproc=2, max_restarts=0, stop_grace=60)
    assert train._run_torchrun(args, ["train"]) == 0
    assert seen == ["4"]
    monkeypatch.setenv(threads.THREADS_ENV, "1")
    assert train._run_torchrun(args, ["train"]) == 0
    assert seen == ["4", "1"]
