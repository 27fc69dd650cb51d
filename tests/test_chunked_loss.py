"""Chunked cross-entropy (issue 27): the LM head and the loss over chunks of tokens equal the whole loss (values,
gradients, evaluation) for plait's GPT and Hugging Face models, under tp (vocab-parallel, with and without
Megatron-SP), pp (the last stage), cp and ZeRO-2 (ZeRO-3 is refused up front); the whole logits never exist, forward or backward (every tensor
an operator produces is watched); what autograd keeps equals ``estimate_memory`` with ``loss_chunk`` to the byte
and is below the whole loss's by the formula's 4 s b V + 4 bytes.
"""

from __future__ import annotations

import pytest
import torch
from helpers.composition import check_in_one_process, whole_gradients
from helpers.harness import run_distributed
from torch.utils._python_dispatch import TorchDispatchMode

import plait
from plait import Layout, estimate_memory
from plait.models import GPT, GPTConfig, lm_loss
from plait.models.loss import ChunkedCrossEntropy, HeadChunks
from plait.observe.memory import SavedActivations
from plait.planner.activations import Forward, loss_buffer_bytes, plait_head_bytes

VOCAB, SEQ, ROWS = 96, 16, 4
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-6}


def config(**overrides: object) -> GPTConfig:
    fields: dict = dict(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=4, d_model=16)
    return GPTConfig(**{**fields, **overrides})


def batch(step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3 + step)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=generator)
    targets = tokens[:, 1:].clone()
    targets[0, :6] = -100  # rows score uneven numbers of tokens
    targets[2, 10:] = -100
    return tokens[:, :-1].contiguous(), targets


def optimizer(params):  # noqa: ANN001, ANN201 - a factory
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-5)


def run(model_config: GPTConfig, loss, layout: Layout | None = None, steps: int = 2) -> dict:  # noqa: ANN001
    """Losses, step-0 gradients (whole tensors), the evaluation loss after training, and what autograd saved in
    the last step (this rank)."""
    torch.manual_seed(0)
    engine = plait.parallelize(GPT(model_config), layout or Layout(), optimizer=optimizer, loss_fn=loss)
    grads: list[dict] = []
    engine.before_optimizer_step.append(lambda e: grads.append(whole_gradients(e)) if not grads else None)
    dp_rank, dp = engine.mesh.index("dp"), engine.mesh.size("dp")
    share = slice(dp_rank * ROWS // dp, (dp_rank + 1) * ROWS // dp)
    losses = []
    for step in range(steps):
        tokens, targets = batch(step)
        with SavedActivations(exclude=engine.model.parameters()) as saved:
            losses.append(engine.train_step((tokens[share], targets[share])).loss)
    tokens, targets = batch(steps)
    evaluation = engine.evaluate([(tokens[share], targets[share])]).loss
    return {"losses": losses, "grads": grads[0], "eval": evaluation, "saved": saved.bytes}


def assert_same(chunked: dict, whole: dict, what: str) -> None:
    torch.testing.assert_close(torch.tensor(chunked["losses"]), torch.tensor(whole["losses"]), rtol=1e-6, atol=0)
    assert chunked["eval"] == pytest.approx(whole["eval"], rel=1e-6), what
    assert chunked["grads"].keys() == whole["grads"].keys(), what
    for name, grad in chunked["grads"].items():
        torch.testing.assert_close(grad, whole["grads"][name], **GRAD_TOL, msg=lambda m, n=name: f"{what} {n}: {m}")


@pytest.mark.parametrize("chunk", [1, 7, 16, 64, 1000])
def test_chunked_equals_the_whole_loss_on_one_device(chunk: int) -> None:
    """Chunks of 1 token, uneven chunks (7 does not divide 64 tokens), one row, the whole batch and more."""
    whole = run(config(), lm_loss)
    assert_same(run(config(), ChunkedCrossEntropy(chunk)), whole, f"chunk {chunk}")


def test_chunked_equals_the_whole_loss_llama_style_with_micro_batches() -> None:
    shape = config(position="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_head=2)
    layout = Layout(microbatches=2)
    assert_same(run(shape, ChunkedCrossEntropy(24), layout), run(shape, lm_loss, layout), "llama-style mb2")


class LargestOutput(TorchDispatchMode):
    """The most elements of a tensor of the vocabulary's width (logits, their gradient, a softmax) that any operator
    produced while active; the head's weight seen transposed ([d, V]: its gradient's matmul) is not one."""

    def __init__(self) -> None:
        super().__init__()
        self.largest_vocab_wide = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.dim() and tensor.shape[-1] == VOCAB:
                if tuple(tensor.shape) == (16, VOCAB):  # d_model x V: the weight, not logits
                    continue
                self.largest_vocab_wide = max(self.largest_vocab_wide, tensor.numel())
        return out


@pytest.mark.parametrize("chunk", [8, 20])
def test_the_whole_logits_never_exist_forward_or_backward(chunk: int) -> None:
    """Every tensor an operator produces during a training step (forward, loss, backward) is at most one chunk of
    logits wide, where the whole loss makes [64, V] logits (and their gradient)."""
    tokens, targets = batch()
    for loss, bound in ((lm_loss, ROWS * SEQ * VOCAB), (ChunkedCrossEntropy(chunk), chunk * VOCAB)):
        torch.manual_seed(0)
        engine = plait.parallelize(GPT(config()), Layout(), optimizer=optimizer, loss_fn=loss)
        with LargestOutput() as watched:
            engine.train_step((tokens, targets))
        assert watched.largest_vocab_wide == bound, (loss, watched.largest_vocab_wide)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_saved_activations_equal_the_estimate_to_the_byte(precision: str) -> None:
    """What one training step keeps for backward (SavedActivations) equals ``estimate_memory(..., loss_chunk)``,
    and chunking saves exactly the log-softmax, the head's weight copy under autocast and the loss's scalar."""
    measured = {}
    for chunk in (0, 24):
        loss = ChunkedCrossEntropy(chunk) if chunk else lm_loss
        layout = Layout(precision=precision)
        result = run(config(), loss, layout)
        shape = {"batch": ROWS, "loss_chunk": chunk}
        estimate = estimate_memory(config(), layout.resolve(1), "adamw", activations=shape, device="cpu")
        assert result["saved"] == estimate.activations, (precision, chunk, result["saved"], estimate.activations)
        measured[chunk] = result["saved"]
    e = 2 if precision == "bf16" else 4
    hidden_copy = (4 - e) * ROWS * SEQ * 16 if precision == "bf16" else 0  # the chunks keep the fp32 head input
    weight_copy = e * 16 * VOCAB if precision == "bf16" else 0
    assert measured[0] - measured[24] == 4 * ROWS * SEQ * VOCAB + 4 + weight_copy - hidden_copy


def test_the_planner_terms() -> None:
    spec = GPT(config()).spec()
    whole, chunked = Forward(batch=ROWS, seq=SEQ), Forward(batch=ROWS, seq=SEQ, loss_chunk=10)
    assert plait_head_bytes(spec, whole) - plait_head_bytes(spec, chunked) == 4 * ROWS * SEQ * VOCAB + 4
    assert loss_buffer_bytes(spec, whole) == 8 * ROWS * SEQ * VOCAB
    assert loss_buffer_bytes(spec, chunked) == 12 * 10 * VOCAB
    assert loss_buffer_bytes(spec, Forward(batch=1, seq=4, loss_chunk=10)) == 12 * 4 * VOCAB  # a chunk <= the tokens
    big = GPTConfig(vocab_size=128_256, seq_len=8192, n_layer=2, n_head=8, d_model=512)
    plain = estimate_memory(big, Layout(), activations={"batch": 1}, device="cpu")
    lean = estimate_memory(big, Layout(), activations={"batch": 1, "loss_chunk": 1024}, device="cpu")
    assert plain.peak - lean.peak > 4 * 8192 * 128_256  # the fp32 logits of a 128k vocabulary dominate
    with pytest.raises(ValueError, match="loss_chunk"):
        Forward(batch=1, seq=4, loss_chunk=-1)


def test_hugging_face_heads_chunk_too() -> None:
    """A transformers GPT-2 (LM head tied to the embedding) and Llama: chunked equals whole."""
    pytest.importorskip("transformers")
    from helpers.hf import global_batch
    from helpers.hf import make_model as hf_model

    for kind in ("gpt2", "llama"):
        results = []
        for loss in (lm_loss, ChunkedCrossEntropy(20)):
            engine = plait.parallelize(hf_model(kind), Layout(), optimizer=optimizer, loss_fn=loss)
            grads: list[dict] = []
            engine.before_optimizer_step.append(lambda e, g=grads: g.append(whole_gradients(e)) if not g else None)
            losses = [engine.train_step(global_batch(step)).loss for step in range(2)]
            results.append({"losses": losses, "grads": grads[0], "eval": engine.evaluate([global_batch(2)]).loss})
            assert isinstance(engine.loss_fn, HeadChunks) == (loss is not lm_loss)
        assert_same(results[1], results[0], kind)


def test_bad_chunks_and_heads_are_refused() -> None:
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="chunk"):
            ChunkedCrossEntropy(bad)  # type: ignore[arg-type]

    class NoHead(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Linear(4, 4)
            self.lm_head = torch.nn.Sequential(torch.nn.Linear(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lm_head(self.body(x))

    with pytest.raises(ValueError, match="lm_head is a Sequential"):
        plait.parallelize(NoHead(), Layout(), optimizer=optimizer, loss_fn=ChunkedCrossEntropy(4))
    with pytest.raises(plait.LayoutError, match="ZeRO-3 has sharded it again. Fix: zero=1 or zero=2"):
        check_in_one_process(2, Layout(dp=2, zero=3), loss_fn=ChunkedCrossEntropy(4))
    with pytest.raises(plait.LayoutError, match="tp_mode='2d' cuts the head's batch as well. Fix: tp_mode='1d'"):
        check_in_one_process(4, Layout(tp=4, tp_mode="2d"), loss_fn=ChunkedCrossEntropy(4))
    check_in_one_process(2, Layout(tp=2), loss_fn=ChunkedCrossEntropy(4))  # 1D tp: accepted


# ----------------------------------------------------------------- layouts: tp (vocab-parallel), pp, cp, ZeRO
LAYOUTS = [
    Layout(tp=2),
    Layout(tp=2, sequence_parallel=True),
    Layout(pp=2, microbatches=2, schedule="1f1b"),
    Layout(cp=2),
    Layout(dp=2, zero=2),
]


def _chunked_and_whole(layouts: list[Layout]) -> list[tuple[dict, dict]]:
    return [(run(config(), ChunkedCrossEntropy(12), layout), run(config(), lm_loss, layout)) for layout in layouts]


@pytest.mark.distributed
def test_chunked_equals_whole_under_tp_pp_cp_and_zero() -> None:
    per_rank = run_distributed(_chunked_and_whole, 2, LAYOUTS, timeout=300)
    for index, layout in enumerate(LAYOUTS):
        for rank, results in enumerate(per_rank):
            chunked, whole = results[index]
            assert_same(chunked, whole, f"{layout.short()} rank {rank}")
            if layout.pp == 1 or rank == 1:  # the rank holding the head keeps less
                assert chunked["saved"] < whole["saved"], (layout.short(), rank)
