"""One tensor against the one-process run's: the largest absolute and relative difference and where it stands
against the budget.

The relative difference of an element is ``|a - e| / (|e| + max(rms(e), floor))`` (its magnitude, floored at its
tensor's RMS, or for gradients at the RMS of every gradient, so that an element near zero does not divide by zero:
the terms a reordered sum adds are not observable afterwards, their result's typical size stands in for them); ``ratio`` is the largest ``|a - e| / allowed`` over the
tensor, ``allowed = rel * (|e| + rms(e)) + extra`` (``plait.certification.budget``): within the budget iff ratio <= 1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

TINY = 1e-30
"""Keeps an all-zero tensor's floor positive (its allowed difference is then ~0: it must be exactly zero)."""


@dataclass(frozen=True)
class TensorDiff:
    """How one tensor differs from the reference."""

    name: str
    max_abs: float
    max_rel: float
    ratio: float
    """The largest difference over what the budget allows (<= 1: within)."""
    bitwise: bool

    @property
    def within(self) -> bool:
        return self.bitwise or self.ratio <= 1.0

    def to_dict(self) -> dict:
        return asdict(self)


def rms(tensor: torch.Tensor) -> float:
    return float(tensor.double().pow(2).mean().sqrt()) if tensor.numel() else 0.0


def diff_tensor(
    name: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    rel: float,
    extra: torch.Tensor | float = 0.0,
    floor: float = 0.0,
) -> TensorDiff:
    """Compare ``actual`` with ``expected`` (same shape) under the relative budget ``rel`` plus ``extra`` (an
    absolute allowance, per element or for all); ``floor`` raises the RMS floor (a gradient that cancels to
    rounding noise, such as a key bias's, is measured against the gradients' typical size)."""
    if actual.shape != expected.shape:
        return TensorDiff(name, float("inf"), float("inf"), float("inf"), False)
    a, e = actual.double(), expected.double()
    if torch.equal(a, e):
        return TensorDiff(name, 0.0, 0.0, 0.0, True)
    delta = (a - e).abs()
    if not bool(torch.isfinite(delta).all()):
        return TensorDiff(name, float("inf"), float("inf"), float("inf"), False)
    scale = e.abs() + max(rms(e), floor, TINY)
    allowed = rel * scale + extra
    ratio = float((delta / allowed.clamp_min(TINY)).max())
    return TensorDiff(name, float(delta.max()), float((delta / scale).max()), ratio, False)


def diff_scalar(name: str, actual: float, expected: float, rel: float) -> TensorDiff:
    """A loss or a gradient norm: ``|a - e| <= rel * |e|``."""
    return diff_tensor(name, torch.tensor([actual]), torch.tensor([expected]), rel)
