"""``DataParallelStrategy``: what the Engine asks of any data-parallel flavour (DDP, ZeRO-1/2/3).

A strategy owns the optimizer that steps (over the model's parameters, or over this rank's shards) and keeps
the replicas over one mesh axis (``dp_cp``) in step. Per training step the Engine calls::

    with strategy.no_sync():  backward of micro-batches 1 .. m-1   # accumulate locally, no communication
    backward of micro-batch m                                       # reductions may start during it
    strategy.finish_backward()                                      # gradients complete (averaged / reduced)
    strategy.unscale_and_find_inf(1/scale)                          # fp16 loss scaling (all ranks agree)
    strategy.clip_grad_norm(max_norm)                               # global norm over every shard
    strategy.step(); strategy.zero_grad()

Subclasses override what differs; this base class is the plain, correct version: one flat all-reduce of the
gradients after the last backward.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from plait.comm import Comm
from plait.layout import Layout
from plait.mesh import EXPERT_SHARD_AXIS
from plait.parallel.param_groups import GroupOf, assign_groups, torch_groups
from plait.parallel.precision import cast_for_reduction, gradient_reduce_dtype
from plait.parallel.tensor.sequence import sum_over_tp
from plait.parallel.whole_tensor import SlotFlat, WholeSlot, WholeTensorOptimizer, build_hybrid, make_slot, slot_flats

GRAD_AXIS = "dp_cp"
"""Gradients are averaged over data- and context-parallel ranks: both see other tokens with the same weights."""

EXPERT_AXIS = "edp"
"""Expert weights split over ``ep`` (``plait.parallel.expert``) are held alike by the ``edp`` ranks only: their
gradients are reduced (and under ZeRO sharded) over it."""

SHARD_AXIS = "shard"
"""HSDP (``Layout.dp_replicate`` > 1): ZeRO shards over one replica group, the dp/R x cp ranks of this axis."""

REPLICATE_AXIS = "replicate"
"""HSDP: the R ranks at the same place of every replica group; each reduced shard's gradient is all-reduced over it."""

EXPERT_AXES = {GRAD_AXIS: EXPERT_AXIS, SHARD_AXIS: EXPERT_SHARD_AXIS}
"""A strategy's data axis -> the axis expert slices are reduced (and sharded) over in its place."""

MODEL_PARALLEL_AXES = ("pp", "tp")
"""Axes over which ranks hold different parameters (pipeline stages, tensor shards): a global gradient norm or
an inf check sums / maxes over them as well."""

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
"""``params -> optimizer``: called with parameters (or tensors) or with torch.optim parameter groups."""


def is_expert_sharded(param: torch.Tensor) -> bool:
    """Whether ``param`` is one ep rank's slice of a layer's experts (tagged by ``plait.parallel.expert``)."""
    return bool(getattr(param, "expert_sharded", False))


def data_axes(layout: Layout, across_replicas: bool = True) -> tuple[str, str | None]:
    """(the axis a strategy reduces gradients over, and ZeRO shards over; the axis each reduced shard is then
    all-reduced over, or None): (``dp_cp``, None), or under HSDP with ZeRO (``SHARD_AXIS``, ``REPLICATE_AXIS``).
    With zero=0 nothing is sharded, and one all-reduce over ``dp_cp`` is the whole of HSDP's reduction. Without
    ``across_replicas`` (semi-synchronous training, ``plait.parallel.semisync``) gradients stay inside a replica
    group: (``SHARD_AXIS``, None) at every ZeRO stage."""
    if layout.dp_replicate > 1 and not across_replicas:
        return SHARD_AXIS, None
    if layout.dp_replicate > 1 and layout.zero >= 1:
        return SHARD_AXIS, REPLICATE_AXIS
    return GRAD_AXIS, None


def reduce_axis(param: torch.Tensor, axis: str = GRAD_AXIS) -> str:
    """The per-parameter gradient table: the mesh axis ``param``'s gradient is reduced (and under ZeRO sharded)
    over: the strategy's ``axis`` (dp_cp, or HSDP's shard), or its expert counterpart ``EXPERT_AXES[axis]`` (edp,
    edp_shard) for an expert slice. Every gradient is then divided by the size of the data ranks (G = dp x cp): an
    expert slice's gradient arrives on its owner as the sum over the ep group's tokens already (the token
    exchange's backward), so sum over edp / G is the single-device gradient, as avg over dp_cp is for the others
    (``reduce_scale``). Under HSDP every parameter's reduced shard is then averaged over ``REPLICATE_AXIS`` too
    (``replica_axis``): avg over shard then over replicate is avg over dp_cp."""
    return EXPERT_AXES.get(axis, EXPERT_AXIS) if is_expert_sharded(param) else axis


def replica_axis(axis: str) -> str | None:
    """The axis each reduced shard of a strategy over ``axis`` is all-reduced (averaged) over next: HSDP's
    ``REPLICATE_AXIS`` for ``SHARD_AXIS``, else None. The same for every parameter, expert slices included (an ep
    group lies inside one replica group, so the replica groups hold the same experts at the same places)."""
    return REPLICATE_AXIS if axis == SHARD_AXIS else None


def reduce_scale(comm: Comm, param_axis: str, axis: str = GRAD_AXIS) -> float:
    """What an average over ``param_axis`` is multiplied by to be the sum over it divided by the size of ``axis``:
    1 for ``axis`` itself, 1/ep for its expert axis (edp over dp_cp, edp_shard over shard: both are 1/ep of it)."""
    return comm.size(param_axis) / comm.size(axis)


def grads_by_device(grads: Iterable[torch.Tensor], by_dtype: bool = False) -> dict[Any, list[torch.Tensor]]:
    """Gradients grouped by device (and dtype): foreach kernels and their scalar tensors need one device per call."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault((grad.device, grad.dtype) if by_dtype else grad.device, []).append(grad)
    return groups


def check_steps_without_closure(optimizer: torch.optim.Optimizer) -> None:
    """The Engine calls ``optimizer.step()`` with no argument: refuse an optimizer whose ``step`` requires a
    closure (torch.optim.LBFGS re-evaluates the loss several times per step) instead of failing at the first
    step with torch's "missing 1 required positional argument: 'closure'"."""
    closure = inspect.signature(optimizer.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise TypeError(
            f"{type(optimizer).__name__}.step(closure) needs a closure that re-evaluates the loss, but plait's Engine "
            f"runs forward and backward itself and calls optimizer.step() without one. Fix: use an optimizer whose "
            f"closure is optional (SGD, Adam, AdamW, ...)."
        )


def build_optimizer(
    factory: OptimizerFactory | torch.optim.Optimizer,
    params: list[nn.Parameter],
    groups: list[dict[str, Any]] | None = None,
) -> torch.optim.Optimizer:
    """Call the factory on ``params`` (or on ``groups``, torch.optim param groups over them), or accept an
    optimizer already built on exactly those parameters."""
    if isinstance(factory, torch.optim.Optimizer):
        if groups is not None:
            raise TypeError(
                "param_groups needs an optimizer factory (the strategy builds the groups), not an optimizer "
                "already built. Fix: optimizer=lambda groups: torch.optim.AdamW(groups, lr=...)."
            )
        owned = {id(p) for p in params}
        if not all(id(p) in owned for group in factory.param_groups for p in group["params"]):
            raise ValueError(
                "the optimizer holds parameters that are not the model's. Fix: pass a factory lambda p: ..."
            )
        check_steps_without_closure(factory)
        return factory
    optimizer = factory(groups if groups is not None else params)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"the optimizer factory returned {type(optimizer).__name__}, not a torch.optim.Optimizer")
    check_steps_without_closure(optimizer)
    return optimizer


class DataParallelStrategy:
    """Replicated parameters; gradients averaged over ``axis`` with one flat all-reduce after backward."""

    sharded = False
    """True when each rank owns only part of the gradients/optimizer state (norms then need an all-reduce)."""
    replica_axis: str | None = None
    """HSDP under ZeRO: the axis each reduced gradient shard is averaged over next (``replica_axis``); None when
    the strategy's own all-reduce is the whole reduction, or inside a replica group (``plait.parallel.semisync``)."""

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        optimizer: OptimizerFactory | torch.optim.Optimizer,
        layout: Layout | None = None,
        axis: str = GRAD_AXIS,
        param_groups: GroupOf | None = None,
    ) -> None:
        self.model = model
        self.comm = comm
        self.layout = layout or Layout().resolve(comm.mesh.world_size)
        self.axis = axis
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        groups = None
        options, ids = assign_groups(named, param_groups)
        if param_groups is not None:  # plait.parallel.param_groups: the factory gets torch.optim param groups
            groups = torch_groups(
                options, [[p for p, g in zip(self.params, ids) if g == i] for i in range(len(options))]
            )
        self.whole_slots: list[WholeSlot] = []
        """``WholeTensorOptimizer``: the parameters stepped whole (tp slices gathered at each step)."""
        if isinstance(optimizer, WholeTensorOptimizer):
            self.optimizer: torch.optim.Optimizer = self._build_whole(
                optimizer, named, ids, options if param_groups is not None else None
            )
        else:
            self.optimizer = build_optimizer(optimizer, self.params, groups)
        self.reduce_dtype = gradient_reduce_dtype(self.layout)
        """The dtype gradients are reduced in when not their own (``Layout.reduce_dtype="compute"``), else None."""
        self.expert_ranks = comm.size("ep") if any(is_expert_sharded(p) for p in self.params) else 1
        """ep when this rank holds expert slices (other ep ranks hold other experts), else 1."""
        self._sync = True

    def _build_whole(
        self,
        spec: WholeTensorOptimizer,
        named: list[tuple[str, nn.Parameter]],
        ids: list[int],
        options: list[dict[str, Any]] | None,
    ) -> torch.optim.Optimizer:
        """Replicated parameters are whole on every rank already: ``spec.whole`` steps the selected ones (a tp slice
        through a ``WholeSlot`` that gathers it over tp at each step), ``spec.rest`` the others."""
        chosen = spec.chosen(self.model)
        tp, tp_rank = self.comm.size("tp"), self.comm.mesh.index("tp")
        whole, rest = [], []
        for (name, param), group in zip(named, ids):
            if id(param) in chosen:
                slot = make_slot(name, param, param, None, param.shape, tp, tp_rank)
                self.whole_slots.append(slot)
                whole.append((slot, group))
            else:
                rest.append((param, group))
        rest_names = [name for name, p in named if id(p) not in chosen]
        return build_hybrid(spec, whole, rest, options, self.comm, self.whole_slots, rest_names)

    def whole_flats(self) -> list[SlotFlat]:
        """The tensors stepped whole that are not the model's parameters (gathered tp slices), for checkpoints."""
        return slot_flats(self.whole_slots)

    # ----------------------------------------------------------------- backward
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally without communication."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def finish_backward(self) -> None:
        """Average every gradient over its axis (``reduce_axis``; one flat buffer per dtype and axis). A parameter
        without a gradient on this rank contributes zeros, so that every rank runs the same collective with the
        same sizes."""
        if self.comm.size(self.axis) == 1:
            return
        by_key: dict[tuple[torch.dtype, str], list[nn.Parameter]] = {}
        for param in self.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            by_key.setdefault((param.grad.dtype, reduce_axis(param, self.axis)), []).append(param)
        for (_dtype, axis), params in by_key.items():
            grads = [p.grad for p in params if p.grad is not None]  # all of them: zeros were given above
            flat = cast_for_reduction(torch.cat([g.reshape(-1) for g in grads]), self.reduce_dtype)
            self.comm.all_reduce(flat, axis, op="avg")
            if axis != self.axis:
                flat.mul_(reduce_scale(self.comm, axis, self.axis))
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()

    # ----------------------------------------------------------------- pipeline
    def attach_pipeline(self, stage_modules: dict[int, nn.Module]) -> None:
        """Pipeline parallelism: ``stage_modules`` (stage index -> the module the runner calls) are this rank's
        stages. Nothing to do for replicated parameters; ZeRO-3 gathers a stage's units around its actions."""

    def pipeline_scope(self, stage: int, kind: str) -> contextlib.AbstractContextManager[None]:
        """What the pipeline runner enters around each compute action (``kind`` "F", "B", "I" or "W") of
        ``stage``, and around every no-grad forward of it (shape pass, evaluation): nothing here."""
        return contextlib.nullcontext()

    # ----------------------------------------------------------------- gradients
    def owned_grads(self) -> list[torch.Tensor]:
        """The gradients this rank is responsible for after ``finish_backward`` (every one, when replicated)."""
        return [p.grad for p in self.params if p.grad is not None]

    def reduction_axes(self) -> list[str]:
        """Axes whose ranks hold different gradients: the data axis when sharded (it spans ep), ep when replicated
        data parallelism holds expert slices, and pp / tp when > 1."""
        axes = [self.axis] if self.sharded else (["ep"] if self.expert_ranks > 1 else [])
        return axes + [axis for axis in MODEL_PARALLEL_AXES if self.comm.size(axis) > 1]

    def param_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """This rank's owned gradients, each with the parameter it belongs to (whole ``.grad`` here; a sharded
        strategy returns views of the pieces of each parameter in its shards). Writing them writes the gradient."""
        return [(p, p.grad) for p in self.params if p.grad is not None]

    def norm_groups(self) -> list[tuple[list[torch.Tensor], float]]:
        """This rank's owned gradients in groups ``(grads, weight)``: the global squared norm is the sum over
        ranks of weight x ||grads||^2. Weight 1 without tensor parallelism; with tp > 1 gradients of parameters
        replicated over tp (not ``tp_sharded``: norms, row-parallel biases) get the weight 1/tp, so that the sum
        over the tp ranks counts them once, and tp slices weight 1 (1/``param.tp_replicas`` for a slice that several
        tp ranks hold, as 2.5D tensor parallelism's weights replicated over its depth). Replicated data parallelism
        with expert slices sums over ep too (``reduction_axes``): the other parameters, the same on every ep rank,
        weigh 1/ep there."""
        tp, ep = self.comm.size("tp"), 1 if self.sharded else self.expert_ranks
        if tp == 1 and ep == 1:
            return [(self.owned_grads(), 1.0)]
        groups: dict[int, list[torch.Tensor]] = {}
        for param, grad in self.param_grads():
            copies = getattr(param, "tp_replicas", 1) if getattr(param, "tp_sharded", False) else tp
            copies *= 1 if is_expert_sharded(param) else ep
            groups.setdefault(copies, []).append(grad)
        return [(grads, 1.0 / copies) for copies, grads in groups.items()]

    def reduce_sequence_parallel_grads(self) -> None:
        """Megatron sequence parallelism: gradients of tp-replicated parameters that saw only this rank's
        sequence chunk (tagged ``sequence_partial``) are partial sums; sum them over tp (one flat all-reduce).
        Called by the Engine right after ``finish_backward``; nothing to do without them."""
        if self.comm.size("tp") == 1:
            return
        partial = [grad for param, grad in self.param_grads() if getattr(param, "sequence_partial", False)]
        sum_over_tp(partial, self.comm)

    def _reduce_device(self, axes: list[str], fallback: torch.device) -> torch.device:
        """Where a scalar that is all-reduced over ``axes`` must live: the communication device when some axis
        has more than one rank (NCCL reduces CUDA tensors only), else ``fallback`` (the gradients' device), so
        that nothing crosses devices when there is nothing to reduce."""
        return self.comm.device if any(self.comm.size(axis) > 1 for axis in axes) else fallback

    def _grad_norm_tensor(self) -> torch.Tensor:
        """sqrt(sum over reduction_axes of sum_groups weight x ||g||^2); torch's foreach norm when nothing is
        reduced (bitwise equal to torch.nn.utils.clip_grad_norm_ on one rank). A 0-dim tensor, never read on
        the host here: on the gradients' device, or on the communication device when ranks reduce it."""
        groups = [(grads, weight) for grads, weight in self.norm_groups() if grads]
        axes = self.reduction_axes()
        if not axes and len(groups) == 1 and groups[0][1] == 1.0:
            return torch.nn.utils.get_total_norm(groups[0][0], 2.0)
        first = groups[0][0][0].device if groups else self.comm.device
        squared = torch.zeros((), dtype=torch.float64, device=self._reduce_device(axes, first))
        dtype = torch.float32
        for grads, weight in groups:
            norm = torch.nn.utils.get_total_norm(grads, 2.0)
            squared += weight * norm.to(squared.device, torch.float64).pow(2)
            dtype = norm.dtype
        for axis in axes:
            self.comm.all_reduce(squared, axis)
        return squared.sqrt().to(dtype)

    def grad_norm(self) -> float:
        """Global L2 norm of the gradients: torch's foreach norm of this rank's owned gradients, and, when
        sharded, the square root of the sum of every rank's squared norm (a host sync: for checks, not steps)."""
        return float(self._grad_norm_tensor())

    def scale_grads_(self, factor: float | torch.Tensor) -> None:
        """Multiply every owned gradient by ``factor`` (a tensor factor is moved to each gradient's device)."""
        for device, grads in grads_by_device(self.owned_grads()).items():
            torch._foreach_mul_(grads, factor.to(device) if isinstance(factor, torch.Tensor) else factor)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Scale gradients by min(1, max_norm / (norm + 1e-6)) exactly as torch's clip_grad_norm_; return the norm
        as a 0-dim tensor (read it on the host only when needed: reading it waits for the device). The factor is
        brought to each gradient's device (with offload the gradients live in host memory while the norm may
        have been all-reduced on the GPU), as ``torch.nn.utils.clip_grads_with_norm_`` does."""
        norm = self._grad_norm_tensor()
        self.scale_grads_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        return norm

    def unscale_and_find_inf(self, inv_scale: float) -> torch.Tensor:
        """fp16 loss scaling in one pass per device and dtype: multiply every owned gradient by ``inv_scale``
        and flag inf/NaN anywhere (``torch._amp_foreach_non_finite_check_and_unscale_``, the kernel of torch's
        GradScaler); the flags are summed and max-reduced over the reduction axes. Returns a 1-element tensor,
        > 0 where any rank overflowed; reading it is the step's one host sync under fp16."""
        groups = grads_by_device(self.owned_grads(), by_dtype=True)
        axes = self.reduction_axes()
        first = next(iter(groups))[0] if groups else self.comm.device
        flag = torch.zeros(1, dtype=torch.float32, device=self._reduce_device(axes, first))
        for (device, _dtype), grads in groups.items():
            found = torch.zeros(1, dtype=torch.float32, device=device)
            inv = torch.full((1,), inv_scale, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
            flag += found.to(flag.device)
        for axis in axes:
            self.comm.all_reduce(flag, axis, op="max")
        return flag

    # ----------------------------------------------------------------- step
    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for param in self.params:
            param.grad = None

    def parameter_count(self) -> int:
        """How many parameters this rank's model has, whole (ZeRO-3 counts its sharded units at their full size;
        with tensor or pipeline parallelism: this rank's slices and stages)."""
        return sum(p.numel() for p in self.model.parameters())

    def held_parameter_count(self) -> int:
        """How many parameters this rank stores between steps: ``parameter_count`` unless the parameters are
        sharded over the data ranks (ZeRO-3 holds 1/dp of each unit)."""
        return self.parameter_count()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter of the model, whole, by name (a copy; sharded strategies gather it)."""
        return {name: p.detach().clone() for name, p in self.model.named_parameters()}
