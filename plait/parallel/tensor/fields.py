"""Typed reads of the fields of a layer that tensor parallelism replaces.

``nn.Module.__getattr__`` is typed ``Tensor | Module`` (it serves parameters, buffers and submodules), and the
layers plait swaps come from several libraries (``nn.Linear``, transformers' ``Conv1D``, norms with or without a
bias), known by their fields rather than by one class. Each read here checks the kind of the value it returns,
so a layer that lacks the expected kind of field fails with a LayoutError naming it, not later in arithmetic.
"""

from __future__ import annotations

from torch import Tensor, nn

from plait.errors import LayoutError


def _wrong_kind(module: nn.Module, name: str, value: object, expected: str) -> LayoutError:
    return LayoutError(
        f"{type(module).__name__}.{name} is a {type(value).__name__}, but tensor parallelism needs {expected} "
        f"there. Fix: give this layer a tp plan style that fits it, or leave it out of the plan."
    )


def tensor_field(module: nn.Module, name: str) -> Tensor:
    """``module.<name>``, a parameter or buffer (AttributeError if absent, LayoutError if not a tensor)."""
    value = getattr(module, name)
    if not isinstance(value, Tensor):
        raise _wrong_kind(module, name, value, "a tensor")
    return value


def optional_tensor_field(module: nn.Module, name: str) -> Tensor | None:
    """``module.<name>``, a tensor or None (a layer built with ``bias=False``); AttributeError if absent."""
    value = getattr(module, name)
    if value is not None and not isinstance(value, Tensor):
        raise _wrong_kind(module, name, value, "a tensor or None")
    return value


def int_field(module: nn.Module, name: str) -> int:
    """``module.<name>``, an integer size (``in_features``, ``nf``, ``num_embeddings``, ``num_heads``)."""
    value = getattr(module, name)
    if not isinstance(value, int):
        raise _wrong_kind(module, name, value, "an integer")
    return value


__all__ = ["int_field", "optional_tensor_field", "tensor_field"]
