"""The fastest optimizer kernels torch has for a run's device: what plait passes where it builds the optimizer.

torch.optim steps parameters one tensor at a time ("for-loop"), in a few multi-tensor launches ("foreach",
torch's default on CUDA) or in one fused kernel per parameter group ("fused": Adam, AdamW, SGD, Adagrad; CUDA,
and CPU since torch 2.4): fewer kernel launches and one pass over memory. ZeRO-Offload's host step gains the
most: an offloaded AdamW without ``fused`` took 338 ms of a 415 ms step on an H100 (issue 14). Fused and
unfused AdamW differ in the last bits (5.96e-8 after 5 steps on CPU here), so the choice is made only on CUDA
runs: CPU runs keep torch's default and stay bitwise equal to a plain single-device loop.

plait cannot change an optimizer the user's factory builds (``optimizer=lambda params: AdamW(params, ...)``):
pass ``fused=True`` there on CUDA, or ``**fast_optimizer_kwargs(AdamW, device)``. ``plait train`` does.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


def supports_fused(optimizer_class: type[torch.optim.Optimizer]) -> bool:
    """Whether the optimizer class takes ``fused=`` (torch.optim's Adam, AdamW, SGD, Adagrad)."""
    try:
        return "fused" in inspect.signature(optimizer_class.__init__).parameters
    except (TypeError, ValueError):
        return False


def fast_optimizer_kwargs(optimizer_class: type[torch.optim.Optimizer], device: torch.device | str) -> dict[str, Any]:
    """``{"fused": True}`` when the run computes on CUDA and the class has a fused kernel, else ``{}`` (torch's
    own default: foreach on CUDA, for-loop on CPU). The fused kernel then also steps ZeRO-Offload's host
    masters (fused kernels exist for CPU tensors too)."""
    if torch.device(device).type == "cuda" and supports_fused(optimizer_class):
        return {"fused": True}
    return {}


__all__ = ["fast_optimizer_kwargs", "supports_fused"]
