"""Mixture-of-Experts parity: a tiny MoE GPT trained by plait under a layout and by one device, compared step by
step (losses, the norm before clipping, the balance loss, the tokens routed to each expert and dropped, the step-0
gradients, the final parameters and the aux-free biases, the evaluation loss).

The model is plait's GPT, tiny: 4 blocks, blocks 1 and 3 MoE (so each of pp=2's stages has a dense and an MoE
block), d_model 16, 4 heads, 8 experts of width 8, top-2, one shared expert; the addition task's 8-token rows
scoring 1 to 4 of their 4 answer tokens (``reference.UnevenMasks``), global batch 8, 3 AdamW steps, clipping at
0.05 (below the norm: it acts at every step) unless a cell says otherwise. ``STARVED`` experts start with an
aux-free bias of -1 (scores are in (0, 1), so they are never chosen): experts that get no token, on one ep rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from helpers.composition import (
    GRAD_TOL,
    LOSS_RTOL,
    NORM_RTOL,
    PARAM_TOL,
    merge_ranks,
    optimizer,
    whole_gradients,
    whole_parameters,
)
from helpers.reference import UnevenMasks, assert_tensors_close, snapshot_grads, snapshot_params

import plait
from plait import Layout
from plait.data import AdditionTask, ShardedBatches
from plait.models import GPT, GPTConfig
from plait.models.loss import apply_loss
from plait.models.moe import finish_moe_step

STEPS = 3
GLOBAL_BATCH = 8
CLIP = 0.05
STARVED = (6, 7)
AUX_RTOL = 1e-5
"""The balance loss: sums of fp32 scores over other splits of the batch (a few ulps)."""
MODEL: dict[str, Any] = {
    "n_layer": 4,
    "n_head": 4,
    "d_model": 16,
    "bias": False,
    "n_experts": 8,
    "top_k": 2,
    "moe_d_ff": 8,
    "n_shared_experts": 1,
    "moe_start": 1,
    "moe_every": 2,
}


@dataclass(frozen=True)
class Cell:
    """One parity cell: a layout (``Layout`` fields), model overrides (``GPTConfig`` fields), clipping, and
    whether some experts are starved (``STARVED``: needs ``moe_balance="aux_free"``)."""

    name: str
    layout: dict[str, Any]
    model: dict[str, Any] = field(default_factory=dict)
    clip: float | None = CLIP
    starve: bool = False

    @property
    def world(self) -> int:
        return Layout(**self.layout).world_size


def make_model(model: dict[str, Any] | None = None, starve: bool = False) -> tuple[GPT, UnevenMasks]:
    """The tiny MoE GPT (module docstring), identically initialised everywhere, and its data."""
    task = AdditionTask(digits=2, seed=1)  # vocab 12, seq_len 8
    torch.manual_seed(1234)
    config = GPTConfig(vocab_size=task.vocab_size, seq_len=task.seq_len, **{**MODEL, **(model or {})})
    gpt = GPT(config)
    if starve:
        for name, buffer in gpt.named_buffers():
            if name.endswith("expert_bias"):
                buffer[list(STARVED)] = -1.0
    return gpt, UnevenMasks(task)


def expert_biases(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().cpu().clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}


def reference(cell: Cell) -> dict[str, Any]:
    """One device on each whole global batch, with the MoE statistics of every step (``finish_moe_step``)."""
    model, task = make_model(cell.model, cell.starve)
    return train_one_device(model, ShardedBatches(task, GLOBAL_BATCH).global_batch_at, cell.clip)


def train_one_device(
    model: torch.nn.Module, batch_at: Callable[[int], tuple[torch.Tensor, torch.Tensor]], clip: float | None
) -> dict[str, Any]:
    """``STEPS`` plain steps of ``model`` on ``batch_at(step)`` (clipped at ``clip``), then an evaluation on
    ``batch_at(STEPS)``: everything ``assert_cell_matches`` compares, the MoE statistics from ``finish_moe_step``."""
    opt = optimizer(model.parameters())
    out: dict[str, Any] = {"losses": [], "grad_norms": [], "aux": [], "load": [], "dropped": []}
    for step in range(STEPS):
        inputs, targets = batch_at(step)
        loss = apply_loss(torch.nn.functional.cross_entropy, model(inputs), targets)
        loss.backward()
        if clip:
            out["grad_norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        if step == 0:
            out["grads"] = snapshot_grads(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        stats = finish_moe_step(model)
        out["losses"].append(float(loss.detach()))
        out["aux"].append(sum(s.aux_loss for s in stats.values()))
        out["load"].append([[int(v) for v in stats[layer].load.tolist()] for layer in sorted(stats)])
        out["dropped"].append([int(stats[layer].dropped.sum()) for layer in sorted(stats)])
    out["params"], out["biases"] = snapshot_params(model), expert_biases(model)
    inputs, targets = batch_at(STEPS)
    model.eval()
    with torch.no_grad():
        out["eval"] = float(apply_loss(torch.nn.functional.cross_entropy, model(inputs), targets))
    return out


def train_cell(cell: Cell) -> dict[str, Any]:
    """Train ``cell`` on this rank; everything ``assert_cell_matches`` compares."""
    model, task = make_model(cell.model, cell.starve)
    engine = plait.parallelize(model, Layout(**cell.layout), optimizer=optimizer, max_grad_norm=cell.clip)
    grads: list[dict[str, torch.Tensor]] = []
    engine.before_optimizer_step.append(lambda e: grads.append(whole_gradients(e)) if not grads else None)
    loader = ShardedBatches(task, GLOBAL_BATCH, dp_rank=engine.mesh.index("dp"), dp_size=engine.mesh.size("dp"))
    stats = [engine.train_step(loader.batch_at(step)) for step in range(STEPS)]
    return cell_results(engine, stats, grads[0], engine.evaluate([loader.batch_at(STEPS)]).loss)


def cell_results(
    engine: plait.Engine, stats: list[Any], grads: dict[str, torch.Tensor], evaluation: float
) -> dict[str, Any]:
    """What ``assert_cell_matches`` compares, from a rank's trained engine, its steps' ``StepStats``, its step-0
    gradients (whole) and its evaluation loss."""
    assert all(s.moe is not None for s in stats)
    return {
        "losses": [s.loss for s in stats],
        "grad_norms": [s.grad_norm for s in stats],
        "aux": [s.moe.aux_loss for s in stats],
        "load": [s.moe.load for s in stats],
        "dropped": [s.moe.dropped for s in stats],
        "grads": grads,
        "params": whole_parameters(engine),
        "biases": expert_biases(engine.model),
        "eval": evaluation,
    }


def train_cells(cells: list[Cell]) -> dict[str, dict[str, Any]]:
    """Every cell of this job's world size, one after another (one process start-up)."""
    world = torch.distributed.get_world_size()
    return {cell.name: train_cell(cell) for cell in cells if cell.world == world}


def assert_cell_matches(cell: Cell, per_rank: list[dict[str, Any]], expected: dict[str, Any]) -> None:
    """Every rank reports the same step statistics, equal to one device's; gradients, parameters and biases too."""
    what = cell.name
    for rank, result in enumerate(per_rank):
        for key in ("losses", "aux", "load", "dropped", "eval"):
            assert result[key] == per_rank[0][key], f"{what}: rank {rank} reports another {key}"
    result = per_rank[0]
    assert result["load"] == expected["load"], f"{what}: tokens per expert {result['load']} != {expected['load']}"
    assert result["dropped"] == expected["dropped"], f"{what}: dropped {result['dropped']} != {expected['dropped']}"
    for step, (actual, wanted) in enumerate(zip(result["losses"], expected["losses"], strict=True)):
        assert abs(actual - wanted) <= LOSS_RTOL * abs(wanted), f"{what} step {step}: loss {actual!r} != {wanted!r}"
    for step, (actual, wanted) in enumerate(zip(result["aux"], expected["aux"], strict=True)):
        assert abs(actual - wanted) <= AUX_RTOL * abs(wanted) + 1e-12, f"{what} step {step}: aux {actual} != {wanted}"
    if cell.clip:
        for step, (actual, wanted) in enumerate(zip(result["grad_norms"], expected["grad_norms"], strict=True)):
            assert abs(actual - wanted) <= NORM_RTOL * wanted, f"{what} step {step}: norm {actual!r} != {wanted!r}"
    wanted = expected["eval"]
    assert abs(result["eval"] - wanted) <= LOSS_RTOL * abs(wanted), f"{what}: eval {result['eval']} != {wanted}"
    grads = merge_ranks([r["grads"] for r in per_rank], f"{what} step-0 grads")
    params = merge_ranks([r["params"] for r in per_rank], f"{what} final params")
    assert params.keys() == expected["params"].keys(), f"{what}: {sorted(params.keys() ^ expected['params'].keys())}"
    assert_tensors_close(grads, expected["grads"], f"{what} step 0 grad", GRAD_TOL)
    assert_tensors_close(params, expected["params"], f"{what} final param", PARAM_TOL)
    for name, bias in expected["biases"].items():
        for rank, r in enumerate(per_rank):
            if name in r["biases"]:
                assert torch.equal(r["biases"][name], bias), f"{what}: rank {rank}'s {name} differs"
