"""Parity helpers: train a deep-copied single-device reference on the global batch, step by step, and
compare loss, gradients and parameters with dtype-based tolerances.

Tolerances (``TOLERANCES``), and why:
- fp32: data parallelism averages N partial gradients (sum, then divide) where the reference sums one long
  batch, so float addition is reordered: each gradient differs by a few ulps (~1e-7 relative). Adam divides
  by sqrt(v) and so can enlarge a relative difference for coordinates whose gradient is near zero; after a
  handful of steps parameters agree to rtol 1e-5 / atol 1e-6 (lr 1e-3), gradients to rtol 1e-4 / atol 1e-6.
- bf16 has 8 bits of mantissa (relative step 2^-8 = 3.9e-3) and fp16 11 bits (2^-11 = 4.9e-4); the
  tolerances are a few of those steps.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from plait.models.loss import apply_loss

TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-6},
    torch.bfloat16: {"rtol": 2e-2, "atol": 1e-2},
    torch.float16: {"rtol": 5e-3, "atol": 1e-3},
}
GRAD_TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"rtol": 1e-4, "atol": 1e-6},
    torch.bfloat16: {"rtol": 5e-2, "atol": 1e-2},
    torch.float16: {"rtol": 1e-2, "atol": 1e-3},
}


@dataclass
class Trajectory:
    """Per step: the loss, the gradients before the optimizer step, and the parameters after it; with clipping also
    the global gradient norm before clipping (clipping to a fixed norm hides a uniform gradient-scale error, such
    as summing instead of averaging over replicas; the norm before clipping shows it)."""

    losses: list[float] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)


def snapshot_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().cpu().clone() for name, p in model.named_parameters()}


def snapshot_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().cpu().clone() for name, p in model.named_parameters() if p.grad is not None}


def train_reference(
    model: nn.Module,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    optimizer_fn: Callable[[object], torch.optim.Optimizer],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.nn.functional.cross_entropy,
    max_grad_norm: float | None = None,
) -> Trajectory:
    """Plain single-device training of a deep copy of ``model`` on each whole global batch."""
    model = copy.deepcopy(model)
    optimizer = optimizer_fn(model.parameters())
    out = Trajectory()
    for inputs, targets in batches:
        loss = apply_loss(loss_fn, model(inputs), targets)
        loss.backward()
        if max_grad_norm:
            out.grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)))
        out.losses.append(float(loss.detach()))
        out.grads.append(snapshot_grads(model))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.params.append(snapshot_params(model))
    return out


def assert_tensors_close(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str, tolerances: dict[str, float]
) -> None:
    """Every named tensor equal within ``tolerances``; the message names the tensor and the worst error."""
    assert actual.keys() == expected.keys(), f"{what}: names differ: {sorted(actual.keys() ^ expected.keys())}"
    for name in expected:
        a, e = actual[name].float(), expected[name].float()
        assert a.shape == e.shape, f"{what} {name}: shape {tuple(a.shape)} != {tuple(e.shape)}"
        if not torch.allclose(a, e, **tolerances):
            worst = (a - e).abs().max().item()
            raise AssertionError(f"{what} {name}: max abs error {worst:.3g} exceeds {tolerances}")


def assert_trajectories_match(
    actual: Trajectory, expected: Trajectory, dtype: torch.dtype = torch.float32, exact: bool = False
) -> None:
    """Losses, gradients and parameters equal step by step (bitwise with ``exact``)."""
    assert len(actual.losses) == len(expected.losses), "different number of steps"
    params_tol = {"rtol": 0.0, "atol": 0.0} if exact else TOLERANCES[dtype]
    grads_tol = {"rtol": 0.0, "atol": 0.0} if exact else GRAD_TOLERANCES[dtype]
    for step, (a, e) in enumerate(zip(actual.losses, expected.losses)):
        ok = a == e if exact else abs(a - e) <= params_tol["atol"] + params_tol["rtol"] * abs(e)
        assert ok, f"step {step}: loss {a!r} != reference {e!r}"
    for step in range(len(expected.losses)):
        if actual.grads:
            assert_tensors_close(actual.grads[step], expected.grads[step], f"step {step} grad", grads_tol)
        assert_tensors_close(actual.params[step], expected.params[step], f"step {step} param", params_tol)


def masked_lm_batch(seed: int, batch: int, length: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens and targets with ~30% of the target positions ignored (-100), more of them late in the
    sequence and the same in every row: context-parallel shards (zigzag or contiguous) score different numbers of
    tokens, so the cp loss weighting is exercised, while dp ranks (which average per-rank means, as DDP does)
    score equal numbers."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, vocab, (batch, length), generator=generator)
    targets = torch.randint(0, vocab, (batch, length), generator=generator)
    ignored = torch.rand(length, generator=generator) < torch.linspace(0.0, 0.6, length)
    return inputs, targets.masked_fill(ignored.expand(batch, length), -100)


def uneven_mask(targets: torch.Tensor, seeds: Sequence[int]) -> torch.Tensor:
    """``targets`` with each row scoring a different number of tokens, as real batches do (padding, prompt
    masking, end-of-document masking): row r keeps k of its n scored targets, k uniform in 1..n drawn from
    ``seeds[r]`` (a row's seed, e.g. its sample index, so any split of the batch masks it alike), the others set
    to -100; odd seeds drop a prefix (a prompt), even ones a suffix (padding). A batch whose rows all score the
    same number of tokens hides the averaging error of per-micro-batch or per-rank means (issue 24)."""
    out = targets.clone()
    for row, seed in enumerate(seeds):
        scored = (out[row] != -100).nonzero().flatten()
        if len(scored) <= 1:
            continue
        keep = int(torch.randint(1, len(scored) + 1, (1,), generator=torch.Generator().manual_seed(seed)))
        dropped = scored[: len(scored) - keep] if seed % 2 else scored[keep:]
        out[row, dropped] = -100
    return out


class UnevenMasks:
    """A plait dataset (``batch(indices)``) whose rows score uneven numbers of tokens (``uneven_mask``, seeded
    by each sample's index); everything else is the wrapped task's (vocabulary, length, accuracy counts)."""

    def __init__(self, task: object) -> None:
        self.task = task

    def __getattr__(self, name: str) -> object:
        if name == "task":  # unpickling looks attributes up before __init__'s have been set
            raise AttributeError(name)
        return getattr(self.task, name)

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.task.batch(indices)  # type: ignore[attr-defined]
        return inputs, uneven_mask(targets, [int(i) for i in indices])
