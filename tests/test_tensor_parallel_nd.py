"""2D (SUMMA), 2.5D (Tesseract) and 3D tensor parallelism against the single-device nn.Linear / MLP: forward,
input and weight gradients, a few SGD and AdamW steps of the MLP, wire bytes per layer against the formulas,
per-rank parameter memory, and bad input (pure). One spawn per mode: 2D on 4 ranks, 2.5D and 3D on 8."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness import run_distributed
from plait import Layout, LayoutError
from plait.comm import Comm
from plait.mesh import Mesh
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
from plait.parallel.tensor.grid import TP_COL, TP_DEP, local_block, whole
from tp_helpers import LAYER_TOL, PARAM_TOL

M, IN, OUT = 8, 8, 16
"""Tiny sizes that every grid divides: batch M by q*d (2.5D) and q^2 (3D), the bias OUT by q^3 (3D)."""
STEPS = 3

MODES = {
    "2d": dict(world=4, layout=dict(tp=4, tp_mode="2d"), q=2, d=1, linears=[("Linear2D", {})], mlp=MLP2D),
    "2.5d": dict(world=8, layout=dict(tp=8, tp_mode="2.5d", tp_depth=2), q=2, d=2,
                 linears=[("Linear2p5D", {})], mlp=MLP2p5D),
    "3d": dict(world=8, layout=dict(tp=8, tp_mode="3d"), q=2, d=2,
               linears=[("Linear3D", dict(reduce_axis=TP_DEP, out_axis=TP_COL)),
                        ("Linear3D", dict(reduce_axis=TP_COL, out_axis=TP_DEP))], mlp=MLP3D),
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
        # fp32 after 3 steps: AdamW's g / sqrt(v) can magnify a gradient's last-ulp difference near zero, bounded
        # by lr per step (PARAM_TOL, as for 1D)
        _close(params["weight"], ref.weight.detach(), f"{mode} {label} weight after {STEPS} steps", PARAM_TOL)
        _close(params["bias"], ref.bias.detach(), f"{mode} {label} bias after {STEPS} steps", PARAM_TOL)
    return sum(p.numel() for p in mlp.parameters())


def _run_mode(mode: str) -> dict:
    spec = MODES[mode]
    comm = Comm(Mesh.build(Layout(**spec["layout"])))
    ratios = _layer_checks(comm, spec, mode)
    held = {}
    for opt_name, make in (("sgd", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
                           ("adamw", lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1))):
        held[opt_name] = _mlp_training(comm, spec, mode, make)
    return {"ratios": ratios, "held": held["adamw"]}


@pytest.mark.distributed
@pytest.mark.parametrize("mode", list(MODES))
def test_nd_layers_and_mlp_match_single_device(mode):
    spec = MODES[mode]
    results = run_distributed(_run_mode, spec["world"], mode)
    full = 2 * (IN * OUT) + OUT + IN  # the MLP's parameters
    share = spec["layout"]["tp"] // (spec["d"] if mode == "2.5d" else 1)  # 2.5D keeps d copies
    for rank, result in enumerate(results):
        # bytes per layer (forward + backward) equal the papers' per-rank formulas exactly (ring model)
        assert result["ratios"] == pytest.approx([1.0] * len(spec["linears"]), abs=1e-12), f"rank {rank}"
        assert result["held"] * share == full, f"{mode} rank {rank}: holds {result['held']} of {full} elements"


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


def test_layer_needs_its_mode_and_parallelize_says_where_nd_lives():
    with pytest.raises(LayoutError, match="needs a mesh with tp_mode in '3d'.*Fix: build the Mesh"):
        Linear3D(nn.Linear(8, 8), _comm(tp=4, tp_mode="2d"))
    with pytest.raises(LayoutError, match="exists as modules.*Linear2D / MLP2D.*Linear3D / MLP3D"):
        plan_tensor_parallel(nn.Sequential(nn.Linear(4, 4)), Layout(tp=4, tp_mode="2d").resolve(4))


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
