"""plait.comm: collective results, differentiable ops' gradients, byte accounting, size-1 no-ops, and
failures (a dead or silent peer) turned into CommError naming rank, axis and op."""

import os
import time

import pytest
import torch
from helpers.harness import DistributedTestError, run_distributed

from plait import CommError, Layout
from plait.comm import (
    Comm,
    CommStats,
    all_gather,
    all_to_all,
    copy_to,
    gather_from,
    reduce_from,
    reduce_scatter,
    scatter_to,
    wire_bytes,
)
from plait.mesh import Mesh

pytestmark = pytest.mark.distributed


def _collectives(world: int):
    mesh = Mesh.build(Layout())
    comm = Comm(mesh)
    r = mesh.rank
    out = {}
    x = torch.arange(4.0) + 10 * r
    out["sum"] = comm.all_reduce(x.clone(), "dp").tolist()
    out["avg"] = comm.all_reduce(x.clone(), "dp", op="avg").tolist()
    out["max"] = comm.all_reduce(x.clone(), "dp", op="max").tolist()
    out["gather_dim1"] = comm.all_gather(torch.full((2, 1), float(r)), "dp", dim=1).tolist()
    out["rs"] = comm.reduce_scatter(torch.arange(2.0 * world), "dp").tolist()
    out["a2a"] = comm.all_to_all(
        torch.full((world, 1), float(r)) + torch.arange(world).view(-1, 1) / 10, "dp", scatter_dim=0, gather_dim=1
    ).tolist()
    b = torch.full((3,), float(r))
    out["bcast"] = comm.broadcast(b, "dp", src=1).tolist()
    # ring exchange with batched p2p
    recv = torch.empty(2)
    comm.send_recv([(torch.full((2,), float(r)), mesh.peer("dp", 1))], [(recv, mesh.peer("dp", -1))], axis="dp")
    out["ring"] = recv.tolist()
    pending = comm.all_reduce(torch.ones(2), "dp", async_op=True)
    out["async"] = pending.wait().tolist()
    out["stats"] = comm.stats.to_dict()
    return out


def test_collectives_values_and_bytes():
    world = 4
    results = run_distributed(_collectives, world, world)
    for r, out in enumerate(results):
        base = torch.arange(4.0)
        assert out["sum"] == (base * world + 10 * sum(range(world))).tolist()
        assert out["avg"] == (base + 10 * (world - 1) / 2).tolist()
        assert out["max"] == (base + 10 * (world - 1)).tolist()
        assert out["gather_dim1"] == [[0.0, 1.0, 2.0, 3.0]] * 2
        assert out["rs"] == [2.0 * r * world, (2.0 * r + 1) * world]
        assert out["a2a"] == [pytest.approx([s + r / 10 for s in range(world)])]
        assert out["bcast"] == [1.0] * 3
        assert out["ring"] == [float((r - 1) % world)] * 2
        assert out["async"] == [float(world)] * 2
        stats = out["stats"]
        assert stats["dp/all_reduce"]["calls"] == 4
        assert stats["dp/all_reduce"]["payload_bytes"] == 3 * 16 + 8
        assert stats["dp/all_reduce"]["wire_bytes"] == pytest.approx(2 * 3 / 4 * (3 * 16 + 8))
        assert stats["dp/all_gather"]["payload_bytes"] == 2 * world * 4
        assert stats["dp/send"]["payload_bytes"] == 8


def _batches(world: int):
    """Rank 1 posts a send batch and two receive batches in one call. Rank 0 sends the second receive's message
    only after a message rank 1 sends once its first receive batch is done: had waiting for one batch waited for
    the others, rank 1 would wait forever (here: a CommError after 20 s)."""
    mesh = Mesh.build(Layout(dp=2))
    comm = Comm(mesh, timeout_s=20)
    comm.stage_p2p = os.environ.get("STAGE") == "1"  # host staging: each batch copies back only its own buffers
    out: dict = {}
    if mesh.rank == 0:
        got, go = torch.empty(3), torch.empty(1)
        comm.send_recv(recvs=[(got, 1)], axis="dp")
        comm.send_recv(sends=[(torch.full((2,), 1.0), 1)], axis="dp")
        comm.send_recv(recvs=[(go, 1)], axis="dp")
        comm.send_recv(sends=[(torch.full((4,), 2.0), 1)], axis="dp")
        out["got"] = got.tolist()
    else:
        first, second = torch.empty(2), torch.empty(4)
        pendings = comm.send_recv_batches(
            [([(torch.full((3,), 7.0), 0)], []), ([], [(first, 0)]), ([], [(second, 0)]), ([], [])], axis="dp"
        )
        pendings[1].wait()
        out["first"] = first.tolist()
        comm.send_recv(sends=[(torch.ones(1), 0)], axis="dp")  # only now may rank 0 send the second message
        pendings[2].wait()
        pendings[0].wait()
        out["second"] = second.tolist()
        out["empty_done"] = pendings[3].wait() is None
        out["stats"] = comm.stats.to_dict()
    return out


@pytest.mark.parametrize("stage", ["0", "1"])
def test_send_recv_batches_complete_each_batch_on_its_own(stage, monkeypatch):
    monkeypatch.setenv("STAGE", stage)
    zero, one = run_distributed(_batches, 2, 2)
    assert zero["got"] == [7.0] * 3
    assert one["first"] == [1.0] * 2 and one["second"] == [2.0] * 4 and one["empty_done"]
    assert one["stats"]["dp/recv"]["calls"] == 2 and one["stats"]["dp/send"]["calls"] == 2


def _coalescing(world: int):
    import torch.distributed as dist

    mesh = Mesh.build(Layout(dp=2))
    comm = Comm(mesh)
    comm.p2p_progresses_independently = lambda axis: False  # a backend reporting one completion per call (NCCL)
    posted = []
    real = dist.batch_isend_irecv
    dist.batch_isend_irecv = lambda ops: posted.append(ops) or real(ops)
    peer = 1 - mesh.rank
    try:
        comm.send_recv_batches([([(torch.ones(1), peer)], []), ([], [(torch.empty(1), peer)])], axis="dp")
    except CommError as error:
        return str(error), len(posted)
    finally:
        dist.batch_isend_irecv = real
    return None, len(posted)


def test_send_recv_batches_refuses_a_backend_that_coalesces_completions():
    for message, posted in run_distributed(_coalescing, 2, 2):
        assert message is not None and "one completion per operation" in message and "Fix:" in message
        assert posted == 0, "refused before anything is posted"


def test_wire_bytes_follow_the_ring_formulas():
    assert wire_bytes("all_reduce", 1000, 4) == 1500
    assert wire_bytes("all_gather", 1000, 4) == 750
    assert wire_bytes("reduce_scatter", 1000, 2) == 500
    assert wire_bytes("broadcast", 1000, 1) == 0


def test_stats_deltas():
    stats = CommStats()
    stats.record("dp", "all_reduce", 100, 2)
    before = stats.snapshot()
    stats.record("dp", "all_reduce", 40, 2)
    stats.record("tp", "all_gather", 8, 2)
    delta = stats.since(before)
    assert delta.wire("dp") == 40 and delta.wire("tp") == 4
    assert delta.wire_by_axis() == {"dp": 40, "tp": 4}
    assert "dp 4e-05 MB (1 calls)" in delta.summary()


def test_size_one_axis_is_a_no_op_without_process_group():
    comm = Comm(Mesh.build(Layout()))
    x = torch.ones(3)
    assert comm.all_reduce(x, "dp") is x
    assert comm.all_gather(x, "tp") is x
    assert comm.stats.counts == {}


def test_an_axis_of_several_ranks_without_its_process_group_is_named():
    """A mesh made by hand with no group for a 2-rank axis: a CommError with the fix, never torch's default group."""
    mesh = Mesh(Layout(dp=2).resolve(2), 0, {"dp": None})
    with pytest.raises(CommError, match=r"all_reduce on mesh axis 'dp' of 2 ranks, but .* no process group.*Fix: "):
        Comm(mesh).all_reduce(torch.ones(2), "dp")


def _differentiable_ops():
    mesh = Mesh.build(Layout())
    comm = Comm(mesh)
    r, n = mesh.rank, mesh.size("dp")
    torch.manual_seed(0)
    full = torch.randn(4, 6)  # same on every rank
    grads = {}

    def grad_of(fn, x):
        x = x.clone().requires_grad_(True)
        y = fn(x)
        (y * torch.arange(y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
        return y.detach(), x.grad

    grads["copy_to"] = grad_of(lambda x: copy_to(x, comm, "dp"), full)
    grads["reduce_from"] = grad_of(lambda x: reduce_from(x, comm, "dp"), full)
    grads["gather_from"] = grad_of(lambda x: gather_from(x, comm, "dp", dim=1), full.chunk(n, 1)[r])
    grads["scatter_to"] = grad_of(lambda x: scatter_to(x, comm, "dp", dim=1), full)
    grads["reduce_scatter"] = grad_of(lambda x: reduce_scatter(x, comm, "dp", dim=0), full)
    grads["all_gather"] = grad_of(lambda x: all_gather(x, comm, "dp", dim=0), full.chunk(n, 0)[r])
    grads["all_to_all"] = grad_of(lambda x: all_to_all(x, comm, "dp", scatter_dim=1, gather_dim=0), full.chunk(n, 0)[r])
    return {k: (y.tolist(), g.tolist()) for k, (y, g) in grads.items()}


def test_differentiable_ops_match_autograd_of_the_whole():
    n = 2
    results = run_distributed(_differentiable_ops, n)
    torch.manual_seed(0)
    full = torch.randn(4, 6)

    def weight(shape):
        return torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32).view(shape)

    for r, out in enumerate(results):
        y, g = out["copy_to"]
        assert torch.equal(torch.tensor(y), full) and torch.equal(torch.tensor(g), n * weight((4, 6)))
        y, g = out["reduce_from"]
        assert torch.allclose(torch.tensor(y), n * full) and torch.equal(torch.tensor(g), weight((4, 6)))
        y, g = out["gather_from"]
        assert torch.equal(torch.tensor(y), full) and torch.equal(torch.tensor(g), weight((4, 6)).chunk(n, 1)[r])
        y, g = out["scatter_to"]
        expected = torch.zeros(4, 6)
        for s in range(n):  # every rank's slice-gradient lands in its own columns
            expected[:, s * 3 : (s + 1) * 3] = weight((4, 3))
        assert torch.equal(torch.tensor(y), full.chunk(n, 1)[r]) and torch.equal(torch.tensor(g), expected)
        y, g = out["reduce_scatter"]
        assert torch.allclose(torch.tensor(y), n * full.chunk(n, 0)[r])
        assert torch.equal(torch.tensor(g), torch.cat([weight((2, 6))] * n))
        y, g = out["all_gather"]
        assert torch.equal(torch.tensor(y), full)
        assert torch.equal(torch.tensor(g), n * weight((4, 6)).chunk(n, 0)[r])
        y, g = out["all_to_all"]  # [2,6] row-chunk -> [4,3] column-chunk; backward is the inverse exchange
        assert torch.equal(torch.tensor(y), full.chunk(n, 1)[r])
        assert len(g) == 2 and len(g[0]) == 6


def _peer_dies(victim: int):
    mesh = Mesh.build(Layout())
    comm = Comm(mesh, timeout_s=20)
    comm.all_reduce(torch.ones(1), "dp")
    if mesh.rank == victim:
        os._exit(3)
    time.sleep(0.5)
    comm.all_reduce(torch.ones(1000), "dp")


def test_dead_peer_makes_the_others_fail_fast_naming_rank_axis_op():
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_peer_dies, 2, 1, timeout=60)
    assert time.monotonic() - start < 45
    failures = info.value.failures
    assert "exit code 3" in failures[1]
    assert "CommError" in failures[0] and "rank 0: all_reduce on mesh axis 'dp'" in failures[0]


def _silent_peer():
    mesh = Mesh.build(Layout())
    comm = Comm(mesh, timeout_s=2)
    if mesh.rank == 1:
        time.sleep(8)
        return "slept"
    try:
        comm.all_reduce(torch.ones(1), "dp")
    except CommError as error:
        return str(error), error.rank, error.axis, error.op
    return "no error"


def test_silent_peer_times_out_with_a_named_error():
    results = run_distributed(_silent_peer, 2, timeout=60, comm_timeout_s=2)
    message, rank, axis, op = results[0]
    assert (rank, axis, op) == (0, "dp", "all_reduce")
    assert "timed out after 2 s" in message
