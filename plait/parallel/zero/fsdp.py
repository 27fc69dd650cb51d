"""ZeRO-3 / FSDP: parameters, gradients and optimizer states all sharded over the data-parallel ranks.

Rajbhandari et al. 2020 (ZeRO, stage 3 "P_os+g+p") and Zhao et al. 2023 (PyTorch FSDP). The model is cut into
*units* (``FlatUnit``): each transformer block, found automatically (``plait.parallel.blocks``: the children of
the shallowest ``nn.ModuleDict``/``nn.ModuleList`` named like ``blocks``, ``layers``, ``h``, ...), plus a *root* unit holding every other trainable parameter (embeddings, final norm, head; the whole model
when no blocks are found). At rest each of the N ranks holds 1/N of every unit's flat parameters; a unit is
whole only while it computes:

    forward:   all-gather unit u (prefetched during u-1), compute, free         (N-1)/N x P bytes sent
    backward:  all-gather unit u again (prefetched during u+1's backward),
               compute gradients, reduce-scatter (average) the flat gradient,
               free the weights and the full gradient                            2 (N-1)/N x P bytes sent

so a step sends 3 (N-1)/N x P x 4 bytes for P fp32 parameters: 1.5x DDP's all-reduce, for holding P/N instead
of P parameters (+ at most two gathered units + the root while computing). The root unit is gathered for the
whole forward (its embeddings run first, its head last) and re-gathered when the backward begins (a hook on the
model's output), so it also moves exactly 3 (N-1)/N x P_root.

Hooks: a forward pre-hook gathers the unit and issues the next unit's all-gather asynchronously (prefetch, in the
order the previous forward ran them); a forward hook frees it and, under grad, hooks the unit's output tensors so
that the unit is gathered again (and the one before it prefetched) just before the gradient flows into it.
A post-accumulate-grad hook on each parameter counts the unit's gradients; when all have arrived the flat
gradient is reduce-scattered (asynchronously; at most one in flight) into the shard's ``.grad``. A callback
queued on the autograd engine finishes units whose parameters got no gradient and frees whatever is left.

Inside ``no_sync()`` (gradient accumulation) nothing is reduced: each unit keeps its full, unsharded flat gradient
locally (P extra values per rank during accumulation, as in PyTorch FSDP's no_sync) and adds it to the gradient
reduced by the next synchronised backward. Activation recomputation may re-run a unit's forward during backward:
the pre-hook is then idempotent and the unit stays gathered until its gradients are reduced.

HSDP (``Layout.dp_replicate`` = R > 1, docs/zero.md): ``axis`` is ``shard``, one replica group of N = dp/R x cp
ranks, so units are gathered and reduce-scattered inside the group, and each reduced shard is averaged over
``replicate`` (asynchronously, finished at the end of the backward): 3 (N-1)/N x P x b + 2 (R-1)/R x P/N x b
per step, the all-reduce crossing the replica groups' (inter-node) links with 1/N of the gradient.

Expert parallelism (``plait.parallel.expert``): a module holding expert slices (an MoE layer's ``experts``) is a
unit of its own inside its block, sharded over ``edp`` (the ranks holding the same experts) and reduced there
(``plait.parallel.strategy.reduce_axis``); the block's other parameters stay in the block's unit over ``dp_cp``.

With tensor parallelism each tp rank's units hold its own slices (and the replicated parameters) and are sharded
over ``axis`` like any other (``param_grads`` gives each piece with its parameter for tp-aware norms and
Megatron-SP sums). Under pipeline parallelism a stage's units are gathered within the runner's scope around
each schedule action, one block at a time in F and B (``fsdp_pipeline``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from plait.comm import Comm
from plait.comm.collectives import Pending
from plait.layout import Layout
from plait.logging import get_logger
from plait.parallel.blocks import find_blocks
from plait.parallel.param_groups import GroupOf, order_by_group
from plait.parallel.precision import cast_for_reduction
from plait.parallel.strategy import (
    EXPERT_AXES,
    EXPERT_AXIS,
    GRAD_AXIS,
    OptimizerFactory,
    is_expert_sharded,
    reduce_scale,
)
from plait.parallel.zero.base import FlatBuffer, ShardedStrategy
from plait.parallel.zero.flat import OwnedLayout, owned_layout
from plait.parallel.zero.fsdp_pipeline import StageScopes
from plait.parallel.zero.fsdp_unit import FlatUnit, UnitState
from plait.parallel.zero.shard_buckets import master_dtype

log = get_logger(__name__)

NamedParams = list[tuple[str, nn.Parameter]]


def group_parameters(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> dict[str, NamedParams]:
    """Trainable parameters per unit name ("" is the root), by their model names; a tied parameter must not
    span two units."""
    groups: dict[str, NamedParams] = {"": [], **{name: [] for name, _ in blocks}}
    owner: dict[int, tuple[str, str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if not param.requires_grad:
            continue
        unit = next((block for block, _ in blocks if name.startswith(block + ".")), "")
        if id(param) in owner:
            first_unit, first_name = owner[id(param)]
            if first_unit != unit:
                raise ValueError(
                    f"parameter '{name}' is the same tensor as '{first_name}', but they lie in different ZeRO-3 units "
                    f"('{unit or 'root'}' and '{first_unit or 'root'}'): each unit is gathered and freed on its own, "
                    "so a weight shared across units cannot be sharded. Fix: untie it, or use zero=1/2."
                )
            continue
        owner[id(param)] = (unit, name)
        groups[unit].append((name, param))
    return groups


def expert_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules holding expert slices directly (units of their own over ``EXPERT_AXIS``), in module order."""
    return [
        (path, module)
        for path, module in model.named_modules()
        if any(is_expert_sharded(p) for p in module.parameters(recurse=False))
    ]


def unit_order(names: list[str], blocks: list[tuple[str, nn.Module]]) -> list[str]:
    """Unit names in forward order: the root, then each block followed by the expert units inside it."""
    order = [""] if "" in names else []
    for block, _ in blocks:
        order += [name for name in names if name == block or name.startswith(block + ".")]
    return order + [name for name in names if name not in order]


def _output_tensors(value: Any) -> list[torch.Tensor]:
    """Tensors requiring grad inside a module's output (a tensor, or tuples/lists/dicts of them)."""
    if isinstance(value, torch.Tensor):
        return [value] if value.requires_grad else []
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _output_tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _output_tensors(item)]
    return []


def _after(order: list[FlatUnit], unit: FlatUnit) -> FlatUnit | None:
    """The unit after ``unit`` in ``order`` (None at the end or when absent)."""
    for index, candidate in enumerate(order):
        if candidate is unit:
            return order[index + 1] if index + 1 < len(order) else None
    return None


class FullyShardedStrategy(ShardedStrategy):
    """ZeRO-3: every unit's parameters sharded at rest over ``axis``; the optimizer steps this rank's masters
    (the parameter shards themselves, or their fp32 copies in host memory / files under ``layout.offload``)."""

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        optimizer: OptimizerFactory | torch.optim.Optimizer,
        layout: Layout | None = None,
        axis: str = GRAD_AXIS,
        offload_dir: str | None = None,
        param_groups: GroupOf | None = None,
        init_shards: Callable[[list[FlatUnit]], None] | None = None,
    ) -> None:
        """``init_shards``: for a model built on the meta device, writes this rank's values into the units'
        shards (``plait.parallel.materialize``) before the masters and the optimizer are made from them."""
        super().__init__(
            model,
            comm,
            optimizer,
            layout or Layout(zero=3).resolve(comm.mesh.world_size),
            axis,
            offload_dir,
            param_groups,
        )
        self.trace: list[tuple[str, ...]] | None = None
        """Set to a list to record ("gather"/"wait"/"free"/"reduce_scatter", unit, ...) events (tests, debugging)."""
        blocks = find_blocks(model)
        experts = expert_units(model)
        groups = group_parameters(model, experts + blocks)  # an expert unit's parameters are not its block's
        groups = {name: groups[name] for name in unit_order(list(groups), blocks)}
        if not any(groups.values()):
            raise ValueError("the model has no trainable parameters (requires_grad=True): ZeRO-3 has nothing to shard")
        self._plan_groups([item for params in groups.values() for item in params])
        groups = {  # with param_groups: each unit laid out group after group (plait.parallel.param_groups)
            name: order_by_group(params, [self._group_id[id(p)] for _, p in params]) for name, params in groups.items()
        }
        modules = {"": model, **dict(blocks), **dict(experts)}
        expert_names = {name for name, _ in experts}
        self.units = [
            FlatUnit(
                name or "root",
                modules[name],
                params,
                comm,
                EXPERT_AXES.get(axis, EXPERT_AXIS) if name in expert_names else axis,
                self._record,
                self._unit_layout(params),
            )
            for name, params in groups.items()
            if params or not name
        ]
        self.root = self.units[0]
        if init_shards is not None:
            init_shards(self.units)
        if self.placement.offloaded:  # ZeRO-Offload: the optimizer steps host copies; the shards stay for compute
            for unit in self.units:
                if not unit.empty:
                    values = unit.shard.detach().to(master_dtype(unit.shard.dtype))
                    unit.master = self._make_master(values, f"master-{unit.name}")
        self.params = [unit.master for unit in self.units if not unit.empty]
        buffers = [FlatBuffer(u.layout, u.rank, u.master, u.params, u.shard) for u in self.units if not u.empty]
        self.optimizer = self._build_optimizer(self.params, buffers)
        self._forward_order = list(self.units)
        self._backward_order = [self.root, *reversed(self.units[1:])]
        self._pre_record: list[FlatUnit] = []
        self._post_record: list[FlatUnit] = []
        self._backward_active = False
        self._inflight: tuple[FlatUnit, Pending] | None = None
        self._replicating: list[tuple[FlatUnit, Pending]] = []
        """HSDP: reduced shards whose average over the replica groups is in flight (finished by ``_settle``)."""
        self._handles: list[Any] = []
        self._stages: StageScopes | None = None
        """Set under pipeline parallelism (``attach_pipeline``): the runner's scopes gather, the hooks stand by."""
        for unit in self.units:
            pre_forward = functools.partial(self._pre_forward, unit)
            self._handles.append(unit.module.register_forward_pre_hook(pre_forward, prepend=True))
            self._handles.append(unit.module.register_forward_hook(functools.partial(self._post_forward, unit)))
            for param in unit.params:
                hook = functools.partial(self._grad_ready, unit)
                self._handles.append(param.register_post_accumulate_grad_hook(hook))
        log.info(
            "ZeRO-3 over %s=%d: %d units (root + %d blocks), %d parameters, %d per rank at rest, offload=%s",
            axis,
            comm.size(axis),
            len(self.units),
            len(self.units) - 1,
            sum(u.layout.numel for u in self.units),
            sum(u.shard.numel() for u in self.units),
            self.layout.offload,
        )

    def _unit_layout(self, params: NamedParams) -> OwnedLayout | None:
        """A unit holding parameters that a ``WholeTensorOptimizer`` steps whole is sharded tensor-atomically (each
        parameter whole on one rank, owners balanced by size); other units split evenly (None)."""
        if not any(id(p) in self._whole_ids for _, p in params):
            return None
        return owned_layout(params, self.world)

    def _record(self, *event: str) -> None:
        if self.trace is not None:
            self.trace.append(event)

    # ----------------------------------------------------------------- forward hooks
    def _recomputing(self) -> bool:
        """A forward run by autograd inside our backward (activation recomputation)."""
        return self._backward_active and torch._C._current_graph_task_id() != -1

    def _pre_forward(self, unit: FlatUnit, module: nn.Module, args: Any) -> None:
        if self._stages is not None:  # pipeline: gathered within the runner's scope of the stage's action
            self._stages.pre_forward(unit)
            return
        if self._recomputing():  # keep the unit gathered until its gradients are reduced
            unit.gather("recompute", grad_enabled=True)
            return
        if unit is self.root:
            self._pre_record, self._post_record = [], []
        self._pre_record.append(unit)
        unit.gather("forward", grad_enabled=torch.is_grad_enabled())
        following = _after(self._forward_order, unit)
        if following is not None:
            following.prefetch("forward")

    def _post_forward(self, unit: FlatUnit, module: nn.Module, args: Any, output: Any) -> None:
        if self._stages is not None:
            self._stages.post_forward(unit, output)
            return
        if self._recomputing():
            return
        self._post_record.append(unit)
        if torch.is_grad_enabled():
            for tensor in _output_tensors(output):
                tensor.register_hook(functools.partial(self._pre_backward_hook, unit))
        unit.reshard()
        if unit is self.root:  # the whole forward ran: remember its order, drop prefetches nobody used
            self._forward_order = list(self._pre_record)
            self._backward_order = list(reversed(self._post_record))
            for other in self.units:
                if other.state is UnitState.PENDING:
                    other.reshard()

    # ----------------------------------------------------------------- backward hooks
    def _enter_backward(self) -> None:
        if not self._backward_active:
            self._backward_active = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward_pass)

    def _pre_backward_hook(self, unit: FlatUnit, grad: torch.Tensor) -> None:
        self._enter_backward()
        if unit.backward_started:
            return
        unit.backward_started = True
        unit.gather("backward")
        following = _after(self._backward_order, unit)
        if following is not None and not following.backward_started:
            following.prefetch("backward")

    def _grad_ready(self, unit: FlatUnit, param: nn.Parameter) -> None:
        if self._stages is not None:  # pipeline: kept unsharded until finish_backward
            self._stages.grad_ready(unit)
            return
        self._enter_backward()
        unit.ready += 1
        if unit.ready == len(unit.params):
            self._reduce(unit)

    def _reduce(self, unit: FlatUnit) -> None:
        """The unit's gradients are complete: keep them (no_sync) or reduce-scatter them; free the weights."""
        if unit.grads_done:
            return
        unit.grads_done = True
        flat = unit.take_grads()
        unit.reshard()
        if not self._sync:
            unit.local_grad = flat
            return
        self._drain()  # at most one reduce-scatter in flight: bounds the full gradients held
        flat = cast_for_reduction(flat, self.reduce_dtype)
        self._inflight = (unit, self.comm.reduce_scatter(flat, unit.axis, op="avg", async_op=True))
        self._record("reduce_scatter", unit.name)

    def _drain(self) -> None:
        """Wait for the reduce-scatter in flight; hand its shard to the master (under HSDP: issue the shard's
        average over the replica groups, finished by ``_settle``)."""
        if self._inflight is not None:
            unit, pending = self._inflight
            self._inflight = None
            self._replicating.append((unit, self.all_reduce_replicas(pending.wait())))
            if self.replica_axis is None:
                self._settle()

    def _settle(self) -> None:
        """Finish every shard's average over the replica groups (HSDP; already done without) and hand it over."""
        for unit, pending in self._replicating:
            reduced = pending.wait()
            if unit.axis != self.axis:  # an expert unit: sum over edp / dp_cp (strategy.reduce_axis)
                reduced = reduced * reduce_scale(self.comm, unit.axis, self.axis)
            self._receive_grad(unit.master, reduced)
        self._replicating = []

    def _finish_backward_pass(self) -> None:
        """End of a backward (autograd engine callback): finish every unit, free everything gathered."""
        for unit in self.units:
            unreduced = unit.backward_started or (self._sync and unit.local_grad is not None)
            if unreduced and not unit.empty and not unit.grads_done:
                self._reduce(unit)
        self._drain()
        self._settle()
        for unit in self.units:
            unit.end_backward()
        self._backward_active = False

    def finish_backward(self) -> None:
        """Gradients are reduced during backward; wait for the last reduce-scatter (and, with offload, for the
        device -> host copies of the reduced shards). Under pipeline parallelism every backward ran in
        ``no_sync``: reduce-scatter every unit's accumulated gradient now, one unit after another (at most one
        in flight), the same units in the same order on every rank."""
        if self._stages is not None:
            for unit in self.units:
                if not unit.empty:
                    flat = cast_for_reduction(unit.take_grads(), self.reduce_dtype)
                    self._drain()
                    self._inflight = (unit, self.comm.reduce_scatter(flat, unit.axis, op="avg", async_op=True))
                    self._record("reduce_scatter", unit.name)
        self._drain()
        self._settle()
        self.placement.synchronize()

    # ----------------------------------------------------------------- pipeline
    def attach_pipeline(self, stage_modules: dict[int, nn.Module]) -> None:
        """Pipeline parallelism: from now on each stage's units are gathered within the runner's ``pipeline_scope``
        around its actions (any schedule's order, split I/W backward included; ``fsdp_pipeline``)."""
        self._stages = StageScopes(self.units, self.root, stage_modules, _output_tensors)

    def pipeline_scope(self, stage: int, kind: str) -> contextlib.AbstractContextManager[None]:
        if self._stages is None:
            return contextlib.nullcontext()
        return self._stages.scope(stage, kind)

    # ----------------------------------------------------------------- gradients and step
    def owned_grads(self) -> list[torch.Tensor]:
        """This rank's slices of the averaged gradients, on the masters (padding included: it is zero)."""
        return [unit.master.grad for unit in self.units if unit.master.grad is not None]

    def param_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Views of the shard gradients, one per parameter piece in this rank's shard: tensor-parallel norm weights
        (a tp slice counts on every tp rank, a replicated parameter once) and Megatron-SP's sum over tp read the
        parameter's tags. Every tp rank lays out its unit alike (slices of equal size), so the piece of a
        replicated parameter sits at the same place of the same shard on every tp rank."""
        pieces = []
        for unit in self.units:
            grad = unit.master.grad
            if grad is not None and not unit.empty:
                for piece in unit.layout.slices(unit.rank):
                    pieces.append((unit.params[piece.index], grad[piece.at : piece.at + piece.end - piece.start]))
        return pieces

    def zero_grad(self) -> None:
        super().zero_grad()
        for unit in self.units:
            unit.local_grad = None

    def _publish(self) -> None:
        """With offload, copy the stepped masters into the parameter shards on the compute device (pinned
        non-blocking host -> device copies with CUDA, ordered before the next forward's all-gathers on the
        same stream); without offload the shards are the masters and already hold the new values."""
        with torch.no_grad():
            for unit in self.units:
                if unit.master is not unit.shard:
                    unit.shard.copy_(self.placement.to_compute(unit.master.detach(), unit.shard.dtype))

    # ----------------------------------------------------------------- introspection
    def _compute_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Parameter shards and gathered flat buffers; gradients on the model, in ``no_sync`` and unreduced."""
        gathered = [unit.full for unit in self.units if unit.full is not None]
        grads = [p.grad for unit in self.units for p in unit.params if p.grad is not None]
        grads += [unit.local_grad for unit in self.units if unit.local_grad is not None]
        grads += [
            unit.shard.grad for unit in self.units if unit.shard is not unit.master and unit.shard.grad is not None
        ]
        return {"parameters": [unit.shard for unit in self.units] + gathered, "gradients": grads}

    def parameter_count(self) -> int:
        """The units' parameters at their full size (the model's own tensors are empty between uses) plus the
        frozen parameters, which are not sharded."""
        frozen = sum(p.numel() for p in self.model.parameters() if not p.requires_grad)
        return sum(unit.layout.numel for unit in self.units) + frozen

    def held_parameter_count(self) -> int:
        """This rank's shards of the units plus the frozen parameters (not sharded)."""
        frozen = sum(p.numel() for p in self.model.parameters() if not p.requires_grad)
        return sum(unit.shard.numel() for unit in self.units) + frozen

    def held_bytes(self) -> int:
        """Bytes of model weights this rank holds now: its shards plus gathered units and gathers in flight."""
        return sum(unit.shard.numel() * unit.element_size + unit.gathered_bytes() for unit in self.units)

    def _full_by_param(self, shard_tensor: Callable[[FlatUnit], torch.Tensor | None]) -> dict[int, torch.Tensor]:
        full: dict[int, torch.Tensor] = {}
        for unit in self.units:
            tensor = shard_tensor(unit)
            if unit.empty or tensor is None:
                continue
            flat = unit.gather_copy(tensor)
            for param, view in zip(unit.params, unit.layout.views(flat)):
                full[id(param)] = view.clone()
        return full

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole, by the model's names (all-gathers every unit; call it on every rank)."""
        full = self._full_by_param(lambda unit: unit.shard)
        return {name: full.get(id(p), p.detach().clone()) for name, p in self.model.named_parameters()}

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """The averaged gradients, whole, by parameter name (after ``finish_backward``; collective)."""
        full = self._full_by_param(
            lambda unit: (
                None if unit.master.grad is None else self.placement.to_compute(unit.master.grad, unit.shard.dtype)
            )
        )
        return {name: full[id(p)] for name, p in self.model.named_parameters() if id(p) in full}
