"""Megatron 1D tensor parallelism: each parallel layer against its single-device layer (forward, input and
weight gradients) at tp=2 and tp=4; the GPT against single-device training: the logits before training (the
forward output, whole in evaluation), then 5 AdamW steps with clipping (tp=2, tp=4, dp=2 x tp=2, dp=2 x tp=2 x
ZeRO-1, pp=2 x tp=2, GQA/RoPE/SwiGLU, a loss that needs whole logits), including evaluation with an accuracy
metric; per-rank parameter memory; plans; bad input. Sequence parallelism and bytes per layer:
test_sequence_parallel.py. 2D / 2.5D / 3D: test_tensor_parallel_nd.py."""

import pytest
import torch
import torch.nn.functional as F
from helpers.harness import run_distributed
from helpers.tp import LAYER_TOL, assert_matches_reference, custom_loss, reference_run, train_tp
from torch import nn

from plait import Layout, LayoutError
from plait.comm import Comm
from plait.mesh import Mesh
from plait.models import GPT, GPTConfig
from plait.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    plan_tensor_parallel,
    vocab_parallel_cross_entropy,
)
from plait.parallel.tensor.plan import default_plan, resolve_plan


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, **LAYER_TOL, msg=lambda m: f"{what}: {m}")


def _layers(world: int) -> None:
    comm = Comm(Mesh.build(Layout(tp=world)))
    rank = comm.mesh.index("tp")
    gather = lambda t, dim: comm.all_gather(t.detach().contiguous(), "tp", dim=dim)  # noqa: E731
    torch.manual_seed(0)

    # column parallel, with and without gathering the output; X enters through f (all-reduce of dX)
    linear = nn.Linear(8, 12)
    x = torch.randn(2, 3, 8, requires_grad=True)
    upstream = torch.randn(2, 3, 12)
    (linear(x) * upstream).sum().backward()
    for gather_output in (True, False):
        column = ColumnParallelLinear.from_linear(linear, comm, gather_output=gather_output)
        x_tp = x.detach().clone().requires_grad_()
        y = column(x_tp)
        weight = upstream if gather_output else upstream.chunk(world, -1)[rank]
        (y * weight).sum().backward()
        _close(y if gather_output else gather(y, -1), linear(x).detach(), f"column(gather={gather_output}) output")
        _close(x_tp.grad, x.grad, f"column(gather={gather_output}) input grad")
        _close(gather(column.weight.grad, 0), linear.weight.grad, "column weight grad")
        _close(gather(column.bias.grad, 0), linear.bias.grad, "column bias grad")

    # row parallel: X split on features, partial products all-reduced, bias added once
    linear = nn.Linear(12, 8)
    x = torch.randn(2, 3, 12, requires_grad=True)
    upstream = torch.randn(2, 3, 8)
    (linear(x) * upstream).sum().backward()
    row = RowParallelLinear.from_linear(linear, comm)
    x_local = x.detach().chunk(world, -1)[rank].clone().requires_grad_()
    y = row(x_local)
    (y * upstream).sum().backward()
    _close(y, linear(x).detach(), "row output")
    _close(x_local.grad, x.grad.chunk(world, -1)[rank], "row input grad")
    _close(gather(row.weight.grad, 1), linear.weight.grad, "row weight grad")
    _close(row.bias.grad, linear.bias.grad, "row bias grad")  # replicated: the whole gradient on every rank

    # vocab-parallel embedding: ids of every shard, out-of-range rows masked, partial lookups all-reduced
    embedding = nn.Embedding(12, 8)
    ids = torch.tensor([[0, 5, 11, 3, 7, 5], [2, 9, 4, 10, 1, 6]])
    upstream = torch.randn(2, 6, 8)
    (embedding(ids) * upstream).sum().backward()
    vocab = VocabParallelEmbedding.from_embedding(embedding, comm)
    out = vocab(ids)
    (out * upstream).sum().backward()
    _close(out, embedding(ids).detach(), "embedding output")
    _close(gather(vocab.weight.grad, 0), embedding.weight.grad, "embedding weight grad")

    # vocab-parallel cross-entropy: loss and dlogits (softmax - onehot on the local shard), ignore_index honoured
    logits = torch.randn(4, 5, 12, requires_grad=True)
    targets = torch.randint(0, 12, (4, 5))
    targets[0, :2] = -100
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    expected_loss = F.cross_entropy(logits.detach().flatten(0, 1), targets.flatten())
    local = logits.detach().chunk(world, -1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, comm)
    loss.backward()
    _close(loss, expected_loss, "vocab-parallel cross-entropy")
    _close(local.grad, logits.grad.chunk(world, -1)[rank], "vocab-parallel cross-entropy dlogits")
    per_token = vocab_parallel_cross_entropy(local.detach(), targets, comm, reduction="none")
    _close(per_token, F.cross_entropy(logits.detach().transpose(1, 2), targets, reduction="none"), "per-token loss")


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_parallel_layers_match_single_device_layers(world):
    run_distributed(_layers, world, world)


# ----------------------------------------------------------------- GPT parity
CASES = {
    "tp2": (2, Layout(tp=2), "gpt2", None),
    "tp2_gqa_rope_swiglu": (2, Layout(tp=2), "llama_gqa", None),
    "tp2_gathered_logits": (2, Layout(tp=2), "gpt2", custom_loss),
    "tp4": (4, Layout(tp=4), "gpt2", None),
    "dp2_tp2": (4, Layout(dp=2, tp=2), "gpt2", None),
    "dp2_tp2_zero1": (4, Layout(dp=2, tp=2, zero=1), "llama_gqa", None),
    "pp2_tp2": (4, Layout(pp=2, tp=2, microbatches=2), "gpt2", None),
    # vocabulary 13 padded to 16: rank 3 holds row 12 and 3 zero rows whose logits are -inf
    "tp4_padded_vocab": (4, Layout(tp=4, tp_pad_vocab=True), "gpt2_vocab13", None),
}


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_gpt_matches_single_device(case):
    world, layout, kind, loss_fn = CASES[case]
    expected = reference_run(kind, loss_fn=loss_fn or F.cross_entropy)
    results = run_distributed(train_tp, world, layout, kind, loss_fn=loss_fn)
    for rank, result in enumerate(results):
        assert_matches_reference(result, expected, f"{case} rank {rank}")
        assert result["losses"] == results[0]["losses"], f"{case}: rank {rank} reports a different loss"
    covered = set().union(*(result["params"].keys() for result in results))
    assert covered == expected.params[-1].keys(), (
        f"{case}: parameters on no rank: {expected.params[-1].keys() - covered}"
    )
    if case == "tp4":
        _check_parameter_memory(results, expected.params[-1], tp=4)


def _check_parameter_memory(results: list[dict], full: dict[str, torch.Tensor], tp: int) -> None:
    """Each rank holds 1/tp of every split layer and all of the replicated parameters."""
    for result in results:
        for name, numel in result["local_numel"].items():
            share = full[name].numel() // tp if name in result["sharded"] else full[name].numel()
            assert numel == share, f"{name}: {numel} elements held, expected {share}"
        split = sum(full[name].numel() for name in result["sharded"])
        held = sum(result["local_numel"].values())
        assert held == sum(t.numel() for t in full.values()) - split + split // tp
    expected_split = {
        name for name in full if name.endswith("weight") and "norm" not in name and "pos_embed" not in name
    }
    assert results[0]["sharded"] == expected_split


# ----------------------------------------------------------------- plans and bad input
def _gpt(**fields) -> GPT:
    defaults = dict(vocab_size=12, seq_len=8, n_layer=2, n_head=4, d_model=16, bias=False)
    return GPT(GPTConfig(**{**defaults, **fields}))


def test_built_in_plan_is_chosen_by_class_and_matches_every_block():
    model = _gpt(mlp="swiglu")
    plan = default_plan(model)
    resolved = resolve_plan(model, plan, tp=2)
    assert plan["blocks.*.mlp.gate"] == "colwise" and plan["lm_head"] == "colwise_vocab"
    assert resolved.styles["blocks.1.attn.o"] == "rowwise" and resolved.styles["blocks.0.attn.q"] == "colwise"
    assert sum(style == "colwise" for style in resolved.styles.values()) == 2 * 5  # q, k, v, gate, up per block


@pytest.mark.parametrize(
    "model, layout, plan, needle",
    [
        (dict(n_head=2), Layout(tp=4), None, "does not divide the 2 attention heads (n_head) of blocks.0.attn"),
        (dict(n_head=4, n_kv_head=1), Layout(tp=2), None, "does not divide the 1 key/value heads"),
        (dict(d_ff=30), Layout(tp=4), None, "does not divide the out_features of blocks.0.mlp.up (30)"),
        (dict(vocab_size=13), Layout(tp=2), None, "does not divide the vocabulary (num_embeddings) of tok_embed (13)"),
        (dict(vocab_size=13), Layout(tp=2), None, "or pad the vocabulary with Layout(tp_pad_vocab=True)"),
        (
            dict(vocab_size=13, d_ff=30),
            Layout(tp=4, tp_pad_vocab=True),
            None,  # only the vocabulary is padded
            "does not divide the out_features of blocks.0.mlp.up (30)",
        ),
        ({}, Layout(tp=2), {"blocks.*.mlp.upp": "colwise"}, "'blocks.*.mlp.upp' names no module of GPT"),
        ({}, Layout(tp=2), {"lm_head": "diagonal"}, "unknown style 'diagonal'"),
        ({}, Layout(tp=2), {"blocks.*.norm1": "colwise"}, "blocks.0.norm1 is a LayerNorm, but style 'colwise'"),
        (dict(seq_len=9), Layout(tp=2, sequence_parallel=True), None, "seq_len=9"),
        (
            {},
            Layout(tp=2, pp=2, sequence_parallel=True, schedule="pipedream"),
            None,
            "sequence_parallel=True with schedule='pipedream'",
        ),
    ],
)
def test_bad_plans_and_layouts_raise_layout_errors_naming_the_fix(model, layout, plan, needle):
    with pytest.raises(LayoutError) as info:
        plan_tensor_parallel(_gpt(**model), layout.resolve(layout.tp * layout.pp), plan)  # dp=-1 -> 1
    assert needle in str(info.value) and "Fix:" in str(info.value), str(info.value)


def test_a_model_without_a_built_in_plan_asks_for_one():
    with pytest.raises(LayoutError, match="no built-in plan for Sequential.*tp_plan="):
        plan_tensor_parallel(nn.Sequential(nn.Linear(4, 4)), Layout(tp=2).resolve(2))
    plan = {"0": "colwise", "2": "rowwise"}
    resolved = plan_tensor_parallel(
        nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)), Layout(tp=2).resolve(2), plan
    )
    assert resolved.styles == {"0": "colwise", "2": "rowwise"}
