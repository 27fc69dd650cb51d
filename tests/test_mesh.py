"""Rank grid arithmetic (pure) and the process groups Mesh.build creates (spawned gloo ranks)."""

import pytest
import torch
from helpers.harness import run_distributed

from plait import Layout
from plait.comm import Comm
from plait.mesh import Mesh, RankGrid


def test_rank_order_is_pp_dp_cp_tp():
    grid = RankGrid.from_layout(Layout(dp=2, tp=2, pp=2, cp=1).resolve(8))
    assert grid.coords(5) == {"pp": 1, "dp": 0, "cp": 0, "tp": 1}
    assert all(grid.rank_of(grid.coords(r)) == r for r in range(8))
    assert grid.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.groups("world") == [list(range(8))]


def test_combined_dp_cp_axis():
    grid = RankGrid.from_layout(Layout(dp=2, cp=2, tp=2).resolve(8))
    assert grid.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.groups("dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert grid.size("dp_cp") == 4


def test_groups_partition_every_axis():
    grid = RankGrid.from_layout(Layout(dp=3, tp=2, pp=2, cp=2).resolve(24))
    for axis in ("pp", "dp", "cp", "tp", "dp_cp"):
        groups = grid.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(24))
        assert all(len(g) == grid.size(axis) for g in groups)


def test_tp_sub_axes_split_the_tp_group():
    """nD tensor parallelism: tp_i = (tp_dep * q + tp_row) * q + tp_col, tp innermost; sub-axes only when needed."""
    grid = RankGrid.from_layout(Layout(dp=2, tp=4, tp_mode="2d").resolve(8))
    assert grid.coords(6) == {"pp": 0, "dp": 1, "cp": 0, "tp": 2, "tp_dep": 0, "tp_row": 1, "tp_col": 0}
    assert grid.groups("tp_col") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.groups("tp_row") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.groups("tp") == [[0, 1, 2, 3], [4, 5, 6, 7]] and grid.size("tp_dep") == 1
    assert all(grid.rank_of(grid.coords(r)) == r for r in range(8))
    cube = RankGrid.from_layout(Layout(tp=8, tp_mode="3d").resolve(8))
    assert cube.groups("tp_dep") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    tesseract = RankGrid.from_layout(Layout(tp=8, tp_mode="2.5d", tp_depth=2).resolve(8))
    assert tesseract.tp_split == (2, 2, 2) and tesseract.groups("tp_dep") == cube.groups("tp_dep")
    assert "tp_row" not in RankGrid.from_layout(Layout(tp=4).resolve(4)).axes
    with pytest.raises(KeyError, match="exists only with tp_mode"):
        RankGrid.from_layout(Layout(tp=4).resolve(4)).size("tp_row")


def test_unknown_axis():
    with pytest.raises(KeyError, match="unknown mesh axis 'xp'"):
        RankGrid((1, 1, 1, 1)).size("xp")


def test_single_process_mesh_has_no_groups():
    mesh = Mesh.build(Layout())
    assert mesh.world_size == 1 and mesh.group("dp") is None
    assert mesh.describe() == "rank 0 of 1: pp0 dp0 cp0 tp0"


def _groups_reduce_along_their_axis():
    mesh = Mesh.build(Layout(dp=2, tp=2))
    comm = Comm(mesh)
    out = {}
    for axis in ("dp", "tp", "world", "pp"):
        value = torch.tensor([float(mesh.rank)])
        comm.all_reduce(value, axis)
        out[axis] = value.item()
    out["coords"] = mesh.coords
    out["peer_tp"] = mesh.peer("tp", 1)
    return out


@pytest.mark.distributed
def test_process_groups_follow_the_grid():
    results = run_distributed(_groups_reduce_along_their_axis, 4)
    # rank = dp * 2 + tp: tp groups {0,1},{2,3}; dp groups {0,2},{1,3}
    assert [r["tp"] for r in results] == [1, 1, 5, 5]
    assert [r["dp"] for r in results] == [2, 4, 2, 4]
    assert [r["world"] for r in results] == [6, 6, 6, 6]
    assert [r["pp"] for r in results] == [0, 1, 2, 3]  # pp=1: no-op
    assert [r["peer_tp"] for r in results] == [1, 0, 3, 2]
