"""Model states per rank by the ZeRO paper's accounting, and what plait's optimizers keep per parameter.

``zero_paper_bytes``: Rajbhandari et al. 2020, Figure 1, for Psi parameters on N data-parallel ranks with
mixed-precision Adam (2 bytes of parameters + 2 of gradients + K = 12 of fp32 master, momentum and variance):

    stage 0: (2 + 2 + K) Psi      stage 1: (2 + 2) Psi + K Psi / N
    stage 2: 2 Psi + (2 + K) Psi / N      stage 3: (2 + 2 + K) Psi / N

``STATE_FLOATS``: the fp32 state tensors each optimizer keeps per parameter element (what ``estimate_memory``
counts for plait's own implementation, plait.planner.memory).
"""

from __future__ import annotations

import torch

STATE_FLOATS = {"adam": 2, "adamw": 2, "sgd": 0, "sgd_momentum": 1, "adagrad": 1, "rmsprop": 1}
"""fp32 state tensors each optimizer keeps per parameter element."""
FOREACH_TEMPORARIES = {"adam": 1, "adamw": 1}
"""fp32 temporaries per stepped element of torch's foreach implementation (Adam/AdamW: sqrt of the second moment)."""


def zero_paper_bytes(psi: float, n: int, stage: int, k: int = 12) -> float:
    """Model-state bytes per rank for ``psi`` parameters, ``n`` ranks, ZeRO ``stage`` (the paper's Figure 1)."""
    if stage == 0:
        return (2 + 2 + k) * psi
    if stage == 1:
        return (2 + 2) * psi + k * psi / n
    if stage == 2:
        return 2 * psi + (2 + k) * psi / n
    if stage == 3:
        return (2 + 2 + k) * psi / n
    raise ValueError(f"ZeRO stage {stage} does not exist; use 0, 1, 2 or 3")


def optimizer_kind(optimizer: str | torch.optim.Optimizer) -> str:
    """Map an optimizer (or its name) to a ``STATE_FLOATS`` key."""
    if isinstance(optimizer, torch.optim.Optimizer):
        name = type(optimizer).__name__.lower()
        if name == "sgd":
            return "sgd_momentum" if optimizer.defaults.get("momentum", 0) else "sgd"
        optimizer = name
    if optimizer not in STATE_FLOATS:
        raise ValueError(f"optimizer {optimizer!r} is unknown to the estimator; use one of {', '.join(STATE_FLOATS)}")
    return optimizer


__all__ = ["FOREACH_TEMPORARIES", "STATE_FLOATS", "optimizer_kind", "zero_paper_bytes"]
