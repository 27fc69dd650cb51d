"""Materialisation as a step of ``parallelize``: plan it before any collective, fill each rank's share after the
layout has cut the model (docs/design.md: pipeline split -> tp/sp -> cp -> recompute -> compile -> here ->
ZeRO/FSDP/DDP; under ZeRO-3 inside the strategy, once its units know which flat ranges this rank keeps).

``plan_materialize`` (pure): the record (``derive``), which tensors a ``WeightSource`` provides (a tied name is read
through the name it is tied to), and that every other tensor can be initialised -- a ``MaterializeError``
naming the module otherwise. ``placeholders`` swaps each meta parameter for a real parameter of the same shape
that holds one element (``expand``), keeping its tags (``tp_sharded``, ...), so that the strategies see shapes and
identities. ``fill`` then writes this rank's values: whole local tensors (a replicated parameter, a tp slice, a
buffer) or, with ZeRO-3 ``units``, only the flat ranges of this rank's shards. Values come from the source, read a
block's worth of rectangles at a time, or from one replay of the record (``replay``), cut as they are delivered.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from plait.logging import get_logger
from plait.parallel.materialize.derive import check_initialisable, init_record
from plait.parallel.materialize.record import InitRecord, module_tensors
from plait.parallel.materialize.replay import MaterializeError, plan_replay, replay
from plait.parallel.materialize.share import PLACEHOLDER, Request, Share, WeightSource, cut, is_placeholder, share_of

log = get_logger(__name__)
READ_BATCH_BYTES = 16 << 20
"""Reads are issued a batch at a time, a batch holding at least this many bytes (or one tensor's rows)."""


@dataclass
class MetaPlan:
    """What ``plan_materialize`` decided: the record, the source and which model names it provides."""

    record: InitRecord
    source: WeightSource | None = None
    source_key: dict[str, str] = field(default_factory=dict)
    """Model name -> the source's name for it."""
    init_names: list[str] = field(default_factory=list)
    """Tensors the replay initialises (every rank draws for these alike)."""


def is_meta_model(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in model.parameters()) or any(t.is_meta for t in model.buffers())


def plan_materialize(model: nn.Module, source: WeightSource | None = None) -> MetaPlan:
    """Check that ``model`` (on meta) can be materialised (module docstring); pure, the same on every rank."""
    tensors = module_tensors(model)
    real = [name for name, (kind, tensor) in tensors.items() if kind != "attribute" and not tensor.is_meta]
    if real:
        raise MaterializeError(
            f"the model is partly on the meta device: {real[:3]} hold real values. Fix: build it whole on meta "
            f"(plait.parallel.materialize.deferred_init) or whole on a device.",
            real,
        )
    record = init_record(model)
    names = [name for name, (kind, _) in tensors.items() if kind != "attribute" or name in record.tensors]
    plan = MetaPlan(record, source)
    if source is not None:
        shapes = source.shapes()
        by_sid: dict[int, list[str]] = {}
        for name in names:
            by_sid.setdefault(record.tensors[name].sid, []).append(name)
        for name in names:
            key = next((alias for alias in [name, *by_sid[record.tensors[name].sid]] if alias in shapes), None)
            if key is None:
                continue
            if tuple(shapes[key]) != record.tensors[name].size:
                raise MaterializeError(
                    f"{source.description} holds {key!r} with shape {tuple(shapes[key])}, but the model's {name!r} "
                    f"is {record.tensors[name].size}. Fix: give the weights of this model.",
                    [name],
                )
            plan.source_key[name] = key
    plan.init_names = [name for name in names if name not in plan.source_key]
    if plan.init_names:
        check_initialisable(model, record, plan.init_names)
    return plan


def placeholders(roots: list[nn.Module], device: torch.device) -> None:
    """Swap every meta parameter under ``roots`` for a real one of the same shape, dtype and tags holding one
    element, on ``device`` (the same new parameter wherever the old one was registered)."""
    swapped: dict[int, nn.Parameter] = {}
    for root in roots:
        for module in root.modules():
            for name, param in list(module._parameters.items()):
                if param is None or not param.is_meta:
                    continue
                new = swapped.get(id(param))
                if new is None:
                    one = torch.empty(1, dtype=param.dtype, device=device).expand(param.shape)
                    new = nn.Parameter(one, requires_grad=param.requires_grad)
                    new.__dict__.update(param.__dict__)
                    setattr(new, PLACEHOLDER, True)
                    swapped[id(param)] = new
                module._parameters[name] = new


class _Targets:
    """This rank's destinations: per single-device name, writers of a whole tensor (init) and read requests with
    what to do once they are filled (load)."""

    def __init__(self, plan: MetaPlan, tp: tuple[int, int], device: torch.device) -> None:
        self.plan, self.tp, self.device = plan, tp, device
        self.writers: dict[str, list[Callable[[torch.Tensor], object]]] = {}
        self.reads: list[tuple[int, Callable[[], tuple[list[Request], Callable[[], object]]]]] = []
        self.installs: list[Callable[[], None]] = []

    def share(self, name: str, tensor: torch.Tensor, local: tuple[int, ...] | None = None) -> Share:
        ref = self.plan.record.tensors.get(name)
        if ref is None:
            raise MaterializeError(
                f"{name!r} is on the meta device but not in the model's record ({self.plan.record.source})"
            )
        try:
            return share_of(tensor, ref.size, *self.tp, local)
        except ValueError as error:
            raise MaterializeError(
                f"{name!r} {error}: plait cannot cut it from the single-device tensor.", [name]
            ) from None

    def add(
        self,
        name: str,
        share: Share,
        rows: tuple[int, int] | None,
        done: Callable[[torch.Tensor], object],
        into: torch.Tensor | None = None,
    ) -> None:
        """The local ``rows`` (default all) of ``name`` are wanted; ``done(values)`` stores them. A read fills
        ``into`` when given (a whole local tensor on the host), else a host buffer made when its batch is read."""
        key = self.plan.source_key.get(name)
        if key is None:
            self.writers.setdefault(name, []).append(lambda full: done(cut(full, share, rows)))
            return
        r0, r1 = rows if rows is not None else (0, share.local[0] if share.local else 1)
        shape = (r1 - r0, *share.local[1:]) if share.local else ()
        dtype = self.plan.record.tensors[name].dtype

        def make() -> tuple[list[Request], Callable[[], object]]:
            values = into if into is not None else torch.zeros(shape, dtype=dtype)
            requests = [(key, full_index, values[local_index]) for full_index, local_index in share.boxes(rows)]
            return requests, (lambda: None) if into is not None else (lambda: done(values))

        self.reads.append((math.prod(shape) * dtype.itemsize, make))

    def whole(self, name: str, tensor: torch.Tensor, install: Callable[[torch.Tensor], None]) -> None:
        share = self.share(name, tensor)
        dest = torch.zeros(share.local, dtype=tensor.dtype, device=self.device)
        self.add(name, share, None, dest.copy_, dest if dest.device.type == "cpu" else None)
        self.installs.append(lambda: install(dest))

    def piece(
        self, name: str, param: torch.Tensor, shape: tuple[int, ...], start: int, end: int, dest: torch.Tensor
    ) -> None:
        """Flat elements [start, end) of ``param``'s local tensor (of ``shape``) go to ``dest`` (a run of a
        ZeRO-3 shard)."""
        share = self.share(name, param, shape)
        r0, r1 = share.rows_of(start, end)
        offset = r0 * share.inner if share.local else 0

        def done(values: torch.Tensor) -> None:
            dest.copy_(values.reshape(-1)[start - offset : end - offset])

        self.add(name, share, (r0, r1), done)


def _install_param(param: nn.Parameter) -> Callable[[torch.Tensor], None]:
    def install(value: torch.Tensor) -> None:
        param.data = value
        param.__dict__.pop(PLACEHOLDER, None)

    return install


def _install_tensor(module: nn.Module, attr: str, kind: str, old: torch.Tensor) -> Callable[[torch.Tensor], None]:
    def install(value: torch.Tensor) -> None:
        value.requires_grad_(old.requires_grad)
        if kind == "buffer":
            module._buffers[attr] = value
        else:
            setattr(module, attr, value)

    return install


@torch.no_grad()
def fill(
    plan: MetaPlan, roots: list[nn.Module], tp: tuple[int, int], device: torch.device, units: list[Any] | None = None
) -> None:
    """Write this rank's values into everything still meta or a placeholder under ``roots`` (module docstring);
    ``tp`` = (tp size, tp index); ``units``: ZeRO-3 ``FlatUnit``s, whose parameters get only their shard ranges."""
    targets = _Targets(plan, tp, device)
    in_units: set[int] = set()
    for unit in units or []:
        in_units.update(id(p) for p in unit.params)
        for piece in unit.layout.slices(unit.rank):
            dest = unit.shard.data[piece.at : piece.at + piece.end - piece.start]
            name = unit.layout.names[piece.index]
            shape = tuple(unit.layout.shapes[piece.index])
            targets.piece(name, unit.params[piece.index], shape, piece.start, piece.end, dest)
        for param in unit.params:
            param.__dict__.pop(PLACEHOLDER, None)
    seen: set[int] = set(in_units)
    for root in roots:
        for path, module in root.named_modules(remove_duplicate=False):
            prefix = f"{path}." if path else ""
            for kind, table in (("parameter", module._parameters), ("buffer", module._buffers)):
                for attr, tensor in list(table.items()):
                    if tensor is None or id(tensor) in seen or not (tensor.is_meta or is_placeholder(tensor)):
                        continue
                    seen.add(id(tensor))
                    if kind == "parameter":
                        install = _install_param(tensor)
                    else:
                        install = _install_tensor(module, attr, kind, tensor)
                    targets.whole(prefix + attr, tensor, install)
            for attr, value in list(vars(module).items()):
                if isinstance(value, torch.Tensor) and value.is_meta and id(value) not in seen:
                    seen.add(id(value))
                    if prefix + attr in plan.record.tensors:
                        targets.whole(prefix + attr, value, _install_tensor(module, attr, "attribute", value))
    _read(plan, targets)
    wanted = [name for name in targets.writers]
    if wanted:
        replay_plan = plan_replay(plan.record, wanted, plan.init_names if plan.source is not None else None)

        def deliver(name: str, full: torch.Tensor) -> None:
            for write in targets.writers[name]:
                write(full)

        replay(plan.record, replay_plan, deliver)
        log.debug(
            "replayed %d ops for %d tensors (peak %d bytes of scratch)",
            len(replay_plan.live),
            len(wanted),
            replay_plan.peak_bytes,
        )
    for finish in targets.installs:
        finish()


def _read(plan: MetaPlan, targets: _Targets) -> None:
    """Issue the source reads a batch at a time (at least ``READ_BATCH_BYTES``, buffers made per batch), storing
    each batch's pieces before the next is read."""
    if plan.source is None:
        return
    pending = deque(targets.reads)
    while pending:
        batch: list[Request] = []
        finish: list[Callable[[], object]] = []
        size = 0
        while pending and (not batch or size < READ_BATCH_BYTES):
            nbytes, make = pending.popleft()
            requests, done = make()
            batch += requests
            finish.append(done)
            size += nbytes
        plan.source.read(batch)
        for done in finish:
            done()
    targets.reads.clear()


def materialize_module(
    model: nn.Module, weights: WeightSource | None = None, device: torch.device | str = "cpu"
) -> nn.Module:
    """Materialise a whole model on the meta device in this one process (as one rank holding everything):
    ``weights``' tensors read one batch at a time, the rest initialised by a replay (``plait generate``, tests)."""
    plan = plan_materialize(model, weights)
    device = torch.device(device)
    placeholders([model], device)
    fill(plan, [model], (1, 0), device)
    return model


__all__ = ["MetaPlan", "fill", "is_meta_model", "materialize_module", "placeholders", "plan_materialize"]
