"""What the meta-device and sharded-loading tests compare: every parameter of an engine, whole, by name."""

from __future__ import annotations

import torch

import plait
from plait.parallel.tensor.layers import gather_slice, is_tp_sharded


def whole_parameters(engine: plait.Engine) -> dict[str, torch.Tensor]:
    """This rank's parameters whole (ZeRO-3 shards gathered over dp, tp slices over tp), by name (a collective)."""
    strategy = engine.strategy
    local = (
        strategy.full_parameters()
        if hasattr(strategy, "full_parameters")
        else {name: p.detach() for name, p in engine.model.named_parameters()}
    )
    return {
        name: (gather_slice(local[name], p, engine.comm) if is_tp_sharded(p) else local[name]).clone()
        for name, p in engine.model.named_parameters()
    }
