"""Deliberately broken plait, for ``plait certify`` to catch and locate (tests/test_certify.py).

Each is a model factory (``--model helpers.certify_mutants:NAME``) that breaks one piece of plait in the process
that calls it (every rank builds its model through it, the one-process reference too, where the broken piece does
nothing) and returns the tiny GPT (``tiny_gpt``, whose data rows score uneven numbers of tokens):

- ``cp_gradients_summed``: gradients summed over the context-parallel replicas instead of averaged (a missing
  1/cp scale on one axis) -> the gradient synchronisation of the first parameter backward reaches;
- ``micro_batch_mean``: each micro-batch normalised by its own scored tokens (a mean of micro-batch means, not the
  global token mean) -> the gradient of the model's output (the loss's backward);
- ``tp_without_all_reduce``: a row-parallel linear layer that never all-reduces its partial sums -> that layer's
  output, the first row-parallel layer in forward order (``blocks.0.attn.o``);
- ``muon_stepping_slices``: with ``train.optimizer = "muon"`` under tp, Muon orthogonalises each rank's slice of a
  matrix instead of the whole matrix (what plait did before whole-tensor optimizers) -> forward, backward and the
  gradients agree; the first parameter whose value after the optimizer step leaves the budget is the first
  tp-sliced matrix Muon steps (``blocks.0.attn.q.weight``).
"""

from __future__ import annotations

from typing import Any

import torch

from plait.models import GPT, GPTConfig


def uneven_rows() -> None:
    """Make the addition task's rows score uneven numbers of tokens (``reference.uneven_mask``, by sample index),
    as real batches do: a batch whose rows all score alike hides a mean of micro-batch means."""
    from helpers.reference import uneven_mask

    from plait.data.synthetic import AdditionTask

    batch = AdditionTask.batch
    if getattr(batch, "uneven", False):
        return

    def uneven(self: AdditionTask, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = batch(self, indices)
        return inputs, uneven_mask(targets, [int(i) for i in indices])

    uneven.uneven = True  # type: ignore[attr-defined]
    AdditionTask.batch = uneven  # type: ignore[method-assign]


def tiny_model() -> GPT:
    """The certify tests' model alone: the addition task's vocabulary (12) and sequence (8), 2 blocks, no biases
    (in the test process itself: it patches nothing)."""
    return GPT(GPTConfig(vocab_size=12, seq_len=8, n_layer=2, n_head=4, d_model=16, bias=False))


def tiny_gpt() -> GPT:
    """``tiny_model`` with its data's rows uneven (``uneven_rows``): a factory for certify's rank processes only,
    since it patches the addition task for the rest of the process."""
    uneven_rows()
    return tiny_model()


def cp_gradients_summed() -> GPT:
    from plait.parallel.ddp import DistributedDataParallel

    finish = DistributedDataParallel.finish_backward

    def summing(self: DistributedDataParallel) -> None:
        finish(self)
        torch._foreach_mul_([g for g in self.owned_grads() if g is not None], float(self.comm.size("cp")))

    DistributedDataParallel.finish_backward = summing  # type: ignore[method-assign]
    return tiny_gpt()


def micro_batch_mean() -> GPT:
    from plait.parallel import loss_normalization as normalization

    def to_backward(self: normalization.TokenMeanStep, k: int, value: torch.Tensor) -> torch.Tensor:
        own = self.counts[k].clamp_min(1).to(value.dtype) * self.window
        return normalization._Scale.apply(value, self.replicas / own)

    normalization.TokenMeanStep.to_backward = to_backward  # type: ignore[method-assign]
    return tiny_gpt()


def tp_without_all_reduce() -> GPT:
    from plait.parallel.tensor import layers

    def forward(self: layers.RowParallelLinear, x: torch.Tensor) -> torch.Tensor:
        y = layers._matmul(x, self.weight, None, self.transposed)
        return y + self.bias if self.bias is not None else y

    layers.RowParallelLinear.forward = forward  # type: ignore[method-assign]
    return tiny_gpt()


def muon_stepping_slices() -> GPT:
    from plait.parallel.whole_tensor import WholeSlot

    WholeSlot.sliced = property(lambda _: False)  # type: ignore[method-assign,assignment]
    return tiny_gpt()


def tiny_matrices_gpt() -> GPT:
    """``tiny_gpt`` with every parameter that is not a matrix (the norms' weights) frozen: a plain Muon factory
    (``plain_muon``) takes every trainable parameter."""
    model = tiny_gpt()
    for param in model.parameters():
        param.requires_grad_(param.dim() == 2)
    return model


def plain_muon(params: Any) -> torch.optim.Optimizer:
    """A user's plain optimizer factory (``--optimizer helpers.certify_mutants:plain_muon``): torch.optim.Muon on
    whatever it is given, its steps RMS-matched to AdamW's."""
    return torch.optim.Muon(params, lr=0.02, weight_decay=0.01, adjust_lr_fn="match_rms_adamw")


def tiny_moe() -> GPT:
    """A Mixture-of-Experts GPT (4 routed experts, top-2, a shared expert, the balance loss), RoPE and RMSNorm."""
    uneven_rows()
    config = GPTConfig(
        vocab_size=12,
        seq_len=8,
        n_layer=2,
        n_head=4,
        d_model=16,
        bias=False,
        position="rope",
        norm="rmsnorm",
        n_experts=4,
        n_shared_experts=1,
    )
    return GPT(config)


# ----------------------------------------------------------------- a wrong rotary offset under cp (certhf)
def tiny_rope_gpt() -> GPT:
    """``tiny_gpt`` with rotary position embeddings (RoPE, grouped-query attention): positions enter every
    attention layer's q and k, so each cp rank must rotate its tokens by their global positions."""
    uneven_rows()
    config = GPTConfig(
        vocab_size=12, seq_len=8, n_layer=2, n_head=4, n_kv_head=2, d_model=16, bias=False, position="rope"
    )
    return GPT(config)


def tiny_hf_llama() -> torch.nn.Module:
    """The HF parity tests' tiny Llama (``helpers.hf.make_model``: RoPE, 4 heads over 2 key/value heads, eager
    attention) at d 16 for the addition task's vocabulary (12) and sequence (8), with ``tiny_gpt``'s uneven rows."""
    from helpers.hf import make_model

    uneven_rows()
    return make_model("llama", hidden_size=16, intermediate_size=32, vocab_size=12, max_position_embeddings=8)


def _rotary_offset_dropped() -> None:
    """Every cp rank's positions from 0 (``arange(T / cp)``) instead of the global positions of its tokens (with
    the zigzag layout, of its two chunks): the tokens each rank holds, and the attention's causal order over
    them, stay right; only the rotary embedding (plait's GPT's ``positions``, a transformers model's
    ``position_ids``) sees the wrong places. Packed documents' positions pass unchanged."""
    from plait.parallel.context import hf, hooks

    def plait_call(self, local_tokens, index, rest, kwargs):  # noqa: ANN001, ANN202
        given = rest[0] if rest else kwargs.get("positions")
        return call(self, local_tokens, index if given is not None else torch.arange(len(index)), rest, kwargs)

    def hf_call(self, local_tokens, index, rest, kwargs):  # noqa: ANN001, ANN202
        given = kwargs.get("position_ids")
        return hf_original(self, local_tokens, index if given is not None else torch.arange(len(index)), rest, kwargs)

    call, hf_original = hooks.ContextParallelModel.local_call, hf.HuggingFaceContextParallelModel.local_call
    hooks.ContextParallelModel.local_call = plait_call  # type: ignore[method-assign]
    hf.HuggingFaceContextParallelModel.local_call = hf_call  # type: ignore[method-assign]


def cp_rotary_offset_dropped() -> GPT:
    """``tiny_rope_gpt`` whose cp ranks rotate from position 0 (``_rotary_offset_dropped``) -> the attention
    core of the first block (the rotation happens in its q and k, which are right until rotated)."""
    _rotary_offset_dropped()
    return tiny_rope_gpt()


def hf_cp_rotary_offset_dropped() -> torch.nn.Module:
    """``tiny_hf_llama`` whose cp ranks pass ``position_ids`` from 0 -> the model's rotary module
    (``model.rotary_emb``: its cos / sin of the wrong positions)."""
    _rotary_offset_dropped()
    return tiny_hf_llama()
