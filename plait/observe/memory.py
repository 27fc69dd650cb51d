"""Memory instruments: what a run really holds (``measure_held``) and what autograd saves for backward
(``SavedActivations``, ``saved_activation_bytes``); storages are counted once (``storage_bytes``). The formulas
of what a layout should hold are ``plait.planner.memory.estimate_memory``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from plait.engine import Engine


def storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.numel():
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def measure_held(engine: Engine) -> dict[str, int]:
    """Bytes this rank really holds now, by kind: ``parameters`` (what forward reads: whole parameters, or
    ZeRO-3's shards and gathered units), ``gradients`` (full or sharded), ``master_weights`` (ZeRO's master
    shards where they are not the parameters) and ``optimizer_states`` (0-dim step counters left out).
    Storages count once, so gradients that are views of one bucket count as the bucket."""
    describe = getattr(engine.strategy, "model_state_tensors", None)
    if describe is not None:
        return {kind: storage_bytes(tensors) for kind, tensors in describe().items()}
    model_params = list(engine.model.parameters())
    states = [t for state in engine.optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    return {
        "parameters": storage_bytes(model_params),
        "master_weights": 0,
        "gradients": storage_bytes([p.grad for p in model_params if p.grad is not None]),
        "optimizer_states": storage_bytes([t for t in states if t.dim() > 0]),
    }


_COUNTING: list[SavedActivations] = []
"""The active ``SavedActivations``, innermost last."""


def counting_saved_activations() -> bool:
    """Whether a ``SavedActivations`` is counting now (so that code keeping activations outside autograd's saved
    tensors, such as selective checkpointing's cache, hands them to it)."""
    return bool(_COUNTING)


def note_kept(tensor: torch.Tensor) -> None:
    """Count ``tensor`` as kept for backward by the innermost active ``SavedActivations`` (as autograd's saved
    tensors go to the innermost ``saved_tensors_hooks``); nothing when none is active."""
    if _COUNTING:
        _COUNTING[-1].add(tensor)


class SavedActivations:
    """Context manager counting the activations autograd keeps for backward while it is active: ``bytes`` is the
    total size of the distinct storages passed to ``saved_tensors_hooks``, leaving out ``exclude`` (parameters:
    a Linear saves its weight by reference, which is not an activation). ``add(t)`` counts a tensor held
    beside the graph (e.g. a pipeline stage's received input), once per storage like the rest; what selective
    checkpointing caches (``Layout(recompute="op")``) arrives through ``note_kept``."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._seen: dict[int, int] = {}
        self._hooks: Any = None

    def add(self, tensor: torch.Tensor) -> torch.Tensor:
        try:
            storage = tensor.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # a tensor without a storage (some subclasses): its own size
            key, size = id(tensor), tensor.numel() * tensor.element_size()
        if key not in self._excluded:
            self._seen.setdefault(key, size)
        return tensor

    def __enter__(self) -> SavedActivations:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.add, lambda tensor: tensor)
        self._hooks.__enter__()
        _COUNTING.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _COUNTING.remove(self)
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())


def saved_activation_bytes(model: nn.Module, forward: Callable[[], Any]) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``forward()`` runs, ``model``'s parameters
    left out: the activations a rank keeps between forward and backward."""
    with SavedActivations(exclude=model.parameters()) as saved:
        forward()
    return saved.bytes
