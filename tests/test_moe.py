"""The Mixture-of-Experts feed-forward of plait's GPT (plait/models/moe.py): routing and experts against a per-token
computation, the grouped kernel against the per-expert loop, capacity drops, the balance loss (DeepSeek-V3's
sequence-wise loss, exact under any split of the batch into sequences and, given the counts, of a sequence into
positions), the aux-free bias, statistics under recomputation, parameter and FLOP counts; and the training program
(``plait train`` with ``[model] n_experts``: metrics.jsonl / TensorBoard, a checkpoint saved at ep=2 under ZeRO-3
resumed at ep=4, ep=2 under DDP, ep=1 and in one process, ``plait convert`` to safetensors, ``plait generate``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers.harness import run_distributed

from plait import Layout
from plait.models import GPT, GPTConfig
from plait.models.moe import (
    GroupedExperts,
    MoE,
    capacity_mask,
    finish_moe_step,
    grouped_mm_available,
    moe_layers,
)

CONFIG = {"vocab_size": 12, "seq_len": 8, "n_layer": 2, "n_head": 4, "d_model": 16, "n_experts": 4, "moe_d_ff": 8}


def _moe(**overrides) -> MoE:
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(**{**CONFIG, **overrides}))
    layer = gpt.blocks["0"].mlp
    assert isinstance(layer, MoE)
    return layer


def _per_token(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """sum_j w_j expert_{e_j}(x) + shared(x), token by token."""
    flat = x.reshape(-1, x.shape[-1])
    _, chosen, weights = layer.router(flat)
    out = torch.zeros_like(flat)
    experts = layer.experts
    for t in range(flat.shape[0]):
        for e, w in zip(chosen[t].tolist(), weights[t]):
            up = flat[t] @ experts.w_up[e]
            hidden = F.gelu(up) if experts.w_gate is None else F.silu(flat[t] @ experts.w_gate[e]) * up
            out[t] += w * (hidden @ experts.w_down[e])
    out = out.view_as(x)
    return out + layer.shared(x) if layer.shared is not None else out


# ----------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"top_k": 5}, "top_k=5 exceeds n_experts=4"),
        ({"moe_start": 2}, "moe_start=2 leaves no MoE block"),
        ({"capacity_factor": 0.0}, "capacity_factor=0.0 must be a positive number"),
        ({"router_score": "relu"}, "router_score='relu' is not supported"),
        ({"moe_balance": "switch"}, "moe_balance='switch' is not supported"),
        ({"n_experts": -1}, "n_experts=-1 must be 0"),
        ({"aux_loss_coef": -0.1}, "aux_loss_coef=-0.1 must be a finite number >= 0"),
    ],
)
def test_config_refuses_bad_moe_fields(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GPTConfig(**{**CONFIG, **fields})


def test_which_blocks_are_moe() -> None:
    config = GPTConfig(**{**CONFIG, "n_layer": 6, "moe_start": 1, "moe_every": 2})
    assert config.moe_layers == [1, 3, 5]
    gpt = GPT(config)
    assert [type(gpt.blocks[str(i)].mlp).__name__ for i in range(6)] == ["MLP", "MoE"] * 3
    assert GPTConfig(**{**CONFIG, "n_experts": 0}).moe_layers == []  # the default: dense


# ----------------------------------------------------------------- routing and experts
@pytest.mark.parametrize(
    "fields",
    [{}, {"mlp": "swiglu", "n_shared_experts": 2}, {"router_score": "sigmoid", "top_k": 3, "router_norm_topk": False}],
)
def test_moe_equals_the_per_token_sum_of_its_experts(fields: dict) -> None:
    layer = _moe(**fields)
    x = torch.randn(3, 8, 16)
    torch.testing.assert_close(layer(x), _per_token(layer, x), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
@pytest.mark.parametrize("gated", [False, True])
def test_grouped_kernel_equals_the_per_expert_loop(gated: bool) -> None:
    torch.manual_seed(0)
    experts = GroupedExperts(4, 16, 8, gated)
    experts.reset_parameters(0.1, 0.1)
    x = torch.randn(10, 16)
    counts = torch.tensor([3, 0, 5, 2])  # an expert without rows
    grad = torch.randn(10, 16)
    results = []
    for kernel in ("loop", "grouped"):  # this CPU torch runs _grouped_mm too: the grouped code path on CPU
        experts.kernel, rows = kernel, x.clone().requires_grad_()
        experts(rows, counts).backward(grad)
        results.append((rows.grad, *(w.grad.clone() for w in experts.weights())))
        experts.zero_grad()
    for loop, grouped in zip(*results):
        torch.testing.assert_close(grouped, loop, rtol=1e-6, atol=1e-6)
    assert not grouped_mm_available(torch.device("cpu"), torch.bfloat16, 16, 8)  # "auto" loops on the CPU


def test_capacity_keeps_first_choices_and_earlier_positions_first() -> None:
    chosen = torch.tensor([[[0, 1], [0, 2], [0, 1], [2, 0]]])  # one sequence of 4 tokens, top-2
    kept = capacity_mask(chosen, n_experts=3, capacity=2)
    # expert 0: first choices of t0, t1 (capacity 2), then t2's first choice and t3's second are dropped
    # expert 1: t0's and t2's second choices fit; expert 2: t3's first choice, then t1's second choice
    assert kept.tolist() == [[[True, True], [True, True], [False, True], [True, False]]]
    layer = _moe(capacity_factor=0.5)  # C = ceil(0.5 x 8 x 2 / 4) = 2 per expert and sequence
    layer.train()
    layer(torch.randn(3, 8, 16))
    stats = layer.take_statistics()
    assert stats is not None and stats[:4].sum() == 3 * 8 * 2 and stats[4:8].sum() == 3 * 8 * 2 - 3 * 4 * 2


def test_dropless_is_a_capacity_no_token_reaches() -> None:
    x = torch.randn(2, 8, 16)
    torch.testing.assert_close(_moe(capacity_factor=100.0)(x), _moe()(x))


# ----------------------------------------------------------------- the balance loss
def _balance_gradient(layer: MoE, x: torch.Tensor, scale: float | None) -> tuple[float, torch.Tensor]:
    """The balance loss's value (sum over sequences) and the router weight's gradient from it alone."""
    layer.train()
    layer.aux_grad_scale = scale
    layer.router.gate.weight.grad = None
    (layer(x) * 0).sum().backward()  # only the balance term's gradient reaches the router
    stats = layer.take_statistics()
    assert stats is not None
    return float(stats[-1]), layer.router.gate.weight.grad.clone()


def test_balance_loss_is_deepseek_v3_sequence_wise_loss() -> None:
    layer = _moe(aux_loss_coef=0.5, router_score="sigmoid")
    x = torch.randn(3, 8, 16)
    total, _ = _balance_gradient(layer, x, None)
    scores = layer.router.gate(x).sigmoid().detach()
    chosen = scores.topk(2, dim=-1).indices
    expected = 0.0
    for b in range(3):
        f = F.one_hot(chosen[b], 4).sum(dim=(0, 1)).double() * 4 / (2 * 8)
        p = (scores[b] / scores[b].sum(-1, keepdim=True)).mean(dim=0).double()
        expected += 0.5 * float((f * p).sum())
    assert total == pytest.approx(expected, rel=1e-6)


def test_balance_loss_splits_exactly_over_sequences_and_positions() -> None:
    """Halves of the batch (data parallelism, micro-batches) each scaled by 1/B of the whole batch add up to the
    whole batch's gradient; so do halves of each sequence (context parallelism) once the counts are summed."""
    layer = _moe()
    x = torch.randn(4, 8, 16)
    whole, grad = _balance_gradient(layer, x, None)  # default scale 1/B: the mean over the 4 sequences
    parts = [_balance_gradient(layer, half, 1 / 4) for half in (x[:2], x[2:])]
    assert sum(v for v, _ in parts) == pytest.approx(whole, rel=1e-6)
    torch.testing.assert_close(parts[0][1] + parts[1][1], grad, rtol=1e-5, atol=1e-9)

    halves = (x[:, :4], x[:, 4:])
    counts = []
    layer.sequence_sum = lambda stats: counts.append(stats.detach().clone()) or stats
    for half in halves:  # each half's counts (the balance loss is computed in training forwards with grad)
        layer(half)
    layer.take_statistics()
    layer.sequence_sum = lambda stats: counts[0] + counts[1]  # what SequenceSum sums over the cp ranks
    parts = [_balance_gradient(layer, half, 1 / 4) for half in halves]
    assert sum(v for v, _ in parts) == pytest.approx(whole, rel=1e-6)
    torch.testing.assert_close(parts[0][1] + parts[1][1], grad, rtol=1e-5, atol=1e-9)

    layer.sequence_sum = None  # without the counts' sum each half is a sequence of its own: not the same loss
    wrong = sum(_balance_gradient(layer, half, 1 / 4)[0] for half in halves)
    assert abs(wrong - whole) > 1e-4 * whole


def test_balance_loss_reaches_the_loss_through_the_output_only() -> None:
    """model(x) stays logits; a plain loss.backward() trains on loss + mean balance loss (the default scale)."""
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(**{**CONFIG, "aux_loss_coef": 1.0}))
    x = torch.randint(0, 12, (2, 8))
    logits = gpt(x)
    assert isinstance(logits, torch.Tensor) and logits.shape == (2, 8, 12)
    logits.sum().mul(0).backward()
    assert gpt.blocks["0"].mlp.router.gate.weight.grad.abs().sum() > 0  # from the balance term alone
    assert finish_moe_step(gpt)[0].aux_loss > 0
    gpt.eval()
    with torch.no_grad():
        gpt(x)
    assert all(layer.take_statistics() is None for layer in moe_layers(gpt))  # evaluation records nothing


def test_aux_free_bias_moves_against_the_load() -> None:
    layer = _moe(moe_balance="aux_free", bias_update_rate=0.25)
    layer.update_bias(torch.tensor([10.0, 2.0, 2.0, 2.0]))
    assert layer.router.expert_bias.tolist() == [-0.25, 0.25, 0.25, 0.25]
    layer.router.expert_bias.copy_(torch.tensor([0.0, 0.0, -1.0, 0.0]))  # expert 2 can never be chosen now
    gpt = GPT(GPTConfig(**{**CONFIG, "moe_balance": "aux_free"}))
    gpt.blocks["0"].mlp.router.expert_bias[2] = -1.0
    gpt(torch.randint(0, 12, (4, 8)))
    stats = finish_moe_step(gpt)
    assert stats[0].load[2] == 0 and stats[0].aux_loss == 0.0
    assert gpt.blocks["0"].mlp.router.expert_bias[2] == pytest.approx(-1.0 + 0.001)  # underloaded: raised


def test_recomputation_does_not_count_twice() -> None:
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(**CONFIG))
    x = torch.randint(0, 12, (2, 8))
    gpt(x).sum().backward()
    plain = finish_moe_step(gpt)
    from plait.parallel.recompute import apply_recompute

    apply_recompute(gpt, "full")
    gpt(x).sum().backward()
    again = finish_moe_step(gpt)
    assert torch.equal(again[0].load, plain[0].load) and again[0].aux_loss == pytest.approx(plain[0].aux_loss)


def test_spec_counts_total_and_active_parameters_and_flops() -> None:
    config = GPTConfig(**{**CONFIG, "n_layer": 4, "moe_start": 1, "moe_every": 2, "n_shared_experts": 1})
    gpt, spec = GPT(config), GPT(config).spec()
    assert spec.parameters == gpt.num_parameters()
    per_expert = 2 * 16 * 8
    assert spec.parameters - spec.active_parameters == 2 * (4 - 2) * per_expert  # 2 MoE blocks, 2 idle experts
    attention = 16 * (16 + 2 * 16) + 16 * 16
    dense, moe = attention + 2 * 16 * 64, attention + 16 * 4 + (2 + 1) * per_expert  # router + top-2 + shared
    assert spec.forward_flops_per_token() == 2 * (2 * dense + 2 * moe) + 4 * 4 * 8 * 16 + 2 * 16 * 12
    assert gpt.flops_per_token() == spec.flops_per_token()
    stage = GPT(config)
    del stage.blocks["0"], stage.blocks["1"]  # a pipeline stage holding blocks 2 (dense) and 3 (MoE)
    assert stage.flops_per_token() == 3 * spec.forward_flops_per_token(block_indices=[2, 3])
    assert GPTConfig(**spec.to_gpt_config()).moe_layers == config.moe_layers


# ----------------------------------------------------------------- the training program, checkpoints across ep
RUN_MODEL = {"n_layer": 2, "n_head": 4, "d_model": 16, "n_experts": 4, "top_k": 2, "moe_d_ff": 16}
RUN_MODEL_AUX_FREE = {**RUN_MODEL, "moe_balance": "aux_free", "bias_update_rate": 0.01}
RUN_TRAIN = {"steps": 3, "global_batch": 8, "save_every": 2, "eval_every": 0, "tensorboard": True}


def _train_job(root: str) -> None:
    """``plait train``'s worker on 4 ranks: dp4 x ep2 under ZeRO-3 (each rank holds 2 experts, sharded again over
    edp = 2), checkpoint at step 2, 3 steps."""
    from plait.distributed import init
    from plait.train.config import RunConfig
    from plait.train.loop import run

    world = init()
    layout = {"dp": 4, "ep": 2, "zero": 3}
    run(
        RunConfig.from_dict({"layout": layout, "model": RUN_MODEL_AUX_FREE, "train": {**RUN_TRAIN, "out": root}}), world
    )


def _resume_job(root: str, layouts: list[dict]) -> list[dict]:
    """Resume the run's step-2 checkpoint under each layout and train step 3 (the run's own data and settings)."""
    from plait.data import ShardedBatches
    from plait.distributed import init
    from plait.train.config import load_config
    from plait.train.loop import build

    world = init()
    config = load_config(Path(root) / "config.toml")
    out = []
    for fields in layouts:
        engine, dataset, _ = build(dataclasses.replace(config, layout=Layout(**fields)), world)
        engine.load(Path(root) / "ckpt" / "step-00000002")  # not the last step, 3, also saved
        dp_rank, dp_size = engine.mesh.index("dp"), engine.mesh.size("dp")
        loader = ShardedBatches(dataset, config.train.global_batch, dp_rank, dp_size)
        stats = engine.train_step(loader.batch_at(engine.step))
        out.append({"step": stats.step, "loss": stats.loss, "load": stats.moe.load, "grad_norm": stats.grad_norm})
    return out


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("moe") / "run"
    run_distributed(_train_job, 4, str(root), timeout=300)
    return root


@pytest.mark.distributed
def test_plait_train_records_expert_load_in_metrics_and_tensorboard(moe_run: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train = [json.loads(line) for line in (moe_run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in train if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    for record in train:
        moe = record["moe"]
        assert moe["layers"] == [0, 1] and len(moe["load"]) == 2
        assert all(sum(row) == 8 * 8 * 2 for row in moe["load"])  # 64 tokens x top-2, summed over the 4 ranks
        assert moe["imbalance"] == pytest.approx([max(row) / (sum(row) / 4) for row in moe["load"]])
        assert moe["dropped"] == [0, 0] and moe["aux_loss"] == 0.0  # dropless, aux-free balancing
        assert record["comm_bytes"]["ep"] > 0  # the token exchange, counted on its axis
    tags = set(EventAccumulator(str(moe_run)).Reload().Tags()["scalars"])
    assert {"moe/imbalance", "moe/layer1/imbalance", "moe/layer0/expert3", "moe/aux_loss"} <= tags


@pytest.mark.distributed
def test_checkpoint_saved_at_ep2_resumes_at_ep4_ep2_ep1_and_in_one_process(moe_run: Path) -> None:
    """Step 3 after loading the step-2 checkpoint (experts saved whole from ZeRO-3 shards of ep slices; the
    aux-free biases, the optimizer and the lr schedule with them) equals the run's own step 3, under other ep and
    ZeRO stages."""
    step3 = [json.loads(line) for line in (moe_run / "metrics.jsonl").read_text().splitlines()][2]
    assert step3["step"] == 3
    results = run_distributed(_resume_job, 4, str(moe_run), [{"dp": 4, "ep": 4, "zero": 1}], timeout=300)[0]
    layouts = [{"dp": 2, "ep": 2, "zero": 0}, {"dp": 2, "ep": 1, "zero": 3}]
    results += run_distributed(_resume_job, 2, str(moe_run), layouts, timeout=300)[0]
    results += run_distributed(_resume_job, 1, str(moe_run), [{"dp": 1}], timeout=300)[0]
    for result in results:
        assert result["step"] == 3 and result["load"] == step3["moe"]["load"]
        assert result["loss"] == pytest.approx(step3["loss"], rel=1e-6)
        assert result["grad_norm"] == pytest.approx(step3["grad_norm"], rel=1e-5)


@pytest.mark.distributed
def test_convert_and_generate_from_an_moe_checkpoint(
    moe_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import load_file

    from plait.checkpoint import load_full_state
    from plait.cli.main import main

    whole, _ = load_full_state(moe_run / "ckpt")
    assert whole["blocks.0.mlp.experts.w_up"].shape == (4, 16, 16)  # saved from ep slices [2, 16, 16]
    records = [json.loads(line) for line in (moe_run / "metrics.jsonl").read_text().splitlines()][:3]
    for layer in (0, 1):  # the aux-free biases after the 3 steps (the last is saved): rate x sum of sign(mean - load)
        loads = torch.tensor([r["moe"]["load"][layer] for r in records], dtype=torch.float64)
        moved = 0.01 * torch.sign(loads.mean(dim=1, keepdim=True) - loads).sum(dim=0)
        torch.testing.assert_close(whole[f"blocks.{layer}.mlp.router.expert_bias"], moved.float())
    assert main(["convert", str(moe_run / "ckpt"), str(tmp_path / "moe.safetensors")]) == 0
    exported = load_file(str(tmp_path / "moe.safetensors"))
    assert exported.keys() == whole.keys()
    assert all(torch.equal(exported[name], whole[name]) for name in whole)
    capsys.readouterr()
    assert main(["generate", str(moe_run), "--prompt", "12+34=", "--max-new-tokens", "3", "--temperature", "0"]) == 0
    text = capsys.readouterr().out.strip()
    assert len(text) == 3 and set(text) <= set("0123456789+=")
    assert math.isfinite(float(json.loads((moe_run / "summary.json").read_text())["eval_loss"]))
