"""Record what building a model does to its tensors, on the meta device, so that any rank can replay it later.

``deferred_init(build, *args)`` runs ``build(*args)`` (e.g. ``GPT(config)``, or transformers' ``from_config``)
under a ``TorchDispatchMode`` that sends every tensor the code creates on the host to the meta device and logs each
aten operation it runs: the operator, its arguments with every tensor replaced by a ``TRef`` (which storage, and
the view's dtype, size, stride and offset into it), which storages it reads, writes, overwrites whole or creates,
and whether it draws random numbers (``torch.Tag.nondeterministic_seeded``). Nothing is allocated: a 70B
model's log is a few thousand entries. The CPU generator's state at the start is kept, and restored at the end
(a host tensor the code made for real may have drawn from it), so that the replay draws exactly what eager
construction would have drawn, in the same order (``replay``).

The idea is torchdistx's deferred initialisation (record the operations on fake tensors, replay them to
materialise); here the log is keyed by storage, so views, ``.data``, slicing and tied weights need no special
case: an operation on a view is an operation on its storage at that view's geometry.

Storages are named by their C++ object (``untyped_storage()._cdata``); the recorder keeps every storage it saw
alive until the end, so that an address is never reused for another one. Host tensors that enter from outside
(``torch.tensor(...)`` constants, module-level tensors) are copied once when first seen; meta tensors made
before the recording (a model already on meta) are *unknown*: a replay that needs their values fails
(``replay.MaterializeError``) naming the tensors that depend on them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from plait.errors import PlaitError

META = torch.device("meta")
OVERWRITE = frozenset(
    {"fill_", "zero_", "normal_", "uniform_", "random_", "exponential_", "geometric_", "log_normal_", "cauchy_"}
    | {"bernoulli_", "copy_"}
)
"""In-place operators whose result does not depend on ``self``'s old values (they write every element)."""
T = TypeVar("T", bound=nn.Module)


class MaterializeError(PlaitError, ValueError):
    """A model on the meta device that plait cannot materialise (named with the fix), raised before any
    collective."""

    def __init__(self, message: str, names: list[str] | None = None) -> None:
        super().__init__(message)
        self.names = names or []


@dataclass(frozen=True)
class TRef:
    """A tensor of the log: a view of storage ``sid`` with this dtype and geometry."""

    sid: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.size)


class _Device:
    """Placeholder for the meta device in a logged argument: the replay's device goes there."""

    def __repr__(self) -> str:
        return "<replay device>"


REPLAY_DEVICE = _Device()


@dataclass
class Op:
    """One logged aten operation and what it does to storages."""

    func: torch._ops.OpOverload
    args: Any
    kwargs: Any
    reads: frozenset[int]
    writes: frozenset[int]
    kills: frozenset[int]
    """Storages whose old values no longer matter after this op: created by it, or overwritten whole."""
    outputs: tuple[TRef, ...]
    rng: bool

    @property
    def name(self) -> str:
        return str(self.func)


@dataclass
class InitRecord:
    """The log of a model's construction (module docstring) and where each of its tensors ended up."""

    ops: list[Op] = field(default_factory=list)
    nbytes: dict[int, int] = field(default_factory=dict)
    external: dict[int, torch.Tensor] = field(default_factory=dict)
    """Host storages that entered from outside (as uint8 copies)."""
    unknown: set[int] = field(default_factory=set)
    """Meta storages made before the recording: their values are unknown."""
    tensors: dict[str, TRef] = field(default_factory=dict)
    """Every parameter, buffer and tensor attribute of the model by name (tied names each) -> its value's view."""
    kinds: dict[str, str] = field(default_factory=dict)
    """name -> "parameter", "buffer" or "attribute"."""
    rng_state: torch.Tensor | None = None
    """The CPU generator's state when the recording began: the replay starts from it."""
    source: str = ""
    """What was recorded (for messages): e.g. "GPT(...)" or "reset_parameters of every module"."""

    def __deepcopy__(self, memo: dict[int, Any]) -> InitRecord:
        """Shared, not copied, by deep copies of its model (pipeline stages): it never changes once recorded."""
        return self


def _is_factory(func: torch._ops.OpOverload, leaves: list[Any]) -> bool:
    return not any(isinstance(leaf, torch.Tensor) for leaf in leaves) and any(
        argument.name == "device" for argument in func._schema.arguments
    )


def _covers(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is its whole storage (so writing every element of it overwrites the storage)."""
    nbytes = tensor.untyped_storage().nbytes()
    return tensor.storage_offset() == 0 and tensor.is_contiguous() and tensor.numel() * tensor.element_size() == nbytes


class Recorder(TorchDispatchMode):
    """The dispatch mode that builds an ``InitRecord`` (module docstring)."""

    def __init__(self, record: InitRecord) -> None:
        super().__init__()
        self.record = record
        self._sids: dict[int, int] = {}
        self._alive: list[Any] = []

    def sid_of(self, tensor: torch.Tensor, made_here: bool = False) -> int:
        storage = tensor.untyped_storage()
        key = storage._cdata
        sid = self._sids.get(key)
        if sid is None:
            sid = self._sids[key] = len(self._sids)
            self._alive.append(storage)
            self.record.nbytes[sid] = storage.nbytes()
            if not made_here:
                if tensor.is_meta:
                    self.record.unknown.add(sid)
                else:
                    whole = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
                    self.record.external[sid] = whole.clone()
        return sid

    def ref(self, tensor: torch.Tensor, made_here: bool = False) -> TRef:
        return TRef(
            self.sid_of(tensor, made_here),
            tensor.dtype,
            tuple(tensor.shape),
            tuple(tensor.stride()),
            int(tensor.storage_offset()),
        )

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        leaves, _ = tree_flatten((args, kwargs))
        factory = _is_factory(func, leaves)
        if factory:
            device = kwargs.get("device")
            if device is None or torch.device(device).type == "cpu":
                kwargs["device"] = META
        schema = func._schema
        written: list[torch.Tensor] = []
        for index, argument in enumerate(schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = args[index] if index < len(args) and not argument.kwarg_only else kwargs.get(argument.name)
            written += [leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, torch.Tensor)]
        overwrite = func._overloadpacket.__name__ in OVERWRITE and bool(written) and written[0] is args[0]
        kills = {self.sid_of(args[0])} if overwrite and _covers(args[0]) else set()
        reads = set()
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and not (overwrite and leaf is args[0]):
                reads.add(self.sid_of(leaf))
        writes = {self.sid_of(tensor) for tensor in written}
        reads |= writes - kills  # a partial write keeps the rest of the storage's old values
        template = tree_map(self._template, (args, kwargs))
        out = func(*args, **kwargs)
        outputs = []
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                new = leaf.untyped_storage()._cdata not in self._sids
                ref = self.ref(leaf, made_here=True)
                outputs.append(ref)
                if new:
                    kills.add(ref.sid)
                    writes.add(ref.sid)
        if factory and "dtype" in {a.name for a in schema.arguments} and kwargs.get("dtype") is None and outputs:
            template[1]["dtype"] = outputs[0].dtype  # the default dtype at the time, not at the replay's
        rng = torch.Tag.nondeterministic_seeded in func.tags
        self.record.ops.append(
            Op(
                func,
                template[0],
                template[1],
                frozenset(reads),
                frozenset(writes),
                frozenset(kills),
                tuple(outputs),
                rng,
            )
        )
        return out

    def _template(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self.ref(value)
        if isinstance(value, torch.device) and value.type == "meta":
            return REPLAY_DEVICE
        return value


def module_tensors(model: nn.Module) -> dict[str, tuple[str, torch.Tensor]]:
    """Every parameter, buffer and tensor attribute of ``model`` by dotted name (tied names each):
    name -> (kind, tensor)."""
    found: dict[str, tuple[str, torch.Tensor]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        prefix = f"{path}." if path else ""
        for name, param in module._parameters.items():
            if param is not None:
                found[prefix + name] = ("parameter", param)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                found[prefix + name] = ("buffer", buffer)
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not name.startswith("_"):
                found.setdefault(prefix + name, ("attribute", value))
    return found


def record(build: Callable[[], T], source: str) -> tuple[T, InitRecord]:
    """Run ``build()`` under the recorder; the model it returns (on meta) and its record."""
    log = InitRecord(rng_state=torch.get_rng_state(), source=source)
    recorder = Recorder(log)
    try:
        with recorder:
            model = build()
    except (RuntimeError, NotImplementedError) as error:  # e.g. .item() of a meta tensor: data-dependent code
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise MaterializeError(
            f"{source} cannot run on the meta device ({reason}): its construction reads tensor values (code that "
            f"branches on them, such as a rejection loop). Fix: initialise with operations that do not depend on "
            f"the values (normal_, uniform_, arithmetic), or build the model on a real device."
        ) from error
    finally:
        assert log.rng_state is not None
        torch.set_rng_state(log.rng_state)  # a host tensor made for real may have drawn: the replay draws instead
    for name, (kind, tensor) in module_tensors(model).items():
        log.tensors[name] = recorder.ref(tensor)
        log.kinds[name] = kind
    return model, log


__all__ = [
    "META",
    "REPLAY_DEVICE",
    "InitRecord",
    "MaterializeError",
    "Op",
    "Recorder",
    "TRef",
    "module_tensors",
    "record",
]
