"""One model description (plait.models.spec.ModelSpec) owns the FLOPs per token: the reference GPT, the run
metrics' MFU and the planner count the same number, and torch's own FLOP counter measures it."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

from plait import Layout
from plait.models import GPT, GPTConfig, ModelSpec, lm_loss
from plait.parallel.recompute import apply_recompute
from plait.planner import predict
from plait.planner.models import ModelSpec as PlannerModelSpec
from plait.planner.models import resolve_model
from plait.train.loop import Throughput
from plait.train.metrics import model_flops_per_token

GPT2_SMALL_SHAPE = GPTConfig(vocab_size=50304, seq_len=1024, n_layer=12, n_head=12, d_model=768)
"""The shape issue 14 ran on an H100: 854.7 M FLOPs per token (metrics) against 1091.9 M (GPT's old 6N + 12 L h s)."""
TINY = {
    "gpt2-style": GPTConfig(vocab_size=40, seq_len=16, n_layer=2, n_head=4, d_model=32),
    "llama-style-gqa": GPTConfig.llama_style(vocab_size=40, seq_len=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32),
}


def test_the_planner_imports_the_same_class():
    assert PlannerModelSpec is ModelSpec


def test_one_count_everywhere_for_the_gpt2_small_shape():
    with torch.device("meta"):  # shapes only: no 163M-parameter allocation
        model = GPT(GPT2_SMALL_SHAPE)
    spec = ModelSpec.from_gpt_config(GPT2_SMALL_SHAPE)
    want = 3 * (12 * (2 * 12 * 768**2 + 4 * 1024 * 768) + 2 * 768 * 50304)  # Narayanan et al. 2021, eq. 3 per token
    assert want == 854_654_976
    assert spec.flops_per_token() == model.flops_per_token() == want
    assert model_flops_per_token(model, 1024) == model_flops_per_token(GPT2_SMALL_SHAPE, 1024) == want
    assert spec.parameters == model.num_parameters() == 163_109_376
    # the old 6 N + 12 L h s counted 6 FLOPs for every parameter, lookups and elementwise weights included
    lookups = 50304 * 768 + 1024 * 768
    elementwise = (
        12 * (9 * 768 + 4 * 768) + 2 * 768
    )  # biases of q, k, v, o, up (4h), down; the norms' weights and biases
    assert 6 * model.num_parameters() + 12 * 12 * 768 * 1024 == 1_091_902_464 == want + 6 * (lookups + elementwise)


@pytest.mark.parametrize("name", list(TINY))
def test_torch_flop_counter_measures_the_spec(name):
    """torch.utils.flop_counter counts every matmul of a real forward + backward (math attention, whose bmm it
    sees): exactly tokens x flops_per_token; the parameter count is the module's."""
    config = TINY[name]
    torch.manual_seed(0)
    model = GPT(config)
    tokens = torch.randint(0, config.vocab_size, (3, config.seq_len))
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        lm_loss(model(tokens), tokens).backward()
    assert counter.get_total_flops() == tokens.numel() * model.flops_per_token()
    assert model.spec().parameters == model.num_parameters()


@pytest.mark.parametrize("recompute, extra_blocks", [("full", 2), ((1,), 1), ("selective", None)])
def test_recomputation_adds_the_hardware_flops_it_says(recompute, extra_blocks):
    """Model FLOPs exclude recomputation (Chowdhery et al. 2022, app. B); the hardware FLOPs it adds are what
    torch counts on top: the forward of the recomputed blocks, or the attention cores only (selective). Counted
    as the papers do, with the whole recomputed forward: torch's default early stop skips the last matmul of a
    recomputed region (its output is not needed again), so it is switched off here."""
    config = TINY["gpt2-style"]
    torch.manual_seed(0)
    model = GPT(config)
    apply_recompute(model, recompute)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_len))
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH), set_checkpoint_early_stop(False):
        lm_loss(model(tokens), tokens).backward()
    spec = model.spec()
    extra = spec.recompute_flops_per_token(recompute)
    assert counter.get_total_flops() == tokens.numel() * (spec.flops_per_token() + extra)
    if extra_blocks is not None:
        assert extra == spec.forward_flops_per_token(blocks=extra_blocks, logits=False)
    else:
        assert extra == config.n_layer * 4 * config.seq_len * config.d_model


@pytest.mark.parametrize("name", list(TINY))
@pytest.mark.parametrize("kernel", ["flash", "math"])
def test_operator_recomputation_adds_the_flops_it_says(name, kernel):
    """Layout(recompute="op") adds what torch spends (its default early stop on): the even-numbered matmuls but
    the region's last (k and o; a gated MLP's up), and with the math attention kernel the core (its bmm, which
    the policy does not keep). A fused kernel's output is kept, so its FLOPs are not repeated."""
    config = TINY[name]
    spent = {}
    for recompute in ("none", "op"):
        torch.manual_seed(0)
        model = GPT(config)
        apply_recompute(model, recompute)
        tokens = torch.randint(0, config.vocab_size, (2, config.seq_len), generator=torch.Generator().manual_seed(1))
        counter = FlopCounterMode(display=False)
        backend = SDPBackend.MATH if kernel == "math" else SDPBackend.FLASH_ATTENTION
        with counter, sdpa_kernel(backend):
            lm_loss(model(tokens), tokens).backward()
        spent[recompute] = counter.get_total_flops()
    spec = model.spec()
    h, kv_width = config.d_model, spec.kv * spec.head_dim
    matmuls = 2 * h * (kv_width + h) + (2 * h * spec.ffn if spec.gated else 0)
    core = 4 * config.seq_len * h if kernel == "math" else 0
    extra = spec.recompute_flops_per_token("op", fused_attention=kernel == "flash")
    assert extra == config.n_layer * (matmuls + core)
    assert spent["op"] - spent["none"] == tokens.numel() * extra


def test_pipeline_stages_sum_to_the_model():
    spec = ModelSpec.from_gpt_config(TINY["gpt2-style"])
    first = spec.flops_per_token(blocks=1, logits=False)
    assert first + spec.flops_per_token(blocks=1) == spec.flops_per_token()


def test_the_planner_counts_the_same_model_flops():
    spec = resolve_model("gpt2")
    assert isinstance(spec, ModelSpec)
    layout = Layout(dp=8, recompute="selective", precision="bf16")
    result = predict(spec, layout, "h100", global_batch=64)
    tokens = 64 * spec.seq
    assert result.model_flops == tokens * spec.flops_per_token()
    assert result.hardware_flops == result.model_flops + tokens * spec.layers * 4 * spec.seq * spec.hidden


def test_run_throughput_leaves_the_warm_up_step_out():
    meter = Throughput()
    meter.add(1000, 5.0)  # warm-up: allocator growth, lazy state
    assert meter.tokens_per_s == 200.0  # alone, the first step is all there is
    meter.add(1000, 1.0)
    meter.add(1000, 1.0)
    assert meter.tokens_per_s == 1000.0
