"""Shared pieces of the tensor- and sequence-parallel tests: the tiny GPTs, one plait run recording what the
parity checks compare (losses, step-1 gradients and final parameters, gathered whole by name), the
single-device reference, and the comparison with its tolerances."""

from __future__ import annotations

import torch
from helpers.reference import assert_tensors_close, train_reference

import plait
from plait import Layout
from plait.comm import Comm
from plait.data import AdditionTask, ShardedBatches
from plait.models import GPT, GPTConfig
from plait.parallel.tensor import gather_parameters
from plait.parallel.tensor.layers import gather_slice, is_tp_sharded

STEPS = 5
GLOBAL_BATCH = 8
CLIP = 0.05
"""Small enough that clipping is active at every step (the test GPT's gradient norm is ~0.3-1)."""


def optimizer(params):  # noqa: ANN001, ANN201 - a factory, as users pass it
    """AdamW with eps=1e-5, as the composition and Hugging Face parity helpers use (their docstrings measure why):
    Adam's step lr g / (|g| + eps) turns a reordering difference d on a near-zero gradient coordinate into a
    parameter drift of up to lr d / eps. With the default 1e-8, tp=4 with a padded vocabulary drifted 2.2e-6 on
    blocks.0.attn.o.weight after 5 steps on this machine's CPU (AMD EPYC; the same code passed on the previous
    session's), past the 1e-6 tolerance; 1e-5 bounds it far below while gradients of ~1e-3 still take steps
    within 1% of lr."""
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-5)


MODELS = {
    # bias=False: the key bias has an analytically zero gradient (softmax ignores a shift shared by every score),
    # pure rounding noise that Adam normalises to +-lr, so it is no parity signal (see tests/test_engine.py).
    "gpt2": dict(n_layer=2, n_head=4, d_model=16, bias=False),
    "llama_gqa": dict(
        n_layer=2, n_head=4, n_kv_head=2, d_model=16, position="rope", norm="rmsnorm", mlp="swiglu", bias=False, d_ff=32
    ),
    # a vocabulary of 13 (the task uses ids 0-11) that no tp > 1 divides: for Layout(tp_pad_vocab=True)
    "gpt2_vocab13": dict(n_layer=2, n_head=4, d_model=16, bias=False, vocab_size=13),
}


def make_model(kind: str = "gpt2", n_layer: int | None = None) -> tuple[GPT, AdditionTask]:
    task = AdditionTask(digits=2, seed=1)  # vocab 12, seq_len 8, targets with ignore_index on the prompt
    torch.manual_seed(1234)
    fields = {"vocab_size": task.vocab_size, "seq_len": task.seq_len, **MODELS[kind]}
    if n_layer is not None:
        fields["n_layer"] = n_layer
    return GPT(GPTConfig(**fields)), task


def gather_grads(engine: plait.Engine, comm: Comm) -> dict[str, torch.Tensor]:
    """Every parameter's synchronised gradient, whole, by name (ZeRO shards gathered over dp, tp slices over tp)."""
    strategy = engine.strategy
    local = (
        strategy.full_gradients()
        if hasattr(strategy, "full_gradients")
        else {name: p.grad for name, p in engine.model.named_parameters() if p.grad is not None}
    )
    out = {}
    for name, param in engine.model.named_parameters():
        grad = local[name].detach().contiguous()
        if is_tp_sharded(param):  # a 1D slice or a 2D / 2.5D / 3D grid block
            grad = gather_slice(grad, param, comm)
        out[name] = grad.cpu().clone()
    return out


def custom_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy that plait does not recognise as such: the LM head must then gather whole logits."""
    return torch.nn.functional.cross_entropy(logits, targets) * 1.0


def initial_logits(engine: plait.Engine, inputs: torch.Tensor) -> torch.Tensor | None:
    """The forward output before training, in evaluation mode (where the LM head gathers whole logits); None on
    a pipeline rank (its stages end elsewhere)."""
    if engine.pipeline is not None:
        return None
    engine.model.eval()
    with torch.no_grad():
        logits = engine.model(inputs)
    engine.model.train()
    return logits.detach().cpu().clone()


def train_tp(layout: Layout, kind: str = "gpt2", clip: float | None = CLIP, loss_fn=None) -> dict:
    """5 steps with plait: the logits before training, losses, gradients at step 1 and final parameters (whole,
    by name), the parameter elements each rank holds, and an evaluation (loss, accuracy) on this rank's share of
    one more batch."""
    model, task = make_model(kind)
    kwargs = {"loss_fn": loss_fn} if loss_fn is not None else {}
    engine = plait.parallelize(model, layout, optimizer=optimizer, max_grad_norm=clip, **kwargs)
    grads: list[dict[str, torch.Tensor]] = []
    engine.before_optimizer_step.append(lambda e: grads.append(gather_grads(e, e.comm)) if not grads else None)
    loader = ShardedBatches(task, GLOBAL_BATCH, dp_rank=engine.mesh.index("dp"), dp_size=engine.mesh.size("dp"))
    logits = initial_logits(engine, loader.batch_at(0)[0])
    losses = [engine.train_step(loader.batch_at(step)).loss for step in range(STEPS)]
    params = {k: v.cpu() for k, v in gather_parameters(engine.model, engine.comm).items()}
    local = {name: p.numel() for name, p in engine.model.named_parameters()}
    sharded = {name for name, p in engine.model.named_parameters() if getattr(p, "tp_sharded", False)}
    evaluation = engine.evaluate([loader.batch_at(STEPS)], metric=task.accuracy_counts)
    return {
        "logits": logits,
        "dp_rank": engine.mesh.index("dp"),
        "losses": losses,
        "grads": grads[0],
        "params": params,
        "local_numel": local,
        "sharded": sharded,
        "eval": (evaluation.loss, evaluation.correct, evaluation.total),
    }


def reference_run(kind: str = "gpt2", clip: float | None = CLIP, loss_fn=torch.nn.functional.cross_entropy):
    """The single-device trajectory, plus ``logits``: the output before training on the first global batch, and
    ``evaluation``: (loss, correct, total) of its final weights on the global batch that ``train_tp`` evaluates."""
    model, task = make_model(kind)
    loader = ShardedBatches(task, GLOBAL_BATCH)
    with torch.no_grad():
        initial = model.eval()(loader.global_batch_at(0)[0])
    model.train()
    trajectory = train_reference(model, [loader.global_batch_at(s) for s in range(STEPS)], optimizer, loss_fn, clip)
    model.load_state_dict(trajectory.params[-1])
    inputs, targets = loader.global_batch_at(STEPS)
    with torch.no_grad():
        logits = model(inputs)
    correct, total = task.accuracy_counts(logits, targets)
    loss = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    trajectory.evaluation = (loss, correct, total)
    trajectory.logits = initial
    return trajectory


# fp32 tolerances. Tensor parallelism reorders sums: the all-reduce of the row-parallel partial products, the
# vocab-parallel softmax denominator and the tp-summed norm gradients add the same terms in another order (a
# few ulps, ~1e-7 relative). Losses are compared to 1e-6 relative; gradients to rtol 1e-4 / atol 1e-6, since
# clipping divides by the global norm and near-zero coordinates carry only absolute error; parameters after 5
# AdamW steps to rtol 1e-5 / atol 1e-6 (Adam's g / sqrt(v) can magnify a relative error of a gradient near zero
# but the step is bounded by lr = 1e-3, so atol 1e-6 is ~1e-3 of one step).
LOSS_RTOL = 1e-6
# Layer parity, fp32: a row-parallel output and every tp-reduced gradient is the same sum of products as on one
# device, added in another order (partials per rank, then the all-reduce): a few ulps, ~1e-7 relative; rtol
# 1e-5 / atol 1e-6 leaves room for a handful of roundings on values of order 1.
LAYER_TOL = {"rtol": 1e-5, "atol": 1e-6}
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-6}
PARAM_TOL = {"rtol": 1e-5, "atol": 1e-6}


def assert_matches_reference(result: dict, expected, what: str) -> None:
    """Logits before training (this dp rank's rows; not on a pipeline rank), losses, step-1 gradients, final
    parameters and the evaluation equal the reference (a pipeline rank is compared on the parameters of its
    stages)."""
    if result["logits"] is not None:  # the forward output: sums in another order, as a layer's (LAYER_TOL)
        rows = result["logits"].shape[0]
        expected_logits = expected.logits[result["dp_rank"] * rows : (result["dp_rank"] + 1) * rows]
        assert_tensors_close({"logits": result["logits"]}, {"logits": expected_logits}, f"{what} initial", LAYER_TOL)
    names = result["params"].keys()
    expected_grads = {k: v for k, v in expected.grads[0].items() if k in names}
    expected_params = {k: v for k, v in expected.params[-1].items() if k in names}
    for step, (a, e) in enumerate(zip(result["losses"], expected.losses)):
        assert abs(a - e) <= LOSS_RTOL * abs(e), f"{what} step {step}: loss {a!r} != reference {e!r}"
    assert_tensors_close(result["grads"], expected_grads, f"{what} step 0 grad", GRAD_TOL)
    assert_tensors_close(result["params"], expected_params, f"{what} final param", PARAM_TOL)
    loss, correct, total = result["eval"]
    ref_loss, ref_correct, ref_total = expected.evaluation
    assert (correct, total) == (ref_correct, ref_total), (
        f"{what}: eval accuracy {correct}/{total} != {ref_correct}/{ref_total}"
    )
    assert abs(loss - ref_loss) <= LOSS_RTOL * abs(ref_loss), f"{what}: eval loss {loss!r} != reference {ref_loss!r}"
