"""One pipeline stage on this rank: a model chunk and the per-micro-batch state its schedule actions need.

- ``F`` (``forward``): keeps the input (a leaf that requires grad when the stage is not the first, so that its
  ``.grad`` is the gradient to send back) and the output (the last stage: the loss to differentiate).
- ``B`` (``backward``): ``autograd.backward(output, grad_output)`` (or of the loss); returns the input's
  gradient and frees the micro-batch.
- ``I`` / ``W`` (zero-bubble schedules, Qi et al. 2023): ``I`` computes only dL/d(input), which the previous
  stage waits for; ``W`` computes the weight gradients later. The graph is split where the input's path and a
  parameter's path meet: while ``I`` runs (``autograd.grad`` w.r.t. the input, graph retained) a pre-hook on
  each such *merge node* captures the gradient arriving there; ``W`` restarts from those nodes towards their
  own parameters only (one ``autograd.backward(GradientEdge, inputs=params)`` per merge node, which cannot
  reach another merge node's parameters), so nothing is computed twice. For linear layers I is dX = dY W and
  W is dW = dY^T X, exactly the split of the paper. Where one parameter is reached from two merge nodes (a
  weight used twice) the stage falls back to ``W`` = a second backward restricted to the parameters, which is
  exact but repeats the activation-gradient work. Either way the gradients equal those of ``B``.

Activation bytes (``count_activations``, off unless asked for: ``PipelineRunner.count_activations``): every tensor
autograd saves during ``F`` (not parameters; each storage once) plus the input is counted while the micro-batch
is held; ``held_bytes`` / ``peak_bytes`` report it (1F1B vs GPipe memory). Counting hooks every saved tensor, a
host cost per action that the runtime does not pay when nothing reads the figures.

Per-action host work is kept to what torch.distributed.pipelining does: the stage's trainable tensors are looked
up once (``params``: ZeRO-3 swaps their ``.data``, never the Parameter objects; ``refresh_params`` after replacing
modules or buffers), not by walking the module tree at every action.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, Node

from plait.errors import ScheduleError
from plait.observe.memory import SavedActivations
from plait.parallel.pipeline.schedule import Kind


@dataclass
class _Held:
    """What one micro-batch keeps between its forward and its (last) backward."""

    input: torch.Tensor | None
    output: torch.Tensor | None
    bytes: int = 0
    grad_output: torch.Tensor | None = None
    deferred: list[tuple[list[GradientEdge], list[torch.Tensor], list[torch.Tensor]]] | None = None
    """After ``I``: per merge node, (roots, their gradients, the parameters behind them); None: fallback W."""
    captured: dict[Node, tuple[Any, ...]] = field(default_factory=dict)


class PipelineStage:
    """Stage ``index`` of ``num_stages``: runs ``module`` on micro-batches and keeps what backward needs."""

    def __init__(self, module: nn.Module, index: int, num_stages: int) -> None:
        self.module = module
        self.index = index
        self.num_stages = num_stages
        self.tied: tuple[tuple[str, str], ...] = ()
        """Tied parameters (name on stage 0, name on the last stage) when this is the first or the last stage."""
        self._held: dict[int, _Held] = {}
        self.held_bytes = 0
        self.peak_bytes = 0
        self.count_activations = False
        """Count the activation bytes each micro-batch holds (``held_bytes`` / ``peak_bytes``; module docstring)."""
        self._params: list[torch.Tensor] | None = None

    @property
    def params(self) -> list[torch.Tensor]:
        """What the stage trains: its parameters and the buffers that require grad (the last stage's copy of a
        tied parameter, ``split.tie_copy``), looked up at the first action and kept (``refresh_params``)."""
        if self._params is None:
            self._params = [
                *(p for p in self.module.parameters() if p.requires_grad),
                *(b for b in self.module.buffers() if b.requires_grad),
            ]
        return self._params

    def refresh_params(self) -> None:
        """Look ``params`` up again at the next action: after moving the module to a device (which replaces its
        buffers) or making a buffer trainable."""
        self._params = None

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def reset_peak(self) -> None:
        self.peak_bytes = self.held_bytes

    # ----------------------------------------------------------------- forward
    def run(self, inputs: torch.Tensor, positions: torch.Tensor | None = None) -> Any:
        """The chunk on ``inputs`` (and the micro-batch's packed-document ``positions``, when it has them)."""
        return self.module(inputs) if positions is None else self.module(inputs, positions=positions)

    def forward(self, microbatch: int, inputs: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Run the chunk on ``inputs`` (``positions``: the micro-batch's document positions, given to every stage:
        ``plait.models.inputs``); keep input and output for backward; return the output."""
        if microbatch in self._held:
            raise ScheduleError(f"stage {self.index}: {self.index}F{microbatch} ran twice without its backward.")
        if not self.is_first and inputs.is_floating_point():
            inputs = inputs.detach().requires_grad_(True)
        held_bytes = 0
        if self.count_activations:
            with SavedActivations(exclude=self.params) as saved:  # the input, then what autograd keeps
                saved.add(inputs)
                output = self.run(inputs, positions)
            held_bytes = saved.bytes
        else:
            output = self.run(inputs, positions)
        if not isinstance(output, torch.Tensor):
            raise TypeError(
                f"pipeline stage {self.index} returned {type(output).__name__}; stages must pass one tensor to the next. "
                f"Fix: make each chunk's forward return a single tensor."
            )
        held = _Held(inputs if inputs.requires_grad else None, output, held_bytes)
        self._held[microbatch] = held
        self.held_bytes += held.bytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return output

    def set_loss(self, microbatch: int, loss: torch.Tensor) -> None:
        """Last stage: what backward differentiates is this (scaled) loss, not the output."""
        self._held[microbatch].output = loss

    # ----------------------------------------------------------------- backward
    def backward(self, microbatch: int, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        """B: input and weight gradients at once; returns dL/d(input) (None on the first stage)."""
        held = self._take(microbatch, Kind.BACKWARD)
        output = held.output
        if output is not None and output.requires_grad:
            torch.autograd.backward(output, None if self.is_last else grad_output)
        return self._release(microbatch, held, held.input.grad if held.input is not None else None)

    def backward_input(self, microbatch: int, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        """I: dL/d(input) only (graph kept for W); None on the first stage, whose W then does everything."""
        held = self._peek(microbatch, Kind.BACKWARD_INPUT)
        held.grad_output = None if self.is_last else grad_output
        if held.input is None or held.output is None or not held.output.requires_grad:
            return None
        merges = _merge_nodes(held.output, held.input, self.params)
        handles = []
        if merges is not None:
            for node in merges:
                handles.append(node.register_prehook(_capture(held.captured, node)))
        try:
            (grad_input,) = torch.autograd.grad(
                held.output, held.input, held.grad_output, retain_graph=True, allow_unused=True
            )
        finally:
            for handle in handles:
                handle.remove()
        if merges is not None:
            held.deferred = [_roots(node, held.captured.get(node), branch) for node, branch in merges.items()]
        held.captured = {}
        return grad_input if grad_input is not None else torch.zeros_like(held.input)

    def backward_weight(self, microbatch: int) -> None:
        """W: the weight gradients of a micro-batch whose I has run; frees it."""
        held = self._take(microbatch, Kind.BACKWARD_WEIGHT)
        output = held.output
        if held.deferred is not None:
            for roots, grads, params in held.deferred:
                if roots:
                    torch.autograd.backward(roots, grads, retain_graph=True, inputs=params)
        elif output is not None and output.requires_grad and (params := self.params):
            torch.autograd.backward(output, held.grad_output, inputs=params)
        self._release(microbatch, held, None)

    # ----------------------------------------------------------------- bookkeeping
    def _peek(self, microbatch: int, kind: str) -> _Held:
        if microbatch not in self._held:
            raise ScheduleError(
                f"stage {self.index}: {self.index}{kind}{microbatch} runs before {self.index}F{microbatch}."
            )
        return self._held[microbatch]

    def _take(self, microbatch: int, kind: str) -> _Held:
        self._peek(microbatch, kind)
        return self._held.pop(microbatch)

    def _release(self, microbatch: int, held: _Held, result: torch.Tensor | None) -> torch.Tensor | None:
        self.held_bytes -= held.bytes
        held.input = held.output = held.grad_output = None
        held.deferred = None
        return result

    @property
    def in_flight(self) -> int:
        """Micro-batches whose forward has run and whose backward has not finished."""
        return len(self._held)


def _capture(store: dict[Node, tuple[Any, ...]], node: Node) -> Any:
    def hook(grad_outputs: tuple[Any, ...]) -> None:
        store[node] = tuple(grad_outputs)

    return hook


def _roots(
    node: Node, grads: tuple[Any, ...] | None, params: list[torch.Tensor]
) -> tuple[list[GradientEdge], list[torch.Tensor], list[torch.Tensor]]:
    if grads is None:  # the node got no gradient in I (nothing flows to it): its parameters get none either
        return [], [], params
    pairs = [(GradientEdge(node, i), g) for i, g in enumerate(grads) if g is not None]
    return [edge for edge, _ in pairs], [g for _, g in pairs], params


def _merge_nodes(
    output: torch.Tensor, inputs: torch.Tensor, params: list[torch.Tensor]
) -> dict[Node, list[torch.Tensor]] | None:
    """The nodes on the input's gradient path with a branch leading only to parameters, each with the
    parameters behind its branches; None when a parameter lies behind two of them (then W is a full re-run)."""
    root = output.grad_fn
    if root is None:
        return None
    param_ids = {id(p): p for p in params}
    order: list[Node] = []
    state: dict[Node, bool] = {}
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:  # iterative post-order (children before parents)
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in state:
            continue
        state[node] = True
        stack.append((node, True))
        stack.extend((child, False) for child, _ in node.next_functions if child is not None and child not in state)
    reach_input: dict[Node, bool] = {}
    behind: dict[Node, frozenset[int]] = {}
    for node in order:
        variable = getattr(node, "variable", None)
        reach_input[node] = variable is inputs
        found = {id(variable)} if variable is not None and id(variable) in param_ids else set()
        for child, _ in node.next_functions:
            if child is not None:
                reach_input[node] |= reach_input[child]
                found |= behind[child]
        behind[node] = frozenset(found)
    if not reach_input[root]:
        return None
    merges: dict[Node, list[torch.Tensor]] = {}
    owner: dict[int, Node] = {}
    for node in order:
        if not reach_input[node]:
            continue
        branch: set[int] = set()
        for child, _ in node.next_functions:
            if child is not None and not reach_input[child]:
                branch |= behind[child]
        if not branch:
            continue
        for pid in branch:
            if owner.setdefault(pid, node) is not node:
                return None  # a parameter behind two merge nodes (a weight used twice): fall back
        merges[node] = [param_ids[pid] for pid in sorted(branch)]
    return merges


__all__ = ["PipelineStage"]
