"""The rank-aware logger: rank 0 speaks at INFO, other ranks at WARNING; a warning about the whole job
(``job_warning``: every rank finds it alike) is said once per job, by rank 0 (issue 37: the validation-split
warning was printed once per rank)."""

from __future__ import annotations

import logging

import pytest

from plait import logging as plait_logging
from plait.train.evaluation import evaluation_batches


class _NoSplit:
    """A dataset that could have a validation split and has none (a token folder prepared with --val-fraction 0)."""

    seq_len = 4

    def validation_split(self) -> None:
        return None

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, index: int) -> int:
        return index


@pytest.fixture
def records():
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    yield seen, Keep()
    plait_logging.configure(0)


@pytest.mark.parametrize(("rank", "expected"), [(0, 1), (1, 0), (3, 0)])
def test_a_job_wide_warning_is_said_by_rank_zero_only(records, rank: int, expected: int) -> None:
    seen, keep = records
    plait_logging.configure(rank)
    logging.getLogger("plait").addHandler(keep)
    plait_logging.job_warning(plait_logging.get_logger("plait.test"), "the data is %s", "odd")
    logging.getLogger("plait.test").warning("this rank's own trouble")  # every rank still says its own
    assert [r.getMessage() for r in seen].count("the data is odd") == expected
    assert [r.getMessage() for r in seen].count("this rank's own trouble") == 1
    logging.getLogger("plait").removeHandler(keep)


def test_the_missing_validation_split_warning_comes_from_rank_zero_only(records, monkeypatch) -> None:  # noqa: ANN001
    import plait.train.evaluation as evaluation

    calls: list[tuple] = []
    monkeypatch.setattr(evaluation, "ShardedBatches", lambda *a, **k: type("L", (), {"batch_at": lambda s, i: i})())
    seen, keep = records
    for rank in (1, 0):
        plait_logging.configure(rank)
        logging.getLogger("plait").addHandler(keep)
        evaluation_batches(_NoSplit(), 8, 2, rank, 2)
        logging.getLogger("plait").removeHandler(keep)
        calls.append((rank, sum("no validation split" in r.getMessage() for r in seen)))
    assert calls == [(1, 0), (0, 1)]


def test_records_go_to_the_current_stderr_even_after_the_first_was_closed(monkeypatch, capsys) -> None:  # noqa: ANN001
    """configure() bound the handler to the stderr of its moment; once that stream closed (a finished test's
    capture), every record failed with a logging traceback, which the next command printed among its output."""
    import io
    import sys

    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    plait_logging.configure(0)
    first.close()
    monkeypatch.undo()
    plait_logging.get_logger("plait.test").warning("still said")
    err = capsys.readouterr().err
    assert "still said" in err and "Logging error" not in err
    plait_logging.configure(0)
