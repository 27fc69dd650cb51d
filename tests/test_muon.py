"""Muon (an optimizer that needs whole tensors) equals one device under DDP, ZeRO-1/2/3, tp (+SP), pp and dp x tp.

The hybrid optimizer (Muon on the hidden matrices, AdamW on the rest; ``helpers.muon``) trains the composition
matrix's tiny GPT for 3 steps, clipped (and unclipped), under each layout; losses, the step-0 gradients and the
final parameters are compared with one device. Twice: with Newton-Schulz in fp32 at fp32 tolerances (the layouts
are exact), and with torch's bf16 Newton-Schulz at the tolerance justified in ``helpers/muon.py``, which the old
behaviour (each tp rank orthogonalising its slice) exceeds. Also: the communication each layout adds equals its
formula (docs/optimizers.md), layouts that cannot do it raise LayoutError before any collective, checkpoints of
Muon's state reshard between ZeRO-1, DDP and tp, and the tensor-atomic layout's balance.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys

import pytest
import torch
from helpers.composition import GRAD_TOL, LOSS_RTOL, PARAM_TOL, ChecksPassed, check_in_one_process, make_model
from helpers.harness import run_distributed
from helpers.muon import (
    BF16_LOSS_RTOL,
    BF16_PARAM_ATOL,
    CLIP,
    RESHARD_PAIRS,
    SAVE_AT,
    matrices_model,
    muon_spec,
    plain_muon,
    reference,
    reshard,
    train_many,
)
from helpers.reference import assert_tensors_close

from plait import Layout
from plait.errors import LayoutError
from plait.parallel.whole_tensor import (
    WholeTensorOptimizer,
    adopt_plain_factory,
    hidden_matrices,
    needs_whole_tensors,
)
from plait.parallel.zero.flat import owned_layout

WORLD2 = {
    "ddp": Layout(dp=2),
    "zero1": Layout(dp=2, zero=1),
    "zero2": Layout(dp=2, zero=2),
    "zero3": Layout(dp=2, zero=3),
    "tp2": Layout(tp=2),
    "tp2-sp": Layout(tp=2, sequence_parallel=True),
    "pp2": Layout(pp=2, microbatches=2),
    "zero1-offload": Layout(dp=2, zero=1, offload="cpu"),
    "zero3-offload": Layout(dp=2, zero=3, offload="cpu"),
}
WORLD4 = {
    "dp2-tp2": Layout(dp=2, tp=2),
    "dp2-tp2-zero1": Layout(dp=2, tp=2, zero=1),
    "dp2-tp2-zero3": Layout(dp=2, tp=2, zero=3),
    "dp2-tp2-pp2": Layout(dp=2, tp=2, pp=2, microbatches=2),
}
UNCLIPPED = ("ddp", "zero1", "tp2")


def _cases(layouts: dict[str, Layout]) -> dict[str, tuple[Layout, bool, float | None, bool]]:
    cases = {}
    for name, layout in layouts.items():
        cases[f"{name}-fp32ns"] = (layout, True, CLIP, False)
        cases[f"{name}-bf16"] = (layout, False, CLIP, False)
        if name in UNCLIPPED:
            cases[f"{name}-bf16-unclipped"] = (layout, False, None, False)
    if "tp2" in layouts:
        cases["tp2-slices-mutant"] = (layouts["tp2"], False, CLIP, True)
    return cases


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    return run_distributed(train_many, 2, _cases(WORLD2))


@pytest.fixture(scope="module")
def world4() -> list[dict]:
    return run_distributed(train_many, 4, _cases({k: v for k, v in WORLD4.items() if v.pp == 1}))


@pytest.fixture(scope="module")
def references() -> dict[tuple[bool, bool], object]:
    return {(fp32, clip): reference(fp32, CLIP if clip else None) for fp32 in (True, False) for clip in (True, False)}


def _merged(per_rank: list[dict], case: str, what: str) -> dict[str, torch.Tensor]:
    """Every rank's whole tensors by name (pipeline stages hold different names; replicas must agree)."""
    out: dict[str, torch.Tensor] = {}
    for result in per_rank:
        for name, tensor in result[case][what].items():
            if name in out:
                assert torch.equal(out[name], tensor), f"{case}: replicas of {name} differ"
            out[name] = tensor
    return out


def _check(per_rank: list[dict], case: str, references: dict) -> None:
    fp32 = case.endswith("fp32ns")
    expected = references[(fp32, "unclipped" not in case)]
    loss_rtol = LOSS_RTOL if fp32 else BF16_LOSS_RTOL
    for step, (loss, want) in enumerate(zip(per_rank[0][case]["losses"], expected.losses)):
        assert abs(loss - want) <= loss_rtol * abs(want), f"{case} step {step}: loss {loss} != {want}"
    # step 0's gradients come before any Muon step: fp32 reordering only, whatever the Newton-Schulz precision
    assert_tensors_close(_merged(per_rank, case, "grads"), expected.grads[0], f"{case} step-0 grad", GRAD_TOL)
    # fp32 Newton-Schulz: PARAM_TOL (fp32 reordering). bf16: helpers/muon.py, BF16_PARAM_ATOL (measured, justified)
    tolerance = PARAM_TOL if fp32 else {"rtol": 0.0, "atol": BF16_PARAM_ATOL}
    assert_tensors_close(_merged(per_rank, case, "params"), expected.params[-1], f"{case} params", tolerance)


@pytest.mark.parametrize("case", sorted(c for c in _cases(WORLD2) if "mutant" not in c))
def test_muon_equals_one_device_world2(world2: list[dict], references: dict, case: str) -> None:
    _check(world2, case, references)


@pytest.mark.parametrize("case", sorted(c for c in _cases({k: v for k, v in WORLD4.items() if v.pp == 1})))
def test_muon_equals_one_device_dp_x_tp(world4: list[dict], references: dict, case: str) -> None:
    _check(world4, case, references)


def test_slice_orthogonalisation_is_caught(world2: list[dict], references: dict) -> None:
    """The bug this replaces: tp=2 with each rank orthogonalising its own slice. The bf16 tolerance must see it."""
    expected, case = references[(False, True)], "tp2-slices-mutant"
    losses = world2[0][case]["losses"]
    assert abs(losses[-1] - expected.losses[-1]) > BF16_LOSS_RTOL * abs(expected.losses[-1])
    with pytest.raises(AssertionError, match="max abs error"):
        params = _merged(world2, case, "params")
        assert_tensors_close(params, expected.params[-1], case, {"rtol": 0.0, "atol": BF16_PARAM_ATOL})


def test_muon_dp_x_tp_x_pp() -> None:
    """dp x tp x pp (8 ranks, ~6 s): stages hold whole tensors; tp slices are gathered; fp32 Newton-Schulz, exact."""
    cases = {"dp2-tp2-pp2-fp32ns": (WORLD4["dp2-tp2-pp2"], True, CLIP, False)}
    per_rank = run_distributed(train_many, 8, cases)
    _check(per_rank, "dp2-tp2-pp2-fp32ns", {(True, True): reference(True, CLIP)})


# ----------------------------------------------------------------- communication = formula
def _sizes() -> tuple[list[int], list[int]]:
    """numel of the hidden matrices (Muon) and of the other parameters (AdamW), in registration order."""
    model, _ = make_model()
    hidden = hidden_matrices(model)
    whole = [p.numel() for n, p in model.named_parameters() if n in hidden]
    rest = [p.numel() for n, p in model.named_parameters() if n not in hidden]
    return whole, rest


def _step1(per_rank: list[dict], case: str, rank: int, key: str) -> int:
    """Payload bytes of ``key`` ("axis/op") in step 1 (step 0 also carries the test's gradient gathers)."""
    return int(per_rank[rank][case]["comm"][1].get(key, {}).get("payload_bytes", 0))


def test_bytes_zero1_equal_formula(world2: list[dict]) -> None:
    """ZeRO-1 over N=2: one reduce-scatter and one all-gather of N x (shard) elements per bucket: the AdamW bucket
    N ceil(E/N), the tensor-atomic Muon bucket N x S_W (S_W: the largest owner's load). Extra over elementwise
    ZeRO-1: only the padding N S_W - W (docs/optimizers.md)."""
    whole, rest = _sizes()
    n = 2
    named = [(str(i), torch.nn.Parameter(torch.empty(k))) for i, k in enumerate(whole)]
    s_w = owned_layout(named, n).shard_size
    expected = 4 * (n * math.ceil(sum(rest) / n) + n * s_w)
    for rank in range(n):
        assert _step1(world2, "zero1-bf16", rank, "dp_cp/reduce_scatter") == expected
        assert _step1(world2, "zero1-bf16", rank, "dp_cp/all_gather") == expected
    assert s_w * n - sum(whole) <= max(whole), "greedy largest-first: padding at most one tensor"


def test_bytes_tp_equal_formula(world2: list[dict], world4: list[dict]) -> None:
    """tp=2: each rank all-gathers its slices of the hidden matrices, values and gradients in one call: payload
    2 x tp x (W / tp) x 4 bytes per step (W: hidden-matrix elements; the only all-gather on tp without SP). Under
    dp x tp with ZeRO-1 only the owners' tp groups gather: the dp ranks' payloads sum to the same W."""
    whole, _ = _sizes()
    w = sum(whole)
    for rank in range(2):
        assert _step1(world2, "tp2-bf16", rank, "tp/all_gather") == 2 * w * 4
    for rank in range(4):
        assert _step1(world4, "dp2-tp2-bf16", rank, "tp/all_gather") == 2 * w * 4
    owners = [_step1(world4, "dp2-tp2-zero1-bf16", rank, "tp/all_gather") for rank in range(4)]
    assert owners[0] == owners[1] and owners[2] == owners[3], "tp peers gather together"  # ranks: dp-major
    assert owners[0] + owners[2] == 2 * w * 4, owners


# ----------------------------------------------------------------- refusals, before any collective
@pytest.mark.parametrize(
    ("world", "layout", "needle"),
    [
        (2, Layout(pp=2, schedule="pipedream", microbatches=2), "PipeDream"),
        (4, Layout(tp=4, tp_mode="2d"), "tp_mode='2d'"),
        (2, Layout(dp=2, zero=1, offload="nvme"), "nvme"),
    ],
)
def test_unsupported_layouts_refused_before_any_collective(world: int, layout: Layout, needle: str) -> None:
    with pytest.raises(LayoutError, match="Fix:") as info:
        check_in_one_process(world, layout, optimizer=muon_spec())
    assert needle in str(info.value)


@pytest.mark.parametrize("layout", [Layout(tp=2), Layout(dp=2, zero=1), Layout(dp=2, zero=3)])
def test_plain_muon_factory_that_leaves_parameters_out_is_refused(layout: Layout) -> None:
    """A plain ``lambda p: Muon(p)`` on a model with norms: Muon takes only the matrices, and which optimizer steps
    the norms is the user's to say (here as on one device, where the factory fails on them): refused, naming
    the fix, before any collective."""
    with pytest.raises(LayoutError, match="takes only 2-D matrices.*Fix: optimizer=.*WholeTensorOptimizer") as info:
        check_in_one_process(2, layout, optimizer=lambda p: torch.optim.Muon(p))
    assert "blocks.0.norm1.weight" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("layout", [Layout(tp=2), Layout(dp=2, zero=3)])
def test_plain_muon_factory_adopted_when_it_takes_every_parameter(layout: Layout, caplog) -> None:
    """The same factory on a model whose trainable parameters are all matrices: plait wraps it (Muon on every
    parameter, each whole), saying so in one info line; a plain elementwise factory is left as it is."""
    model, _ = matrices_model()
    with caplog.at_level(logging.INFO, logger="plait.parallel.whole_tensor"):
        adopted = adopt_plain_factory(layout.resolve(2), plain_muon, model)
    assert isinstance(adopted, WholeTensorOptimizer) and adopted.whole is plain_muon and adopted.rest is None
    assert adopted.chosen(model) == {id(p) for p in model.parameters() if p.requires_grad}
    lines = [r.getMessage() for r in caplog.records if "needs whole tensors" in r.getMessage()]
    assert len(lines) == 1 and "Muon" in lines[0], lines
    adamw = lambda p: torch.optim.AdamW(p)  # noqa: E731
    assert adopt_plain_factory(layout.resolve(2), adamw, model) is adamw
    assert adopt_plain_factory(Layout(dp=2).resolve(2), plain_muon, model) is plain_muon  # DDP: whole already


PLAIN = {"tp2": Layout(tp=2), "zero3": Layout(dp=2, zero=3)}


@pytest.fixture(scope="module")
def plain_runs() -> list[dict]:
    """The plain factory under tp=2 and ZeRO-3 dp=2: fp32 and bf16 Newton-Schulz, clipped and not (one spawn)."""
    cases = {}
    for name, layout in PLAIN.items():
        cases[f"plain-{name}-fp32ns"] = (layout, True, CLIP, False, True)
        cases[f"plain-{name}-bf16"] = (layout, False, CLIP, False, True)
        cases[f"plain-{name}-bf16-unclipped"] = (layout, False, None, False, True)
    return run_distributed(train_many, 2, cases)


@pytest.mark.parametrize("case", [f"plain-{n}-{k}" for n in PLAIN for k in ("fp32ns", "bf16", "bf16-unclipped")])
def test_plain_muon_factory_equals_one_device(plain_runs: list[dict], case: str) -> None:
    """``lambda p: torch.optim.Muon(p, ...)`` under tp=2 and ZeRO-3 equals the same factory on one device: losses,
    step-0 gradients, parameters after 3 steps; the tolerances of the hybrid's tests (helpers/muon.py)."""
    fp32, clipped = case.endswith("fp32ns"), "unclipped" not in case
    _check(plain_runs, case, {(fp32, clipped): reference(fp32, CLIP if clipped else None, plain=True)})


def test_plain_muon_accepted_where_tensors_are_whole() -> None:
    """DDP without tp holds whole tensors: a plain Muon factory (on 2-D parameters) is accepted."""
    with pytest.raises(ChecksPassed):
        from unittest import mock

        with (
            mock.patch("plait.parallelize.dist.is_initialized", return_value=True),
            mock.patch("plait.parallelize.dist.get_world_size", return_value=2),
            mock.patch("plait.parallelize.Mesh.build", side_effect=ChecksPassed),
        ):
            import plait

            model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False))
            plait.parallelize(model, Layout(dp=2), optimizer=lambda p: torch.optim.Muon(p))


def test_spec_misuse_is_named() -> None:
    model, _ = make_model()
    with pytest.raises(LayoutError, match="plait.parallelize"):
        muon_spec()(list(model.parameters()))
    with pytest.raises(LayoutError, match="rest"):
        WholeTensorOptimizer(whole=lambda p: torch.optim.Muon(p)).build(model)
    with pytest.raises(LayoutError, match="elementwise"):
        WholeTensorOptimizer(
            whole=lambda p: torch.optim.Muon(p), rest=lambda p: torch.optim.Muon(p), select=lambda n, p: n[0] == "0"
        ).build(torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False)))


def test_declaring_whole_tensors() -> None:
    class Declared(torch.optim.SGD):
        needs_whole_tensors = True

    assert needs_whole_tensors(torch.optim.Muon) and needs_whole_tensors(Declared)
    assert not needs_whole_tensors(torch.optim.AdamW)
    hybrid = muon_spec().build(make_model()[0])
    assert needs_whole_tensors(hybrid)


def test_hidden_matrices_are_the_blocks_2d_weights() -> None:
    model, _ = make_model()
    hidden = hidden_matrices(model)
    assert hidden and all(name.startswith("blocks.") for name in hidden)
    assert all(model.get_parameter(name).dim() == 2 for name in hidden)
    outside = {n for n, p in model.named_parameters() if p.dim() == 2} - hidden
    assert outside, "embeddings / head stay with AdamW"


def test_owned_layout_is_balanced_and_atomic() -> None:
    sizes = [1024, 1024, 256, 256, 256, 256, 16, 16]
    named = [(str(i), torch.nn.Parameter(torch.empty(k))) for i, k in enumerate(sizes)]
    layout = owned_layout(named, 2)
    assert layout.shard_size == sum(sizes) // 2  # greedy largest first balances these exactly
    for rank in range(2):
        for piece in layout.slices(rank):
            assert piece.start == 0 and piece.end == sizes[piece.index], "every tensor whole in one shard"


# ----------------------------------------------------------------- checkpoints reshard Muon's state
@pytest.fixture(scope="module")
def resharded(tmp_path_factory) -> dict:  # noqa: ANN001
    root = tmp_path_factory.mktemp("muon")
    kept = run_distributed(reshard, 2, str(root / "kept"))
    dropped = run_distributed(reshard, 2, str(root / "dropped"), True)
    return {"kept": kept, "dropped": dropped}


@pytest.mark.parametrize("pair", [f"{a}->{b}" for a, b in RESHARD_PAIRS])
def test_muon_state_reshards(resharded: dict, pair: str) -> None:
    """Saved under A after 2 steps, loaded under B, trained 2 more: B's losses and parameters equal A's own steps
    2..3 (Muon's momentum by parameter name, whole: ZeRO-1's owner shards, DDP's parameters, tp's gathered whole
    tensors). Without the loaded state (the control) the losses differ."""
    a = pair.split("->")[0]
    kept, dropped = resharded["kept"], resharded["dropped"]
    want = kept[0][a]["losses"][SAVE_AT:]
    for loss, expected in zip(kept[0][pair]["losses"], want):
        assert abs(loss - expected) <= LOSS_RTOL * abs(expected), f"{pair}: {loss} != {expected}"
    final = {name: t for rank in kept for name, t in rank[pair]["final"].items()}
    assert_tensors_close(final, {n: t for r in kept for n, t in r[a]["final"].items()}, pair, PARAM_TOL)
    lost = dropped[0][pair]["losses"][-1]
    assert abs(lost - want[-1]) > LOSS_RTOL * abs(want[-1]), f"{pair}: the control did not see the lost state"


# ----------------------------------------------------------------- plait train --set train.optimizer=muon
@pytest.mark.cli
def test_plait_train_with_muon_under_zero1_x_tp(tmp_path) -> None:  # noqa: ANN001
    """``plait train --set train.optimizer=muon`` on 4 ranks (dp=2 x tp=2, ZeRO-1): it trains and learns; the run's
    traffic has the tp all-gather of the hidden matrices' slices (values and gradients)."""
    out = tmp_path / "run"
    sets = ["train.optimizer=muon", "train.steps=30", "train.eval_every=0", "layout.tp=2", "layout.zero=1"]
    argv = [sys.executable, "-m", "plait", "train", "--nproc", "4", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    argv += [a for s in sets for a in ("--set", s)]
    result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    train = [r for r in map(json.loads, lines) if r["kind"] == "train"]
    assert len(train) == 30
    assert sum(r["loss"] for r in train[-5:]) < 0.8 * sum(r["loss"] for r in train[:5])  # it learns
    assert train[-1]["comm_bytes"]["tp"] > 0


def test_muon_config_builds_the_hybrid() -> None:
    """train.optimizer=muon: Muon (Moonlight's RMS matching, momentum 0.95, lr and weight decay from [train] unless
    muon_* say otherwise) on the hidden matrices, AdamW on the rest; bad Muon settings are refused with the fix."""
    from plait.errors import ConfigError
    from plait.train.config import RunConfig
    from plait.train.optim import muon_optimizer

    config = RunConfig.from_dict({"train": {"optimizer": "muon", "lr": 1e-3, "muon_lr": 0.02}})
    model, _ = make_model()
    hybrid = muon_optimizer(config.train).build(model)
    muon, adamw = hybrid.parts
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    group = muon.param_groups[0]
    assert group["lr"] == 0.02 and group["momentum"] == 0.95 and group["adjust_lr_fn"] == "match_rms_adamw"
    assert group["weight_decay"] == config.train.weight_decay and adamw.param_groups[0]["lr"] == 1e-3
    assert {id(p) for p in muon.param_groups[0]["params"]} == {
        id(p) for n, p in model.named_parameters() if n in hidden_matrices(model)
    }
    with pytest.raises(ConfigError, match="muon_momentum"):
        RunConfig.from_dict({"train": {"optimizer": "muon", "muon_momentum": 1.5}})


def test_hybrid_state_dict_round_trip() -> None:
    """torch's state_dict / load_state_dict on the HybridOptimizer: the parts keep one shared state and their
    groups' settings (what an lr scheduler or a user's own save relies on)."""
    model, task = make_model()
    first = muon_spec().build(model)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    first.step()
    first.param_groups[0]["lr"] = 0.5
    second = muon_spec().build(model)
    second.load_state_dict(first.state_dict())
    assert second.parts[0].param_groups[0]["lr"] == 0.5
    assert all(part.state is second.state for part in second.parts)
    for param, state in first.state.items():
        for key, value in state.items():
            assert torch.equal(second.state[param][key], value), key
