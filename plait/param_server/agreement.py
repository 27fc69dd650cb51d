"""What servers and workers of one job must agree on, compared when a worker joins.

Processes started by hand on several hosts can be given different flags. A worker sends its ``JobSettings`` and
its model spec with its join; the server compares them with its own and refuses the join with a ``ConfigError``
naming every difference (and logs the same at ERROR), so both sides say what differs within a second of the
connect instead of training something else or waiting forever (e.g. servers expecting 4 BSP workers, 2 started).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from plait.param_server.wire import ProtocolError


@dataclass(frozen=True)
class JobSettings:
    """The job-wide settings every process has: consistency mode and bound, steps per worker, workers expected
    (BSP's start barrier), server count. ``steps`` 0 means "not checked" (a process that does not know it)."""

    mode: str = "bsp"
    staleness: int = 0
    steps: int = 0
    workers: int = 1
    servers: int = 1

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, value: Any) -> JobSettings:
        """Read a peer's settings, refusing anything but the expected fields with the expected types."""
        names = {field.name: field.type for field in fields(cls)}
        if not isinstance(value, dict) or set(value) != set(names):
            raise ProtocolError(f"job settings must be an object with the fields {sorted(names)}")
        for name, kind in names.items():
            item = value[name]
            ok = isinstance(item, str) if kind == "str" else isinstance(item, int) and not isinstance(item, bool)
            if not ok or (isinstance(item, str) and len(item) > 16):
                raise ProtocolError(f"job setting {name!r} has a bad value {str(item)[:40]!r}")
        return cls(**value)

    def differences(self, worker: JobSettings) -> list[str]:
        """One phrase per setting that differs: "mode: server 'bsp', worker 'asp'"."""
        found = []
        for field in fields(self):
            mine, theirs = getattr(self, field.name), getattr(worker, field.name)
            if field.name == "steps" and 0 in (mine, theirs):
                continue
            if mine != theirs:
                found.append(f"{field.name}: server {mine!r}, worker {theirs!r}")
        return found


FLAG_OF = {"mode": "--mode", "staleness": "--staleness", "steps": "--steps", "workers": "--workers"}


def mismatch_message(name: str, differences: list[str]) -> str:
    """The ConfigError text for a refused join."""
    flags = sorted({FLAG_OF.get(item.split(":")[0], "--servers") for item in differences})
    return (
        f"worker {name!r} and the servers disagree on {'; '.join(differences)}. Fix: start every server and "
        f"worker of the job with the same {', '.join(flags)}."
    )


__all__ = ["JobSettings", "mismatch_message"]
