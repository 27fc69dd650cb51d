"""ZeRO-3 under pipeline parallelism: a stage's units gathered within each of its schedule actions.

A pipeline schedule interleaves the micro-batches: forwards of micro-batches j+1, j+2, ... run before the backward
of j (1F1B, interleaved chunks), and zero-bubble schedules split a backward into I (input gradient) and W (weight
gradients, which restarts from nodes inside the units, where no module or tensor hook fires). The runner enters
``StageScopes.scope(stage, kind)`` around every compute action (F, B, I, W) and every no-grad forward (shape pass,
evaluation); inside it:

- F and B, one unit at a time (as without pipeline): the stage's root unit (embeddings / final norm and head:
  used at both ends of the stage) is gathered for the whole action; a block is gathered by its forward pre-hook
  (the stage's next block prefetched) and freed by its forward hook; in B a hook on the block's output gathers it
  again (the stage's previous block prefetched) and, once all its parameters have their gradient, the gradients
  move into the unit's unsharded accumulator ``local_grad`` and the block is freed. Held: the root and at most
  two blocks.
- I and W: every unit of the stage is gathered for the action (W starts inside the units, no hook tells which).
- exit: gradients not yet moved are moved, every unit of the stage is freed (only the shards stay).

Two actions of two stages may be running at once: DualPipeV's overlapped pair (``pipeline/overlap.py``) runs the
forward of one stage and the backward of another, one at a time, switching at each expert-parallel exchange. So
what an action is doing is kept per stage (``active``), each block's hooks read its own stage's, and a unit that
both stages use (a V's root on rank 0: the embeddings of stage 0, the head of stage 2p - 1) is freed when the
last of them ends (its gradients moved then, added to what the first one's end moved). The switch points are
the same on every rank of the group, so the gathers are issued in the same order on all of them.

Every micro-batch's autograd graph saves views of a unit's flat buffer; the buffer's *storage* is kept (only
resized) for the strategy's whole life, so each re-gather refills the storage those views point into (the FSDP
"free storage / allocate storage" trick of ``fsdp_unit``, kept across the micro-batches in flight). The runner
runs every backward under ``no_sync``; ``finish_backward`` reduce-scatters each unit's accumulated gradient once
per step (PyTorch FSDP's no_sync: one full gradient per unit held until then).

Communication per step with m micro-batches and a stage of P parameters over N ranks: 2 m (N-1)/N P gathered
(3 m with zero-bubble's separate I and W, but for the first stage, whose I has nothing to compute) plus one
(N-1)/N P reduce-scatter.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from plait.parallel.pipeline.schedule import Kind
from plait.parallel.zero.fsdp_unit import FlatUnit, UnitState

PER_UNIT_KINDS = (Kind.FORWARD, Kind.BACKWARD)
"""Actions whose units are gathered one at a time by hooks; in I and W the whole stage is gathered."""


def _neighbour(order: list[FlatUnit], unit: FlatUnit, step: int) -> FlatUnit | None:
    """The unit ``step`` places after ``unit`` in ``order`` (None past either end or when absent)."""
    for index, candidate in enumerate(order):
        if candidate is unit:
            other = index + step
            return order[other] if 0 <= other < len(order) else None
    return None


class StageScopes:
    """Which of ``units`` each local pipeline stage uses, the scope around its actions and the hooks' work."""

    def __init__(
        self,
        units: list[FlatUnit],
        root: FlatUnit,
        stage_modules: dict[int, nn.Module],
        output_tensors: Callable[[Any], list[torch.Tensor]],
    ) -> None:
        self.units, self.root = units, root
        self.output_tensors = output_tensors
        self.by_stage: dict[int, list[FlatUnit]] = {}
        """Per stage, the non-empty units holding its parameters, in registration (forward) order."""
        for stage, module in stage_modules.items():
            held = {id(p) for p in module.parameters()}
            self.by_stage[stage] = [u for u in units if not u.empty and any(id(p) in held for p in u.params)]
        self.blocks: dict[int, list[FlatUnit]] = {
            stage: [u for u in stage_units if u is not root] for stage, stage_units in self.by_stage.items()
        }
        self.stage_of = {id(u): stage for stage, blocks in self.blocks.items() for u in blocks}
        """The stage of each block unit (the root may serve two: a V's both ends)."""
        for unit in units:
            unit.in_graph = True  # always refill the one storage: graphs of micro-batches in flight view it
        self.active: dict[int, str] = {}
        """The kind of the action each stage is running now (two stages in DualPipeV's overlapped pair)."""
        self.peak_gathered = 0
        """Most units gathered (or being gathered) at once inside an F or B action (tests; the memory claim)."""

    # ----------------------------------------------------------------- the scope around one action
    @contextlib.contextmanager
    def scope(self, stage: int, kind: str) -> Iterator[None]:
        """Gather what ``stage``'s action needs up front; afterwards keep new gradients unsharded, free all."""
        units = self.by_stage.get(stage, [])
        if kind == Kind.BACKWARD_INPUT and stage == 0:
            upfront = []  # the first stage's I computes nothing (its W does the whole backward)
        elif kind in PER_UNIT_KINDS:
            upfront = [u for u in units if u is self.root]
        else:
            upfront = units
        self.active[stage] = kind
        try:
            for unit in upfront:
                unit.prefetch(kind)
            for unit in upfront:
                unit.gather(kind, grad_enabled=True)
            yield
        finally:
            del self.active[stage]
            busy = {id(u) for other in self.active for u in self.by_stage.get(other, [])}
            for unit in units:
                if id(unit) in busy:  # the other running action's too: freed when that one ends
                    continue
                self._keep_grads(unit)
                unit.reshard()
                unit.backward_started = unit.grads_done = False
                unit.ready = 0

    def _keep_grads(self, unit: FlatUnit) -> None:
        if any(p.grad is not None for p in unit.params):
            unit.local_grad = unit.take_grads()  # adds the previous local_grad

    def _count(self) -> None:
        if any(kind in PER_UNIT_KINDS for kind in self.active.values()):
            held = sum(1 for u in self.units if u.state is not UnitState.FREE)
            self.peak_gathered = max(self.peak_gathered, held)

    def _kind(self, unit: FlatUnit) -> str | None:
        """The kind of the action running on ``unit``'s stage (a root unit: of any running action), or None."""
        stage = self.stage_of.get(id(unit))
        if stage is None:
            return next(iter(self.active.values()), None) if unit is self.root else None
        return self.active.get(stage)

    def _per_unit(self, unit: FlatUnit) -> bool:
        """Whether ``unit`` is a block gathered by hooks in its stage's running F/B action."""
        return unit is not self.root and self._kind(unit) in PER_UNIT_KINDS

    def _next_block(self, unit: FlatUnit, step: int) -> FlatUnit | None:
        return _neighbour(self.blocks[self.stage_of[id(unit)]], unit, step)

    # ----------------------------------------------------------------- hooks (called by the strategy)
    def pre_forward(self, unit: FlatUnit) -> None:
        if unit is self.root:
            return
        if torch._C._current_graph_task_id() != -1:  # recomputation inside a backward: stays until the scope ends
            unit.gather("recompute", grad_enabled=True)
            return
        if not self._per_unit(unit):
            return
        unit.gather(self._kind(unit) or Kind.FORWARD, grad_enabled=True)
        following = self._next_block(unit, +1)
        if following is not None:
            following.prefetch(Kind.FORWARD)
        self._count()

    def post_forward(self, unit: FlatUnit, output: Any) -> None:
        if unit is self.root or torch._C._current_graph_task_id() != -1 or not self._per_unit(unit):
            return
        if torch.is_grad_enabled():
            for tensor in self.output_tensors(output):
                tensor.register_hook(functools.partial(self._pre_backward, unit))
        unit.reshard()

    def _pre_backward(self, unit: FlatUnit, grad: torch.Tensor) -> None:
        kind = self._kind(unit)
        if unit.backward_started or kind is None:
            return
        unit.backward_started = True
        unit.gather(kind, grad_enabled=True)  # idempotent in I (the whole stage is gathered)
        if self._per_unit(unit):
            previous = self._next_block(unit, -1)
            if previous is not None and not previous.backward_started:
                previous.prefetch(Kind.BACKWARD)
            self._count()

    def grad_ready(self, unit: FlatUnit) -> None:
        """A parameter's gradient was accumulated: in B, a block whose gradients are all there is done."""
        unit.ready += 1
        if unit.ready == len(unit.params) and self._per_unit(unit) and self._kind(unit) == Kind.BACKWARD:
            self._keep_grads(unit)
            unit.reshard()


__all__ = ["StageScopes"]
