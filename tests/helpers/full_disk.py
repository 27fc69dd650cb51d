"""Writes that fail as a full (or read-only, or forbidden) disk would, injected at a module's ``open``."""

from __future__ import annotations

import builtins
import os
from typing import Any


class FullDisk:
    """A file opened for writing whose writes fail with the errno ``code`` once ``room`` bytes are written."""

    def __init__(self, handle: Any, code: int, room: int = 0) -> None:
        self.handle, self.code, self.room = handle, code, room

    def write(self, data: Any) -> int:
        if len(data) > self.room:
            raise OSError(self.code, os.strerror(self.code))
        self.room -= len(data)
        return self.handle.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.handle, name)

    def __enter__(self) -> FullDisk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.close()


def failing_open(code: int, room: int = 0) -> Any:
    """An ``open`` to set as a module's ``open``: files opened for writing fail with ``code`` past ``room`` bytes."""

    def opener(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = builtins.open(file, mode, *args, **kwargs)
        return FullDisk(handle, code, room) if "w" in mode else handle

    return opener
