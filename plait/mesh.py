"""Layout -> Mesh: the rank grid, this rank's coordinates, and one process group per axis.

Ranks are numbered in ``AXES`` order, pp outermost and tp innermost::

    rank = ((pp_i * DP + dp_i) * CP + cp_i) * TP + tp_i

so the ranks of one tp group are consecutive (neighbours on a node) and pipeline stages are the largest
blocks. Besides the four axes the mesh has the combined axes that paradigms need: ``dp_cp`` (gradients are
averaged over data *and* context parallel ranks, which see different tokens of the same weights) and
``world``. Under nD tensor parallelism (``Layout.tp_mode`` "2d", "2.5d", "3d") the tp group is further split
into the sub-axes ``TP_SUB_AXES``, tp staying innermost::

    tp_i = (tp_dep * ROWS + tp_row) * COLS + tp_col

(2D: a q x q grid, depth 1; 2.5D: q x q x d, depth outermost; 3D: a q x q x q cube), so a ``tp_col`` group
is consecutive ranks. The sub-axes exist only when tp_mode needs them.

Expert parallelism (``Layout.ep``) folds the data ranks the same way: a rank's index j = dp_i x CP + cp_i in its
``dp_cp`` group splits into ``EP_SUB_AXES``, ep innermost::

    j = edp_i * EP + ep_i

so an ``ep`` group (the ranks that split one layer's experts and exchange tokens all-to-all) is consecutive data
ranks, and ``edp`` links the ranks holding the same experts (their gradients are reduced over it). With ep = 1,
``ep`` has one rank and ``edp`` is ``dp_cp`` (the same process group).

HSDP (``Layout.dp_replicate`` = R) folds the same index j into ``HSDP_SUB_AXES``, ``shard`` innermost::

    j = replicate_i * S + shard_i        S = DP x CP / R

so a ``shard`` group (the dp/R x cp ranks that ZeRO shards over: one replica group) is consecutive data ranks, and
a ``replicate`` group links the ranks at the same place of every replica group (they hold equal shards; each
shard's gradient is all-reduced over it). dp is outside cp and tp in the rank order, so replica groups are the
largest blocks of data ranks: across nodes on a cluster. With ep > 1 an ep group lies inside one replica group
(``Layout`` checks that ep divides S) and ``edp_shard``, the ranks of one replica group holding the same experts
(j = replicate_i * S + edp_shard_i * EP + ep_i), is what ZeRO shards expert slices over. The sub-axes exist only
with R > 1; ``Mesh.group`` then answers ``shard`` with the ``dp_cp`` group, ``edp_shard`` with ``edp`` and
``replicate`` with none (one rank). The grid arithmetic (``RankGrid``)
is pure; ``Mesh.build`` creates the process groups once, on every rank in the same order, and the Mesh is
then passed explicitly to whatever needs it.
"""

from __future__ import annotations

import datetime
import itertools
import math
from dataclasses import dataclass

import torch.distributed as dist

from plait.errors import LayoutError
from plait.layout import AXES, Layout, tp_grid_dims

COMBINED_AXES: dict[str, tuple[str, ...]] = {"dp_cp": ("dp", "cp"), "world": AXES}
"""Axes made of several mesh axes: name -> the axes they span."""

ALL_AXES: tuple[str, ...] = AXES + tuple(COMBINED_AXES)

TP_SUB_AXES: tuple[str, ...] = ("tp_dep", "tp_row", "tp_col")
"""The sub-axes that split the tp group for 2D / 2.5D / 3D tensor parallelism, outermost first."""

EP_SUB_AXES: tuple[str, ...] = ("edp", "ep")
"""The sub-axes that split the data ranks (dp x cp) for expert parallelism, outermost first."""

HSDP_SUB_AXES: tuple[str, ...] = ("replicate", "shard")
"""The sub-axes that split the data ranks (dp x cp) into HSDP replica groups, outermost first."""

EXPERT_SHARD_AXIS = "edp_shard"
"""Under HSDP with expert parallelism: the ranks of one replica group that hold the same experts."""

DATA_SUB_AXES: tuple[str, ...] = EP_SUB_AXES + HSDP_SUB_AXES + (EXPERT_SHARD_AXIS,)
"""Every sub-axis of the data ranks j = dp x CP + cp (expert parallelism's and HSDP's)."""


def axis_members(axis: str) -> tuple[str, ...]:
    """The mesh axes that ``axis`` spans (itself for a plain axis or a tp / ep sub-axis)."""
    if axis in AXES or axis in TP_SUB_AXES or axis in DATA_SUB_AXES:
        return (axis,)
    if axis in COMBINED_AXES:
        return COMBINED_AXES[axis]
    raise KeyError(f"unknown mesh axis {axis!r}; the axes are {', '.join(ALL_AXES + DATA_SUB_AXES + TP_SUB_AXES)}")


@dataclass(frozen=True)
class RankGrid:
    """Pure rank arithmetic for degrees in ``AXES`` order (no processes needed).

    ``tp_split`` = (depth, rows, cols) splits tp into ``TP_SUB_AXES`` (None: 1D tensor parallelism, no sub-axes);
    ``ep`` splits the data ranks into ``EP_SUB_AXES``, ``replicate`` (HSDP's R) into ``HSDP_SUB_AXES`` (module
    docstring).
    """

    sizes: tuple[int, ...]
    tp_split: tuple[int, int, int] | None = None
    ep: int = 1
    replicate: int = 1

    def __post_init__(self) -> None:
        if self.tp_split is not None and math.prod(self.tp_split) != self.sizes[AXES.index("tp")]:
            raise LayoutError(f"tp sub-axes {self.tp_split} do not multiply to tp={self.sizes[AXES.index('tp')]}.")
        if self.ep < 1 or self._data_size % self.ep:
            raise LayoutError(f"ep={self.ep} does not divide the data ranks dp x cp = {self._data_size}.")
        if self.replicate < 1 or self.sizes[AXES.index("dp")] % self.replicate:
            raise LayoutError(f"dp_replicate={self.replicate} does not divide dp={self.sizes[AXES.index('dp')]}.")
        if (self._data_size // self.replicate) % self.ep:
            raise LayoutError(
                f"ep={self.ep} does not divide the {self._data_size // self.replicate} data ranks of a replica group."
            )

    @property
    def _data_size(self) -> int:
        return self.sizes[AXES.index("dp")] * self.sizes[AXES.index("cp")]

    @classmethod
    def from_layout(cls, layout: Layout) -> RankGrid:
        dims = tp_grid_dims(layout.tp, layout.tp_mode, layout.tp_depth)
        split: tuple[int, int, int] | None = None
        if dims:
            depth, rows, cols = (dims[a] for a in TP_SUB_AXES)
            split = (depth, rows, cols)
        return cls(tuple(layout.degrees[axis] for axis in AXES), split, layout.ep, layout.dp_replicate)

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    @property
    def axes(self) -> tuple[str, ...]:
        """Every axis this grid has groups for: ``ALL_AXES``, plus ``EP_SUB_AXES`` under expert parallelism,
        ``HSDP_SUB_AXES`` under HSDP (and ``EXPERT_SHARD_AXIS`` with both) and ``TP_SUB_AXES`` under nD tensor
        parallelism."""
        hsdp = HSDP_SUB_AXES + ((EXPERT_SHARD_AXIS,) if self.ep > 1 else ()) if self.replicate > 1 else ()
        return (
            ALL_AXES + (EP_SUB_AXES if self.ep > 1 else ()) + hsdp + (TP_SUB_AXES if self.tp_split is not None else ())
        )

    def _axis_size(self, axis: str) -> int:
        if axis == "ep":
            return self.ep
        if axis == "edp":
            return self._data_size // self.ep
        if axis == "replicate":
            return self.replicate
        if axis == "shard":
            return self._data_size // self.replicate
        if axis == EXPERT_SHARD_AXIS:
            return self._data_size // self.replicate // self.ep
        if axis in TP_SUB_AXES:
            if self.tp_split is None:
                raise KeyError(f"mesh axis {axis!r} exists only with tp_mode '2d', '2.5d' or '3d'")
            return self.tp_split[TP_SUB_AXES.index(axis)]
        return self.sizes[AXES.index(axis)]

    def size(self, axis: str) -> int:
        return math.prod(self._axis_size(a) for a in axis_members(axis))

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each of ``AXES`` (and each of ``TP_SUB_AXES`` when tp is split, of ``EP_SUB_AXES``
        under expert parallelism)."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside a mesh of {self.world_size} ranks.")
        coords: dict[str, int] = {}
        for axis, size in zip(reversed(AXES), reversed(self.sizes)):
            coords[axis] = rank % size
            rank //= size
        ordered = {axis: coords[axis] for axis in AXES}
        if self.tp_split is not None:
            tp, sub = ordered["tp"], {}
            for axis, size in zip(reversed(TP_SUB_AXES), reversed(self.tp_split)):
                sub[axis] = tp % size
                tp //= size
            ordered.update({axis: sub[axis] for axis in TP_SUB_AXES})
        if self.ep > 1:
            ordered.update(zip(EP_SUB_AXES, self._ep_coords(ordered)))
        if self.replicate > 1:
            j = self._data_index(ordered)
            ordered.update(zip(HSDP_SUB_AXES, divmod(j, self._axis_size("shard"))))
            if self.ep > 1:
                ordered[EXPERT_SHARD_AXIS] = j % self._axis_size("shard") // self.ep
        return ordered

    def _data_index(self, coords: dict[str, int]) -> int:
        """j = dp x CP + cp: a rank's index in its ``dp_cp`` group."""
        return coords["dp"] * self.sizes[AXES.index("cp")] + coords["cp"]

    def _ep_coords(self, coords: dict[str, int]) -> tuple[int, int]:
        """(edp, ep) of a rank at ``coords``: its data index j = dp x CP + cp split as j = edp x EP + ep."""
        edp, ep = divmod(self._data_index(coords), self.ep)
        return edp, ep

    def _data_key(self, axis: str, j: int) -> tuple[int, ...]:
        """What the data ranks of one ``axis`` group (a sub-axis of the data ranks) share: j and j' are in one
        group when their keys are equal (module docstring's folds of j)."""
        shard = self._data_size // self.replicate
        keys = {
            "ep": (j // self.ep,),  # the same edp index
            "edp": (j % self.ep,),  # the same ep index
            "replicate": (j % shard,),  # the same place in its replica group
            "shard": (j // shard,),  # the same replica group
            EXPERT_SHARD_AXIS: (j // shard, j % self.ep),  # the same replica group and experts
        }
        return keys[axis]

    def rank_of(self, coords: dict[str, int]) -> int:
        """The rank at ``coords`` (``AXES``; under a tp split, tp is taken from the sub-axes when they are given)."""
        coords = dict(coords)
        if self.tp_split is not None and all(a in coords for a in TP_SUB_AXES):
            tp = 0
            for axis, size in zip(TP_SUB_AXES, self.tp_split):
                tp = tp * size + coords[axis]
            coords["tp"] = tp
        rank = 0
        for axis, size in zip(AXES, self.sizes):
            rank = rank * size + coords[axis]
        return rank

    def group_of(self, rank: int, axis: str) -> list[int]:
        """The ranks that share ``rank``'s coordinates on every axis outside ``axis``, in mesh order."""
        varying = axis_members(axis)
        base = self.coords(rank)
        if axis in DATA_SUB_AXES:  # data ranks j = dp * CP + cp that share this rank's key along ``axis``
            cp = self.sizes[AXES.index("cp")]
            key = self._data_key(axis, self._data_index(base))
            members = [j for j in range(self._data_size) if self._data_key(axis, j) == key]
            return sorted(self.rank_of({**{a: base[a] for a in AXES}, "dp": j // cp, "cp": j % cp}) for j in members)
        if self.tp_split is not None and "tp" in varying:  # the sub-axes follow tp
            base = {a: c for a, c in base.items() if a not in TP_SUB_AXES}
        ranks = []
        for combo in itertools.product(*(range(self._axis_size(a)) for a in varying)):
            ranks.append(self.rank_of({**base, **dict(zip(varying, combo))}))
        return sorted(ranks)

    def groups(self, axis: str) -> list[list[int]]:
        """The partition of all ranks into ``axis`` groups, each sorted, ordered by their first rank."""
        seen: set[int] = set()
        result = []
        for rank in range(self.world_size):
            if rank not in seen:
                group = self.group_of(rank, axis)
                seen.update(group)
                result.append(group)
        return result


class Mesh:
    """The ranks of a resolved Layout, with this rank's coordinates and a process group per axis.

    ``group(axis)`` is None where the axis has one rank (collectives on it are no-ops) or where no process
    group exists (a single process).
    """

    def __init__(self, layout: Layout, rank: int, groups: dict[str, dist.ProcessGroup | None]) -> None:
        self.layout = layout
        self.grid = RankGrid.from_layout(layout)
        self.rank = rank
        self.world_size = self.grid.world_size
        self.coords = self.grid.coords(rank)
        self._groups = groups
        self._ranks: dict[str, list[int]] = {}  # per axis: this rank's group (the mesh never changes: computed once)
        self._sizes: dict[str, int] = {}

    @classmethod
    def build(cls, layout: Layout, timeout: datetime.timedelta | None = None) -> Mesh:
        """Create the mesh for this process (every rank must call this, with the same layout)."""
        if dist.is_available() and dist.is_initialized():
            rank, world_size = dist.get_rank(), dist.get_world_size()
        else:
            rank, world_size = 0, 1
        layout = layout.resolve(world_size)
        grid = RankGrid.from_layout(layout)
        groups: dict[str, dist.ProcessGroup | None] = {axis: None for axis in grid.axes}
        if world_size > 1:
            created: dict[tuple[int, ...], dist.ProcessGroup] = {}
            for axis in grid.axes:
                if grid.size(axis) == 1:
                    continue
                for members in grid.groups(axis):
                    key = tuple(members)
                    if key not in created:  # every rank creates every group, in the same order
                        if len(members) == world_size:
                            # WORLD is typed Optional; it is set once the process group is initialised (checked above).
                            world = dist.group.WORLD
                            assert world is not None
                            created[key] = world
                        else:
                            created[key] = dist.new_group(members, timeout=timeout)
                    if rank in members:
                        groups[axis] = created[key]
        return cls(layout, rank, groups)

    def size(self, axis: str) -> int:
        """The number of ranks along ``axis``."""
        if axis not in self._sizes:
            self._sizes[axis] = self.grid.size(axis)
        return self._sizes[axis]

    def index(self, axis: str) -> int:
        """This rank's position in its ``axis`` group."""
        return self._group_ranks(axis).index(self.rank)

    def ranks(self, axis: str) -> list[int]:
        """The global ranks of this rank's ``axis`` group, in order."""
        return list(self._group_ranks(axis))

    def _group_ranks(self, axis: str) -> list[int]:
        """``ranks(axis)`` without the copy (hot paths call it per collective and per pipeline action)."""
        if axis not in self._ranks:
            self._ranks[axis] = self.grid.group_of(self.rank, axis)
        return self._ranks[axis]

    def group(self, axis: str) -> dist.ProcessGroup | None:
        axis_members(axis)
        if axis in EP_SUB_AXES and axis not in self._groups:  # ep = 1: one rank, and edp is dp_cp
            return None if axis == "ep" else self._groups["dp_cp"]
        if axis in HSDP_SUB_AXES + (EXPERT_SHARD_AXIS,) and axis not in self._groups:  # no HSDP: one replica group
            if axis == EXPERT_SHARD_AXIS:  # ep = 1: the replica group; no HSDP: edp
                return self.group("shard" if self.grid.replicate > 1 else "edp")
            return None if axis == "replicate" else self._groups["dp_cp"]
        if axis not in self._groups:
            raise KeyError(
                f"mesh axis {axis!r} exists only with tp_mode '2d', '2.5d' or '3d' (this mesh: {self.layout.tp_mode!r})"
            )
        return self._groups[axis]

    def peer(self, axis: str, offset: int) -> int:
        """The global rank ``offset`` steps along ``axis`` from this one (wrapping around)."""
        ranks = self._group_ranks(axis)
        return ranks[(ranks.index(self.rank) + offset) % len(ranks)]

    def describe(self) -> str:
        """E.g. ``rank 5 of 8: pp0 dp1 cp0 tp1``."""
        where = " ".join(f"{axis}{self.coords[axis]}" for axis in AXES)
        return f"rank {self.rank} of {self.world_size}: {where}"

    def __repr__(self) -> str:
        return f"Mesh({self.layout.short()}; {self.describe()})"
