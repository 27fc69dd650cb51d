"""``ShardedStrategy``: what ZeRO-1/2 (``sharded.py``) and ZeRO-3 (``fsdp.py``) share.

Every ZeRO stage keeps, on rank r of N, the fp32 *master* copy of 1/N of the flat parameter space and the
optimizer state of exactly those elements (Rajbhandari et al. 2020, sec. 5). So both strategies:

- refuse an optimizer already built (it would hold the full parameters) and call the user's factory on this
  rank's master shards instead, checking that it used exactly those (``_build_optimizer``);
- keep the masters where ``layout.offload`` says (``Placement``: the compute device, host memory, or files),
  receive each reduced gradient shard there (``_receive_grad``: device -> host with offload), step there,
  and bring the stepped values back to the compute device (``_publish``, the subclass's part: ZeRO-1/2
  all-gather them into the whole parameters, ZeRO-3 copies them into its parameter shards);
- account the bytes they hold by place (``memory_split``) and by kind (``model_state_tensors``, which
  ``plait.measure_held`` reads).

A subclass builds its shards and masters (``_make_master``), then calls ``_build_optimizer`` with them. With
``param_groups`` (``plait.parallel.param_groups``) the subclass lays each flat buffer out group after group
(``_plan_groups`` gives each parameter's group) and ``_build_optimizer`` steps one ``GroupView`` per buffer and group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.comm import Comm
from plait.comm.collectives import Done, Pending
from plait.errors import LayoutError
from plait.layout import Layout
from plait.parallel.param_groups import GroupOf, assign_groups, torch_groups
from plait.parallel.precision import gradient_reduce_dtype
from plait.parallel.strategy import (
    DataParallelStrategy,
    OptimizerFactory,
    check_steps_without_closure,
    is_expert_sharded,
    replica_axis,
)
from plait.parallel.whole_tensor import SlotFlat, WholeSlot, WholeTensorOptimizer, build_hybrid, make_slot, slot_flats
from plait.parallel.zero.flat import FlatLayout, GroupLayout, OwnedLayout
from plait.parallel.zero.offload import Placement, is_file_backed
from plait.parallel.zero.optimizers import check_elementwise, factory_failed_on_shards


def require_factory(optimizer: OptimizerFactory | torch.optim.Optimizer, stage: int) -> OptimizerFactory:
    """The optimizer factory, or a TypeError naming the fix when given an optimizer (or anything else)."""
    if isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer):
        example = type(optimizer).__name__ if isinstance(optimizer, torch.optim.Optimizer) else "AdamW"
        raise TypeError(
            f"ZeRO-{stage} builds the optimizer itself, on this rank's shard of the parameters, so it needs a factory "
            f"(an optimizer factory), not {type(optimizer).__name__}: an optimizer built on model.parameters() holds "
            f"the full parameters. Fix: optimizer=lambda params: torch.optim.{example}(params, lr=...)."
        )
    return optimizer


def _tensors_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


@dataclass(frozen=True)
class FlatBuffer:
    """One flat sharded buffer as ``_build_optimizer`` sees it: a ZeRO-1/2 bucket or a ZeRO-3 unit."""

    layout: FlatLayout
    rank: int
    master: nn.Parameter
    params: list[nn.Parameter]
    shard: torch.Tensor | None = None
    """ZeRO-3: the parameter shard that forward gathers (the master itself unless offloaded)."""


@dataclass(eq=False)
class GroupView:
    """The run of one flat buffer's shard that belongs to one parameter group: ``master`` (what the optimizer
    steps) is a view of the buffer's master ``owner`` at shard offsets [lo, hi), sharing its storage."""

    group: int
    owner: nn.Parameter
    lo: int
    hi: int
    master: nn.Parameter
    layout: GroupLayout
    rank: int
    params: list[nn.Parameter]
    shard: torch.Tensor | None

    def bind_grad(self) -> None:
        """Point the view's gradient at its run of the owner's (reduced, clipped) gradient."""
        grad = self.owner.grad
        self.master.grad = None if grad is None else grad[self.lo : self.hi]


def group_views(buffer: FlatBuffer, group_of_param: dict[int, int]) -> list[GroupView]:
    """One ``GroupView`` per run of equal-group parameters in ``buffer`` (laid out group after group)."""
    views, first = [], 0
    groups = [group_of_param[id(p)] for p in buffer.params]
    for index in range(1, len(groups) + 1):
        if index == len(groups) or groups[index] != groups[first]:
            layout = GroupLayout(buffer.layout, first, index)
            lo, hi = layout.span(buffer.rank)
            master = nn.Parameter(buffer.master.detach()[lo:hi])
            shard: torch.Tensor | None = None
            if buffer.shard is buffer.master:
                shard = master
            elif buffer.shard is not None:
                shard = buffer.shard.detach()[lo:hi]
            views.append(
                GroupView(
                    groups[first],
                    buffer.master,
                    lo,
                    hi,
                    master,
                    layout,
                    buffer.rank,
                    buffer.params[first:index],
                    shard,
                )
            )
            first = index
    return views


class ShardedStrategy(DataParallelStrategy):
    """Base of the ZeRO strategies: master shards placed by ``layout.offload``, an optimizer over them."""

    sharded = True

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        optimizer: OptimizerFactory | torch.optim.Optimizer,
        layout: Layout,
        axis: str,
        offload_dir: str | None = None,
        param_groups: GroupOf | None = None,
    ) -> None:
        self._factory = require_factory(optimizer, layout.zero)
        self._group_of = param_groups
        self._group_options: list[dict[str, Any]] = [{}]
        self._group_id: dict[int, int] = {}
        self.group_views: list[GroupView] = []
        """With ``param_groups``: what the optimizer steps, one view per (flat buffer, group); else empty."""
        self._owners: list[nn.Parameter] = []
        self._spec = optimizer if isinstance(optimizer, WholeTensorOptimizer) else None
        self._whole_ids: set[int] = self._spec.chosen(model) if self._spec is not None else set()
        """The parameters a ``WholeTensorOptimizer`` steps whole: laid out tensor-atomically (``OwnedLayout``)."""
        experts = [n for n, p in model.named_parameters() if id(p) in self._whole_ids and is_expert_sharded(p)]
        if experts:
            raise LayoutError(
                f"a whole-tensor optimizer under ZeRO-{layout.zero} owns each tensor on one rank of dp_cp, but expert "
                f"slices ({', '.join(experts[:3])}) are sharded over edp. Fix: leave the experts to the elementwise "
                f"optimizer (select only dense matrices), or use zero=0 with ep > 1."
            )
        self.whole_slots: list[WholeSlot] = []
        """The parameters this rank owns in ``OwnedLayout`` buffers, each stepped whole (``plait.parallel.whole_tensor``)."""
        self.model, self.comm, self.layout, self.axis = model, comm, layout, axis
        self.stage = layout.zero
        self.replica_axis = replica_axis(axis)
        """HSDP: the axis each reduced shard is averaged over after the reduce-scatter (``all_reduce_replicas``)."""
        self.world = comm.size(axis)
        self.index = comm.mesh.index(axis)
        self._sync = True
        self.reduce_dtype = gradient_reduce_dtype(layout)
        """bf16/fp16 with ``Layout.reduce_dtype="compute"``: gradients are reduce-scattered in it (``_receive_grad``
        casts the reduced shard back to the master's fp32); None: in their own dtype."""
        self.placement = Placement(layout.offload, comm.device, comm.mesh.rank, offload_dir)

    # ----------------------------------------------------------------- masters and optimizer
    def _make_master(self, values: torch.Tensor, name: str) -> nn.Parameter:
        """A master shard holding a copy of ``values``, kept where the placement keeps long-lived state."""
        return nn.Parameter(self.placement.place(values.detach(), name))

    def _plan_groups(self, named: list[tuple[str, nn.Parameter]]) -> list[int]:
        """Each parameter's group under ``param_groups`` (all 0 without): the subclass lays its flat buffers out
        in group order, so that each group is one contiguous run of every buffer."""
        self._group_options, ids = assign_groups(named, self._group_of)
        self._group_id = {id(p): group for (_, p), group in zip(named, ids)}
        return ids

    def _build_optimizer(
        self, masters: list[nn.Parameter], buffers: list[FlatBuffer] | None = None
    ) -> torch.optim.Optimizer:
        """Call the factory on ``masters`` (with ``param_groups``: on torch.optim groups of ``GroupView``s of
        ``buffers``, whose masters are ``masters``); check that the optimizer holds exactly them, steps without a
        closure and is elementwise (``plait.parallel.zero.optimizers``)."""
        self._owners = list(masters)
        if self._spec is not None:
            return self._build_hybrid(buffers or [])
        stepped: list[nn.Parameter] | list[dict[str, Any]] = masters
        if self._group_of is not None:
            assert buffers is not None, "param_groups: the strategy must describe its flat buffers"
            self.group_views = [view for buffer in buffers for view in group_views(buffer, self._group_id)]
            members = [[v.master for v in self.group_views if v.group == g] for g in range(len(self._group_options))]
            stepped = torch_groups(self._group_options, members)
            masters = [v.master for v in self.group_views]
        try:
            optimizer = self._factory(stepped)
        except ValueError as error:  # e.g. torch.optim.Muon: "only supports 2D parameters"
            raise factory_failed_on_shards(error, masters, self.stage) from error
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"the optimizer factory returned {type(optimizer).__name__}, not a torch.optim.Optimizer")
        check_steps_without_closure(optimizer)
        check_elementwise(optimizer, self.stage)
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if held != {id(m) for m in masters}:
            raise ValueError(
                f"the optimizer factory must build its optimizer on exactly the parameters it is given (under ZeRO: "
                f"this rank's master shards), e.g. lambda params: torch.optim.AdamW(params) (zero={self.stage}). For "
                f"parameter groups, pass param_groups=group_of to plait.parallelize instead."
            )
        return optimizer

    def _build_hybrid(self, buffers: list[FlatBuffer]) -> torch.optim.Optimizer:
        """``WholeTensorOptimizer``: the parameters this rank owns in ``OwnedLayout`` buffers become ``WholeSlot``s
        (views of the master shard shaped like the parameter; a tp slice gathered whole at each step), stepped by
        ``whole`` when selected and by ``rest`` otherwise; evenly sharded buffers step as always, in ``rest``."""
        assert self._spec is not None
        options = self._group_options if self._group_of is not None else None
        even = [b for b in buffers if not isinstance(b.layout, OwnedLayout)]
        rest: list[tuple[torch.Tensor, int]] = [(b.master, 0) for b in even]
        if self._group_of is not None:
            self.group_views = [view for buffer in even for view in group_views(buffer, self._group_id)]
            rest = [(view.master, view.group) for view in self.group_views]
        tp, tp_rank = self.comm.size("tp"), self.comm.mesh.index("tp")
        whole: list[tuple[WholeSlot, int]] = []
        rest_names = [name for b in even for name in b.layout.names]
        for buffer in buffers:
            layout = buffer.layout
            if not isinstance(layout, OwnedLayout):
                continue
            base = layout.shard_range(buffer.rank)[0]
            for index in layout.owned(buffer.rank):
                param, name = buffer.params[index], layout.names[index]
                start = layout.offsets[index] - base
                span = (start, start + layout.numels()[index])
                selected = id(param) in self._whole_ids
                slot = make_slot(name, param, buffer.master, span, layout.shapes[index], tp if selected else 1, tp_rank)
                self.whole_slots.append(slot)
                group = self._group_id.get(id(param), 0)
                if selected:
                    whole.append((slot, group))
                else:
                    rest.append((slot.stepped, group))
                    rest_names.append(name)
        optimizer = build_hybrid(self._spec, whole, rest, options, self.comm, self.whole_slots, rest_names)
        if even and len(optimizer.parts) > int(bool(whole)):
            check_elementwise(optimizer.parts[-1], self.stage)
        return optimizer

    def whole_flats(self) -> list[SlotFlat]:
        """The tensors stepped whole, one flat each, for checkpoints (``plait.checkpoint.canonical``)."""
        return slot_flats(self.whole_slots)

    def all_reduce_replicas(self, shard: torch.Tensor) -> Pending:
        """HSDP: average a reduce-scattered gradient shard over the replica groups, in place and asynchronously
        (the replicas hold the same shard of the same flat buffer, so after it every replica steps alike and
        stays bitwise equal). Avg over ``shard`` (S ranks) then avg over ``replicate`` (R) is the sum over the
        S x R data ranks / (dp x cp): plain ZeRO's average. Without HSDP: nothing to do (already finished)."""
        if self.replica_axis is None:
            return Done(shard)
        return self.comm.all_reduce(shard, self.replica_axis, op="avg", async_op=True)

    def _receive_grad(self, master: nn.Parameter, reduced: torch.Tensor) -> None:
        """Hand a reduced gradient shard to its master: moved to the master's place (non-blocking into pinned
        host memory with CUDA offload; ``placement.synchronize()`` before the CPU reads it), accumulated when
        the master already has a gradient."""
        grad = self.placement.to_host(reduced, master.dtype)
        if master.grad is None:
            master.grad = grad
        else:
            master.grad.add_(grad)

    def _publish(self) -> None:
        """Bring the stepped masters back to the compute device (ZeRO-1/2: all-gather; ZeRO-3: shard copy)."""
        raise NotImplementedError

    def step(self) -> None:
        """Step the masters (on the CPU with offload), keep new optimizer state in files under "nvme", publish."""
        for view in self.group_views:
            view.bind_grad()
        self.optimizer.step()
        self.placement.adopt_states(self.optimizer)
        self._publish()

    # ----------------------------------------------------------------- accounting
    def _masters(self) -> list[nn.Parameter]:
        """This rank's master shards (what the optimizer steps, or, with param groups, what its views view)."""
        return self._owners

    def zero_grad(self) -> None:
        super().zero_grad()
        for master in self._owners:
            master.grad = None

    def _compute_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Model-side tensors on the compute device by kind ("parameters", "gradients"); masters excluded."""
        raise NotImplementedError

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Every model-state tensor this rank holds now, by kind: ``parameters`` (what forward reads),
        ``gradients`` (full or sharded, on the model or on the masters), ``master_weights`` (masters that are
        not themselves the parameters, nor hold them as views: ZeRO-1/2 on one rank) and ``optimizer_states``
        (dim >= 1; 0-dim step counters left out)."""
        compute = self._compute_tensors()
        parameter_storages = {t.untyped_storage().data_ptr() for t in compute["parameters"] if t.numel()}
        masters = self._masters()
        return {
            "parameters": compute["parameters"],
            "master_weights": [m for m in masters if m.untyped_storage().data_ptr() not in parameter_storages],
            "gradients": compute["gradients"] + [m.grad for m in masters if m.grad is not None],
            "optimizer_states": [t for t in _tensors_of(self.optimizer) if t.dim() > 0],
        }

    def memory_split(self) -> dict[str, int]:
        """Bytes this rank holds now, by place: ``device`` (model-side tensors, and the masters without offload),
        ``host`` (offloaded masters, their gradients, optimizer states in RAM) and ``files`` (memory-mapped
        "nvme" files). Each storage counts once."""
        split = {"device": 0, "host": 0, "files": 0}
        seen: set[int] = set()

        def add(tensor: Any, where: str) -> None:
            if isinstance(tensor, torch.Tensor) and tensor.numel():
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    split[where] += storage.nbytes()

        compute = self._compute_tensors()
        for tensor in compute["parameters"] + compute["gradients"]:
            add(tensor, "files" if is_file_backed(tensor) else "device")
        masters = self._masters()
        for tensor in [*masters, *(m.grad for m in masters if m.grad is not None), *_tensors_of(self.optimizer)]:
            if isinstance(tensor, torch.Tensor):
                add(tensor, self.placement.where(tensor))
        return split

    def close(self) -> None:
        """Delete offload files (the strategy cannot train afterwards)."""
        self.placement.close()
