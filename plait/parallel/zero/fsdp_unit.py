"""One ZeRO-3 unit: a module's trainable parameters as one flat buffer, sharded at rest over N ranks.

A unit's k parameters are laid end to end in a padded flat buffer of L' = N ceil(L/N) elements (``FlatLayout``);
rank r keeps only elements [r L'/N, (r+1) L'/N) as an fp32 ``nn.Parameter`` (the shard the optimizer steps).
The module's own Parameter objects stay (their names, hooks and ``requires_grad`` do not change), but between
uses their ``.data`` is an empty tensor. A unit is in one of three states:

- FREE: only the shard exists (L'/N elements held).
- PENDING: an asynchronous all-gather of the N shards is in flight (a prefetch; its output buffer is held).
- GATHERED: the full flat buffer exists and every parameter's ``.data`` is a view into it.

Freeing resizes the flat buffer's *storage* to 0 bytes, not just the parameters: autograd may have saved views of
the buffer in forward (``matmul`` saves ``weight.t()``), and they keep the storage alive. Re-gathering before the
unit's backward resizes that same storage back and copies the gathered weights into it, so the saved views see
the weights again (PyTorch FSDP's "free storage / allocate storage" trick). Saved leaf tensors (the Parameter
objects themselves) see whatever ``.data`` is current, and ``param.data = ...`` keeps their version counter.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from plait.comm import Comm
from plait.comm.collectives import Pending
from plait.parallel.materialize.share import is_placeholder
from plait.parallel.zero.flat import FlatLayout

Record = Callable[..., None]


def _owned(gathered: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``gathered`` as a tensor of its own: on one rank the all-gather returns its input, the shard itself."""
    aliased = gathered.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()
    return gathered.clone() if aliased else gathered


class UnitState(enum.Enum):
    FREE = "free"
    PENDING = "pending"
    GATHERED = "gathered"


class FlatUnit:
    """The flat, sharded parameters of ``module`` (named ``name`` in the model) over mesh axis ``axis``."""

    def __init__(
        self,
        name: str,
        module: nn.Module,
        named_params: list[tuple[str, nn.Parameter]],
        comm: Comm,
        axis: str,
        record: Record,
        layout: FlatLayout | None = None,
    ) -> None:
        """``layout``: how the flat buffer is sharded (default: N equal shards cutting across tensors; an
        ``OwnedLayout`` keeps each parameter whole on one rank, for optimizers that need whole tensors)."""
        dtypes = {p.dtype for _, p in named_params}
        if len(dtypes) > 1:
            raise ValueError(
                f"ZeRO-3 unit '{name}' mixes parameter dtypes {sorted(map(str, dtypes))}: a unit is one flat buffer. "
                "Fix: keep the model's trainable parameters in one dtype (fp32 master weights; use Layout.precision "
                "for low-precision compute)."
            )
        self.name = name
        self.module = module
        self.params = [p for _, p in named_params]
        self.comm, self.axis, self._record = comm, axis, record
        self.layout = layout or FlatLayout.of(named_params, comm.size(axis))
        self.rank = comm.mesh.index(axis) if comm.size(axis) > 1 else 0
        device = self.params[0].device if self.params else comm.device
        dtype = self.params[0].dtype if self.params else torch.float32
        if self.params and any(is_placeholder(p) for p in self.params):
            # a model built on the meta device: the shard is filled later with only this rank's values
            self.shard = nn.Parameter(torch.zeros(self.layout.shard_size, dtype=dtype, device=device))
        elif self.params:
            full = self.layout.flatten([p.detach() for p in self.params])
            lo, hi = self.layout.shard_range(self.rank)
            self.shard = nn.Parameter(full[lo:hi].clone())
        else:
            self.shard = nn.Parameter(torch.empty(0, dtype=dtype, device=device))
        self.master: nn.Parameter = self.shard
        """What the optimizer steps: the shard itself, or (offload) its copy in host memory set by the strategy."""
        self._empty = torch.empty(0, dtype=dtype, device=device)
        self.full: torch.Tensor | None = None
        self.pending: Pending | None = None
        self.state = UnitState.FREE
        self.in_graph = False
        """True once a grad-enabled forward used ``self.full``: autograd may hold views of its storage."""
        self.local_grad: torch.Tensor | None = None
        """Unsharded flat gradient accumulated inside ``no_sync`` (reduced on the next synchronised backward)."""
        self.backward_started = False
        self.grads_done = False
        self.ready = 0
        """Parameters whose gradient autograd has accumulated in the current backward."""
        self._release_params()

    # ----------------------------------------------------------------- sizes
    @property
    def empty(self) -> bool:
        return self.layout.numel == 0

    @property
    def element_size(self) -> int:
        return self.shard.element_size()

    def gathered_bytes(self) -> int:
        """Bytes of full parameters this unit holds now: the flat buffer's storage plus a gather in flight."""
        held = self.full.untyped_storage().nbytes() if self.full is not None else 0
        if self.state is UnitState.PENDING:
            held += self.layout.padded * self.element_size
        return held

    # ----------------------------------------------------------------- gather / free
    def _all_gather(self, async_op: bool) -> Any:
        return self.comm.all_gather(self.shard.detach(), self.axis, async_op=async_op)

    def prefetch(self, phase: str) -> None:
        """Issue the all-gather of this unit's shards without waiting (it overlaps the current unit's compute)."""
        if self.state is not UnitState.FREE or self.empty:
            return
        self.pending = self._all_gather(async_op=True)
        self.state = UnitState.PENDING
        self._record("gather", self.name, phase, "async")

    def gather(self, phase: str, grad_enabled: bool = False) -> None:
        """Make the parameters whole (idempotent): wait for a prefetch, or all-gather now."""
        if self.state is UnitState.GATHERED or self.empty:
            self.state = UnitState.GATHERED
            return
        if self.state is UnitState.PENDING:
            assert self.pending is not None
            gathered = self.pending.wait()
            self.pending = None
            self._record("wait", self.name, phase)
        else:
            gathered = self._all_gather(async_op=False)
            self._record("gather", self.name, phase, "sync")
        gathered = _owned(gathered, self.shard)
        if self.full is not None and self.in_graph:
            # Autograd holds views of the old storage (saved in forward): refill that same storage.
            self.full.untyped_storage().resize_(gathered.numel() * gathered.element_size())
            self.full.copy_(gathered)
        else:
            self.full = gathered
        for param, view in zip(self.params, self.layout.views(self.full)):
            param.data = view
        self.in_graph = self.in_graph or grad_enabled
        self.state = UnitState.GATHERED

    def reshard(self) -> None:
        """Back to FREE: drop a prefetch in flight, empty the parameters, free the flat buffer's storage."""
        if self.state is UnitState.PENDING:
            assert self.pending is not None
            self.pending.wait()  # every rank issued it; finish it before dropping the buffer
            self.pending = None
        elif self.state is UnitState.GATHERED and not self.empty:
            self._release_params()
            assert self.full is not None
            self.full.untyped_storage().resize_(0)
        if self.state is not UnitState.FREE:
            self._record("free", self.name)
        self.state = UnitState.FREE

    def _release_params(self) -> None:
        for param in self.params:
            param.data = self._empty

    def gather_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """All-gather a shard-shaped tensor (weights, gradient, optimizer state) into a new full flat tensor."""
        return _owned(self.comm.all_gather(tensor.detach(), self.axis), tensor)

    # ----------------------------------------------------------------- gradients
    def take_grads(self) -> torch.Tensor:
        """The unit's flat padded gradient (parameters without one contribute zeros, plus what ``no_sync``
        accumulated); the parameters' own ``.grad`` are released."""
        grads = [
            p.grad if p.grad is not None else torch.zeros(shape, dtype=self.shard.dtype, device=self.shard.device)
            for p, shape in zip(self.params, self.layout.shapes)
        ]
        flat = self.layout.flatten(grads, dtype=self.shard.dtype)
        for param in self.params:
            param.grad = None
        if self.local_grad is not None:
            flat.add_(self.local_grad)
            self.local_grad = None
        return flat

    def end_backward(self) -> None:
        """Reset the per-backward bookkeeping and free everything gathered."""
        self.reshard()
        self.backward_started = self.grads_done = False
        self.ready = 0
        self.in_graph = False
