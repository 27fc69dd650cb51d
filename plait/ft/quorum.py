"""The ``replicate`` axis of a fault-tolerant job: the same rank of every replica group in this step's quorum,
over a process group that torchft re-forms whenever the quorum changes.

``QuorumMesh`` is a one-axis Mesh whose group and size are read at call time, so a ``plait.comm.Comm`` over it
(collectives with byte accounting, timeouts, and a ``CommError`` naming rank, axis and operation) follows the
quorum from step to step. Its ranks are the quorum's replica ranks (torchft orders the groups by their ids), those
of groups still healing included: they take part in every collective, with zeros.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from plait.comm import Comm, CommStats
from plait.layout import Layout
from plait.mesh import Mesh

AXIS = "replicate"


class QuorumMesh(Mesh):
    """A Mesh with one axis, ``replicate``, that follows a torchft manager's quorum (module docstring)."""

    def __init__(self, manager: Any, group_pg: Any) -> None:  # no super().__init__: no layout's grid to build
        self.manager, self.group_pg = manager, group_pg
        self.layout = Layout()
        self._groups: dict[str, dist.ProcessGroup | None] = {}
        self._ranks: dict[str, list[int]] = {}
        self._sizes: dict[str, int] = {}
        self.coords = {AXIS: 0}

    @property
    def rank(self) -> int:  # type: ignore[override]  # the quorum's, read at call time
        group = self.group_pg._pg  # every group of the quorum, those still healing too (torchft's re-formed group)
        return int(group.rank()) if group is not None else 0

    @property
    def world_size(self) -> int:  # type: ignore[override]
        group = self.group_pg._pg
        return int(group.size()) if group is not None else 1

    def size(self, axis: str) -> int:
        return self.world_size if axis == AXIS else 1

    def index(self, axis: str) -> int:
        return self.rank if axis == AXIS else 0

    def ranks(self, axis: str) -> list[int]:
        return list(range(self.world_size)) if axis == AXIS else [self.rank]

    def _group_ranks(self, axis: str) -> list[int]:
        return self.ranks(axis)

    def group(self, axis: str) -> dist.ProcessGroup | None:
        return self.group_pg.parent if axis == AXIS and self.world_size > 1 else None

    def describe(self) -> str:
        return f"replica rank {self.rank} of {self.world_size} in the quorum"


def quorum_comm(manager: Any, group_pg: Any, stats: CommStats, timeout_s: float, device: torch.device) -> Comm:
    """Collectives over the quorum's ``replicate`` axis, counted in ``stats`` (the engine's)."""
    return Comm(QuorumMesh(manager, group_pg), stats=stats, timeout_s=timeout_s, device=device)


__all__ = ["AXIS", "QuorumMesh", "quorum_comm"]
