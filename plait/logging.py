"""A rank-aware logger: every record carries the rank, and by default only rank 0 speaks at INFO.

Use ``get_logger(__name__)`` everywhere instead of print. ``configure(rank)`` is called once per process by
``plait.init``; ranks other than 0 log warnings and errors only, unless ``PLAIT_LOG_ALL_RANKS=1``. A warning that
every rank would find alike goes through ``job_warning``: said once per job, by rank 0.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

_FORMAT = "[%(asctime)s rank %(rank)s %(levelname)s %(name)s] %(message)s"


class _RankFilter(logging.Filter):
    """Stamps each record with this process's rank."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record comes, not the stream it was when ``configure`` ran: a
    stream replaced since (a test's capture that has been closed, a redirection) would otherwise fail every
    record with "I/O operation on closed file" and a logging traceback."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:  # logging.StreamHandler sets it; the current one is always used
        pass


_rank = 0
"""This process's rank, as ``configure`` was told (``job_warning`` speaks on rank 0 only)."""


def configure(rank: int = 0, level: int | str | None = None) -> None:
    """Set up the ``plait`` logger hierarchy for this process (idempotent: replaces its own handler)."""
    global _rank
    _rank = rank
    root = logging.getLogger("plait")
    if level is None:
        level = os.environ.get("PLAIT_LOG_LEVEL", "INFO")
    all_ranks = os.environ.get("PLAIT_LOG_ALL_RANKS", "0") == "1"
    root.setLevel(level if (rank == 0 or all_ranks) else logging.WARNING)
    for handler in list(root.handlers):
        if getattr(handler, "_plait", False):
            root.removeHandler(handler)
    handler = _CurrentStderr()
    handler._plait = True  # type: ignore[attr-defined]
    handler.addFilter(_RankFilter(rank))
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    root.addHandler(handler)
    root.propagate = False


def get_logger(name: str) -> logging.Logger:
    """The logger for a plait module (a child of ``plait``)."""
    return logging.getLogger(name if name.startswith("plait") else f"plait.{name}")


def job_warning(logger: logging.Logger, message: str, *args: object) -> None:
    """A warning about the whole job, which every rank finds alike (the data has no validation split): logged by
    rank 0 only, once per job rather than once per rank. A rank's own trouble stays ``logger.warning``."""
    if _rank == 0:
        logger.warning(message, *args)
