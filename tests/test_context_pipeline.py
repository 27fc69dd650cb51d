"""Context parallelism x pipeline parallelism (docs/context_parallel.md, "With pipeline parallelism"): the first
stage shards the tokens over cp, later stages recompute their shard's global positions, the last stage scores
the matching target slice with the cp loss weighting, evaluation gathers the last stage's outputs over cp.

Parity against single-device training of a Llama-style GPT (RoPE, so every stage's attention needs the right
global positions; grouped-query attention; targets partly ignored, more of them late in the sequence, so cp
ranks score different numbers of tokens): losses, step-0 gradients and final parameters after 3 AdamW steps with
global-norm clipping, and the evaluation loss of the trained model, under pp2 x cp2 with ring attention (1F1B,
interleaved with 2 virtual stages, zero-bubble, ZB-V) and Ulysses (GPipe, ZeRO-1); under ``long``, DualPipeV with
both modes and ZB-V with Ulysses and recomputation. The composition matrix adds dp and
tp (tests/composition.py: pp2 x cp2 with dp2 and/or tp2, ZeRO 0 and 1, learned positions).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.composition import (  # the matrix's helpers: ZeRO shards, tp slices
    merge_ranks,
    whole_gradients,
    whole_parameters,
)
from helpers.harness import run_distributed
from helpers.reference import assert_tensors_close, masked_lm_batch, train_reference

import plait
from plait import Layout, LayoutError
from plait.models import GPT, GPTConfig
from plait.models.loss import apply_loss
from plait.parallel.context import plan_context_parallel

STEPS, GLOBAL_BATCH, LENGTH, VOCAB = 3, 4, 16, 32
CLIP = 0.05
"""Below the gradient norm of this model (~0.5): clipping acts at every step, so the global norm must be summed
over both pipeline stages and taken over the cp-sharded gradients correctly."""
# fp32 (why: tests/reference.py, docs/composition.md): cp splits the attention sums into blocks and the loss into
# per-rank means, pp only moves tensors; sums are reordered, a few ulps per reduction.
LOSS_RTOL = 1e-6
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-6}
PARAM_TOL = {"rtol": 1e-5, "atol": 1e-6}
"""After 3 AdamW steps of lr 1e-3 (eps 1e-5, as tests/composition.py: see there): 1/1000 of a step."""

CASES = {
    "pp2-cp2-ring-1f1b": Layout(dp=1, pp=2, cp=2, cp_mode="ring", schedule="1f1b", microbatches=2),
    "pp2-cp2-ulysses-gpipe-zero1": Layout(
        dp=1, pp=2, cp=2, cp_mode="ulysses", schedule="gpipe", microbatches=2, zero=1
    ),
    "pp2v2-cp2-ring-interleaved": Layout(dp=1, pp=2, cp=2, schedule="interleaved", virtual_stages=2, microbatches=2),
    "pp2-cp2-ring-zero-bubble-recompute": Layout(
        dp=1, pp=2, cp=2, schedule="zero-bubble", microbatches=2, recompute="full"
    ),
    "tp2-pp2-sp": Layout(dp=1, tp=2, pp=2, sequence_parallel=True, microbatches=2),
    "dp2-pp2-cp2-ring-zero1": Layout(dp=2, pp=2, cp=2, zero=1, microbatches=2),
    "tp2-pp2-cp2-sp-ring": Layout(dp=1, tp=2, pp=2, cp=2, sequence_parallel=True, microbatches=2),
    "pp2-cp2-ring-zb-v": Layout(dp=1, pp=2, cp=2, schedule="zb-v", microbatches=2),
}
LONG_CASES = {
    "pp2-cp2-ulysses-dualpipev": Layout(dp=1, pp=2, cp=2, cp_mode="ulysses", schedule="dualpipev", microbatches=4),
    "pp2-cp2-ring-dualpipev-zero1": Layout(dp=1, pp=2, cp=2, schedule="dualpipev", microbatches=4, zero=1),
    "pp2-cp2-ulysses-zb-v-recompute": Layout(
        dp=1, pp=2, cp=2, cp_mode="ulysses", schedule="zb-v", microbatches=4, recompute="full"
    ),
}
"""Behind marker ``long``: the V schedules with Ulysses, ZeRO-1 and recomputation. A V (ZB-V, DualPipeV: 2p = 4
stages, rank 0 holds the first and the last, docs/pipeline.md) runs its later stages' RoPE at the cp shard's global
positions on both ranks, and turns at rank 1 without a message."""
ALL_CASES = {**CASES, **LONG_CASES}
"""Interleaved and the V put one of the 4 blocks on each of the 4 stages. "sp": Megatron sequence parallelism, whose
stage boundaries carry [B, T/(cp tp), d] chunks (tp2-pp2-sp: SP x pp without cp)."""


def optimizer(params):  # noqa: ANN001, ANN201 - a factory, as users pass it
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-5, weight_decay=0.1)


def make_model() -> GPT:
    torch.manual_seed(4321)
    config = GPTConfig(
        vocab_size=VOCAB, seq_len=LENGTH, n_layer=4, n_head=4, n_kv_head=2, d_model=16, position="rope", bias=False
    )  # no bias: see docs/testing.md
    return GPT(config)


def global_batch(step: int, length: int = LENGTH) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens with ignored targets (``reference.masked_lm_batch``)."""
    return masked_lm_batch(200 + step, GLOBAL_BATCH, length, VOCAB)


def _train_on_rank(names: list[str]) -> dict:
    results = {}
    for name in names:
        layout = ALL_CASES[name]
        if layout.world_size != torch.distributed.get_world_size():
            continue
        engine = plait.parallelize(make_model(), layout, optimizer=optimizer, max_grad_norm=CLIP)
        grads: list[dict[str, torch.Tensor]] = []  # step 0's synchronised gradients, whole (tp slices gathered)
        engine.before_optimizer_step.append(lambda e: grads.append(whole_gradients(e)) if not grads else None)  # noqa: B023 - called within this iteration
        dp_index, dp = engine.mesh.index("dp"), engine.mesh.size("dp")
        rows = slice(dp_index * GLOBAL_BATCH // dp, (dp_index + 1) * GLOBAL_BATCH // dp)
        losses = [engine.train_step(tuple(t[rows] for t in global_batch(step))).loss for step in range(STEPS)]
        result = {"losses": losses, "grads": grads[0], "params": whole_parameters(engine), "layout": layout}
        # the metric counts the positions of the output it is given: the last stage's, gathered over cp
        evaluation = engine.evaluate(
            [tuple(t[rows] for t in global_batch(STEPS))], metric=lambda output, target: (0, output.shape[1])
        )
        result.update({"eval": evaluation.loss, "eval_tokens": evaluation.total})
        with pytest.raises(LayoutError) as refused:  # 15 tokens: every rank, the later stage's included, refuses
            engine.train_step(global_batch(0, length=LENGTH - 1))
        result["refused"] = str(refused.value)
        results[name] = result
    return results


def _train(cases: dict[str, Layout]) -> dict[str, list[dict]]:
    out = {}
    for world in sorted({layout.world_size for layout in cases.values()}):  # one process start-up per size
        per_rank = run_distributed(_train_on_rank, world, list(cases), timeout=300)
        out.update({name: [result[name] for result in per_rank] for name in per_rank[0]})
    return out


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    return _train(CASES)


@pytest.fixture(scope="module")
def long_runs() -> dict[str, list[dict]]:
    return _train(LONG_CASES)


@pytest.fixture(scope="module")
def reference():
    model = make_model()
    trajectory = train_reference(model, [global_batch(step) for step in range(STEPS)], optimizer, max_grad_norm=CLIP)
    model.load_state_dict(trajectory.params[-1])
    inputs, targets = global_batch(STEPS)
    with torch.no_grad():
        trajectory.evaluation = float(apply_loss(F.cross_entropy, model(inputs), targets))
    return trajectory


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_with_context_parallel_matches_single_device(name, runs, reference):
    _assert_matches(name, runs[name], reference)


@pytest.mark.distributed
@pytest.mark.long
@pytest.mark.parametrize("name", list(LONG_CASES))
def test_pipeline_with_context_parallel_matches_single_device_long(name, long_runs, reference):
    _assert_matches(name, long_runs[name], reference)


def _assert_matches(name: str, per_rank: list[dict], reference) -> None:  # noqa: ANN001 - the fixture's trajectory
    for rank, result in enumerate(per_rank):
        assert result["losses"] == per_rank[0]["losses"], f"{name}: rank {rank} reports another loss"
        assert result["eval"] == per_rank[0]["eval"], f"{name}: rank {rank} reports another evaluation loss"
        # the evaluation gathers the last stage's outputs over cp: the metric sees all 16 positions on each dp rank
        assert result["eval_tokens"] == LENGTH * result["layout"].dp, f"{name}: rank {rank}: {result['eval_tokens']}"
        assert (
            "15 tokens" in result["refused"] and "Fix: use a sequence length that is a multiple of" in result["refused"]
        ), f"{name} rank {rank}: {result['refused']}"  # (SP: "has 15 tokens per sample")
    for step, (actual, wanted) in enumerate(zip(per_rank[0]["losses"], reference.losses)):
        assert abs(actual - wanted) <= LOSS_RTOL * abs(wanted), f"{name} step {step}: loss {actual!r} != {wanted!r}"
    actual, wanted = per_rank[0]["eval"], reference.evaluation
    assert abs(actual - wanted) <= LOSS_RTOL * abs(wanted), f"{name}: evaluation loss {actual!r} != {wanted!r}"
    grads = merge_ranks([r["grads"] for r in per_rank], f"{name} step-0 grads")  # cp replicas bitwise equal
    params = merge_ranks([r["params"] for r in per_rank], f"{name} final params")
    assert params.keys() == reference.params[-1].keys(), sorted(params.keys() ^ reference.params[-1].keys())
    assert_tensors_close(grads, reference.grads[0], f"{name} step 0 grad", GRAD_TOL)
    assert_tensors_close(params, reference.params[-1], f"{name} final param", PARAM_TOL)


def test_context_parallel_with_pipedream_or_hugging_face_stages_is_refused_with_the_fix():
    with pytest.raises(LayoutError, match=r"schedule='pipedream' is not implemented.*Fix: use a synchronous"):
        plan_context_parallel(make_model(), Layout(dp=1, pp=2, cp=2, schedule="pipedream"))
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=LENGTH,
    )
    llama = transformers.LlamaForCausalLM(config)
    with pytest.raises(LayoutError, match=r"not for Hugging Face models.*Fix: use pp=1 with cp > 1"):
        plan_context_parallel(llama, Layout(dp=1, pp=2, cp=2))
    assert plan_context_parallel(make_model(), Layout(dp=1, pp=2, cp=2)).size == 2


def test_the_cases_hold_every_schedule_family_both_modes_and_every_partner_axis():
    """1F1B, GPipe, interleaved (virtual stages), zero-bubble (split backward) and ZB-V (a V) in the default
    suite, DualPipeV under ``long``; ring and Ulysses; dp (ZeRO-1) and tp (with Megatron-SP) next to pp x cp; at
    most 8 ranks."""
    assert {layout.schedule for layout in CASES.values()} == {"1f1b", "gpipe", "interleaved", "zero-bubble", "zb-v"}
    assert {layout.schedule for layout in LONG_CASES.values()} == {"zb-v", "dualpipev"}
    assert {layout.cp_mode for layout in CASES.values() if layout.cp > 1} == {"ring", "ulysses"}
    assert {layout.cp_mode for layout in LONG_CASES.values() if layout.schedule == "dualpipev"} == {"ring", "ulysses"}
    assert any(layout.dp > 1 and layout.cp > 1 and layout.zero == 1 for layout in CASES.values())
    assert any(layout.tp > 1 and layout.cp > 1 and layout.sequence_parallel for layout in CASES.values())
    assert all(layout.pp == 2 and layout.world_size <= 8 for layout in ALL_CASES.values())
