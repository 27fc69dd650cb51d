"""Tiny Hugging Face causal LMs (GPT-2, Llama) with seeded random weights, as the HF parity tests train them: the
models, the batch, the optimizer, a plait run (logits, losses, step-1 gradients, final parameters gathered by name)
and the single-device reference, with their fp32 tolerances. Imports transformers: import it only where a test
has skipped without it."""

from __future__ import annotations

import torch
from helpers.reference import assert_tensors_close, train_reference, uneven_mask
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import plait
from plait import Layout
from plait.models.hf import return_logits
from plait.parallel.tensor.layers import gather_parameters, gather_slice, is_tp_sharded

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
    """Random tokens; targets are the inputs shifted by one (next-token prediction), each row scoring a different
    number of them (``reference.uneven_mask``: the rest -100, as padding or a masked prompt would)."""
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
    rows = [1000 * step + row for row in range(GLOBAL_BATCH)]
    return tokens[:, :-1].contiguous(), uneven_mask(tokens[:, 1:].contiguous(), rows)


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
