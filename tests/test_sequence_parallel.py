"""Megatron sequence parallelism: the SP variants of the parallel layers against single-device layers; the GPT
against single-device training (tp=2; dp=2 x tp=2 x ZeRO-2 with GQA/RoPE/SwiGLU); tensor-parallel bytes per
step and per layer, 1D and SP, against the ring theory; activation bytes per rank, single device / 1D / SP."""

import pytest
import torch
from helpers.harness import run_distributed
from helpers.tp import (
    CLIP,
    GLOBAL_BATCH,
    LAYER_TOL,
    assert_matches_reference,
    make_model,
    optimizer,
    reference_run,
    train_tp,
)
from torch import nn

import plait
from plait import Layout
from plait.comm import Comm
from plait.data import ShardedBatches
from plait.mesh import Mesh
from plait.models.loss import apply_loss
from plait.parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from plait.parallel.tensor.sequence import saved_activation_bytes


def _layers(world: int) -> None:
    comm = Comm(Mesh.build(Layout(tp=world, sequence_parallel=True)))
    rank = comm.mesh.index("tp")
    chunk = lambda t, dim: t.detach().chunk(world, dim)[rank]  # noqa: E731
    gather = lambda t, dim: comm.all_gather(t.detach().contiguous(), "tp", dim=dim)  # noqa: E731
    close = lambda a, e, what: torch.testing.assert_close(a, e, **LAYER_TOL, msg=lambda m: f"{what}: {m}")  # noqa: E731
    torch.manual_seed(0)

    # column: this rank's sequence chunk in, all-gathered (fwd) / dX reduce-scattered (bwd); output features split
    linear = nn.Linear(8, 12)
    x = torch.randn(2, 4, 8, requires_grad=True)
    upstream = torch.randn(2, 4, 12)
    (linear(x) * upstream).sum().backward()
    column = ColumnParallelLinear.from_linear(linear, comm, input_mode="sequence")
    x_local = chunk(x, 1).clone().requires_grad_()
    y = column(x_local)
    (y * chunk(upstream, -1)).sum().backward()
    close(y, chunk(linear(x), -1), "SP column output")
    close(x_local.grad, chunk(x.grad, 1), "SP column input grad")
    close(gather(column.weight.grad, 0), linear.weight.grad, "SP column weight grad")

    # row: partial products reduce-scattered along the sequence; the bias, added on the chunk, gets a partial grad
    linear = nn.Linear(12, 8)
    x = torch.randn(2, 4, 12, requires_grad=True)
    upstream = torch.randn(2, 4, 8)
    (linear(x) * upstream).sum().backward()
    row = RowParallelLinear.from_linear(linear, comm, sequence_parallel=True)
    x_local = chunk(x, -1).clone().requires_grad_()
    y = row(x_local)
    (y * chunk(upstream, 1)).sum().backward()
    close(y, chunk(linear(x), 1), "SP row output")
    close(x_local.grad, chunk(x.grad, -1), "SP row input grad")
    close(gather(row.weight.grad, 1), linear.weight.grad, "SP row weight grad")
    close(comm.all_reduce(row.bias.grad.clone(), "tp"), linear.bias.grad, "SP row bias grad summed over tp")

    # embedding: partial lookups reduce-scattered along the sequence
    embedding = nn.Embedding(12, 8)
    ids = torch.tensor([[0, 5, 11, 3], [2, 9, 4, 10]])
    upstream = torch.randn(2, 4, 8)
    (embedding(ids) * upstream).sum().backward()
    vocab = VocabParallelEmbedding.from_embedding(embedding, comm, sequence_parallel=True)
    out = vocab(ids)
    (out * chunk(upstream, 1)).sum().backward()
    close(out, chunk(embedding(ids), 1), "SP embedding output")
    close(gather(vocab.weight.grad, 0), embedding.weight.grad, "SP embedding weight grad")


@pytest.mark.distributed
def test_sequence_parallel_layers_match_single_device_layers():
    run_distributed(_layers, 2, 2)


CASES = {
    "tp2_sp": (2, Layout(tp=2, sequence_parallel=True), "gpt2"),
    "dp2_tp2_sp_zero2": (4, Layout(dp=2, tp=2, zero=2, sequence_parallel=True), "llama_gqa"),
}


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_gpt_with_sequence_parallelism_matches_single_device(case):
    world, layout, kind = CASES[case]
    expected = reference_run(kind)
    for rank, result in enumerate(run_distributed(train_tp, world, layout, kind)):
        assert_matches_reference(result, expected, f"{case} rank {rank}")


# ----------------------------------------------------------------- bytes and activations
TP = 2
LAYERS = (2, 3)


def _measure() -> dict:
    """For 1D and SP at tp=2 and for 2 and 3 layers: one training step's tp traffic, and the activation bytes
    autograd saves in one forward on this rank."""
    out = {}
    for sp in (False, True):
        for n_layer in LAYERS:
            model, task = make_model("gpt2", n_layer=n_layer)
            engine = plait.parallelize(
                model, Layout(tp=TP, sequence_parallel=sp), optimizer=optimizer, max_grad_norm=CLIP
            )
            inputs, targets = ShardedBatches(task, GLOBAL_BATCH).global_batch_at(0)
            forward = lambda: apply_loss(engine.loss_fn, engine.model(inputs), targets)  # noqa: B023, E731
            saved = saved_activation_bytes(engine.model, forward)
            stats = engine.train_step((inputs, targets))
            out[sp, n_layer] = {"wire": stats.comm.wire("tp"), "ops": stats.comm.to_dict(), "saved": saved}
    return out


@pytest.fixture(scope="module")
def measured() -> dict:
    return run_distributed(_measure, TP)[0]


def _theory(sp: bool, n_layer: int) -> tuple[float, float]:
    """Ring wire bytes per rank per step over tp, and the part per transformer layer (fp32, B=8, T=8, d=16)."""
    model, task = make_model("gpt2", n_layer=n_layer)
    batch, seq, d = GLOBAL_BATCH, task.seq_len, model.config.d_model
    act = batch * seq * d * 4  # one [B, T, d] fp32 activation
    all_reduce, half = 2 * (TP - 1) / TP, (TP - 1) / TP  # all-gather and reduce-scatter each move (t-1)/t x S
    tokens = batch * seq
    loss = all_reduce * (tokens * 4) + all_reduce * (2 * tokens * 4)  # max, then (sum exp, target logit)
    clip = all_reduce * 8  # the float64 squared gradient norm
    if not sp:
        per_layer = 4 * all_reduce * act  # g after attn.o and mlp.down (fwd), f at attn and mlp inputs (bwd)
        return n_layer * per_layer + 2 * all_reduce * act + loss + clip, per_layer  # + embedding fwd, head bwd
    norm_grads = 2 * d * 4  # norm1 and norm2 weights: their tp-partial gradients are summed
    per_layer = 8 * half * act + all_reduce * norm_grads  # 2 all-gathers + 2 reduce-scatters, fwd and bwd
    other_grads = (seq * d + d) * 4  # position embedding and final norm
    edges = 4 * half * act  # embedding reduce-scatter / all-gather, head all-gather / reduce-scatter
    return n_layer * per_layer + edges + loss + clip + all_reduce * other_grads, per_layer


@pytest.mark.distributed
@pytest.mark.parametrize("sp", [False, True], ids=["1d", "sp"])
def test_tensor_parallel_bytes_per_step_and_per_layer_equal_the_theory(measured, sp):
    for n_layer in LAYERS:
        total, _ = _theory(sp, n_layer)
        wire = measured[sp, n_layer]["wire"]
        assert wire == pytest.approx(total, rel=1e-12), f"sp={sp} L={n_layer}: measured/theory {wire / total:.6f}"
    per_layer = measured[sp, 3]["wire"] - measured[sp, 2]["wire"]
    theory = _theory(sp, 3)[1]
    assert per_layer == pytest.approx(theory, rel=1e-12), f"per layer: measured/theory {per_layer / theory:.6f}"
    if sp:  # an all-reduce is a reduce-scatter plus an all-gather: SP moves the same activation bytes as 1D
        assert theory - 2 * (TP - 1) / TP * (2 * 16 * 4) == pytest.approx(_theory(False, 3)[1])


@pytest.mark.distributed
def test_sequence_parallelism_splits_the_activations_of_the_norm_regions(measured):
    """Per layer, SP saves (1 - 1/t) of what the norm regions keep replicated under 1D: the two LayerNorm inputs
    [B, T, d] and their mean and rstd [B, T] each (fp32). The gathered inputs of q/k/v and of the MLP stay whole
    (saved once, not re-gathered in backward; docs/tensor_parallel.md)."""
    model, task = make_model("gpt2", n_layer=2)
    inputs, targets = ShardedBatches(task, GLOBAL_BATCH).global_batch_at(0)
    single = saved_activation_bytes(
        model, lambda: apply_loss(torch.nn.functional.cross_entropy, model(inputs), targets)
    )
    one_d, sp = measured[False, 2]["saved"], measured[True, 2]["saved"]
    assert sp < one_d < single, (single, one_d, sp)
    per_layer_1d = measured[False, 3]["saved"] - one_d
    per_layer_sp = measured[True, 3]["saved"] - sp
    tokens, d = GLOBAL_BATCH * task.seq_len, model.config.d_model
    norm_regions = 2 * (tokens * d + 2 * tokens) * 4
    assert per_layer_1d - per_layer_sp == norm_regions * (1 - 1 / TP), (per_layer_1d, per_layer_sp)
