"""Mixed precision: bf16/fp16 compute under autocast with fp32 master weights, and dynamic loss scaling for fp16.

Parameters, gradients and optimizer states stay fp32 (the master copy); ``torch.autocast`` runs matmuls and
other eligible ops in the low precision. fp16 has a narrow exponent range (min normal 6e-5), so small
gradients underflow: the loss is multiplied by a scale S before backward and the gradients divided by S
after (Micikevicius et al. 2018). Dynamic scaling: if any rank finds inf/NaN the step is skipped and S halves;
after ``growth_interval`` clean steps S doubles. bf16 has fp32's exponent range and needs no scaling.

Gradients are reduced over data parallelism in fp32 by default; ``Layout(reduce_dtype="compute")`` reduces
them in the compute dtype instead (``gradient_reduce_dtype``, ``cast_for_reduction``): half the bytes of DDP's
all-reduce and ZeRO's reduce-scatter, the reduced values cast back to fp32 before clipping and the step.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from plait.layout import Precision, ReduceDtype

if TYPE_CHECKING:
    from plait.layout import Layout
    from plait.parallel.strategy import DataParallelStrategy

DTYPES: dict[str, torch.dtype] = {
    Precision.FP32: torch.float32,
    Precision.BF16: torch.bfloat16,
    Precision.FP16: torch.float16,
}


def gradient_reduce_dtype(layout: Layout) -> torch.dtype | None:
    """The dtype to reduce gradients in when it is not their own: the compute dtype under
    ``Layout(reduce_dtype="compute")`` with bf16/fp16 precision, else None (reduce the fp32 gradients as they are).
    Reducing in bf16/fp16 halves the bytes sent; each gradient and each partial sum is rounded to the compute
    dtype (relative error 2^-8 / 2^-11 per rounding), and fp16 sums of loss-scaled gradients may overflow, which
    the loss scaler then treats as any other overflow (the step is skipped)."""
    dtype = DTYPES[layout.precision]
    return dtype if layout.reduce_dtype == ReduceDtype.COMPUTE and dtype != torch.float32 else None


def cast_for_reduction(flat: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``flat`` (fp32 gradients) as ``dtype`` for a reduction, or ``flat`` itself (no ``dtype``, or gradients of
    another dtype, e.g. fp64 parameters, which stay as they are)."""
    return flat.to(dtype) if dtype is not None and flat.dtype == torch.float32 else flat


class DynamicLossScaler:
    """S starts at ``init_scale``; halves on overflow (step skipped); doubles after ``growth_interval`` good steps."""

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 2000, min_scale: float = 1.0) -> None:
        self.scale = init_scale
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.good_steps = 0
        self.skipped_steps = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = max(self.min_scale, self.scale / 2)
            self.good_steps = 0
            self.skipped_steps += 1
        else:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= 2


class MixedPrecision:
    """The Engine's precision policy for one Layout.precision value ("fp32", "bf16" or "fp16")."""

    def __init__(self, precision: str, device: torch.device, scaler: DynamicLossScaler | None = None) -> None:
        if precision not in DTYPES:
            raise ValueError(f"precision={precision!r} is unknown; use one of {', '.join(DTYPES)}")
        self.dtype = DTYPES[precision]
        self.device = device
        self.scaler = (scaler or DynamicLossScaler()) if precision == "fp16" else None

    @property
    def loss_scale(self) -> float | None:
        return self.scaler.scale if self.scaler else None

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """Autocast to the compute dtype (a no-op for fp32)."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale if self.scaler else loss

    def unscale_and_check(self, strategy: DataParallelStrategy) -> bool:
        """Divide the gradients by S and check them for inf/NaN in one fused pass per device
        (``strategy.unscale_and_find_inf``); return False (skip the step) if any rank's gradients overflowed.
        Reading the flag is the step's one host sync under fp16 (the next scale depends on it); bf16 and fp32
        need no scaling and no sync. On overflow the gradients were unscaled too, but the step is skipped and
        they are zeroed."""
        if self.scaler is None:
            return True
        found_inf = bool(strategy.unscale_and_find_inf(1.0 / self.scaler.scale).item() > 0)
        self.scaler.update(found_inf)
        return not found_inf
