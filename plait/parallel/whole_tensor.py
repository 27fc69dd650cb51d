"""Optimizers that need whole tensors (Muon, Shampoo, SOAP, Adafactor, LAMB) under every data and tensor layout.

An *elementwise* optimizer (SGD, Adam, AdamW) updates each element from that element's gradient and state alone,
so it may step any piece of a parameter: a tensor-parallel slice, a flat ZeRO shard cutting across tensors. A
*whole-tensor* optimizer computes a function of the whole matrix: ``torch.optim.Muon`` orthogonalises each 2-D
update with Newton-Schulz iterations, Shampoo/SOAP keep per-dimension preconditioners, Adafactor factors the second
moment into row and column means, LAMB scales by the tensor's norm. On a piece it is a different algorithm.

**Declaring it.** ``needs_whole_tensors(optimizer_or_class)`` is True for ``torch.optim.Muon`` and
``torch.optim.Adafactor`` (built in), for a class
registered with ``register_whole_tensor`` and for a class with the attribute ``needs_whole_tensors = True``::

    class MyShampoo(torch.optim.Optimizer):
        needs_whole_tensors = True   # plait: never step a slice or a flat shard of a parameter

**Using it.** Such optimizers are meant for the hidden matrices only (Muon's authors, Moonlight, modded-nanogpt:
AdamW for embeddings, the output head, norms and biases), so plait takes a ``WholeTensorOptimizer``: the factory of
the whole-tensor optimizer, the factory of the elementwise one for the other parameters, and which parameters are
which (default ``hidden_matrices``: the 2-D parameters inside the model's blocks)::

    optimizer = WholeTensorOptimizer(
        whole=lambda p: torch.optim.Muon(p, lr=0.02, adjust_lr_fn="match_rms_adamw"),
        rest=lambda p: torch.optim.AdamW(p, lr=3e-4),
    )
    engine = plait.parallelize(model, layout, optimizer=optimizer)

Each strategy then hands the whole-tensor optimizer whole tensors (docs/optimizers.md):

- DDP (zero=0): every rank holds every parameter whole; each steps all of them (as today).
- ZeRO-1/2/3: tensor-atomic ownership (``plait.parallel.zero.flat.owned_layout``): each selected parameter lies whole
  in the shard of one rank of the data axis, owners balanced by size (greedy largest first); the reduce-scatter
  that ZeRO already runs hands the owner the whole gradient, the owner steps the whole tensor with its whole state,
  and the all-gather that ZeRO already runs brings it back. No extra collective; padding to the largest owner.
- tp (Megatron 1D): a ``WholeSlot`` all-gathers the slice's values and gradient along ``tp_shard_dim`` before the
  step (one all-gather of each per step and dtype, on the tp axis), every tp rank steps the same whole tensor and
  keeps its slice. Composes with all of the above; with ZeRO only the owner's tp group gathers.
- pp: stages hold whole tensors; nothing to do.

A layout that cannot do this exactly raises ``LayoutError`` before any collective (``check_layout``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.comm import Comm
from plait.errors import LayoutError
from plait.logging import get_logger
from plait.parallel.blocks import find_blocks
from plait.parallel.zero.flat import FlatLayout

log = get_logger(__name__)
TP_AXIS = "tp"
Factory = Callable[[Any], torch.optim.Optimizer]
Select = Callable[[str, nn.Parameter], bool]

_REGISTERED: set[type] = {torch.optim.Muon, torch.optim.Adafactor}
"""Optimizer classes known to need whole tensors (subclasses included): Muon orthogonalises each matrix, Adafactor
factors each matrix's second moment into row and column means (``plait.parallel.zero.optimizers``)."""


def register_whole_tensor(cls: type) -> type:
    """Declare that optimizer class ``cls`` needs whole tensors (usable as a class decorator)."""
    _REGISTERED.add(cls)
    return cls


def needs_whole_tensors(optimizer: Any) -> bool:
    """Whether ``optimizer`` (an instance or a class) must never step a slice or a flat shard of a parameter: a
    registered class, a class with ``needs_whole_tensors = True``, or a ``HybridOptimizer`` with such a part."""
    if isinstance(optimizer, HybridOptimizer):
        return any(needs_whole_tensors(part) for part in optimizer.parts)
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    return bool(getattr(cls, "needs_whole_tensors", False)) or any(issubclass(cls, known) for known in _REGISTERED)


def hidden_matrices(model: nn.Module) -> set[str]:
    """Names of the model's hidden matrices: 2-D parameters inside its blocks (``plait.parallel.blocks``), so not
    the embeddings, the output head (tied or not), norms or biases. Without blocks: every 2-D parameter that is not
    an embedding table (``nn.Embedding``, a vocabulary-parallel embedding, or a weight tied to one)."""
    blocks = [path for path, _ in find_blocks(model)]
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if blocks:
        return {name for name, p in named if p.dim() == 2 and any(name.startswith(b + ".") for b in blocks)}
    tables = {
        id(module.weight)
        for module in model.modules()
        if isinstance(module, nn.Embedding) or type(module).__name__.endswith("Embedding")
        if isinstance(getattr(module, "weight", None), torch.Tensor)
    }
    return {name for name, p in named if p.dim() == 2 and id(p) not in tables}


@dataclass(frozen=True)
class WholeTensorOptimizer:
    """What to pass as ``plait.parallelize(..., optimizer=...)`` for an optimizer that needs whole tensors.

    ``whole`` builds the whole-tensor optimizer on the selected parameters (every strategy hands it whole tensors),
    ``rest`` the elementwise optimizer on the others (None: every trainable parameter must be selected), ``select``
    ``(name, param) -> bool`` picks the parameters for ``whole`` (default: ``hidden_matrices`` of the model). Both
    factories are called with tensors, or with torch.optim parameter groups under ``param_groups``."""

    whole: Factory
    rest: Factory | None = None
    select: Select | None = None

    def __call__(self, params: Any) -> torch.optim.Optimizer:
        raise LayoutError(
            "a WholeTensorOptimizer was called as a plain optimizer factory: only plait.parallelize's data-parallel "
            "strategies (DDP, ZeRO-1/2/3) know how to hand its optimizer whole tensors. Fix: pass it to "
            "plait.parallelize(..., optimizer=...), or build the optimizers yourself on one device."
        )

    def build(
        self, model: nn.Module, param_groups: Callable[[str, nn.Parameter], Any] | None = None
    ) -> HybridOptimizer:
        """The optimizer on one device, over ``model``'s own parameters (``whole`` on the selected ones, ``rest`` on
        the others; ``param_groups`` as for ``plait.parallelize``): the single-device run plait's layouts equal."""
        chosen = self.chosen(model)
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        options: list[dict[str, Any]] | None = None
        index: dict[int, int] = {}
        if param_groups is not None:
            keys: dict[tuple[tuple[str, Any], ...], int] = {}
            options = []
            for _, param in named:
                overrides = dict(param_groups(_, param))
                key = tuple(sorted(overrides.items()))
                if key not in keys:
                    keys[key] = len(options)
                    options.append(overrides)
                index[id(param)] = keys[key]
        slots = [make_slot(n, p, p, None, p.shape, 1, 0) for n, p in named if id(p) in chosen]
        whole = [(slot, index.get(id(slot.param), 0)) for slot in slots]
        rest = [(p, index.get(id(p), 0)) for _, p in named if id(p) not in chosen]
        return build_hybrid(self, whole, rest, options, None, slots, [n for n, p in named if id(p) not in chosen])

    def chosen(self, model: nn.Module) -> set[int]:
        """The ids of the trainable parameters of ``model`` that ``whole`` steps."""
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        if self.select is not None:
            return {id(p) for name, p in named if self.select(name, p)}
        names = hidden_matrices(model)
        return {id(p) for name, p in named if name in names}


# ----------------------------------------------------------------------------------------------- slots
def whole_shape(param: torch.Tensor, local: Sequence[int], tp: int) -> torch.Size:
    """The single-device shape of a tensor whose tp slice has shape ``local`` (unchanged when not a tp slice)."""
    shape = list(local)
    if tp > 1 and getattr(param, "tp_sharded", False):
        dim = param.tp_shard_dim  # type: ignore[attr-defined]
        shape[dim] = getattr(param, "tp_full_size", shape[dim] * tp)
    return torch.Size(shape)


def assemble(pieces: Sequence[torch.Tensor], param: torch.Tensor) -> torch.Tensor:
    """The whole tensor from every tp rank's slice (in rank order) of ``param``: concatenated along
    ``tp_shard_dim``, a fused parameter's blocks put back in order, a padded vocabulary clipped (as
    ``plait.parallel.tensor.gather_slice``)."""
    dim = param.tp_shard_dim  # type: ignore[attr-defined]
    fused = getattr(param, "tp_fused_parts", 1)
    if fused > 1:
        per_rank = [piece.chunk(fused, dim=dim) for piece in pieces]
        whole = torch.cat([blocks[part] for part in range(fused) for blocks in per_rank], dim=dim)
    else:
        whole = torch.cat(list(pieces), dim=dim)
    if hasattr(param, "tp_full_size"):
        whole = whole.narrow(dim, 0, param.tp_full_size)
    return whole


def take_slice(whole: torch.Tensor, param: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s tp slice of ``whole`` (the inverse of ``assemble``)."""
    dim = param.tp_shard_dim  # type: ignore[attr-defined]
    if hasattr(param, "tp_full_size"):
        local = param.shape[dim]
        pad = list(whole.shape)
        pad[dim] = local * tp - whole.shape[dim]
        whole = torch.cat([whole, whole.new_zeros(pad)], dim=dim)
    fused = getattr(param, "tp_fused_parts", 1)
    blocks = whole.chunk(fused, dim=dim)
    return torch.cat([block.chunk(tp, dim=dim)[rank] for block in blocks], dim=dim)


@dataclass(eq=False)
class WholeSlot:
    """One parameter stepped whole. ``source`` holds this rank's values: the model's parameter itself (DDP), or a
    flat master shard of which elements ``span`` are the parameter, row-major (ZeRO's tensor-atomic ownership).
    ``stepped`` is what the optimizer steps: the parameter itself, a view of the master shard shaped like the
    parameter, or, for a tp slice, a whole tensor refilled from every tp rank's slice before each step."""

    name: str
    param: nn.Parameter
    source: torch.Tensor
    span: tuple[int, int] | None
    shape: torch.Size
    """This rank's (local) shape of the parameter."""
    stepped: nn.Parameter
    tp: int
    tp_rank: int

    @property
    def sliced(self) -> bool:
        """A tp slice: gathered whole before the step, this rank's slice kept after it."""
        return self.tp > 1 and bool(getattr(self.param, "tp_sharded", False))

    def local(self) -> torch.Tensor:
        values = self.source.detach()
        return values if self.span is None else values[self.span[0] : self.span[1]].view(self.shape)

    def local_grad(self) -> torch.Tensor | None:
        grad = self.source.grad
        if grad is None or self.span is None:
            return grad
        return grad[self.span[0] : self.span[1]].view(self.shape)


def make_slot(name: str, param: nn.Parameter, source: torch.Tensor, span: tuple[int, int] | None,
              shape: Sequence[int], tp: int, tp_rank: int) -> WholeSlot:  # fmt: skip
    """A slot for ``param`` (local shape ``shape``) whose values sit in ``source``: at ``span`` of a flat master
    shard, or the parameter itself (``span`` None). ``tp`` 1 steps a tp slice as it is (elementwise parts)."""
    slot = WholeSlot(name, param, source, span, torch.Size(shape), nn.Parameter(torch.empty(0)), tp, tp_rank)
    if slot.sliced:
        shape = whole_shape(param, slot.shape, tp)
        slot.stepped = nn.Parameter(torch.zeros(shape, dtype=source.dtype, device=source.device))
    elif span is None:
        slot.stepped = param
    else:
        slot.stepped = nn.Parameter(slot.local())
    return slot


def _bind_views(slots: list[WholeSlot]) -> None:
    """Before a step: a master view's gradient is its run of the master shard's (reduced, clipped) gradient. A slot
    without a gradient keeps the one it has (None after zero_grad; zeros while a checkpoint load builds state)."""
    for slot in slots:
        if not slot.sliced and slot.span is not None:
            grad = slot.local_grad()
            if grad is not None:
                slot.stepped.grad = grad


def _gather_tp(slots: list[WholeSlot], comm: Comm) -> None:
    """Before a step: every tp slice's values and gradient, all-gathered over tp in one call per dtype, refill the
    whole tensors (a slot without a gradient keeps the one it has, as ``_bind_views``)."""
    by_dtype: dict[torch.dtype, list[WholeSlot]] = {}
    for slot in slots:
        if slot.sliced:
            by_dtype.setdefault(slot.source.dtype, []).append(slot)
    for group in by_dtype.values():
        grads = [slot.local_grad() for slot in group]
        values = torch.cat([slot.local().reshape(-1) for slot in group])
        flat_grads = torch.cat([
            (g if g is not None else torch.zeros(s.shape, dtype=values.dtype, device=values.device)).reshape(-1)
            for s, g in zip(group, grads)
        ])  # fmt: skip
        tp = group[0].tp
        both = comm.all_gather(torch.cat([values, flat_grads.to(values.device)]), TP_AXIS).view(tp, -1)
        rows_v, rows_g = both[:, : values.numel()], both[:, values.numel() :]
        offset = 0
        for slot, grad in zip(group, grads):
            n = math.prod(slot.shape)
            piece = [rows_v[k, offset : offset + n].view(slot.shape) for k in range(tp)]
            slot.stepped.data.copy_(assemble(piece, slot.param))
            if grad is not None:
                pieces = [rows_g[k, offset : offset + n].view(slot.shape) for k in range(tp)]
                slot.stepped.grad = assemble(pieces, slot.param).to(slot.stepped.dtype)
            offset += n


@torch.no_grad()
def _keep_slices(slots: list[WholeSlot]) -> None:
    """After a step: each tp slot writes its slice of the stepped whole tensor back where its values live."""
    for slot in slots:
        if slot.sliced:
            slot.local().copy_(take_slice(slot.stepped.detach(), slot.param, slot.tp_rank, slot.tp))


# ----------------------------------------------------------------------------------------------- optimizer
class HybridOptimizer(torch.optim.Optimizer):
    """Several torch.optim optimizers stepped as one (Muon for the hidden matrices, AdamW for the rest): its
    ``param_groups`` are the parts' own group dicts (an lr schedule sets them), its ``state`` one dict the parts
    share, and ``step`` gathers the whole tensors of tp slices first and keeps this rank's slices after."""

    def __init__(self, parts: Sequence[torch.optim.Optimizer], slots: Sequence[WholeSlot] = (),
                 comm: Comm | None = None) -> None:  # fmt: skip
        groups = [group for part in parts for group in part.param_groups]
        super().__init__(groups or [{"params": []}], {})
        self.parts = list(parts)
        for part in self.parts:
            part.state = self.state
        self.slots = list(slots)
        self.comm = comm
        if any(slot.sliced for slot in self.slots) and comm is None:
            raise ValueError("HybridOptimizer: tensor-parallel slots need the Comm that gathers them")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        _bind_views(self.slots)
        if self.comm is not None:
            _gather_tp(self.slots, self.comm)
        for part in self.parts:
            part.step()
        _keep_slices(self.slots)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as torch does, then hand the parts their groups' settings and the shared state back."""
        super().load_state_dict(state_dict)
        for part in self.parts:
            part.state = self.state
        parts_groups = [group for part in self.parts for group in part.param_groups]
        for mine, new in zip(parts_groups, self.param_groups):
            mine.update({k: v for k, v in new.items() if k != "params"})
        self.param_groups = parts_groups


def grouped(items: Sequence[tuple[torch.Tensor, int]], options: list[dict[str, Any]] | None) -> Any:
    """Tensors for a factory: a plain list without param groups (``options`` None), else torch.optim groups (those
    with members), each tensor in its group ``index``."""
    if options is None:
        return [tensor for tensor, _ in items]
    members: list[list[torch.Tensor]] = [[] for _ in options]
    for tensor, index in items:
        members[index].append(tensor)
    return [{"params": params, **option} for params, option in zip(members, options) if params]


def build_hybrid(
    spec: WholeTensorOptimizer,
    whole: Sequence[tuple[WholeSlot, int]],
    rest: Sequence[tuple[torch.Tensor, int]],
    options: list[dict[str, Any]] | None,
    comm: Comm | None,
    slots: Sequence[WholeSlot] = (),
    rest_names: Iterable[str] = (),
) -> HybridOptimizer:
    """The ``HybridOptimizer`` over ``whole`` (slots, each with its param group index) and ``rest`` (tensors the
    elementwise optimizer steps; ``slots`` are every slot, the rest's master views included): a part is built only
    where it has parameters on this rank."""
    parts = []
    if whole:
        parts.append(spec.whole(grouped([(slot.stepped, g) for slot, g in whole], options)))
    if rest:
        if spec.rest is None:
            names = ", ".join(list(rest_names)[:4])
            raise LayoutError(
                f"WholeTensorOptimizer has no 'rest' factory, but parameters are not selected for 'whole' ({names} "
                f"...). Fix: pass rest=lambda p: torch.optim.AdamW(p, ...), or a select that takes every parameter."
            )
        parts.append(spec.rest(grouped(rest, options)))
    for part in parts:
        if not isinstance(part, torch.optim.Optimizer):
            raise TypeError(f"an optimizer factory returned {type(part).__name__}, not a torch.optim.Optimizer")
    if len(parts) > 1 and needs_whole_tensors(parts[1]):
        raise LayoutError(
            f"WholeTensorOptimizer's 'rest' built {type(parts[1]).__name__}, which needs whole tensors: 'rest' steps "
            f"slices and flat shards. Fix: build an elementwise optimizer (AdamW, SGD, ...) in 'rest'."
        )
    return HybridOptimizer(parts, list(slots) or [slot for slot, _ in whole], comm)


@dataclass(frozen=True)
class SlotFlat:
    """A slot as a one-tensor flat buffer, for checkpoints (``plait.checkpoint.canonical``): the optimizer state
    of ``master`` (the stepped tensor) is the state of parameter ``layout.names[0]``, whose global shape follows
    from ``params[0]`` (the stepped whole tensor itself for a gathered tp slice)."""

    layout: FlatLayout
    rank: int
    master: nn.Parameter
    params: list[nn.Parameter]
    shard: torch.Tensor | None = None


def slot_flats(slots: Sequence[WholeSlot]) -> list[SlotFlat]:
    """The slots whose stepped tensor is not the model's parameter itself (views of masters, gathered wholes)."""
    return [
        SlotFlat(FlatLayout.of([(s.name, s.stepped)], 1), 0, s.stepped, [s.stepped if s.sliced else s.param])
        for s in slots
        if s.stepped is not s.param
    ]


# ----------------------------------------------------------------------------------------------- checks
def _probe(factory: Any, model: nn.Module) -> tuple[torch.optim.Optimizer | None, bool]:
    """The optimizer a plain factory builds, tried on meta copies of the model's trainable parameters (no memory,
    no communication), then of its matrices alone (torch.optim.Muon refuses anything but 2-D); and whether it
    was built on every trainable parameter, exactly those given. (None, False) when the factory accepts neither."""
    params = [nn.Parameter(torch.empty(p.shape, device="meta")) for p in model.parameters() if p.requires_grad]
    for every, trial in ((True, params), (False, [p for p in params if p.dim() == 2])):
        try:
            built = factory(trial)
        except Exception:  # noqa: BLE001, S112 - a factory that needs real tensors is simply not probed
            continue
        if not isinstance(built, torch.optim.Optimizer):
            return None, False
        held = {id(p) for group in built.param_groups for p in group["params"]}
        return built, every and held == {id(p) for p in trial}
    return None, False


def select_all(name: str, param: nn.Parameter) -> bool:
    """``WholeTensorOptimizer.select`` taking every trainable parameter (a plain factory that took them all)."""
    return True


def adopt_plain_factory(layout: Any, optimizer: Any, model: nn.Module) -> Any:
    """A plain factory ``params -> optimizer`` whose optimizer needs whole tensors (``lambda p: torch.optim.Muon
    (p)``), under tp or ZeRO where it would step slices or flat shards, as ``WholeTensorOptimizer(whole=factory,
    select=select_all)``: when the factory, tried on meta copies of every trainable parameter, builds its
    optimizer on exactly those, that is the selection one device makes (all of them, each stepped whole), so
    every strategy hands it whole tensors; one info line says so. A factory that takes only some of them (Muon
    refuses anything but 2-D) leaves the others without an optimizer, here as on one device: which optimizer
    steps them is the user's choice, so LayoutError names the fix. Anything else is returned unchanged."""
    whole_layout = layout.tp > 1 or layout.zero >= 1
    plain = callable(optimizer) and not isinstance(optimizer, (WholeTensorOptimizer, torch.optim.Optimizer))
    if not (whole_layout and plain):
        return optimizer
    built, every = _probe(optimizer, model)
    if built is None or not needs_whole_tensors(built):
        return optimizer
    name = type(built).__name__
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if every:
        log.info(
            "optimizer: %s needs whole tensors; with tp=%d, zero=%d plait hands it every parameter whole "
            "(WholeTensorOptimizer(whole=your factory) over all %d trainable parameters, as on one device)",
            name, layout.tp, layout.zero, len(trainable),
        )  # fmt: skip
        return WholeTensorOptimizer(whole=optimizer, select=select_all)
    others = [n for n, p in trainable if p.dim() != 2] or [n for n, _ in trainable]
    shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
    raise LayoutError(
        f"the optimizer factory builds {name}, which needs whole tensors, but not on every trainable parameter "
        f"({len(others)} others, e.g. {shown}: {name} takes only 2-D matrices), so which optimizer steps the rest "
        f"is yours to say. Fix: optimizer=plait.parallel.whole_tensor.WholeTensorOptimizer(whole=your factory, "
        f"rest=lambda p: torch.optim.AdamW(p, ...)) ({name} on the hidden matrices, AdamW on the rest, as "
        f"train.optimizer='muon' does), or freeze the others (requires_grad_(False))."
    )


def check_layout(layout: Any, optimizer: Any, model: nn.Module) -> None:
    """Refuse, before any collective, a layout under which a whole-tensor optimizer would silently differ from one
    device (or be refused later): PipeDream, 2D/2.5D/3D tensor parallelism, offload to files; a plain factory or
    optimizer that needs whole tensors under tp or ZeRO (it would step slices or shards)."""
    spec = isinstance(optimizer, WholeTensorOptimizer)
    built = None if spec else optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
    if not spec and built is None and (layout.tp > 1 or layout.zero >= 1) and callable(optimizer):
        built = _probe(optimizer, model)[0]
    if not spec and (built is None or not needs_whole_tensors(built)):
        return
    name = "WholeTensorOptimizer" if spec else type(built).__name__
    if not spec and (layout.tp > 1 or layout.zero >= 1):
        raise LayoutError(
            f"{name} needs whole tensors, but with tp={layout.tp}, zero={layout.zero} a plain optimizer factory "
            f"would step tensor-parallel slices or flat ZeRO shards (a different algorithm, silently). Fix: pass "
            f"optimizer=plait.parallel.whole_tensor.WholeTensorOptimizer(whole=lambda p: {name}(p, ...), "
            f"rest=lambda p: torch.optim.AdamW(p, ...)) so that every strategy hands it whole tensors."
        )
    if spec:
        refusals = [
            (layout.schedule == "pipedream", "PipeDream's stashed weight versions", "another pipeline schedule"),
            (
                layout.tp > 1 and layout.tp_mode != "1d",
                f"tp_mode={layout.tp_mode!r} (2D/3D grid blocks)",
                "tp_mode='1d'",
            ),  # fmt: skip
            (layout.offload == "nvme", "offload='nvme' (optimizer state in files)", "offload='cpu' or 'none'"),
        ]
        for refused, what, fix in refusals:
            if refused:
                raise LayoutError(
                    f"a whole-tensor optimizer (WholeTensorOptimizer) is not implemented with {what}: it would not "
                    f"see whole tensors exactly. Fix: use {fix}, or an elementwise optimizer."
                )


__all__ = [
    "HybridOptimizer",
    "adopt_plain_factory",
    "WholeSlot",
    "WholeTensorOptimizer",
    "build_hybrid",
    "check_layout",
    "hidden_matrices",
    "make_slot",
    "slot_flats",
    "needs_whole_tensors",
    "register_whole_tensor",
    "select_all",
]
