"""Context parallelism of Hugging Face transformers models (plait.parallel.context.hf): tiny Llama (GQA, RoPE)
and GPT-2 (learned positions, tied embeddings) with random weights, trained with cp=2 (ring and Ulysses),
dp=2 x cp=2 and tp=2 x cp=2 against single-device training (the machinery and tolerances of tests/test_hf.py:
eval logits gathered over cp, 5 losses, step-1 gradients, final parameters); and clear errors for what cannot
work (padding masks, dropout, Ulysses heads, cross-attention); the registered attention function against
transformers' eager attention on one rank."""

from __future__ import annotations

import pytest
import torch
from helpers.harness import run_distributed
from helpers.hf import check, check_split, global_batch, make_model, optimizer, run_cases
from transformers import GPT2Config, GPT2LMHeadModel

import plait
from plait import Layout, LayoutError
from plait.comm import Comm
from plait.mesh import Mesh
from plait.parallel.context import (
    RingAttention,
    SequenceSharding,
    UlyssesAttention,
    plan_context_parallel,
)
from plait.parallel.context.hf import ATTENTION_NAME, context_parallel_attention

CORES = {"ring": RingAttention, "ulysses": UlyssesAttention}
TWO_RANKS = [
    ("llama", Layout(dp=1, cp=2, cp_mode="ring")),
    ("llama", Layout(dp=1, cp=2, cp_mode="ulysses")),
    ("gpt2", Layout(dp=1, cp=2, cp_mode="ring")),
    ("gpt2", Layout(dp=1, cp=2, cp_mode="ulysses")),
]
FOUR_RANKS = [
    ("llama", Layout(dp=2, cp=2, cp_mode="ring")),
    ("gpt2", Layout(dp=2, cp=2, cp_mode="ulysses")),
    ("llama", Layout(dp=1, tp=2, cp=2, cp_mode="ring")),
    ("gpt2", Layout(dp=1, tp=2, cp=2, cp_mode="ulysses")),
]


@pytest.mark.distributed
@pytest.mark.parametrize("world, cases", [(2, TWO_RANKS), (4, FOUR_RANKS)], ids=["2ranks", "4ranks"])
def test_hf_models_with_context_parallel_match_single_device(world, cases):
    per_rank = run_distributed(_run_cases_and_refuse_padding, world, cases, timeout=300)
    for _, message in per_rank:  # an all-ones mask is accepted, a padding mask refused before any collective
        assert "padding masks" in message and "Fix: pack the sequences" in message, message
    per_rank = [results for results, _ in per_rank]
    for index, (kind, layout) in enumerate(cases):
        what = f"{kind} dp={layout.dp} tp={layout.tp} cp={layout.cp} {layout.cp_mode}"
        results = [rank_results[index] for rank_results in per_rank]
        for rank, result in enumerate(results):
            check(result, kind, f"{what} rank {rank}")
            assert result["losses"] == results[0]["losses"], f"{what}: rank {rank} reports a different loss"
        check_split(results, kind, layout.tp, what)


def _run_cases_and_refuse_padding(cases: list[tuple[str, Layout]]) -> tuple[list[dict], str]:
    """test_hf's ``run_cases``, then a padded batch through a cp model: the LayoutError's message."""
    results = run_cases(cases)
    engine = plait.parallelize(make_model("llama"), Layout(cp=2), optimizer=optimizer)
    assert engine.model.config._attn_implementation == ATTENTION_NAME
    inputs = global_batch(0)[0]
    mask = torch.ones_like(inputs)
    engine.model(inputs, attention_mask=mask)  # an all-ones mask is no mask: accepted
    with pytest.raises(LayoutError) as info:  # raised in the forward pre-hook, before any collective
        engine.model(inputs, attention_mask=mask.index_fill(1, torch.tensor([0]), 0))
    return results, str(info.value)


def test_what_cannot_run_is_refused_with_the_fix():
    with pytest.raises(LayoutError, match=r"dropout=0.1 .*Fix: set the model's dropout to 0"):
        plan_context_parallel(make_model("gpt2", attn_pdrop=0.1), Layout(cp=2).resolve(2))
    with pytest.raises(LayoutError, match=r"model.layers.0.self_attn has 4 query and 2 key/value heads.*tp\*cp = 1\*4"):
        plan_context_parallel(make_model("llama"), Layout(cp=4, cp_mode="ulysses").resolve(4))
    torch.manual_seed(0)
    cross = GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16, add_cross_attention=True)
    )
    with pytest.raises(LayoutError, match=r"cross-attention .*Fix: a decoder-only model"):
        plan_context_parallel(cross, Layout(cp=2).resolve(2))
    plan = plan_context_parallel(make_model("llama"), Layout(cp=2, cp_mode="ulysses").resolve(2))
    assert plan.hugging_face and plan.attention_paths == ("model.layers.0.self_attn", "model.layers.1.self_attn")
    assert plan.kv_groups == (2, 2)


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_attention_function_matches_transformers_eager_attention(mode):
    """The registered function on one rank (cp=1: the kernels' math, no communication) against transformers' own
    eager attention: the layer's scaling (0.3, not 1/sqrt(D), as GPT-2's scale_attn_by_inverse_layer_idx gives),
    unrepeated GQA key/value heads, the causal mask, and the [B, T, H, D] output layout; outputs and gradients."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    module = make_model("llama").model.layers[0].self_attn  # 4 query heads share 2 key/value heads
    module.plait_context_core = CORES[mode](Comm(Mesh.build(Layout(dp=1, cp=1))), SequenceSharding(mode, 1, 0))
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 8, 8, generator=generator, requires_grad=True)
    k, v = (torch.randn(2, 2, 8, 8, generator=generator, requires_grad=True) for _ in range(2))
    causal = torch.full((8, 8), float("-inf")).triu(1)
    expected, _ = eager_attention_forward(module, q, k, v, causal, scaling=0.3)
    got, weights = context_parallel_attention(module, q, k, v, None, scaling=0.3)
    assert weights is None and got.shape == expected.shape == (2, 8, 4, 8)
    expected_grads = torch.autograd.grad((expected * expected.detach()).sum(), (q, k, v))
    got_grads = torch.autograd.grad((got * expected.detach()).sum(), (q, k, v))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)  # fp32: blockwise / fused sums reordered
    for name, a, e in zip("qkv", got_grads, expected_grads):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=2e-6, msg=lambda m, name=name: f"d{name}: {m}")
