"""Errors that plait raises: each names the problem and the fix."""

from __future__ import annotations


class PlaitError(Exception):
    """Base class of every error plait raises on purpose."""


class LayoutError(PlaitError, ValueError):
    """A parallel layout that cannot work: raised on every rank before any collective runs."""


class ConfigError(PlaitError, ValueError):
    """A run configuration (TOML file or ``--set`` override) that cannot be used."""


class DataError(PlaitError, ValueError):
    """Input data that cannot be used: a missing or empty input, a malformed record, a corrupt or truncated token
    file. Names the file (and line) and the fix."""


class ScheduleError(PlaitError, ValueError):
    """A pipeline schedule that cannot run: malformed, wrongly ordered, or deadlocking. Names the action."""


class CheckpointError(PlaitError, FileNotFoundError):
    """A checkpoint that is missing, incomplete, damaged (a file whose size or checksum differs from what its
    plait.json records: the message names the file, the rank that wrote it and the fix) or unsafe to load."""


class CommError(PlaitError, RuntimeError):
    """A collective failed or timed out; the message names the rank, the mesh axis and the operation."""

    def __init__(self, message: str, *, rank: int, axis: str, op: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.axis = axis
        self.op = op
