"""The process-group backend (issue 14): ``plait train --backend gloo|nccl``; ranks sharing a GPU under NCCL refused
up front; gloo's point-to-point staged through host memory for device tensors.

The GPU cases cannot run here, so the decisions are pure functions of (backend, device type, local ranks, GPU
count) tested directly, and the staging path is forced on CPU tensors (``Comm.stage_p2p = True``): the same
copies, send/recv and write-back that a CUDA tensor over gloo takes.
"""

from __future__ import annotations

import argparse

import pytest
import torch
from helpers.gpt import GLOBAL_BATCH, OPTIMIZERS, make_model
from helpers.harness import run_distributed

import plait
from plait import Layout, LayoutError
from plait.cli.main import main
from plait.cli.train import worker_args
from plait.comm import Comm, CommStats
from plait.comm.collectives import needs_host_staging
from plait.data import ShardedBatches
from plait.distributed import check_gpu_sharing, choose_backend, gpu_of_local_ranks
from plait.mesh import Mesh


def test_default_backend_follows_the_device_and_bad_choices_name_the_fix():
    assert choose_backend(None, "cpu") == "gloo"
    assert choose_backend(None, "cuda") == "nccl"
    assert choose_backend("gloo", "cuda") == "gloo"
    with pytest.raises(LayoutError, match="needs CUDA GPUs.*Fix: use --backend gloo"):
        choose_backend("nccl", "cpu")
    with pytest.raises(LayoutError, match="'mpi' is unknown.*Fix"):
        choose_backend("mpi", "cuda")


def test_ranks_sharing_a_gpu_are_refused_under_nccl_only():
    assert gpu_of_local_ranks(4, 2) == [0, 1, 0, 1]
    assert gpu_of_local_ranks(2, 0) == []
    check_gpu_sharing("nccl", gpu_of_local_ranks(8, 8))  # one GPU per rank
    check_gpu_sharing("gloo", gpu_of_local_ranks(2, 1))  # gloo: ranks may share a GPU
    with pytest.raises(LayoutError) as error:
        check_gpu_sharing("nccl", gpu_of_local_ranks(2, 1), rank=1)
    message = str(error.value)
    assert (
        message.startswith("rank 1:")
        and "Duplicate GPU detected" in message
        and "cuda:0 by local ranks [0, 1]" in message
    )
    assert "--nproc 1" in message and "--backend gloo" in message


def test_p2p_staging_is_for_device_tensors_over_gloo():
    assert needs_host_staging("gloo", "cuda")
    assert not needs_host_staging("gloo", "cpu")
    assert not needs_host_staging("nccl", "cuda")
    assert not needs_host_staging(None, "cuda")


def test_plait_train_refuses_nccl_without_a_gpu_before_launching(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: NCCL is a valid choice here")
    assert main(["train", "--backend", "nccl", "--nproc", "2"]) == 2
    assert "LayoutError" in capsys.readouterr().err


def test_plait_train_forwards_the_backend_to_its_workers():
    args = argparse.Namespace(
        out="runs/x", preset=None, config=None, overrides=["train.steps=2"], trace=None, backend="gloo"
    )
    assert worker_args(args) == ["train", "--out", "runs/x", "--set", "train.steps=2", "--backend=gloo"]
    assert "--backend=gloo" not in worker_args(argparse.Namespace(**{**vars(args), "backend": None}))


def _staged_exchanges() -> dict:
    """Raw send_recv with staging forced (blocking and async), then pipeline and ring attention trained with
    and without staging."""
    rank = torch.distributed.get_rank()
    comm = Comm(Mesh.build(Layout(dp=2).resolve(2)), CommStats())
    comm.stage_p2p = True
    peer = 1 - rank
    outgoing = torch.arange(4, dtype=torch.float32) + 10 * rank
    incoming = torch.zeros(4)
    comm.send_recv([(outgoing, peer)], [(incoming, peer)], axis="dp")
    later = torch.zeros(4)
    pending = comm.send_recv([(outgoing * 2, peer)], [(later, peer)], axis="dp", async_op=True)
    before_wait = later.clone()
    pending.wait()
    out = {"incoming": incoming, "before_wait": before_wait, "later": later, "bytes": comm.stats.to_dict()}
    for name, layout in {"pp2": Layout(dp=1, pp=2, microbatches=2), "cp2-ring": Layout(dp=1, cp=2)}.items():
        for staged in (False, True):
            model, task = make_model()
            engine = plait.parallelize(model, layout, optimizer=OPTIMIZERS["adamw"], max_grad_norm=0.05)
            engine.comm.stage_p2p = staged
            loader = ShardedBatches(task, GLOBAL_BATCH)
            out[(name, staged)] = [engine.train_step(loader.batch_at(step)).loss for step in range(3)]
    return out


@pytest.mark.distributed
def test_p2p_staged_through_host_memory_delivers_the_same_values():
    results = run_distributed(_staged_exchanges, 2)
    for rank, out in enumerate(results):
        sent_by_peer = torch.arange(4, dtype=torch.float32) + 10 * (1 - rank)
        assert torch.equal(out["incoming"], sent_by_peer)
        assert torch.equal(out["before_wait"], torch.zeros(4)), "staged: the buffer is written when the op completes"
        assert torch.equal(out["later"], 2 * sent_by_peer)
        assert out["bytes"]["dp/send"]["payload_bytes"] == 2 * 16 == out["bytes"]["dp/recv"]["payload_bytes"]
        for name in ("pp2", "cp2-ring"):
            assert out[(name, True)] == out[(name, False)], f"rank {rank} {name}: staging changed the losses"
