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

pytest.importorskip("transformers")

from harness import run_distributed  # noqa: E402
from reference import assert_tensors_close, train_reference  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

import plait  # noqa: E402
from plait import Layout, LayoutError  # noqa: E402
from plait.models.hf import return_logits  # noqa: E402
from plait.parallel.pipeline.apply import plan_pipeline  # noqa: E402
from plait.parallel.tensor import plan_tensor_parallel  # noqa: E402
from plait.parallel.tensor.layers import gather_parameters, gather_slice, is_tp_sharded  # noqa: E402
from plait.parallel.tensor.plan import default_plan, resolve_plan  # noqa: E402

STEPS = 5
GLOBAL_BATCH = 8
SEQ = 16
VOCAB = 64
CLIP = 0.5
"""Below the tiny models' gradient norm (~1-3 at init), so clipping (and its tp-aware norm) is active."""


def make_model(kind: str, **overrides: int) -> torch.nn.Module:
    """A tiny transformers causal LM with seeded random weights, eager attention and no dropout."""
    torch.manual_seed(1234)
    if kind == "gpt2":
        fields = dict(
            n_layer=2,
            n_embd=32,
            n_head=4,
            vocab_size=VOCAB,
            n_positions=SEQ,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        return GPT2LMHeadModel(GPT2Config(**{**fields, **overrides}, attn_implementation="eager"))
    fields = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        bos_token_id=0,
        eos_token_id=0,
    )
    return LlamaForCausalLM(LlamaConfig(**{**fields, **overrides}, attn_implementation="eager"))


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens; targets are the inputs shifted by one (next-token prediction)."""
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def optimizer(params):  # noqa: ANN001, ANN201 - a factory, as users pass it
    """AdamW with eps=1e-5. Adam's first step is lr g / (|g| + eps), so an absolute gradient difference d moves a
    parameter by up to lr d / eps. Reordered sums leave d ~1.4e-9 on GPT-2's attn.c_proj gradient at init (whose
    smallest coordinates are ~5e-8): with the default eps=1e-8 that is a 3e-6 drift, with 1e-6 still 1.2e-6
    (measured); eps=1e-5 bounds it by ~1.4e-7, well inside the 1e-6 parameter tolerance. Gradients of ~1e-3 and
    more still take steps within 1% of lr, as with the default."""
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-5)


def gather_grads(engine: plait.Engine) -> dict[str, torch.Tensor]:
    """Every parameter's synchronised gradient, whole, by name (ZeRO shards gathered over dp, tp slices over tp)."""
    strategy = engine.strategy
    local = (
        strategy.full_gradients()
        if hasattr(strategy, "full_gradients")
        else {name: p.grad for name, p in engine.model.named_parameters() if p.grad is not None}
    )
    return {
        name: (gather_slice(local[name], p, engine.comm) if is_tp_sharded(p) else local[name].detach()).clone()
        for name, p in engine.model.named_parameters()
    }


def train_plait(kind: str, layout: Layout) -> dict:
    """Whole logits before training (eval mode), then 5 steps: losses, step-1 gradients, final parameters."""
    engine = plait.parallelize(make_model(kind), layout, optimizer=optimizer, max_grad_norm=CLIP)
    dp_rank, dp = engine.mesh.index("dp"), engine.mesh.size("dp")
    engine.model.eval()
    with torch.no_grad():  # with pp: through the stages, the logits on the last stage's rank (None elsewhere)
        logits = (
            engine.model(global_batch(0)[0]) if engine.pipeline is None else engine.pipeline.forward(global_batch(0)[0])
        )
    engine.model.train()
    grads: list[dict[str, torch.Tensor]] = []
    engine.before_optimizer_step.append(lambda e: grads.append(gather_grads(e)) if not grads else None)
    losses = []
    for step in range(STEPS):
        inputs, targets = global_batch(step)
        share = GLOBAL_BATCH // dp
        losses.append(
            engine.train_step(
                (inputs[dp_rank * share : (dp_rank + 1) * share], targets[dp_rank * share : (dp_rank + 1) * share])
            ).loss
        )
    local = {name: p.numel() for name, p in engine.model.named_parameters()}
    sharded = {name for name, p in engine.model.named_parameters() if is_tp_sharded(p)}
    return {
        "logits": logits,
        "losses": losses,
        "grads": grads[0],
        "params": gather_parameters(engine.model, engine.comm),
        "local_numel": local,
        "sharded": sharded,
    }


def run_cases(cases: list[tuple[str, Layout]]) -> list[dict]:
    return [train_plait(kind, layout) for kind, layout in cases]


_REFERENCES: dict[str, object] = {}


def reference(kind: str):  # noqa: ANN201 - a tests/reference.py Trajectory with .logits
    if kind not in _REFERENCES:
        model = return_logits(make_model(kind))
        with torch.no_grad():
            logits = model.eval()(global_batch(0)[0])
        trajectory = train_reference(
            model.train(), [global_batch(s) for s in range(STEPS)], optimizer, max_grad_norm=CLIP
        )
        trajectory.logits = logits
        _REFERENCES[kind] = trajectory
    return _REFERENCES[kind]


# fp32 tolerances. DDP averages two half-batch gradients where the reference sums one batch, and tensor
# parallelism adds the row-parallel partial products and the vocab-parallel softmax terms in another order:
# a few ulps (~1e-7 relative) per value. Logits and losses: rtol 1e-5 (a handful of roundings through 2 layers);
# step-1 gradients rtol 1e-4 / atol 1e-6 (clipping divides by the global norm; near-zero coordinates carry
# only absolute error); parameters after 5 AdamW steps rtol 1e-5 / atol 1e-6 (Adam's g / sqrt(v) can magnify a
# relative error of a gradient near zero, but a step is bounded by lr = 1e-3, so 1e-6 is ~1e-3 of one step).
LOGIT_TOL = {"rtol": 1e-5, "atol": 1e-6}
LOSS_RTOL = 1e-5
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-6}
PARAM_TOL = {"rtol": 1e-5, "atol": 1e-6}


def check(result: dict, kind: str, what: str) -> None:
    expected = reference(kind)
    torch.testing.assert_close(result["logits"], expected.logits, **LOGIT_TOL, msg=lambda m: f"{what} logits: {m}")
    for step, (a, e) in enumerate(zip(result["losses"], expected.losses, strict=True)):
        assert abs(a - e) <= LOSS_RTOL * abs(e), f"{what} step {step}: loss {a!r} != reference {e!r}"
    assert_tensors_close(result["grads"], expected.grads[0], f"{what} step 0 grad", GRAD_TOL)
    assert_tensors_close(result["params"], expected.params[-1], f"{what} final param", PARAM_TOL)


def merge_stages(results: list[dict]) -> dict:
    """Pipeline parallel: the whole model's result from its stages' (union by name; replicas agree exactly)."""
    whole = {"logits": next(r["logits"] for r in results if r["logits"] is not None), "losses": results[0]["losses"]}
    for field in ("grads", "params"):
        whole[field] = {}
        for result in results:
            for name, tensor in result[field].items():
                assert name not in whole[field] or torch.equal(whole[field][name], tensor), f"replicas differ: {name}"
                whole[field][name] = tensor
    return whole


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


SPLIT = {
    "gpt2": ("wte.weight", "c_attn.weight", "c_attn.bias", "c_fc.weight", "c_fc.bias", "c_proj.weight"),
    "llama": ("embed_tokens.weight", "_proj.weight", "lm_head.weight"),
}
"""Name endings of the parameters the built-in plans split (GPT-2's lm_head.weight is wte.weight, tied)."""


def check_split(results: list[dict], kind: str, tp: int, what: str) -> None:
    """Each rank holds 1/tp of every split parameter, all of the replicated ones, and the right ones are split
    (with pp: of its own stage's parameters)."""
    full = reference(kind).params[-1]
    for result in results:
        expected = {name for name in result["local_numel"] if name.endswith(SPLIT[kind])} if tp > 1 else set()
        assert result["sharded"] == expected, f"{what}: split {sorted(result['sharded'] ^ expected)} unexpectedly"
        for name, numel in result["local_numel"].items():
            share = full[name].numel() // tp if name in expected else full[name].numel()
            assert numel == share, f"{what} {name}: {numel} elements held, expected {share}"


# ----------------------------------------------------------------- plans, adapter, bad input
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
