"""Bytes one cp rank sends per attention layer and training step: the formulas, and a measurement of one layer.

With e the element size, Tl = T/cp, H query and KV key/value heads and block = B * KV * Tl * D elements:

- ring: forward (cp-1) hops of the stacked (k, v) block: (cp-1) * 2 block * e; backward the same hops again
  plus (cp-1) hops of their float32 gradient accumulators: (cp-1) * 2 block * (e + 4); 3 (cp-1) sends.
- Ulysses: forward four all-to-alls (q and o with H heads, k and v with KV heads), each sending (cp-1)/cp of
  its input: (cp-1)/cp * B Tl D (2H + 2KV) * e; backward the same four in reverse; 8 calls.

Wire bytes follow ``plait.comm.CommStats`` (a send counts its payload; an all-to-all (n-1)/n of it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plait.comm import Comm
from plait.parallel.context.ring import RingAttention
from plait.parallel.context.sharding import SequenceSharding
from plait.parallel.context.ulysses import UlyssesAttention

FP32_ACCUMULATOR = 4
"""Bytes per element of the ring's gradient accumulators (float32 whatever the compute dtype)."""


def theory_wire_bytes(
    mode: str, cp: int, batch: int, heads: int, kv_heads: int, length: int, head_dim: int, element_size: int = 4
) -> dict[str, float]:
    """{"forward", "backward": wire bytes one rank sends in one attention layer; "calls": sends/all-to-alls}."""
    local_length = length // cp
    if mode == "ring":
        block = batch * kv_heads * local_length * head_dim
        forward: float = (cp - 1) * 2 * block * element_size
        return {
            "forward": forward,
            "backward": forward + (cp - 1) * 2 * block * FP32_ACCUMULATOR,
            "calls": 3 * (cp - 1),
        }
    forward = (cp - 1) / cp * batch * local_length * head_dim * (2 * heads + 2 * kv_heads) * element_size
    return {"forward": forward, "backward": forward, "calls": 8}


def measure_wire_bytes(
    comm: Comm, mode: str, batch: int, heads: int, kv_heads: int, length: int, head_dim: int, axis: str = "cp"
) -> dict[str, float]:
    """Run one causal attention layer forward and backward on this rank's shard (fp32, random inputs) and
    return the wire bytes it sent on ``axis`` in each, and its number of calls, as ``theory_wire_bytes``."""
    sharding = SequenceSharding(mode, comm.size(axis), comm.mesh.index(axis))
    core_class = RingAttention if mode == "ring" else UlyssesAttention
    core = core_class(comm, sharding, causal=True, axis=axis)
    local_length = length // sharding.size
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, local_length, head_dim, generator=generator, requires_grad=True)
    k, v = (
        torch.randn(batch, kv_heads, local_length, head_dim, generator=generator, requires_grad=True) for _ in range(2)
    )
    start = comm.stats.snapshot()
    out = core.attend(q, k, v)
    after_forward = comm.stats.snapshot()
    F.mse_loss(out, torch.zeros_like(out)).backward()
    forward, total = after_forward.since(start), comm.stats.since(start)
    op = "send" if mode == "ring" else "all_to_all"
    return {
        "forward": forward.wire(axis),
        "backward": total.wire(axis) - forward.wire(axis),
        "calls": total.counts[(axis, op)].calls,
    }
