"""2D (SUMMA), 2.5D (Tesseract) and 3D tensor parallelism against single-device training.

Per mode, in one spawn (2D on 4 ranks, 2.5D and 3D on 8): each grid Linear against nn.Linear (forward, input and
weight gradients, wire bytes per layer against the papers' formulas), GridNorm against LayerNorm and RMSNorm,
5 SGD and 5 AdamW steps of the MLP, the wire bytes of one GPT block against the sum of its layers' formulas, and
plait's GPT through ``parallelize(model, Layout(tp=..., tp_mode=...))`` (GPT-2 style: LayerNorm, learned
positions, GELU; Llama style: RMSNorm, RoPE, GQA, SwiGLU) over 5 AdamW steps with clipping: the logits before
training, the loss at every step, every parameter's gradient at step 1 and every parameter after 5 steps, the
evaluation, and the parameter elements each rank holds. Bad input (pure): grids, sizes, heads, plans, layouts."""

from __future__ import annotations

import re

import pytest
import torch
from helpers.harness import run_distributed
from helpers.tp import (
    GLOBAL_BATCH,
    LAYER_TOL,
    MODELS,
    PARAM_TOL,
    STEPS,
    assert_matches_reference,
    reference_run,
    train_tp,
)
from torch import nn

from plait import Layout, LayoutError
from plait.comm import Comm
from plait.mesh import Mesh
from plait.models import GPT, GPTConfig
from plait.models.layers import Block, RMSNorm
from plait.parallel.tensor import (
    MLP2D,
    MLP3D,
    Linear2D,
    Linear2p5D,
    Linear3D,
    MLP2p5D,
    gather_activation,
    plan_tensor_parallel,
    scatter_activation,
)
from plait.parallel.tensor.grid import ACTIVATION_PLACEMENT, TP_COL, TP_DEP, local_block, whole
from plait.parallel.tensor.grid_layers import GridEmbedding, GridNorm
from plait.parallel.tensor.grid_plan import apply_grid_plan, gpt_grid_plan, resolve_grid_plan

M, IN, OUT = 8, 8, 16
"""Tiny sizes that every grid divides: batch M by q*d (2.5D) and q^2 (3D), the bias OUT by q^3 (3D)."""
GPT_KINDS = ("gpt2", "llama_gqa")
"""tp_helpers' tiny GPTs (d_model 16, 4 heads, vocab 12, T 8, batch 8): every size divides every grid here."""

MODES = {
    "2d": dict(world=4, layout=dict(tp=4, tp_mode="2d"), q=2, d=1, linears=[("Linear2D", {})], mlp=MLP2D),
    "2.5d": dict(
        world=8, layout=dict(tp=8, tp_mode="2.5d", tp_depth=2), q=2, d=2, linears=[("Linear2p5D", {})], mlp=MLP2p5D
    ),
    "3d": dict(
        world=8,
        layout=dict(tp=8, tp_mode="3d"),
        q=2,
        d=2,
        linears=[
            ("Linear3D", dict(reduce_axis=TP_DEP, out_axis=TP_COL)),
            ("Linear3D", dict(reduce_axis=TP_COL, out_axis=TP_DEP)),
        ],
        mlp=MLP3D,
    ),
}
LINEARS = {"Linear2D": Linear2D, "Linear2p5D": Linear2p5D, "Linear3D": Linear3D}


def theory_wire_bytes(mode: str, q: int, d: int, m: int = M, k: int = IN, n: int = OUT) -> float:
    """Ring wire bytes one rank sends for one layer, forward + backward (fp32), as in the module docstrings."""
    ring = (q - 1) / q
    if mode == "2d":
        return 4 * 2 * ring * (m * k / q + k * n / q + n / q)
    if mode == "2.5d":
        return 4 * (2 * ring * (m * k / (d * q) + k * n / q + n / q) + 2 * (d - 1) / d * (k * n + n) / q**2)
    return 4 * 2 * ring * ((m * k + k * n + m * n) / q**2 + n / q**2 + n / q)


def block_theory_bytes(mode: str, q: int, depth: int, m: int, config: GPTConfig) -> float:
    """Ring wire bytes one rank sends for one transformer block (pre-norm attention + MLP, no biases), forward +
    backward (fp32), summed from the per-layer terms of the module docstrings: per grid linear K -> N an input
    gather (once per group entered together: q/k/v, gate/up), a weight gather (+ 2.5D's depth all-reduce of dW)
    and, in 3D, the output reduce-scatter; per norm its statistics (all-reduced over the q feature ranks, forward
    and backward) and its weight's all-gather over the batch axes (a reduce-scatter backward)."""
    ring, d, f = (q - 1) / q, config.d_model, config.ffn_dim
    kv = config.kv_heads * config.head_dim
    if mode == "3d":
        rows = m / q**2
        gather = lambda k: 2 * ring * m * k / q**2  # noqa: E731 - input [M/q^2, K/q] gathered over the batch
        weight = lambda k, n: 2 * ring * k * n / q**2  # noqa: E731 - W[N/q, K/q] gathered over tp_row
        out = lambda n: 2 * ring * m * n / q**2  # noqa: E731 - partial products reduce-scattered over the batch
        norm_weight = 2 * ring * (d / q**2 + d / q)  # gathered over tp_col, then tp_row
    else:
        rows = m / (q * depth)
        gather = lambda k: 2 * ring * rows * k  # noqa: E731 - input [M/(dq), K/q] gathered over tp_col
        weight = lambda k, n: 2 * ring * k * n / q + 2 * (depth - 1) / depth * k * n / q**2  # noqa: E731
        out = lambda n: 0.0  # noqa: E731 - SUMMA's output needs no communication
        norm_weight = 2 * ring * d / (q * depth) + 2 * (depth - 1) / depth * d / q  # over tp_row, then tp_dep
    stats = 2 if config.norm == "layernorm" else 1  # mean and variance, or the mean square
    norm = stats * 2 * 2 * ring * rows + norm_weight
    attention = gather(d) + sum(weight(d, n) + out(n) for n in (d, kv, kv)) + gather(d) + weight(d, d) + out(d)
    ups = 2 if config.mlp == "swiglu" else 1
    mlp = gather(d) + ups * (weight(d, f) + out(f)) + gather(f) + weight(f, d) + out(d)
    return 4 * (2 * norm + attention + mlp)


def _block_bytes(comm: Comm, mode: str, spec: dict) -> list[float]:
    """Measured / theory wire bytes of one GPT block, forward + backward, under the built-in grid plan's styles."""
    ratios = []
    for kind in GPT_KINDS:
        config = GPTConfig(**MODELS[kind], vocab_size=12, seq_len=8)
        torch.manual_seed(0)
        block = Block(config)
        plan = {k.removeprefix("blocks.*."): v for k, v in gpt_grid_plan(GPT(config)).items() if "blocks" in k}
        apply_grid_plan(resolve_grid_plan(block, plan, comm.mesh.layout), block, comm, gather_logits=False)
        x = scatter_activation(torch.randn(GLOBAL_BATCH, config.seq_len, config.d_model), comm).requires_grad_()
        before = comm.stats.snapshot()
        block(x).square().sum().backward()
        measured = comm.stats.since(before).total_wire_bytes
        tokens = GLOBAL_BATCH * config.seq_len
        ratios.append(measured / block_theory_bytes(mode, spec["q"], spec["d"], tokens, config))
    return ratios


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, tol: dict = LAYER_TOL) -> None:
    # fp32: the blocked matmul and the reduce-scatters add the same products in another order (a few ulps)
    torch.testing.assert_close(actual, expected, **tol, msg=lambda m: f"{what}: {m}")


def _layer_checks(comm: Comm, spec: dict, mode: str) -> list[float]:
    """Each layer of the mode against nn.Linear: output, dX, dW, db (whole); returns measured/theory wire bytes."""
    ratios = []
    for name, kwargs in spec["linears"]:
        torch.manual_seed(0)
        linear = nn.Linear(IN, OUT)
        x = torch.randn(M, IN, requires_grad=True)
        upstream = torch.randn(M, OUT)
        (linear(x) * upstream).sum().backward()

        layer = LINEARS[name].from_linear(linear, comm, **kwargs)
        x_local = local_block(x, comm, layer.input_placement()).requires_grad_()
        before = comm.stats.snapshot()
        y_local = layer(x_local)
        (y_local * local_block(upstream, comm, layer.output_placement())).sum().backward()
        measured = comm.stats.since(before).total_wire_bytes
        what = f"{mode} {name}{kwargs or ''}"
        _close(whole(y_local, comm, layer.output_placement()), linear(x).detach(), f"{what} output")
        _close(whole(x_local.grad, comm, layer.input_placement()), x.grad, f"{what} input grad")
        grads = layer.whole_parameters(grads=True)
        _close(grads["weight"], linear.weight.grad, f"{what} weight grad")
        _close(grads["bias"], linear.bias.grad, f"{what} bias grad")
        ratios.append(measured / theory_wire_bytes(mode, spec["q"], spec["d"]))
    return ratios


def _norm_checks(comm: Comm, mode: str) -> None:
    """GridNorm against nn.LayerNorm (with bias) and RMSNorm on activations in the mode's placement: output, dX,
    and the whole weight / bias gradients."""
    for norm in (nn.LayerNorm(OUT), RMSNorm(OUT)):
        torch.manual_seed(2)
        with torch.no_grad():  # not the init values, so that the affine terms matter
            for param in norm.parameters():
                param.normal_()
        x = torch.randn(M, OUT, requires_grad=True)
        upstream = torch.randn(M, OUT)
        (norm(x) * upstream).sum().backward()
        grid = GridNorm.from_norm(norm, comm)
        placement = ACTIVATION_PLACEMENT[mode]
        x_local = local_block(x, comm, placement).requires_grad_()
        y_local = grid(x_local)
        (y_local * local_block(upstream, comm, placement)).sum().backward()
        what = f"{mode} {type(norm).__name__}"
        _close(whole(y_local, comm, placement), norm(x).detach(), f"{what} output")
        _close(whole(x_local.grad, comm, placement), x.grad, f"{what} input grad")
        for name, param in grid.named_parameters():
            _close(whole(param.grad, comm, param.tp_grid_placement), getattr(norm, name).grad, f"{what} {name} grad")


def _mlp_training(comm: Comm, spec: dict, mode: str, make_optimizer) -> int:
    """A few optimizer steps of the MLP (entered and left through the differentiable scatter / gather) against the
    single-device MLP with the same optimizer; returns the parameter elements this rank holds."""
    torch.manual_seed(1)
    reference = nn.Sequential(nn.Linear(IN, OUT), nn.GELU(), nn.Linear(OUT, IN))
    mlp = spec["mlp"].from_linears(reference[0], reference[2], comm)
    ref_opt, opt = make_optimizer(reference.parameters()), make_optimizer(mlp.parameters())
    for step in range(STEPS):
        x, target = torch.randn(M, IN), torch.randn(M, IN)
        x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
        ref_loss = ((reference(x_ref) - target) ** 2).mean()
        ref_opt.zero_grad()
        ref_loss.backward()
        loss = ((gather_activation(mlp(scatter_activation(x_tp, comm)), comm) - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        # the input gradient comes back through scatter_activation's all-gather backward, whole on every rank
        _close(x_tp.grad, x_ref.grad, f"{mode} MLP input grad step {step}")
        ref_opt.step()
        opt.step()
        # fp32: the same loss from blocks summed in another order
        assert abs(loss.item() - ref_loss.item()) <= 1e-6 * abs(ref_loss.item()), f"{mode} step {step} loss"
    for (label, layer), ref in ((("up", mlp.up), reference[0]), (("down", mlp.down), reference[2])):
        params = layer.whole_parameters()
        # fp32 after 5 steps: AdamW's g / sqrt(v) can magnify a gradient's last-ulp difference near zero, bounded
        # by lr per step (PARAM_TOL, as for 1D)
        _close(params["weight"], ref.weight.detach(), f"{mode} {label} weight after {STEPS} steps", PARAM_TOL)
        _close(params["bias"], ref.bias.detach(), f"{mode} {label} bias after {STEPS} steps", PARAM_TOL)
    return sum(p.numel() for p in mlp.parameters())


def _run_mode(mode: str) -> dict:
    spec = MODES[mode]
    comm = Comm(Mesh.build(Layout(**spec["layout"])))
    ratios = _layer_checks(comm, spec, mode)
    _norm_checks(comm, mode)
    held = {}
    for opt_name, make in (
        ("sgd", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
        ("adamw", lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)),
    ):
        held[opt_name] = _mlp_training(comm, spec, mode, make)
    block_ratios = _block_bytes(comm, mode, spec)
    gpt = {kind: train_tp(Layout(**spec["layout"]), kind) for kind in GPT_KINDS}  # through parallelize
    return {"ratios": ratios, "held": held["adamw"], "block_ratios": block_ratios, "gpt": gpt}


@pytest.mark.distributed
@pytest.mark.parametrize("mode", list(MODES))
def test_nd_layers_mlp_and_gpt_match_single_device(mode):
    spec = MODES[mode]
    results = run_distributed(_run_mode, spec["world"], mode, timeout=300.0)
    full = 2 * (IN * OUT) + OUT + IN  # the MLP's parameters
    share = spec["layout"]["tp"] // (spec["d"] if mode == "2.5d" else 1)  # 2.5D keeps d copies
    for rank, result in enumerate(results):
        # bytes per layer (forward + backward) equal the papers' per-rank formulas exactly (ring model)
        assert result["ratios"] == pytest.approx([1.0] * len(spec["linears"]), abs=1e-12), f"rank {rank}"
        assert result["held"] * share == full, f"{mode} rank {rank}: holds {result['held']} of {full} elements"
        # a whole GPT block (norms, attention, MLP), forward + backward: the sum of its layers' formulas, exactly
        assert result["block_ratios"] == pytest.approx([1.0] * len(GPT_KINDS), abs=1e-12), f"rank {rank}"
    for kind in GPT_KINDS:
        expected = reference_run(kind)
        for rank, result in enumerate(results):
            gpt = result["gpt"][kind]
            assert_matches_reference(gpt, expected, f"{mode} {kind} rank {rank}")
            assert gpt["losses"] == results[0]["gpt"][kind]["losses"], f"{mode} {kind}: rank {rank}'s loss differs"
            _check_grid_memory(gpt, expected.params[-1], spec, f"{mode} {kind} rank {rank}")


@pytest.mark.distributed
def test_dp2_x_2d_with_zero1_matches_single_device():
    """Grid tensor parallelism inside data parallelism: dp=2 x 2D (q=2) with ZeRO-1 over dp, 8 ranks."""
    expected = reference_run("llama_gqa")
    results = run_distributed(train_tp, 8, Layout(dp=2, tp=4, tp_mode="2d", zero=1), "llama_gqa", timeout=300.0)
    for rank, result in enumerate(results):
        assert_matches_reference(result, expected, f"dp2 x 2d zero1 rank {rank}")


def _check_grid_memory(result: dict, full: dict[str, torch.Tensor], spec: dict, what: str) -> None:
    """Every parameter is a grid block: 1/tp of it per rank, except 2.5D's linear weights, which Tesseract keeps
    in every depth layer (d/tp); nothing is replicated over the whole tp group."""
    tp, depth = spec["layout"]["tp"], spec["d"] if "tp_depth" in spec["layout"] else 1
    assert result["sharded"] == set(full), f"{what}: parameters not split: {set(full) - result['sharded']}"
    for name, numel in result["local_numel"].items():
        linear = any(part in name for part in (".attn.", ".mlp.", "lm_head"))
        copies = depth if linear else 1
        assert numel * tp == full[name].numel() * copies, f"{what} {name}: holds {numel} of {full[name].numel()}"


# ----------------------------------------------------------------- pure: layouts, mesh, bad input
def _comm(**layout) -> Comm:
    """A Comm for rank 0 of a layout, without processes (slicing only needs sizes and indices)."""
    resolved = Layout(**layout).resolve(layout["tp"])
    return Comm(Mesh(resolved, 0, {}))


@pytest.mark.parametrize(
    "layout, needle",
    [
        (dict(tp=8, tp_mode="2d"), "tp=8 is not a square.*Fix: use tp=4 or tp=9"),
        (dict(tp=4, tp_mode="3d"), "tp=4 is not a cube.*Fix: use tp=1 or tp=8"),
        (dict(tp=12, tp_mode="2.5d", tp_depth=2), "tp=12 is not 2 x a square.*tp=8 or tp=18"),
        (dict(tp=6, tp_mode="2.5d", tp_depth=4), "does not split into tp_depth=4"),
        (dict(tp=4, tp_mode="2d", tp_depth=2), "Fix: set tp_mode='2.5d'"),
        (dict(tp=4, tp_mode="4d"), "tp_mode='4d' is unknown"),
        (dict(tp=4, tp_mode="2d", sequence_parallel=True), "sequence_parallel=True is Megatron 1D"),
        (
            dict(tp=4, tp_mode="2d", tp_pad_vocab=True),
            "tp_pad_vocab=True pads Megatron 1D's.*Fix: set tp_pad_vocab=False",
        ),
    ],
)
def test_bad_nd_layouts(layout, needle):
    with pytest.raises(LayoutError, match=needle):
        Layout(**layout)


def test_inferred_tp_is_checked_at_resolve():
    with pytest.raises(LayoutError, match="tp=2 is not a square"):
        Layout(tp=-1, dp=2, tp_mode="2d").resolve(4)
    assert Layout(tp=-1, dp=2, tp_mode="2d").resolve(8).tp == 4


def test_dims_not_divisible_by_the_grid():
    with pytest.raises(LayoutError, match=r"up.weight .*size 5 does not split into 2 blocks.*multiple of 2"):
        Linear2D.from_linear(nn.Linear(5, 8), _comm(tp=4, tp_mode="2d"), "up")
    with pytest.raises(LayoutError, match=r"bias .*size 4 does not split into 8 blocks"):  # 3D cuts the bias q^3 ways
        Linear3D(nn.Linear(4, 4), _comm(tp=8, tp_mode="3d"))
    with pytest.raises(LayoutError, match="activation dim 0: size 3 does not split into 4"):
        scatter_activation(torch.zeros(3, 8), _comm(tp=8, tp_mode="2.5d", tp_depth=2))


def test_layer_needs_its_mode():
    with pytest.raises(LayoutError, match="needs a mesh with tp_mode in '3d'.*Fix: build the Mesh"):
        Linear3D(nn.Linear(8, 8), _comm(tp=4, tp_mode="2d"))


def _gpt(**fields) -> GPT:
    defaults = dict(vocab_size=12, seq_len=8, n_layer=1, n_head=4, d_model=16, bias=False)
    return GPT(GPTConfig(**{**defaults, **fields}))


@pytest.mark.parametrize(
    "model, layout, plan, needle",
    [
        (
            dict(n_head=4, n_kv_head=1),
            dict(tp=4, tp_mode="2d"),
            None,
            "splits the heads over tp_col=2 ranks, but blocks.0.attn has 1 key/value heads",
        ),
        (dict(n_head=2, d_model=16), dict(tp=9, tp_mode="2d"), None, "does not split over the grid"),
        (
            dict(vocab_size=13),
            dict(tp=4, tp_mode="2d"),
            None,
            r"lm_head.weight of shape \(13, 16\) does not split over the grid \(dim 0: size 13 does not split into 2",
        ),
        (
            dict(d_model=4, n_head=2),
            dict(tp=8, tp_mode="3d"),
            None,  # norms and embeddings: 1/tp of d_model each
            r"tok_embed.weight of shape \(12, 4\) .*dim 1: size 4 does not split into 8 blocks "
            r"\(tp_dep=2 x tp_row=2 x tp_col=2\)",
        ),
        (
            {},
            dict(tp=4, tp_mode="2d"),
            {"blocks.*.attn.q": "grid_in"},
            "parameter tok_embed.weight belongs to tok_embed, which the tp plan does not make a grid layer",
        ),
        (
            {},
            dict(tp=4, tp_mode="2d"),
            {"blocks.*.norm1": "grid_in"},
            "blocks.0.norm1 is a LayerNorm, but style 'grid_in'",
        ),
        ({}, dict(tp=4, tp_mode="2d"), {"lm_head": "colwise_vocab"}, "unknown style 'colwise_vocab'"),
        ({}, dict(tp=4, tp_mode="2d", pp=2), None, "tp_mode='2d' with pp=2 is not supported"),
        ({}, dict(tp=4, tp_mode="2d", cp=2), None, "tp_mode='2d' with cp=2 is not supported"),
        ({}, dict(tp=4, tp_mode="2d", zero=3), None, "zero=3 with tp=4 is not supported"),
    ],
)
def test_bad_grid_plans_raise_layout_errors_naming_the_fix(model, layout, plan, needle):
    layout = Layout(**layout)
    with pytest.raises(LayoutError) as info:
        plan_tensor_parallel(_gpt(**model), layout.resolve(layout.tp * layout.pp * layout.cp), plan)
    assert re.search(needle, str(info.value)) and "Fix:" in str(info.value), str(info.value)


def test_a_model_without_a_grid_plan_asks_for_one():
    with pytest.raises(LayoutError, match="tp_mode='2d' has no built-in plan for Sequential.*tp_plan="):
        plan_tensor_parallel(nn.Sequential(nn.Linear(4, 4)), Layout(tp=4, tp_mode="2d").resolve(4))
    plan = {"0": "grid_in", "2": "grid_out"}  # any model takes a grid plan covering its parameters
    resolved = plan_tensor_parallel(
        nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)), Layout(tp=4, tp_mode="2d").resolve(4), plan
    )
    assert resolved.styles == plan


def test_a_layernorm_without_affine_parameters_takes_a_grid_norm():
    """LayerNorm(elementwise_affine=False) has weight None: the grid_norm check reads its normalized_shape
    (it read weight.shape, an AttributeError) and GridNorm holds no parameters (pure: no collective)."""
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8, elementwise_affine=False))
    plan = {"0": "grid_in", "1": "grid_norm"}
    assert plan_tensor_parallel(model, Layout(tp=4, tp_mode="2d").resolve(4), plan).styles == plan
    norm = GridNorm.from_norm(model[1], _comm(tp=4, tp_mode="2d"))
    assert (norm.features, norm.weight, norm.bias, list(norm.parameters())) == (8, None, None, [])
    with pytest.raises(LayoutError, match=r"1 normalises over \(2, 4\); a grid norm takes one feature dim"):
        plan_tensor_parallel(
            nn.Sequential(nn.Linear(4, 8), nn.LayerNorm((2, 4), elementwise_affine=False)),
            Layout(tp=4, tp_mode="2d").resolve(4),
            plan,
        )


def test_a_batch_that_does_not_split_over_the_grid():
    embedding = GridEmbedding(nn.Embedding(12, 16), _comm(tp=8, tp_mode="3d"), "tok_embed")
    with pytest.raises(
        LayoutError,
        match=r"tok_embed: tp_mode='3d' splits the batch over tp_row=2 x tp_col=2 = 4 "
        r"blocks, but this micro-batch has 6 rows. Fix: .* multiple of 4",
    ):
        embedding(torch.zeros(6, 8, dtype=torch.long))


def test_local_blocks_tile_the_whole_tensor():
    """Every rank's block of the 3D weight, put back by its sub-coordinates, is the whole weight (pure)."""
    weight = torch.arange(16 * 8, dtype=torch.float32).reshape(16, 8)
    seen = torch.zeros_like(weight)
    for rank in range(8):
        comm = Comm(Mesh(Layout(tp=8, tp_mode="3d").resolve(8), rank, {}))
        layer = Linear3D(nn.Linear(8, 16), comm)
        block = local_block(weight, comm, layer.weight_placement())
        assert block.shape == (4, 4)  # 128 elements / 8 ranks
        for value in block.flatten().tolist():
            seen.view(-1)[int(value)] += 1
    assert torch.equal(seen, torch.ones_like(weight)), "each element on exactly one rank"
