"""Module-by-module recording of one step: every module's outputs (forward) and the gradients of those outputs
(backward), by its name in ``model.named_modules()``, in the order they were produced.

A forward hook on each module keeps its floating-point outputs (a tensor, the tensors of a tuple or list, the
tensor values of a mapping such as a Hugging Face ``ModelOutput``) and registers a hook on each that requires a
gradient, which keeps that gradient when backward reaches it. Forward hooks fire when a module *ends*, so the
forward order lists a module after the modules it called: the first module in it whose output is wrong is the
innermost one that went wrong. Backward order starts at the model's output (the loss's gradient).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

ROOT = "(model)"
"""How the report names the whole model (``named_modules()`` calls it "")."""


def output_tensors(output: Any) -> list[torch.Tensor]:
    """The floating-point tensors of at least one dimension a module returned (one level deep; a 0-dim value
    such as an auxiliary loss has no rows to gather)."""
    if isinstance(output, torch.Tensor):
        values: list[Any] = [output]
    elif isinstance(output, (tuple, list)):
        values = list(output)
    elif isinstance(output, Mapping):
        values = list(output.values())
    else:
        values = []
    return [v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0]


class ModuleTape:
    """Records ``model``'s modules while ``active``: ``forward[name][call][i]`` and ``backward[name][(call, i)]``,
    on the CPU; ``forward_order`` / ``backward_order`` are the names in the order of their first record."""

    def __init__(self, model: nn.Module, skip: set[str] | None = None) -> None:
        self.active = False
        self.forward: dict[str, list[list[torch.Tensor]]] = {}
        self.backward: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
        self.forward_order: list[str] = []
        self.backward_order: list[str] = []
        self._handles = [
            module.register_forward_hook(self._on_forward(name or ROOT))
            for name, module in model.named_modules()
            if not skip or (name or ROOT) not in skip
        ]

    def _on_forward(self, name: str) -> Any:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            if not self.active:
                return
            tensors = output_tensors(output)
            calls = self.forward.setdefault(name, [])
            if not calls:
                self.forward_order.append(name)
            call = len(calls)
            calls.append([t.detach().float().cpu().clone() for t in tensors])
            for index, tensor in enumerate(tensors):
                if tensor.requires_grad:
                    tensor.register_hook(self._on_backward(name, call, index))

        return hook

    def _on_backward(self, name: str, call: int, index: int) -> Any:
        def hook(grad: torch.Tensor) -> None:
            grads = self.backward.setdefault(name, {})
            if not grads:
                self.backward_order.append(name)
            grads[(call, index)] = grad.detach().float().cpu().clone()

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def grouped(self, name: str, backward: bool, microbatches: int) -> list[torch.Tensor] | None:
        """The module's outputs (or their gradients) per (call within a micro-batch, output index), each the
        concatenation of its ``microbatches`` micro-batches' tensors along dim 0; None when the calls do not
        split evenly into micro-batches or a gradient is missing."""
        calls = self.forward.get(name, [])
        if not calls or len(calls) % microbatches:
            return None
        per = len(calls) // microbatches
        width = min(len(c) for c in calls)
        out = []
        for call in range(per):
            for index in range(width):
                parts = []
                for micro in range(microbatches):
                    at = micro * per + call
                    if backward:
                        grad = self.backward.get(name, {}).get((at, index))
                        if grad is None:
                            return None
                        parts.append(grad)
                    else:
                        parts.append(calls[at][index])
                out.append(parts[0] if microbatches == 1 else torch.cat(parts, 0))
        return out
