"""Optimizer parameter groups under every data-parallel strategy (DDP and ZeRO-1/2/3).

A run often wants different hyper-parameters for different parameters: no weight decay for norms, biases and
(optionally) embeddings (Loshchilov & Hutter 2019 decay the weights of linear maps; GPT-2/3, nanoGPT and
Megatron-LM exempt gains and biases), or a smaller learning rate for some layers. torch.optim expresses that as
*param groups*: ``Optimizer([{"params": [...], "weight_decay": 0.0}, {"params": [...]}], lr=..., weight_decay=0.1)``.

``parallelize(..., param_groups=group_of)`` takes ``group_of(name, param) -> overrides``: the hyper-parameters in
which the parameter's group differs from the factory's defaults ({} for none). Parameters with equal overrides
form one group, in order of first appearance in ``model.named_parameters()``. The strategy then calls the optimizer
factory with ``[{"params": [...], **overrides}, ...]`` instead of a list of tensors (every torch.optim optimizer
accepts both):

- DDP (zero=0): the groups hold the model's own parameters.
- ZeRO-1/2/3: the optimizer steps flat 1-D master shards that cut across tensors, so a shard may hold elements
  of several groups. Each flat buffer (a ZeRO-1/2 bucket, a ZeRO-3 unit) therefore lays its parameters out group
  after group; a rank's shard, a contiguous window of that buffer, then holds at most one contiguous run of each
  group, and the optimizer steps one *view* of the shard per (buffer, group) (``GroupView``). The views share
  the shard's storage: the optimizer writes the master in place, gradients are views of the reduced shard
  gradient, and every element is stepped with its own group's hyper-parameters, as on one device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

GroupOf = Callable[[str, nn.Parameter], Mapping[str, Any]]
"""``group_of(name, param)``: the hyper-parameters of the parameter's group that differ from the optimizer
factory's defaults, e.g. ``{"weight_decay": 0.0}``; ``{}`` for the default group."""

GroupKey = tuple[tuple[str, Any], ...]


def _key(overrides: Mapping[str, Any]) -> GroupKey:
    if "params" in overrides:
        raise ValueError("param_groups: group_of must return hyper-parameters only, not 'params'.")
    return tuple(sorted(overrides.items()))


def assign_groups(
    named: list[tuple[str, nn.Parameter]], group_of: GroupOf | None
) -> tuple[list[dict[str, Any]], list[int]]:
    """The groups' overrides (in order of first appearance) and each parameter's group index."""
    if group_of is None:
        return [{}], [0] * len(named)
    keys: dict[GroupKey, int] = {}
    options: list[dict[str, Any]] = []
    indices = []
    for name, param in named:
        overrides = dict(group_of(name, param))
        key = _key(overrides)
        if key not in keys:
            keys[key] = len(options)
            options.append(overrides)
        indices.append(keys[key])
    return options, indices


def torch_groups(options: list[dict[str, Any]], members: Sequence[Sequence[torch.Tensor]]) -> list[dict[str, Any]]:
    """``[{"params": members[g], **options[g]}]``: what a torch.optim optimizer takes as param groups."""
    return [{"params": list(params), **overrides} for overrides, params in zip(options, members)]


def order_by_group(items: list[Any], group_ids: list[int]) -> list[Any]:
    """``items`` sorted by their group (stable: registration order within a group)."""
    return [item for _, _, item in sorted(zip(group_ids, range(len(items)), items), key=lambda t: (t[0], t[1]))]


__all__ = ["GroupKey", "GroupOf", "assign_groups", "order_by_group", "torch_groups"]
