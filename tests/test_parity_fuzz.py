"""Randomised parity: seeded draws of layout x loss-mask pattern x optimizer (AdamW, SGD, Muon) x clipping, each trained with plait and
compared with one device on the same global batches (losses, step-0 gradients, final parameters, the gradient
norm before clipping). The fixed matrices test what someone thought of; this searches the space around them, so
the next class of silent difference (like the mean of per-micro-batch means under uneven masks, issue 24) is found
by a machine. A draw that ``plait.parallelize`` refuses (a LayoutError before any collective) is replaced by the
next one: refusals are tested elsewhere.

CI runs ``CI_DRAWS`` draws per world size; ``make parity-fuzz`` (marker ``long``) runs ``LONG_DRAWS`` and
prints each draw. A failing draw names its seed: ``PLAIT_FUZZ_SEED=<seed> make parity-fuzz`` runs from it.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from helpers.composition import (
    GRAD_TOL,
    LOSS_RTOL,
    NORM_RTOL,
    PARAM_TOL,
    ChecksPassed,
    whole_gradients,
    whole_parameters,
)
from helpers.harness import run_distributed
from helpers.muon import fp32_newton_schulz, muon_spec
from helpers.reference import assert_tensors_close, train_reference, uneven_mask

import plait
from plait import Layout, LayoutError
from plait.data import AdditionTask, ShardedBatches
from plait.models import GPT, GPTConfig
from plait.parallel.whole_tensor import HybridOptimizer, hidden_matrices

STEPS = 3
GLOBAL_BATCH = 8
CLIP = 0.05
CI_DRAWS = 2
LONG_DRAWS = 24
FIRST_SEED = int(os.environ.get("PLAIT_FUZZ_SEED", "0"))
MASKS = ("prompt", "uneven", "sparse", "one-row")
OPTIMIZERS = ("adamw", "sgd", "muon")


@dataclass(frozen=True)
class Draw:
    """One randomised case: a layout's fields, a mask pattern, an optimizer and a clipping threshold."""

    seed: int
    layout: dict
    mask: str
    optimizer: str
    clip: float | None

    @property
    def world(self) -> int:
        return self.layout.get("dp", 1) * self.layout.get("tp", 1) * self.layout.get("pp", 1) * self.layout.get("cp", 1)

    def __str__(self) -> str:
        fields = " ".join(f"{k}={v}" for k, v in sorted(self.layout.items()))
        return f"seed {self.seed}: {fields} mask={self.mask} optimizer={self.optimizer} clip={self.clip}"


# ----------------------------------------------------------------- data, model, optimizers
class MaskedTask:
    """The addition task with one of ``MASKS``: "prompt" (its own: every row scores its answer), "uneven" (rows
    score 1..n of them), "sparse" (each scored target kept with probability 1/2), "one-row" (only every 8th
    sample scores: one data-parallel rank may hold no scored token at all)."""

    def __init__(self, mask: str) -> None:
        self.task, self.mask = AdditionTask(digits=2, seed=1), mask

    def __getattr__(self, name: str) -> object:
        if name == "task":  # unpickling looks attributes up before __init__'s have been set
            raise AttributeError(name)
        return getattr(self.task, name)

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.task.batch(indices)
        rows = [int(i) for i in indices]
        if self.mask == "uneven":
            targets = uneven_mask(targets, rows)
        elif self.mask == "sparse":
            keep = torch.stack([torch.rand(targets.shape[1], generator=torch.Generator().manual_seed(r)) for r in rows])
            targets = targets.masked_fill(keep < 0.5, -100)
        elif self.mask == "one-row":
            scored = torch.tensor([r % GLOBAL_BATCH == 3 for r in rows]).unsqueeze(1)
            targets = targets.masked_fill(~scored, -100)
        return inputs, targets


def make_model(mask: str) -> tuple[GPT, MaskedTask]:
    task = MaskedTask(mask)
    torch.manual_seed(1234)
    config = GPTConfig(vocab_size=task.vocab_size, seq_len=task.seq_len, n_layer=4, n_head=4, d_model=16, bias=False)
    return GPT(config), task


def optimizer_for(name: str):  # noqa: ANN201 - a factory, as users pass it
    """AdamW with eps 1e-5 (tests/helpers/composition.py says why), SGD with momentum, or Muon on the hidden
    matrices with AdamW on the rest (``helpers.muon.muon_spec``; run with fp32 Newton-Schulz iterations, so fp32
    tolerances hold: tests/helpers/muon.py measures why)."""
    if name == "adamw":
        return lambda params: torch.optim.AdamW(params, lr=1e-3, eps=1e-5, weight_decay=0.1)
    if name == "muon":
        return muon_spec()
    return lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)


def reference_optimizer(name: str, model: torch.nn.Module):  # noqa: ANN201 - a factory of the reference's copy
    """``optimizer_for(name)`` for ``train_reference``, which calls it on a copy's parameters in model order."""
    if name != "muon":
        return optimizer_for(name)
    spec, hidden = muon_spec(), hidden_matrices(model)
    mask = [name in hidden for name, _ in model.named_parameters()]

    def hybrid(params):  # noqa: ANN001, ANN202
        params = list(params)
        assert spec.rest is not None
        rest = spec.rest([p for p, m in zip(params, mask) if not m])
        return HybridOptimizer([spec.whole([p for p, m in zip(params, mask) if m]), rest])

    return hybrid


# ----------------------------------------------------------------- draws
def _layout_fields(rng: random.Random, world: int) -> dict:
    axes = {
        2: [("dp",), ("tp",), ("pp",), ("cp",)],
        4: [("dp", "tp"), ("dp", "pp"), ("dp", "cp"), ("tp", "pp"), ("tp", "cp"), ("pp", "cp")],
    }
    fields: dict = {axis: 2 for axis in rng.choice(axes[world])}
    fields["zero"] = rng.choice([0, 1, 2, 3])
    if fields.get("pp"):
        fields["schedule"] = rng.choice(["gpipe", "1f1b", "interleaved", "zero-bubble"])
        fields["microbatches"] = rng.choice([2, 4])
        if fields["schedule"] == "interleaved":
            fields["virtual_stages"] = 2
    else:
        fields["microbatches"] = rng.choice([1, 2])
    if fields.get("tp"):
        fields["sequence_parallel"] = rng.choice([False, True])
    if fields.get("cp"):
        fields["cp_mode"] = rng.choice(["ring", "ulysses"])
    return fields


def accepted(draw: Draw) -> bool:
    """Whether ``plait.parallelize`` accepts the draw's layout (its checks run in this process, before a mesh)."""
    model, _ = make_model(draw.mask)
    with (
        mock.patch("plait.parallelize.dist.is_initialized", return_value=True),
        mock.patch("plait.parallelize.dist.get_world_size", return_value=draw.world),
        mock.patch("plait.parallelize.Mesh.build", side_effect=ChecksPassed),
    ):
        try:
            plait.parallelize(
                model, Layout(**draw.layout), optimizer=optimizer_for(draw.optimizer), max_grad_norm=draw.clip
            )
        except ChecksPassed:
            return True
        except LayoutError:
            return False
    return False


def draws(world: int, count: int, first_seed: int = FIRST_SEED) -> list[Draw]:
    """``count`` accepted draws for ``world`` ranks, from consecutive seeds (deterministic)."""
    out: list[Draw] = []
    seed = first_seed
    while len(out) < count:
        rng = random.Random(seed * 7919 + world)
        draw = Draw(
            seed, _layout_fields(rng, world), rng.choice(MASKS), rng.choice(OPTIMIZERS), rng.choice([None, CLIP])
        )
        if accepted(draw):
            out.append(draw)
        seed += 1
    return out


# ----------------------------------------------------------------- one draw on this rank, and the reference
def train_draw(draw: Draw) -> dict:
    model, task = make_model(draw.mask)
    with fp32_newton_schulz(draw.optimizer == "muon"):
        engine = plait.parallelize(
            model, Layout(**draw.layout), optimizer=optimizer_for(draw.optimizer), max_grad_norm=draw.clip
        )
        grads: list[dict[str, torch.Tensor]] = []
        engine.before_optimizer_step.append(lambda e: grads.append(whole_gradients(e)) if not grads else None)
        loader = ShardedBatches(task, GLOBAL_BATCH, dp_rank=engine.mesh.index("dp"), dp_size=engine.mesh.size("dp"))
        stats = [engine.train_step(loader.batch_at(step)) for step in range(STEPS)]
    return {
        "losses": [s.loss for s in stats],
        "norms": [s.grad_norm for s in stats],
        "grads": grads[0],
        "params": whole_parameters(engine),
    }


def train_draws(cases: list[Draw]) -> list[dict]:
    return [train_draw(draw) for draw in cases]


def check(draw: Draw, per_rank: list[dict]) -> None:
    model, task = make_model(draw.mask)
    loader = ShardedBatches(task, GLOBAL_BATCH)
    batches = [loader.global_batch_at(step) for step in range(STEPS)]
    with fp32_newton_schulz(draw.optimizer == "muon"):
        optimizer = reference_optimizer(draw.optimizer, model)
        expected = train_reference(model, batches, optimizer, max_grad_norm=draw.clip)
    losses = per_rank[0]["losses"]
    assert all(r["losses"] == losses for r in per_rank), f"{draw}: ranks report different losses"
    for step, (actual, wanted) in enumerate(zip(losses, expected.losses)):
        assert abs(actual - wanted) <= LOSS_RTOL * abs(wanted), f"{draw}: step {step} loss {actual} != {wanted}"
    if draw.clip:
        for step, (actual, wanted) in enumerate(zip(per_rank[0]["norms"], expected.grad_norms)):
            assert abs(actual - wanted) <= NORM_RTOL * wanted, f"{draw}: step {step} norm {actual} != {wanted}"
    grads = {name: t for r in per_rank for name, t in r["grads"].items()}
    params = {name: t for r in per_rank for name, t in r["params"].items()}
    assert_tensors_close(grads, expected.grads[0], f"{draw}: step-0 grad", GRAD_TOL)
    assert_tensors_close(params, expected.params[-1], f"{draw}: final param", PARAM_TOL)


def run_and_check(world: int, count: int) -> None:
    cases = draws(world, count)
    results = run_distributed(train_draws, world, cases, timeout=120 + 60 * count)
    for index, draw in enumerate(cases):
        print(draw)
        check(draw, [rank[index] for rank in results])


# ----------------------------------------------------------------- tests
def test_draws_are_deterministic_and_accepted():
    assert draws(4, 3) == draws(4, 3)
    assert all(accepted(draw) and draw.world == 4 for draw in draws(4, 3))
    assert {draw.mask for draw in draws(2, LONG_DRAWS)} == set(MASKS), "make parity-fuzz covers every mask pattern"


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_random_draws_match_one_device(world):
    run_and_check(world, CI_DRAWS)


@pytest.mark.long
@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_many_random_draws_match_one_device(world):
    run_and_check(world, LONG_DRAWS)
