"""Hugging Face transformers models under plait: GPT-2 (Conv1D, fused q/k/v, tied embeddings) and Llama (GQA,
RoPE, SwiGLU), built from tiny configs with random weights (nothing is downloaded), trained against single-device
training: DDP (dp=2), ZeRO-1, tensor parallel with the built-in plans (tp=2: logits, loss each step, step-1
gradients and parameters after 5 steps gathered by name) and dp=2 x tp=2; pipeline parallel (pp=2 with 1F1B,
GPT-2's tied embeddings split over the first and last stage; pp=2 x dp=2: GPT-2 zero-bubble with ZeRO-1, Llama
1F1B with DDP; Llama pp=2 x tp=2 with GPipe); heads that tp does not divide; pipeline refusals; plait importing
without transformers."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers.harness import run_distributed
from helpers.hf import (
    GLOBAL_BATCH,
    SEQ,
    VOCAB,
    check,
    check_split,
    global_batch,
    make_model,
    merge_stages,
    reference,
    run_cases,
)
from transformers import (
    BertConfig,
    BertForMaskedLM,
)

from plait import Layout, LayoutError
from plait.models.hf import return_logits
from plait.parallel.pipeline.apply import plan_pipeline
from plait.parallel.tensor import plan_tensor_parallel
from plait.parallel.tensor.plan import default_plan, resolve_plan

TWO_RANKS = [
    ("gpt2", Layout(dp=2)),
    ("gpt2", Layout(tp=2)),
    ("llama", Layout(dp=2, zero=1)),
    ("llama", Layout(tp=2)),
    ("gpt2", Layout(pp=2, microbatches=4, schedule="1f1b")),  # tied wte / lm_head across the stages
    ("llama", Layout(pp=2, microbatches=4, schedule="1f1b")),
]
FOUR_RANKS = [
    ("gpt2", Layout(dp=2, tp=2)),
    ("llama", Layout(dp=2, tp=2, zero=1)),
    ("gpt2", Layout(pp=2, dp=2, microbatches=2, schedule="zero-bubble", zero=1)),  # the copy's grad in W
    ("llama", Layout(pp=2, dp=2, microbatches=2, schedule="1f1b")),
    ("llama", Layout(pp=2, tp=2, microbatches=2, schedule="gpipe")),
]


@pytest.mark.distributed
@pytest.mark.parametrize("world, cases", [(2, TWO_RANKS), (4, FOUR_RANKS)], ids=["2ranks", "4ranks"])
def test_hf_models_match_single_device(world, cases):
    per_rank = run_distributed(run_cases, world, cases)
    for index, (kind, layout) in enumerate(cases):
        what = f"{kind} dp={layout.dp} tp={layout.tp} pp={layout.pp} {layout.schedule} zero={layout.zero}"
        results = [rank_results[index] for rank_results in per_rank]
        for rank, result in enumerate(results):
            if layout.pp == 1:
                check(result, kind, f"{what} rank {rank}")
            assert result["losses"] == results[0]["losses"], f"{what}: rank {rank} reports a different loss"
        if layout.pp > 1:  # every parameter on exactly the stages that own it; GPT-2's lm_head copy is no parameter
            whole = merge_stages(results)
            assert sorted(whole["params"]) == sorted(reference(kind).params[-1]), f"{what}: parameters by name"
            check(whole, kind, what)
        check_split(results, kind, layout.tp if layout.tp > 1 else 1, what)


def test_built_in_plans_cover_every_block_and_keep_the_tie():
    gpt2, llama = make_model("gpt2"), make_model("llama", num_hidden_layers=3)
    gpt2_styles = resolve_plan(gpt2, default_plan(gpt2), tp=2).styles
    assert gpt2_styles["transformer.h.1.attn.c_attn"] == "colwise_fused_qkv"
    assert gpt2_styles["transformer.h.0.mlp.c_proj"] == "rowwise" and gpt2_styles["lm_head"] == "colwise_vocab"
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight, "the test model must be tied"
    llama_styles = resolve_plan(llama, default_plan(llama), tp=2).styles
    assert sum(style == "colwise" for style in llama_styles.values()) == 3 * 5  # q, k, v, gate, up per layer
    assert llama_styles["model.layers.2.self_attn.o_proj"] == "rowwise"


def test_adapter_returns_logits_and_keeps_parameter_names():
    model = make_model("gpt2")
    names = [name for name, _ in model.named_parameters()]
    out = return_logits(model)(global_batch(0)[0])
    assert isinstance(out, torch.Tensor) and out.shape == (GLOBAL_BATCH, SEQ, VOCAB)
    assert [name for name, _ in model.named_parameters()] == names


@pytest.mark.parametrize(
    "kind, overrides, tp, needle",
    [
        ("gpt2", {}, 8, "does not divide the 4 attention heads (n_head) of transformer.h.0.attn"),
        ("gpt2", dict(n_embd=24, n_head=6), 4, "does not divide the 6 attention heads (n_head)"),
        ("llama", {}, 4, "does not divide the 2 key/value heads (num_key_value_heads) of model.layers.0.self_attn"),
        ("llama", dict(num_key_value_heads=4), 8, "does not divide the 4 attention heads (num_attention_heads)"),
    ],
)
def test_heads_not_divisible_by_tp_raise_layout_errors(kind, overrides, tp, needle):
    with pytest.raises(LayoutError) as info:
        plan_tensor_parallel(make_model(kind, **overrides), Layout(tp=tp).resolve(tp))
    assert needle in str(info.value) and "Fix:" in str(info.value), str(info.value)


def test_sequence_parallel_is_refused_for_hf_models():
    with pytest.raises(LayoutError, match="sequence_parallel=True is not supported for GPT2Attention.*Fix:"):
        plan_tensor_parallel(make_model("gpt2"), Layout(tp=2, sequence_parallel=True).resolve(2))


def test_pipeline_refusals_name_the_fix():
    tied_with_tp = (
        r"transformer.wte.weight = lm_head.weight tie the first and the last pipeline stage.*tp=2.*"
        r"Fix:.*tie_word_embeddings=False"
    )
    with pytest.raises(LayoutError, match=tied_with_tp):
        plan_pipeline(make_model("gpt2"), Layout(pp=2, tp=2, microbatches=2).resolve(4))
    with pytest.raises(LayoutError, match=r"schedule=\"pipedream\".*Fix:.*tie_word_embeddings=False"):
        plan_pipeline(make_model("gpt2"), Layout(pp=2, microbatches=2, schedule="pipedream").resolve(2))
    assert plan_pipeline(make_model("gpt2", tie_word_embeddings=False), Layout(pp=2, tp=2, microbatches=2).resolve(4))
    bert = BertForMaskedLM(
        BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    )
    with pytest.raises(LayoutError, match=r"BertForMaskedLM \(model_type='bert'\) is not supported.*Fix:"):
        plan_pipeline(bert, Layout(pp=2, microbatches=2).resolve(2))


def test_plait_imports_and_plans_without_transformers():
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import plait\n"
        "from plait.models import GPT, GPTConfig\n"
        "from plait.parallel.tensor.plan import default_plan\n"
        "plan = default_plan(GPT(GPTConfig(vocab_size=12, seq_len=8, n_layer=1, n_head=2, d_model=8)))\n"
        "assert plan['lm_head'] == 'colwise_vocab' and 'transformers' not in [m for m in sys.modules if sys.modules[m]]\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_pipeline_stages_build_the_causal_mask_without_deprecated_arguments():
    """The stages' causal mask goes through transformers' create_causal_mask with the cache argument this
    transformers names (``past_key_values`` is deprecated from 5.24 and removed in 5.40): no FutureWarning."""
    import warnings

    from plait.models.hf_stages import _causal_mask

    model = make_model("llama")
    hidden = torch.zeros(1, 4, model.config.hidden_size)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        mask = _causal_mask(model.config, hidden, torch.arange(4).unsqueeze(0))
    assert mask is None or mask.shape[-1] == 4


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_pipeline_stage_forwards_raise_no_deprecation_warning(kind):
    """A llama stage passed ``past_key_values=None`` to every decoder layer: one FutureWarning per layer call,
    printed by every rank at each evaluation (issue 37). The stage forward is the model's own, restricted."""
    import warnings

    from plait.models.hf_stages import make_stage_forward

    model = make_model(kind)
    tokens = torch.randint(0, model.config.vocab_size, (2, 8))
    expected = model(tokens).logits
    make_stage_forward(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        got = model(tokens)
    # fp32: the stage passes attention an explicit causal mask where the model may use its causal kernel path,
    # a different summation order (measured: 6e-8 absolute at most); an error would be orders of magnitude larger
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
