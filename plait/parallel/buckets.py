"""Gradient buckets for DDP: which parameters share a flat buffer, and which dtypes a backend can reduce.

Parameters are taken in reverse registration order (backward visits the last layers first, so that is roughly
the order their gradients become ready) and packed greedily: a bucket takes parameters of one (dtype, device)
until the next one would push it past ``cap_bytes``; a parameter larger than the cap gets a bucket of its own.
So every bucket holds at most ``cap_bytes`` of gradients unless it is a single parameter, and the number of
buckets is about ceil(P x bytes / cap) (Li et al. 2020, "PyTorch Distributed", sec. 3.2.3: bucketing trades
per-call latency against overlap).

A bucket's buffer is ``[g_0 | g_1 | ... | g_k | u_0 .. u_k]``: the gradients end to end, then (only with
``with_flags``) one "used" slot per parameter, 1 if this rank produced a gradient for it this step, else 0.
After an average over N ranks a slot is (ranks that used it) / N, so 0 means no rank did, without a separate
collective for the used-map.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

REDUCIBLE: dict[str, frozenset[torch.dtype]] = {
    # gloo reduces float32/64, float16, bfloat16 and integers; torch.distributed reduces complex tensors as
    # view_as_real pairs. float8 types fail with "Invalid scalar type" (probed on torch 2.13).
    "gloo": frozenset(
        {
            torch.float32,
            torch.float64,
            torch.float16,
            torch.bfloat16,
            torch.complex32,
            torch.complex64,
            torch.complex128,
        }
    ),
    # NCCL: the same floating and complex types; float8 reductions are refused by ProcessGroupNCCL.
    "nccl": frozenset(
        {
            torch.float32,
            torch.float64,
            torch.float16,
            torch.bfloat16,
            torch.complex32,
            torch.complex64,
            torch.complex128,
        }
    ),
}
"""Gradient dtypes each backend can all-reduce (sum). Backends not listed are not checked."""


def check_reducible(named_params: list[tuple[str, nn.Parameter]], backend: str | None, device_type: str) -> None:
    """Raise TypeError naming each parameter whose gradient dtype ``backend`` cannot reduce (DDP and ZeRO).

    ``backend`` is ``dist.get_backend(group)``: a name ("gloo") or a per-device list ("cpu:gloo,cuda:nccl").
    """
    if backend is None:
        return
    if ":" in backend:
        per_device = dict(part.split(":", 1) for part in backend.split(","))
        backend = per_device.get(device_type)
    supported = REDUCIBLE.get(str(backend))
    if supported is None:
        return
    bad = [f"{name} ({p.dtype})" for name, p in named_params if p.dtype not in supported]
    if bad:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in supported))
        raise TypeError(
            f"the {backend} backend cannot reduce the gradients of: {', '.join(bad)}. It reduces {names}. "
            f"Fix: keep these parameters in one of those dtypes (cast them, e.g. param.data = param.data.float()), "
            f"or freeze them with requires_grad_(False)."
        )


def assign_buckets(sizes_bytes: list[int], keys: list[object], cap_bytes: float) -> list[list[int]]:
    """Group parameter indices into buckets, visiting them in reverse order.

    ``sizes_bytes[i]`` and ``keys[i]`` (its (dtype, device)) describe parameter i. One bucket is open per key;
    adding parameter i closes the open bucket of its key first when size + sizes_bytes[i] > cap_bytes. Buckets
    are returned in the order they were opened, each listing its parameters in visiting order.
    """
    if not cap_bytes > 0:
        raise ValueError(f"bucket cap {cap_bytes} bytes must be positive")
    buckets: list[list[int]] = []
    open_bucket: dict[object, tuple[int, float]] = {}  # key -> (index in buckets, bytes so far)
    for i in reversed(range(len(sizes_bytes))):
        key, size = keys[i], sizes_bytes[i]
        at = open_bucket.get(key)
        if at is None or at[1] + size > cap_bytes:
            buckets.append([])
            at = (len(buckets) - 1, 0.0)
        buckets[at[0]].append(i)
        open_bucket[key] = (at[0], at[1] + size)
    return buckets


@dataclass
class Bucket:
    """One flat gradient buffer and the parameters whose gradients are views into it."""

    index: int
    names: list[str]
    params: list[nn.Parameter]
    buffer: torch.Tensor
    views: list[torch.Tensor] = field(default_factory=list)
    """``views[j]`` is shaped like ``params[j]`` and aliases its slice of ``buffer``."""
    flags: torch.Tensor | None = None
    """The "used" slots (one per parameter) at the end of ``buffer``; None without unused-parameter tracking."""
    axis: str | None = None
    """The mesh axis its gradients are reduced over (None: the strategy's; expert slices: ``edp``)."""

    @classmethod
    def build(
        cls, index: int, named_params: list[tuple[str, nn.Parameter]], with_flags: bool, axis: str | None = None
    ) -> Bucket:
        numel = sum(p.numel() for _, p in named_params)
        first = named_params[0][1]
        extra = len(named_params) if with_flags else 0
        buffer = torch.zeros(numel + extra, dtype=first.dtype, device=first.device)
        views, offset = [], 0
        for _, param in named_params:
            views.append(buffer[offset : offset + param.numel()].view(param.shape))
            offset += param.numel()
        flags = buffer[numel:] if with_flags else None
        return cls(index, [n for n, _ in named_params], [p for _, p in named_params], buffer, views, flags, axis)

    @property
    def grad_bytes(self) -> int:
        """Bytes of gradients it carries (without the flag slots)."""
        return sum(v.numel() for v in self.views) * self.buffer.element_size()


def build_buckets(
    named_params: list[tuple[str, nn.Parameter]],
    cap_bytes: float,
    with_flags: bool,
    axes: list[str | None] | None = None,
) -> list[Bucket]:
    """Buckets over ``named_params`` (registration order), each at most ``cap_bytes`` unless one parameter.
    ``axes``: each parameter's reduction axis (expert slices reduce over another axis than the rest); a bucket
    holds one axis, and buckets of different axes interleave in the order backward fills them."""
    sizes = [p.numel() * p.element_size() for _, p in named_params]
    axes = axes if axes is not None else [None] * len(named_params)
    keys: list[object] = [(p.dtype, p.device, axis) for (_, p), axis in zip(named_params, axes)]
    groups = assign_buckets(sizes, keys, cap_bytes)
    return [
        Bucket.build(b, [named_params[i] for i in group], with_flags, axes[group[0]]) for b, group in enumerate(groups)
    ]
