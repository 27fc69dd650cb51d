"""ZeRO-3 checkpoint states for torch.distributed.checkpoint (DCP): flat dicts of string keys.

- ``model``: every parameter whole (gathered from the shards) and every buffer, by the model's state_dict names.
  Identical on every rank, so DCP writes each tensor once; on load each rank keeps its own slice.
- ``optimizer``: this rank's optimizer state over its shards, keyed ``rank{r}of{N}/{unit}/{state}`` (distinct
  per rank, so DCP writes every rank's part), plus ``param_groups/{g}/{hyper-parameter}``. The keys name the
  layout: loading them needs the same N (resharding optimizer state to another layout is a later step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from plait.parallel.zero.fsdp_unit import FlatUnit


def model_state(model: nn.Module, full: dict[int, torch.Tensor]) -> dict[str, Any]:
    """``model.state_dict()`` with each sharded parameter replaced by its gathered full tensor (``full`` by id)."""
    return {key: full.get(id(value), value.detach()) for key, value in model.state_dict(keep_vars=True).items()}


def load_model_state(model: nn.Module, units: Sequence[FlatUnit], state: dict[str, Any]) -> None:
    """Slice each unit's flat parameters out of the full tensors in ``state``; copy buffers and frozen parameters."""
    sharded: set[int] = set()
    for unit in units:
        if unit.empty:
            continue
        tensors = []
        for name, shape in zip(unit.layout.names, unit.layout.shapes):
            if name not in state:
                raise KeyError(f"the checkpoint's model state has no parameter '{name}'")
            if tuple(state[name].shape) != tuple(shape):
                raise ValueError(
                    f"checkpoint parameter '{name}' has shape {tuple(state[name].shape)}, the model {tuple(shape)}"
                )
            tensors.append(state[name].to(unit.shard.device, unit.shard.dtype))
        lo, hi = unit.layout.shard_range(unit.rank)
        with torch.no_grad():
            unit.shard.copy_(unit.layout.flatten(tensors)[lo:hi])
            if unit.master is not unit.shard:  # offload: the optimizer's copy in host memory / files
                unit.master.copy_(unit.shard)
        sharded.update(id(p) for p in unit.params)
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) in sharded:
            continue
        if key not in state:
            raise KeyError(f"the checkpoint's model state has no entry '{key}'")
        if state[key] is not value:
            with torch.no_grad():
                value.copy_(state[key])


def _prefix(unit: FlatUnit, shards: int) -> str:
    return f"rank{unit.rank}of{shards}/{unit.name}/"


def init_optimizer_state(optimizer: torch.optim.Optimizer, units: Sequence[FlatUnit]) -> None:
    """Create the optimizer's lazily-built state (as torch's get_state_dict does): one step at lr 0 on zero
    gradients, which leaves the shards unchanged, so that a fresh optimizer has tensors for DCP to load into."""
    shards = [unit.master for unit in units if not unit.empty]
    if all(shard in optimizer.state for shard in shards):
        return
    if any(shard.grad is not None for shard in shards):
        raise RuntimeError("cannot build the optimizer state in the middle of a step (gradients are present)")
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    for shard in shards:
        shard.grad = torch.zeros_like(shard)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def optimizer_state(optimizer: torch.optim.Optimizer, units: Sequence[FlatUnit], shards: int) -> dict[str, Any]:
    """This rank's optimizer state, flat: ``rank{r}of{N}/{unit}/{key}`` and ``param_groups/{g}/{key}``."""
    init_optimizer_state(optimizer, units)
    state: dict[str, Any] = {}
    for unit in units:
        for key, value in optimizer.state.get(unit.master, {}).items():
            if value is not None:
                state[_prefix(unit, shards) + key] = value
    for index, group in enumerate(optimizer.param_groups):
        for key, value in group.items():
            if key != "params":
                state[f"param_groups/{index}/{key}"] = value
    return state


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, units: Sequence[FlatUnit], shards: int, state: dict[str, Any]
) -> None:
    """Put ``state`` (from ``optimizer_state`` at the same layout) back into the optimizer."""
    mine = f"rank{units[0].rank}of{shards}"
    foreign = sorted({key.split("/", 1)[0] for key in state if key.startswith("rank")} - {mine})
    if foreign:
        raise ValueError(
            f"the optimizer state was saved by another ZeRO-3 layout ({', '.join(foreign)}; this rank is {mine}): "
            "resharding ZeRO-3 optimizer state to a different number of ranks is not supported yet. "
            "Fix: load it with the same data-parallel size."
        )
    init_optimizer_state(optimizer, units)
    for unit in units:
        prefix = _prefix(unit, shards)
        current = optimizer.state.get(unit.master, {})
        for key, value in current.items():
            if prefix + key not in state:
                raise KeyError(f"the checkpoint's optimizer state has no entry '{prefix + key}'")
            loaded = state[prefix + key]
            if isinstance(value, torch.Tensor):
                if loaded.shape != value.shape:
                    got, want = tuple(loaded.shape), tuple(value.shape)
                    raise ValueError(f"optimizer state '{prefix + key}' has shape {got}, expected {want}")
                if loaded is not value:
                    value.copy_(loaded)
            else:
                current[key] = loaded
    for index, group in enumerate(optimizer.param_groups):
        for key in group:
            name = f"param_groups/{index}/{key}"
            if key != "params" and name in state:
                group[key] = state[name]
