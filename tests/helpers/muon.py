"""Muon parity helpers: the hybrid optimizer (Muon on the hidden matrices, AdamW on the rest) on the composition
matrix's tiny GPT, trained by plait under a layout and on one device.

Tolerances. ``torch.optim.Muon`` orthogonalises each update with Newton-Schulz iterations run in **bf16**. A layout
computes the same gradient as one device up to fp32 reordering (a few ulps); rounded to bf16 (8 bits of mantissa,
2^-9 = 2e-3 relative) such an ulp flips the rounding of some elements, and five Newton-Schulz iterations carry that
into every element of the update. Measured on CPU (3 steps, lr 0.02 with Moonlight's RMS matching, so each step moves
a 64x16 matrix by up to 0.032): the parameters of every layout differ from one device by at most 1.6e-3 (3.2e-3 with
tp=2); with the Newton-Schulz iterations run in fp32 instead (``fp32_newton_schulz``), by at most 5e-7. So the
distribution is exact and bf16 is the only source: the tests compare with fp32 iterations at fp32 tolerances, and
with torch's own bf16 iterations at ``BF16_PARAM_ATOL``, which a shard-wise orthogonalisation (the bug this replaces)
exceeds by an order of magnitude (``test_slice_orthogonalisation_is_caught``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from unittest import mock

import torch
import torch.optim._muon as torch_muon
from helpers.composition import GLOBAL_BATCH, make_model, whole_gradients, whole_parameters
from helpers.reference import Trajectory, train_reference

import plait
from plait import Layout
from plait.data import ShardedBatches
from plait.parallel.whole_tensor import HybridOptimizer, WholeSlot, WholeTensorOptimizer, hidden_matrices

STEPS = 3
CLIP = 0.05
MUON_LR = 0.02
BF16_PARAM_ATOL = 6e-3
"""Parameters with torch's bf16 Newton-Schulz: measured worst 3.2e-3 (tp=2), 1.6e-3 (others) after 3 steps; a step
moves a parameter by up to 0.032. Slice-wise orthogonalisation under tp=2 is off by more than 1e-2."""
BF16_LOSS_RTOL = 1e-4
"""Losses with bf16 Newton-Schulz: measured 1.2e-5 relative at step 2 (the parameters' difference above)."""


def muon_spec() -> WholeTensorOptimizer:
    """Muon (Moonlight's update-RMS matching, so that it takes AdamW-sized steps) on the hidden matrices, AdamW (eps
    1e-5 as the composition matrix) on embeddings, head and norms."""
    return WholeTensorOptimizer(
        whole=lambda p: torch.optim.Muon(p, lr=MUON_LR, weight_decay=0.01, adjust_lr_fn="match_rms_adamw"),
        rest=lambda p: torch.optim.AdamW(p, lr=1e-3, eps=1e-5, weight_decay=0.1),
    )


def plain_muon(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """A user's plain factory: torch.optim.Muon on whatever it is given, with muon_spec's settings. Under tp or
    ZeRO plait adopts it (``plait.parallel.whole_tensor.adopt_plain_factory``) when it takes every trainable
    parameter."""
    return torch.optim.Muon(params, lr=MUON_LR, weight_decay=0.01, adjust_lr_fn="match_rms_adamw")


def matrices_model() -> tuple[torch.nn.Module, object]:
    """``make_model`` with every parameter that is not a matrix (the norms' weights) frozen, so that a plain Muon
    factory takes every trainable parameter: embeddings, attention, MLP and head matrices."""
    model, task = make_model()
    for param in model.parameters():
        param.requires_grad_(param.dim() == 2)
    return model, task


def _newton_schulz_fp32(grad: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float):  # noqa: ANN201
    """torch.optim.Muon's iteration (torch/optim/_muon.py), in fp32 instead of bf16."""
    a, b, c = coefficients
    x = grad.float()
    tall = grad.size(0) > grad.size(1)
    x = x.T if tall else x
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


@contextlib.contextmanager
def fp32_newton_schulz(on: bool = True) -> Iterator[None]:
    """Run torch.optim.Muon's Newton-Schulz iterations in fp32 inside (on every rank that enters it)."""
    original = torch_muon._zeropower_via_newtonschulz
    if on:
        torch_muon._zeropower_via_newtonschulz = _newton_schulz_fp32
    try:
        yield
    finally:
        torch_muon._zeropower_via_newtonschulz = original


def reference(fp32: bool, clip: float | None = CLIP, plain: bool = False) -> Trajectory:
    """One device, the whole global batch, the same hybrid optimizer (Muon on the parameters ``hidden_matrices``
    names, AdamW on the others), through ``helpers.reference.train_reference``. ``plain``: ``matrices_model``
    trained by ``plain_muon`` on its trainable parameters, as a user would on one device."""
    model, task = matrices_model() if plain else make_model()
    loader = ShardedBatches(task, GLOBAL_BATCH)
    if plain:
        batches = [loader.global_batch_at(s) for s in range(STEPS)]
        with fp32_newton_schulz(fp32):
            return train_reference(
                model, batches, lambda ps: plain_muon(p for p in ps if p.requires_grad), max_grad_norm=clip
            )
    hidden = hidden_matrices(model)
    mask = [name in hidden for name, _ in model.named_parameters()]
    spec = muon_spec()

    def hybrid(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        params = list(params)  # the reference's copy of the model, in the same order
        whole = spec.whole([p for p, m in zip(params, mask) if m])
        assert spec.rest is not None
        return HybridOptimizer([whole, spec.rest([p for p, m in zip(params, mask) if not m])])

    with fp32_newton_schulz(fp32):
        return train_reference(model, [loader.global_batch_at(s) for s in range(STEPS)], hybrid, max_grad_norm=clip)


def train(layout: Layout, fp32: bool, clip: float | None = CLIP, mutant: bool = False, plain: bool = False) -> dict:
    """One rank's run: losses, the step-0 synchronised gradients, the whole parameters after the last step, and
    the traffic of each step. ``mutant``: tp slices are stepped as they are (Muon orthogonalises each rank's slice:
    what plait did before whole-tensor optimizers). ``plain``: ``matrices_model`` with the plain factory
    ``plain_muon``, which plait adopts."""
    model, task = matrices_model() if plain else make_model()
    slices = mock.patch.object(WholeSlot, "sliced", property(lambda _: False)) if mutant else contextlib.nullcontext()
    with fp32_newton_schulz(fp32), slices:
        optimizer = plain_muon if plain else muon_spec()
        engine = plait.parallelize(model, layout, optimizer=optimizer, max_grad_norm=clip)
        grads: list[dict[str, torch.Tensor]] = []
        engine.before_optimizer_step.append(lambda e: grads.append(whole_gradients(e)) if not grads else None)
        loader = ShardedBatches(task, GLOBAL_BATCH, dp_rank=engine.mesh.index("dp"), dp_size=engine.mesh.size("dp"))
        stats = [engine.train_step(loader.batch_at(step)) for step in range(STEPS)]
    return {
        "losses": [s.loss for s in stats],
        "grads": grads[0],
        "params": whole_parameters(engine),
        "comm": [s.comm.to_dict() for s in stats],
    }


def train_many(cases: dict[str, tuple]) -> dict[str, dict]:
    """Several runs in one process group (one spawn): name -> ``(layout, fp32, clip, mutant[, plain])`` -> results."""
    return {name: train(*case) for name, case in cases.items()}


RESHARD_LAYOUTS = {
    "zero1": Layout(dp=2, zero=1),
    "ddp": Layout(dp=2),
    "tp2": Layout(tp=2),
    "zero3": Layout(dp=2, zero=3),
}
RESHARD_PAIRS = [("zero1", "ddp"), ("zero1", "tp2"), ("tp2", "zero1"), ("zero1", "zero3")]
SAVE_AT, RESHARD_STEPS = 2, 4


def reshard(root: str, drop_state: bool = False) -> dict:
    """Muon's state across layouts (world 2, fp32 Newton-Schulz): each A trains 4 steps saving after 2; each B
    loads A's checkpoint and trains steps 2..3. ``drop_state``: B forgets the loaded optimizer state (a control:
    the comparison must see a lost momentum)."""
    out: dict = {}
    with fp32_newton_schulz(True):
        for name in sorted({a for a, _ in RESHARD_PAIRS}):
            engine, loader = _engine(RESHARD_LAYOUTS[name])
            losses = [engine.train_step(loader.batch_at(step)).loss for step in range(SAVE_AT)]
            engine.save(f"{root}/{name}")
            losses += [engine.train_step(loader.batch_at(step)).loss for step in range(SAVE_AT, RESHARD_STEPS)]
            out[name] = {"losses": losses, "final": whole_parameters(engine)}
        for a, b in RESHARD_PAIRS:
            engine, loader = _engine(RESHARD_LAYOUTS[b])
            assert engine.load(f"{root}/{a}") == SAVE_AT
            if drop_state:
                engine.strategy.optimizer.state.clear()
            losses = [engine.train_step(loader.batch_at(step)).loss for step in range(SAVE_AT, RESHARD_STEPS)]
            out[f"{a}->{b}"] = {"losses": losses, "final": whole_parameters(engine)}
    return out


def _engine(layout: Layout) -> tuple[plait.Engine, ShardedBatches]:
    model, task = make_model()
    engine = plait.parallelize(model, layout, optimizer=muon_spec(), max_grad_norm=CLIP)
    loader = ShardedBatches(task, GLOBAL_BATCH, dp_rank=engine.mesh.index("dp"), dp_size=engine.mesh.size("dp"))
    return engine, loader
