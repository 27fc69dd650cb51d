"""Which server owns which parameter (a greedy, size-balanced assignment) and the model spec workers are checked
against.

Greedy longest-processing-time first: parameters sorted by size (largest first, then name) each go to the server
holding the fewest elements so far. Its largest load is at most 4/3 of the optimum (Graham, 1969). The assignment
is a pure function of the spec and the server count, so every process computes the same one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from plait.errors import ConfigError


@dataclass(frozen=True)
class ParamSpec:
    """Name, shape and dtype of one parameter tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def model_spec(model: nn.Module) -> tuple[ParamSpec, ...]:
    """The model's trainable parameters as specs, in `named_parameters` order."""
    return tuple(
        ParamSpec(name, tuple(param.shape), str(param.dtype).removeprefix("torch."))
        for name, param in model.named_parameters()
        if param.requires_grad
    )


def assign_shards(spec: tuple[ParamSpec, ...], num_servers: int) -> list[list[str]]:
    """Parameter names per server, balanced by element count (greedy LPT); every server gets at least one."""
    if isinstance(num_servers, bool) or not isinstance(num_servers, int) or num_servers < 1:
        raise ConfigError(
            f"servers={num_servers!r}: a parameter server needs at least one server process. "
            f"Fix: pass --servers 1 or more."
        )
    if num_servers > len(spec):
        raise ConfigError(
            f"servers={num_servers} but the model has only {len(spec)} parameter tensors, and a "
            f"server must own at least one whole tensor. Fix: use at most {len(spec)} servers."
        )
    loads = [0] * num_servers
    shards: list[list[str]] = [[] for _ in range(num_servers)]
    for param in sorted(spec, key=lambda p: (-p.numel, p.name)):
        server = min(range(num_servers), key=lambda index: (loads[index], len(shards[index]), index))
        shards[server].append(param.name)
        loads[server] += param.numel
    order = {param.name: position for position, param in enumerate(spec)}
    return [sorted(names, key=order.__getitem__) for names in shards]


def spec_mismatch(expected: tuple[ParamSpec, ...], actual: tuple[ParamSpec, ...]) -> str | None:
    """A sentence naming the first difference between two model specs, or None when they agree."""
    expected_by_name = {param.name: param for param in expected}
    actual_by_name = {param.name: param for param in actual}
    missing = [name for name in expected_by_name if name not in actual_by_name]
    extra = [name for name in actual_by_name if name not in expected_by_name]
    if missing or extra:
        return (
            f"parameters missing from the worker's model: {missing[:3]}{'...' if len(missing) > 3 else ''}; "
            f"unknown to the servers: {extra[:3]}{'...' if len(extra) > 3 else ''}"
        )
    for name, want in expected_by_name.items():
        got = actual_by_name[name]
        if want != got:
            return (
                f"parameter {name!r} is {got.shape} {got.dtype} on the worker but {want.shape} {want.dtype} "
                f"on the servers"
            )
    return None


__all__ = ["ParamSpec", "assign_shards", "model_spec", "spec_mismatch"]
