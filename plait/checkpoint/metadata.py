"""DCP's ``.metadata`` read as plain data, then rebuilt from an allow-list of constructors with validated fields.

torch.distributed.checkpoint pickles its ``Metadata``. Restricting which globals a pickle may name is not enough:
pickle's BUILD opcode sets attributes on whatever object is on its stack, *a class included*, so a file that
names an allowed class and then BUILDs on it changes that class for the whole process (``PurePosixPath._str``
redirects every later path). This reader therefore never hands the pickle a real class, function or constant:

1. *parse* (``_Unpickler``): every global the file names becomes a fresh stand-in type of this read only (a
   subclass of ``_Call``); calling it (REDUCE, NEWOBJ) records the arguments, BUILD records the state (its
   ``__setstate__``), and nothing else happens. A global outside ``KNOWN`` is refused before anything is built.
   What comes out is a tree of plain data (dicts, lists, tuples, strings, numbers) and such records;
2. *rebuild* (``_Rebuilder``): each record becomes a DCP object through its own constructor, only for the names
   of ``KNOWN``, and only after its fields have the types and ranges a checkpoint plait wrote can have (sizes and
   offsets are non-negative ints, every chunk lies inside its tensor, a storage entry is a plain file name with a
   non-negative offset and length, ...). Shared sub-objects are rebuilt once; cycles are refused.

Any other content is a ``CheckpointError`` naming what is wrong; nothing of it has run.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from enum import Enum
from pathlib import PurePosixPath
from typing import IO, Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from plait.errors import CheckpointError
from plait.files import plain_name

DCP = "torch.distributed.checkpoint.metadata"
MAX_DEPTH = 64
"""A DCP metadata tree is ~6 levels deep; deeper nesting is refused before Python's recursion limit is reached."""
PLAIN = (str, int, float, bool, bytes, type(None))


class _Call:
    """A record of what the pickle asked of a global: its call's arguments (``args``) and BUILD state (``state``)."""

    args: tuple[Any, ...]
    state: Any

    def __new__(cls, *args: Any) -> _Call:  # NEWOBJ calls cls.__new__(cls, *args); REDUCE calls cls(*args)
        self = object.__new__(cls)
        self.args, self.state = args, None
        return self

    def __init__(self, *args: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:  # BUILD on a record; BUILD on a stand-in type fails (no self)
        self.state = state


class _Unpickler(pickle.Unpickler):
    """Parses a ``.metadata`` pickle into plain data and ``_Call`` records (module docstring, step 1)."""

    def __init__(self, handle: IO[bytes]) -> None:
        super().__init__(handle)
        self.names: dict[type, tuple[str, str]] = {}

    def find_class(self, module: str, name: str) -> type:
        if (module, name) not in KNOWN:
            raise CheckpointError(
                f"the checkpoint's .metadata names {module}.{name}, which a DCP metadata file never needs: refusing "
                f"to load it (unpickling it could run code). Fix: only load checkpoints written by plait / DCP that "
                f"you trust."
            )
        stand_in = type(name, (_Call,), {})
        self.names[stand_in] = (module, name)
        return stand_in

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError("the checkpoint's .metadata refers to external objects, which DCP never writes.")


def _fail(what: str) -> CheckpointError:
    return CheckpointError(
        f"the checkpoint's .metadata is malformed: {what}. Fix: resume from another checkpoint, or restore the file "
        f"from a copy (`plait checkpoint verify` checks it against plait.json)."
    )


def _int(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise _fail(f"{what} is {value!r}, not a whole number >= 0")
    return value


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise _fail(f"{what} is a {type(value).__name__}, not a string")
    return value


def _fields(state: Any, what: str, required: set[str], optional: set[str]) -> dict[str, Any]:
    """A dataclass's BUILD state (a dict of its fields) with exactly the ``required`` and some ``optional`` keys."""
    if isinstance(state, tuple) and len(state) == 2 and state[0] is None and isinstance(state[1], dict):
        state = state[1]  # (None, slots): a dataclass with __slots__
    if not isinstance(state, dict):
        raise _fail(f"the fields of {what} are a {type(state).__name__}, not a dict")
    unknown = set(state) - required - optional
    missing = required - set(state)
    if unknown or missing:
        raise _fail(
            f"{what} has fields {sorted(map(str, state))}: unknown {sorted(map(str, unknown))}, missing {sorted(missing)}"
        )
    return state


class _Rebuilder:
    """Rebuilds DCP's ``Metadata`` from the parsed tree (module docstring, step 2)."""

    def __init__(self, names: dict[type, tuple[str, str]]) -> None:
        self.names = names
        self.done: dict[int, Any] = {}
        self.busy: set[int] = set()

    def name(self, value: Any) -> tuple[str, str] | None:
        kind = value if isinstance(value, type) else type(value)
        return self.names.get(kind)

    def value(self, value: Any, depth: int = 0) -> Any:
        """Plain data rebuilt (containers element by element); records by their builders."""
        if isinstance(value, PLAIN):
            return value
        key = id(value)
        if key in self.done:
            return self.done[key]
        if key in self.busy:
            raise _fail("it contains a cycle (an object inside itself)")
        if depth > MAX_DEPTH:
            raise _fail(f"it is nested more than {MAX_DEPTH} levels deep")
        self.busy.add(key)
        built = self._build(value, depth + 1)
        self.busy.discard(key)
        self.done[key] = built
        return built

    def _build(self, value: Any, depth: int) -> Any:
        if type(value) is list:
            return [self.value(item, depth) for item in value]
        if type(value) is tuple:
            return tuple(self.value(item, depth) for item in value)
        if type(value) is dict:
            return {self.value(k, depth): self.value(v, depth) for k, v in value.items()}
        name = self.name(value)
        if name is None:
            raise _fail(f"it holds a {type(value).__name__}, which is neither plain data nor a DCP metadata object")
        if isinstance(value, type):  # a bare global: only constants (dtypes, memory formats) are values
            return _constant(name)
        build = KNOWN[name]
        if build is None:
            raise _fail(f"{name[0]}.{name[1]} is used as a call, but it is a constant")
        return build(self, value, depth)

    def typed(self, value: Any, depth: int, kind: type, what: str) -> Any:
        built = self.value(value, depth)
        if not isinstance(built, kind):
            raise _fail(f"{what} is a {type(built).__name__}, not a {kind.__name__}")
        return built


def _constant(name: tuple[str, str]) -> Any:
    module, attr = name
    value = getattr(torch, attr, None) if module == "torch" else None
    if isinstance(value, (torch.dtype, torch.memory_format)):
        return value
    raise _fail(f"{module}.{attr} is used as a value, but only torch dtypes and memory formats are")


def _no_state(record: _Call, what: str) -> None:
    if record.state is not None:
        raise _fail(f"{what} has state it cannot have")


def _size(r: _Rebuilder, record: _Call, depth: int) -> torch.Size:
    _no_state(record, "a torch.Size")
    if len(record.args) != 1 or type(record.args[0]) not in (tuple, list):
        raise _fail(f"a torch.Size is built from {record.args!r}, not one tuple of sizes")
    return torch.Size([_int(n, "a tensor size") for n in r.value(record.args[0], depth)])


def _layout(r: _Rebuilder, record: _Call, depth: int) -> torch.layout:
    _no_state(record, "a tensor layout")
    name = r.value(record.args[0], depth) if len(record.args) == 1 else None
    value = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
    if not isinstance(value, torch.layout):
        raise _fail(f"it names an unknown tensor layout {record.args!r}")
    return value


def _memory_encoding(r: _Rebuilder, record: _Call, depth: int) -> Enum:
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    _no_state(record, "a memory format encoding")
    try:
        return _MEM_FORMAT_ENCODING(*record.args)
    except (TypeError, ValueError):
        raise _fail(f"a memory format encoding is {record.args!r}") from None


def _properties(r: _Rebuilder, record: _Call, depth: int) -> TensorProperties:
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    state = r.value(record.state, depth)
    if record.args or not isinstance(state, tuple) or len(state) != 5:
        raise _fail("a TensorProperties is not (dtype, layout, requires_grad, memory format, pin_memory)")
    dtype, layout, requires_grad, encoding, pin = state
    if not isinstance(dtype, torch.dtype) or not isinstance(layout, torch.layout):
        raise _fail(f"a TensorProperties has dtype {dtype!r} and layout {layout!r}")
    if not isinstance(encoding, _MEM_FORMAT_ENCODING) or type(requires_grad) is not bool or type(pin) is not bool:
        raise _fail("a TensorProperties has a malformed memory format, requires_grad or pin_memory")
    built = TensorProperties(dtype=dtype, layout=layout, requires_grad=requires_grad, pin_memory=pin)
    built.__setstate__(state)  # DCP's own decoding of the memory format (an Enum it checked above)
    return built


def _chunk(r: _Rebuilder, record: _Call, depth: int) -> ChunkStorageMetadata:
    state = r.value(_fields(record.state, "a chunk", {"offsets", "sizes"}, set()), depth)
    offsets, sizes = state["offsets"], state["sizes"]
    if not isinstance(offsets, torch.Size) or not isinstance(sizes, torch.Size) or len(offsets) != len(sizes):
        raise _fail("a chunk's offsets and sizes are not two torch.Size of one length")
    return ChunkStorageMetadata(offsets=offsets, sizes=sizes)


def _tensor(r: _Rebuilder, record: _Call, depth: int) -> TensorStorageMetadata:
    state = _fields(record.state, "a tensor entry", {"properties", "size", "chunks"}, set())
    properties = r.typed(state["properties"], depth, TensorProperties, "a tensor's properties")
    size = r.typed(state["size"], depth, torch.Size, "a tensor's size")
    chunks = r.typed(state["chunks"], depth, list, "a tensor's chunks")
    for chunk in chunks:
        if not isinstance(chunk, ChunkStorageMetadata):
            raise _fail(f"a tensor's chunk is a {type(chunk).__name__}")
        ends = [o + s for o, s in zip(chunk.offsets, chunk.sizes)]
        if len(chunk.offsets) != len(size) or any(e > n for e, n in zip(ends, size)):
            raise _fail(
                f"a chunk at {list(chunk.offsets)} of sizes {list(chunk.sizes)} lies outside its tensor {list(size)}"
            )
    return TensorStorageMetadata(properties=properties, size=size, chunks=chunks)


def _bytes_entry(r: _Rebuilder, record: _Call, depth: int) -> BytesStorageMetadata:
    if record.args or record.state not in (None, {}):
        raise _fail("a bytes entry has fields it cannot have")
    return BytesStorageMetadata()


def _index(r: _Rebuilder, record: _Call, depth: int) -> MetadataIndex:
    state = r.value(_fields(record.state, "a storage index", {"fqn"}, {"offset", "index"}), depth)
    offset, index = state.get("offset"), state.get("index")
    if offset is not None and not isinstance(offset, torch.Size):
        raise _fail(f"a storage index's offset is a {type(offset).__name__}")
    if index is not None:
        _int(index, "a storage index's position")
    return MetadataIndex(_str(state["fqn"], "an entry name"), offset, index)


def _storage_info(r: _Rebuilder, record: _Call, depth: int) -> _StorageInfo:
    fields = {"relative_path", "offset", "length"}
    state = r.value(_fields(record.state, "a storage entry", fields, {"transform_descriptors"}), depth)
    problem = plain_name(state["relative_path"])
    if problem is not None:
        raise _fail(f"a piece is stored in {problem}")
    if state.get("transform_descriptors"):
        raise _fail(f"a piece is stored with transforms {state['transform_descriptors']!r}, which plait never writes")
    return _StorageInfo(state["relative_path"], _int(state["offset"], "an offset"), _int(state["length"], "a length"))


def _optional_str(value: Any, what: str) -> str | None:
    return None if value is None else _str(value, what)


def _storage_meta(r: _Rebuilder, record: _Call, depth: int) -> StorageMeta:
    keys = {"checkpoint_id", "save_id", "load_id", "modules"}
    state = r.value(_fields(record.state, "the storage meta", set(), keys), depth)
    checkpoint_id = state.get("checkpoint_id")
    if checkpoint_id is not None and not isinstance(checkpoint_id, (str, PurePosixPath)):
        raise _fail(f"the checkpoint id is a {type(checkpoint_id).__name__}")
    modules = state.get("modules", [])
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise _fail("the storage meta's modules are not a list of strings")
    return StorageMeta(
        checkpoint_id=None if checkpoint_id is None else str(checkpoint_id),
        save_id=_optional_str(state.get("save_id"), "the save id"),
        load_id=_optional_str(state.get("load_id"), "the load id"),
        modules=modules,
    )


def _path(r: _Rebuilder, record: _Call, depth: int) -> PurePosixPath:
    _no_state(record, "a path")
    return PurePosixPath(*(_str(part, "a path part") for part in r.value(record.args, depth)))


def _plain(value: Any, what: str, depth: int = 0) -> None:
    """Refuse anything in ``value`` that is not plain data (planner data is free-form but never an object)."""
    if depth > MAX_DEPTH:
        raise _fail(f"{what} is nested too deep")
    if isinstance(value, dict):
        for k, v in value.items():
            _plain(k, what, depth + 1)
            _plain(v, what, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _plain(item, what, depth + 1)
    elif not isinstance(value, PLAIN):
        raise _fail(f"{what} holds a {type(value).__name__}")


def _metadata(r: _Rebuilder, record: _Call, depth: int) -> Metadata:
    optional = {"planner_data", "storage_data", "storage_meta", "version"}
    state = _fields(record.state, "the metadata", {"state_dict_metadata"}, optional)
    entries = r.typed(state["state_dict_metadata"], depth, dict, "the entries")
    for fqn, stored in entries.items():
        _str(fqn, "an entry name")
        if not isinstance(stored, (TensorStorageMetadata, BytesStorageMetadata)):
            raise _fail(f"entry {fqn!r} is a {type(stored).__name__}")
    storage = r.value(state.get("storage_data"), depth)
    if storage is not None:
        if not isinstance(storage, dict):
            raise _fail(f"the storage data is a {type(storage).__name__}")
        for index, info in storage.items():
            if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
                raise _fail("the storage data does not map storage indices to stored pieces")
    planner_data = r.value(state.get("planner_data"), depth)
    _plain(planner_data, "the planner data")
    storage_meta = r.value(state.get("storage_meta"), depth)
    if storage_meta is not None and not isinstance(storage_meta, StorageMeta):
        raise _fail(f"the storage meta is a {type(storage_meta).__name__}")
    version = _optional_str(r.value(state.get("version"), depth), "the version")
    return Metadata(
        state_dict_metadata=entries,
        planner_data=planner_data,
        storage_data=storage,
        storage_meta=storage_meta,
        version=version,
    )


Builder = Callable[[_Rebuilder, _Call, int], Any]
KNOWN: dict[tuple[str, str], Builder | None] = {
    (DCP, "Metadata"): _metadata,
    (DCP, "TensorStorageMetadata"): _tensor,
    (DCP, "BytesStorageMetadata"): _bytes_entry,
    (DCP, "TensorProperties"): _properties,
    (DCP, "ChunkStorageMetadata"): _chunk,
    (DCP, "MetadataIndex"): _index,
    (DCP, "StorageMeta"): _storage_meta,
    (DCP, "_MEM_FORMAT_ENCODING"): _memory_encoding,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _storage_info,
    ("torch.serialization", "_get_layout"): _layout,
    ("torch", "Size"): _size,
    ("pathlib", "PosixPath"): _path,
    ("pathlib", "PurePosixPath"): _path,
    **{("torch", name): None for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)},
    **{("torch", name): None for name in ("contiguous_format", "channels_last", "preserve_format")},
}
"""Every global a DCP ``.metadata`` may name, with the builder of its records (None: a constant)."""


def load(handle: IO[bytes]) -> Metadata:
    """The DCP ``Metadata`` pickled in ``handle``, rebuilt from plain data (module docstring)."""
    parser = _Unpickler(handle)
    try:
        tree = parser.load()
    except CheckpointError:
        raise
    except (Exception, RecursionError) as error:  # noqa: BLE001 - any malformed pickle: one clear error
        raise _fail(f"not a pickle DCP writes ({type(error).__name__}: {str(error)[:200]})") from None
    rebuilder = _Rebuilder(parser.names)
    try:
        metadata = rebuilder.value(tree)
    except CheckpointError:
        raise
    except (Exception, RecursionError) as error:  # noqa: BLE001 - a constructor refusing its fields
        raise _fail(f"{type(error).__name__}: {str(error)[:200]}") from None
    if not isinstance(metadata, Metadata):
        raise _fail(f"it holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


__all__ = ["KNOWN", "load"]
