"""Activation recomputation: same results as without it (bitwise in one process, parity under dp=2),
far fewer activations held, and clear errors for blocks that do not exist."""

import pytest
import torch
from helpers.gpt import make_model, reference, train_plait
from helpers.harness import run_distributed
from helpers.reference import assert_trajectories_match

import plait
from plait import Layout, LayoutError
from plait.parallel.blocks import find_blocks
from plait.parallel.recompute import apply_recompute


def test_blocks_are_found_by_container_name():
    model, _ = make_model()
    assert [path for path, _ in find_blocks(model)] == ["blocks.0", "blocks.1"]
    assert find_blocks(torch.nn.Linear(2, 2)) == []


@pytest.mark.parametrize("recompute", ["full", (1,)])
def test_recompute_is_bitwise_single_device(recompute):
    actual = train_plait(Layout(recompute=recompute), "adamw")
    assert_trajectories_match(actual, reference("adamw"), exact=True)


@pytest.mark.distributed
def test_recompute_with_data_parallel_and_accumulation():
    results = run_distributed(train_plait, 2, Layout(dp=2, microbatches=2, recompute="full"), "sgd", 0.05)
    for actual in results:
        assert_trajectories_match(actual, reference("sgd", 0.05))


def _saved_bytes(recompute: str) -> int:
    """Bytes autograd saves for backward during one forward (the activations held)."""
    model, task = make_model()
    apply_recompute(model, recompute)
    x, _ = task.batch(range(16))
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum()
    return total


def test_recompute_holds_fewer_activations():
    full, none = _saved_bytes("full"), _saved_bytes("none")
    assert full < 0.5 * none, (full, none)


def test_bad_recompute_choices():
    model, _ = make_model()
    with pytest.raises(LayoutError, match=r"block\(s\) \[5\].*2 blocks"):
        apply_recompute(model, (5,))
    with pytest.raises(LayoutError, match="no ModuleList/ModuleDict"):
        plait.parallelize(torch.nn.Linear(2, 2), Layout(recompute="full"), optimizer=lambda p: torch.optim.SGD(p, lr=1))
