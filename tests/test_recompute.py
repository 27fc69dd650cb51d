"""Activation recomputation: same results as without it (bitwise in one process; parity with single-device
training under dp, tp + SP, pp, cp and ZeRO), the activations held equal to plait's formula to the byte (selective,
full, per block), and clear errors for blocks or models it cannot recompute."""

import contextlib
import functools
import itertools

import pytest
import torch
from helpers.composition import GRAD_TOL, LOSS_RTOL, PARAM_TOL, merge_ranks, whole_gradients, whole_parameters
from helpers.composition import make_model as composition_model
from helpers.composition import optimizer as composition_optimizer
from helpers.gpt import make_model, reference, train_plait
from helpers.harness import run_distributed
from helpers.reference import assert_tensors_close, assert_trajectories_match, snapshot_params, train_reference
from torch.nn.attention import SDPBackend, sdpa_kernel

import plait
from plait import Layout, LayoutError
from plait.data import ShardedBatches
from plait.models import GPT, GPTConfig, lm_loss
from plait.observe.memory import SavedActivations
from plait.parallel.blocks import find_blocks
from plait.parallel.recompute import apply_recompute
from plait.planner.memory import estimate_memory


def test_blocks_are_found_by_container_name():
    model, _ = make_model()
    assert [path for path, _ in find_blocks(model)] == ["blocks.0", "blocks.1"]
    assert find_blocks(torch.nn.Linear(2, 2)) == []


@pytest.mark.parametrize(
    "recompute, clip",
    [("full", None), ((1,), None), ("selective", None), ("selective", 0.05), ("op", None), ("op", 0.05)],
)
def test_recompute_is_bitwise_single_device(recompute, clip):
    actual = train_plait(Layout(recompute=recompute), "adamw", clip)
    assert_trajectories_match(actual, reference("adamw", clip), exact=True)


@pytest.mark.distributed
def test_recompute_with_data_parallel_and_accumulation():
    results = run_distributed(train_plait, 2, Layout(dp=2, microbatches=2, recompute="full"), "sgd", 0.05)
    for actual in results:
        assert_trajectories_match(actual, reference("sgd", 0.05))


def _saved_bytes(recompute: str) -> int:
    """Bytes autograd saves for backward during one forward (the activations held)."""
    model, task = make_model()
    apply_recompute(model, recompute)
    x, _ = task.batch(range(16))
    with SavedActivations(exclude=model.parameters()) as saved:
        model(x).sum()
    return saved.bytes


def test_recompute_holds_fewer_activations():
    full, none = _saved_bytes("full"), _saved_bytes("none")
    assert full < 0.5 * none, (full, none)


def test_bad_recompute_choices():
    model, _ = make_model()
    with pytest.raises(LayoutError, match=r"block\(s\) \[5\].*2 blocks"):
        apply_recompute(model, (5,))
    with pytest.raises(LayoutError, match="no ModuleList/ModuleDict"):
        plait.parallelize(torch.nn.Linear(2, 2), Layout(recompute="full"), optimizer=lambda p: torch.optim.SGD(p, lr=1))
    with pytest.raises(LayoutError, match="no ModuleList/ModuleDict"):
        plait.parallelize(torch.nn.Linear(2, 2), Layout(recompute="op"), optimizer=lambda p: torch.optim.SGD(p, lr=1))
    with pytest.raises(LayoutError, match="'none', 'selective', 'op', 'full'"):
        Layout(recompute="attention")
    with pytest.raises(LayoutError, match="recompute='op' cannot run under schedule='zero-bubble'.*Fix"):
        Layout(pp=2, microbatches=2, schedule="zero-bubble", recompute="op")
    with pytest.raises(LayoutError, match="attention cores.*Fix: use recompute='full'"):
        plait.parallelize(
            torch.nn.Sequential(torch.nn.Linear(2, 2)),
            Layout(recompute="selective"),
            optimizer=lambda p: torch.optim.SGD(p, lr=1),
        )


# ----------------------------------------------------------------- selective: the attention core recomputed
def test_selective_replays_attention_dropout_bitwise():
    """With dropout (CPU SDPA then runs the math kernel, whose s^2 softmax and mask selective recomputation drops),
    the recomputed core replays the same dropout mask: the same run as without recomputation, bit for bit."""
    runs = {}
    for recompute in ("none", "selective"):
        model, task = make_model()
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.2
            if hasattr(module, "dropout") and isinstance(module.dropout, float):
                module.dropout = 0.2
        torch.manual_seed(7)  # the dropout masks' stream, the same for both runs
        engine = plait.parallelize(model, Layout(recompute=recompute), optimizer=lambda p: torch.optim.AdamW(p, 1e-3))
        loader = ShardedBatches(task, 8)
        losses = [engine.train_step(loader.batch_at(step)).loss for step in range(3)]
        runs[recompute] = (losses, snapshot_params(engine.model))
    assert runs["selective"][0] == runs["none"][0]
    assert_tensors_close(runs["selective"][1], runs["none"][1], "params", {"rtol": 0.0, "atol": 0.0})


def _hf_model(kind: str) -> torch.nn.Module:
    """A tiny transformers causal LM (eager attention: the softmax is materialised) with seeded weights."""
    import transformers

    torch.manual_seed(1234)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation="eager",
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=16, bos_token_id=0, eos_token_id=0, attn_implementation="eager",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _hf_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_selective_on_hugging_face_models_is_bitwise_and_drops_the_softmax(kind):
    """GPT-2 and Llama (eager attention, GQA for Llama): 3 clipped AdamW steps with selective recomputation equal
    those without, bit for bit; one forward keeps exactly the s^2 softmax of every layer less (4 a s^2 b bytes),
    less Llama's kv heads repeated for the core (2 x 4 b s (a - k) d), plus the [b, 1, s, s] fp32 mask that the
    recomputed cores receive as an input (once: every layer reads the same tensor)."""
    runs, saved = {}, {}
    for recompute in ("none", "selective"):
        engine = plait.parallelize(
            _hf_model(kind),
            Layout(recompute=recompute),
            optimizer=lambda p: torch.optim.AdamW(p, 1e-3),
            max_grad_norm=0.5,
        )
        inputs, targets = _hf_batch(99)
        with SavedActivations(exclude=engine.model.parameters()) as held:
            lm_loss(engine.model(inputs), targets)
        saved[recompute] = held.bytes
        runs[recompute] = [engine.train_step(_hf_batch(step)).loss for step in range(3)], snapshot_params(engine.model)
    assert runs["selective"][0] == runs["none"][0]
    assert_tensors_close(runs["selective"][1], runs["none"][1], "params", {"rtol": 0.0, "atol": 0.0})
    b, s, a, layers, d = 4, 16, 4, 2, 8
    repeated = 2 * 4 * b * s * (a - 2) * d if kind == "llama" else 0
    assert saved["none"] - saved["selective"] == layers * (4 * a * s * s * b + repeated) - 4 * b * s * s


# ----------------------------------------------------------------- measured activations == plait's formula
FORMULA_CONFIGS = {
    "gpt2": dict(),
    "llama-gqa": dict(position="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_head=2),
    "gpt2-dropout": dict(dropout=0.1),
}


@pytest.mark.parametrize("name", list(FORMULA_CONFIGS))
def test_saved_activations_equal_the_formula(name):
    """For every recompute mode (none, selective, op, full, one block), precision (fp32; bf16 autocast) and attention
    kernel (SDPA's fused CPU flash kernel; the math kernel, which CPU SDPA also runs under dropout), the bytes one
    forward and loss keep for backward (SavedActivations) equal ``estimate_memory(...).activations``, which sums
    plait.planner.activations' per-block formula, to the byte."""
    config = GPTConfig(vocab_size=12, seq_len=8, n_layer=3, n_head=4, d_model=16, **FORMULA_CONFIGS[name])
    kernels = ["math"] if config.dropout else ["flash", "math"]
    for recompute, precision, kernel in itertools.product(
        ["none", "selective", "op", "full", (1,)], ["fp32", "bf16"], kernels
    ):
        torch.manual_seed(0)
        model = GPT(config)
        apply_recompute(model, recompute)
        inputs, targets = (torch.randint(0, 12, (2, 8), generator=torch.Generator().manual_seed(i)) for i in (1, 2))
        math = sdpa_kernel(SDPBackend.MATH) if kernel == "math" else contextlib.nullcontext()
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
        with math, autocast, SavedActivations(exclude=model.parameters()) as saved:
            lm_loss(model(inputs), targets)
        layout = Layout(recompute=recompute, precision=precision)
        shape = {"batch": 2, "seq": 8, "attention": kernel, "dropout": config.dropout}
        estimate = estimate_memory(config, layout, activations=shape, device="cpu")
        assert saved.bytes == estimate.activations, (recompute, precision, kernel, saved.bytes, estimate.activations)


def test_the_formula_reproduces_the_measured_tensor_parallel_rows():
    """docs/tensor_parallel.md's per-layer bytes, measured by tests/test_sequence_parallel.py (fp32, B=8, T=8,
    d=16, 4 heads, t=2): 67,584 on one device, 42,496 under 1D TP, 37,888 with SP."""
    from plait.models.spec import ModelSpec
    from plait.planner.activations import Forward, plait_block_bytes

    spec = ModelSpec("docs", 1, 16, 4, 64, 12, 8, learned_positions=True, bias=True)
    rows = [Forward(8, 8), Forward(8, 8, tp=2), Forward(8, 8, tp=2, sequence_parallel=True)]
    assert [plait_block_bytes(spec, fwd) for fwd in rows] == [67_584, 42_496, 37_888]


def _operator_bytes_under_tp() -> dict[tuple[bool, int], int]:
    """Saved bytes of one forward + loss of a Llama-style GPT (GQA, SwiGLU) with recompute="op" at tp=2, with and
    without sequence parallelism, for 2 and 3 blocks (their difference is one block's)."""
    from plait.models.loss import apply_loss
    from plait.parallel.tensor.sequence import saved_activation_bytes

    out = {}
    for sp, n_layer in itertools.product((False, True), (2, 3)):
        torch.manual_seed(0)
        config = GPTConfig.llama_style(vocab_size=16, seq_len=8, n_layer=n_layer, n_head=4, n_kv_head=2, d_model=16)
        layout = Layout(tp=2, sequence_parallel=sp, recompute="op")
        engine = plait.parallelize(GPT(config), layout, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
        tokens = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(1))
        out[sp, n_layer] = saved_activation_bytes(
            engine.model,
            lambda: apply_loss(engine.loss_fn, engine.model(tokens), tokens),  # noqa: B023
        )
    return out


@pytest.mark.distributed
def test_operator_recompute_bytes_under_tensor_parallelism_equal_the_formula():
    """Per block under tp=2 (1D and SP), what "op" keeps equals plait_block_bytes to the byte: q, v, the attention
    output and gate split by t, down's row-parallel output whole (its partial sums, before their reduction)."""
    from plait.models.spec import ModelSpec
    from plait.planner.activations import Forward, plait_block_bytes

    measured = run_distributed(_operator_bytes_under_tp, 2)[0]
    spec = ModelSpec.from_gpt_config(
        GPTConfig.llama_style(vocab_size=16, seq_len=8, n_layer=3, n_head=4, n_kv_head=2, d_model=16)
    )
    for sp in (False, True):
        per_block = measured[sp, 3] - measured[sp, 2]
        assert per_block == plait_block_bytes(spec, Forward(4, 8, tp=2, sequence_parallel=sp), "op"), (sp, per_block)


# ----------------------------------------------------------------- selective composed with the other paradigms
COMPOSED = {
    "dp2-tp2-sp-zero3-clip": ("gpt", Layout(dp=2, tp=2, sequence_parallel=True, zero=3), 0.05),
    "tp2-pp2-sp-1f1b-zero1": ("gpt", Layout(tp=2, pp=2, sequence_parallel=True, zero=1, microbatches=2), None),
    "pp2-cp2-ring-gpipe-clip": ("gpt", Layout(pp=2, cp=2, microbatches=2, schedule="gpipe"), 0.05),
    "dp2-cp2-ulysses-zero3": ("gpt", Layout(dp=2, cp=2, cp_mode="ulysses", zero=3), None),
    "dp2-pp2-1f1b-zero1": ("gpt", Layout(dp=2, pp=2, zero=1, microbatches=2), None),
    "dp2-pp2-zero-bubble-clip": ("gpt", Layout(dp=2, pp=2, microbatches=2, schedule="zero-bubble"), 0.05),
    "hf-llama-dp2-cp2-ring-clip": ("llama", Layout(dp=2, cp=2), 0.5),
    "hf-gpt2-dp2-pp2-1f1b": ("gpt2", Layout(dp=2, pp=2, microbatches=2), None),
}
"""World 4: selective recomputation of the attention cores (and per-operator recomputation of the blocks) of
plait's GPT under tp with Megatron-SP and ZeRO-3, under pp with SP, around cp's ring kernels in a pipeline, around
Ulysses' all-to-alls under ZeRO-3, in zero-bubble's split backward (selective only); of Hugging Face Llama around
the context-parallel attention function, and of GPT-2 in pipeline stages; clipped and unclipped."""
STEPS = 3


def _cell_model(kind: str) -> tuple[torch.nn.Module, object]:
    if kind == "gpt":
        return composition_model()
    return _hf_model(kind), None


def _cell_batches(kind: str, task: object, dp_rank: int, dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's batch for this dp rank: its share of the same global batches as the reference."""
    if kind == "gpt":
        loader = ShardedBatches(task, 8, dp_rank=dp_rank, dp_size=dp)
        return [loader.batch_at(step) for step in range(STEPS)]
    share = 4 // dp
    return [tuple(t[dp_rank * share : (dp_rank + 1) * share] for t in _hf_batch(step)) for step in range(STEPS)]


def _cells(recompute: str) -> dict[str, tuple[str, Layout, float | None]]:
    """The cells a recompute mode runs: op refuses zero-bubble (test_bad_recompute_choices)."""
    return {
        name: cell for name, cell in COMPOSED.items() if not (recompute == "op" and cell[1].schedule == "zero-bubble")
    }


def _train_composed(recompute: str) -> dict[str, dict]:
    out = {}
    for name, (kind, layout, clip) in _cells(recompute).items():
        model, task = _cell_model(kind)
        layout = Layout(**{**layout.to_dict(), "recompute": recompute})
        engine = plait.parallelize(model, layout, optimizer=composition_optimizer, max_grad_norm=clip)
        if recompute == "op":  # every block runs under the per-operator checkpoint
            recomputed = [m._plait_recompute for m in engine.model.modules() if hasattr(m, "_plait_recompute")]
        elif kind == "gpt":
            recomputed = [m.recompute_core for m in engine.model.modules() if hasattr(m, "recompute_core")]
        else:
            recomputed = [engine.model.config._attn_implementation.startswith("plait_selective_")]
        grads: list = []
        engine.before_optimizer_step.append(lambda e, g=grads: g.append(whole_gradients(e)) if not g else None)
        batches = _cell_batches(kind, task, engine.mesh.index("dp"), engine.mesh.size("dp"))
        if engine.pipeline is not None:
            engine.pipeline.count_activations()
        losses = [engine.train_step(batch).loss for batch in batches]
        peaks = engine.pipeline.peak_activation_bytes() if engine.pipeline is not None else {}
        out[name] = {
            "losses": losses,
            "grads": grads[0],
            "params": whole_parameters(engine),
            "recomputed": recomputed,
            "stage_peaks": peaks,
        }
    return out


@functools.cache
def _reference(kind: str, clip: float | None):
    from plait.models.hf import return_logits

    model, task = _cell_model(kind)
    if kind == "gpt":
        loader = ShardedBatches(task, 8)
        batches = [loader.global_batch_at(step) for step in range(STEPS)]
    else:
        model, batches = return_logits(model), [_hf_batch(step) for step in range(STEPS)]
    return train_reference(model, batches, composition_optimizer, max_grad_norm=clip)


@pytest.mark.distributed
@pytest.mark.parametrize("recompute", ["selective", "op"])
def test_recompute_composes_with_every_paradigm(recompute):
    """Losses, step-0 gradients and final parameters of every cell equal single-device training (the composition
    matrix's fp32 tolerances), every rank's attention layers do recompute their cores (selective) or its blocks run
    under the per-operator checkpoint (op), and the pipeline's measured per-stage peaks equal the formula's."""
    per_rank = run_distributed(_train_composed, 4, recompute, timeout=300)
    for name, (kind, _, clip) in _cells(recompute).items():
        runs = [rank[name] for rank in per_rank]
        assert all(run["recomputed"] and all(run["recomputed"]) for run in runs), f"{name}: not recomputed"
        expected = _reference(kind, clip)
        for step, (actual, wanted) in enumerate(zip(runs[0]["losses"], expected.losses)):
            assert abs(actual - wanted) <= LOSS_RTOL * abs(wanted), f"{name} step {step}: {actual} != {wanted}"
        grads = merge_ranks([run["grads"] for run in runs], f"{name} grads")
        params = merge_ranks([run["params"] for run in runs], f"{name} params")
        assert params.keys() == expected.params[-1].keys(), name
        assert_tensors_close(grads, expected.grads[0], f"{name} step 0 grad", GRAD_TOL)
        assert_tensors_close(params, expected.params[-1], f"{name} final param", PARAM_TOL)
    _check_stage_peaks([rank["dp2-pp2-1f1b-zero1"]["stage_peaks"] for rank in per_rank], recompute)


def _check_stage_peaks(per_rank: list[dict[int, int]], recompute: str) -> None:
    """The pipeline runtime's measured peak of saved activations per stage (its SavedActivations of every
    micro-batch in flight under 1F1B: 2 on the first stage, 1 on the last) equals ``rank_activations``' walk over
    the schedule, once two differences of what the runtime counts are put back: each micro-batch's token ids are
    a view of the rank's batch (4 samples, 2 per micro-batch), whose whole storage it counts per micro-batch
    (+8 x 2 x 8 bytes each), and the last stage's loss (log-softmax 4 b s V, targets 8 b s, a scalar) is
    computed after the stage's forward, outside its count."""
    from plait.planner.memory import _run_forward, rank_activations

    model, _ = composition_model()
    layout = Layout(dp=2, pp=2, zero=1, microbatches=2, recompute=recompute)
    spec = model.spec()
    predicted, _ = rank_activations(spec, layout, _run_forward(spec, layout, {"batch": 2}, "cpu"))
    b, s = 2, spec.seq
    counted_as_runtime = [predicted[0] + 2 * 8 * b * s, predicted[1] - (4 * b * s * spec.vocab + 8 * b * s + 4)]
    measured = {stage: peak for peaks in per_rank for stage, peak in peaks.items()}
    assert [measured[stage] for stage in range(2)] == counted_as_runtime, (measured, predicted)
