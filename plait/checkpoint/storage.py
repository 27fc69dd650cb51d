"""DCP reading and writing with plait's ``Chunked`` objects, and without running pickled code on load.

torch.distributed.checkpoint pickles its ``.metadata`` file and would ``torch.load(weights_only=False)`` any
non-tensor value. plait writes tensors only (everything else goes to JSON, plait.json), and reads:

- ``.metadata`` with ``MetadataUnpickler``: only DCP's metadata dataclasses, ``torch.Size``, torch dtypes /
  layouts / memory formats and plain builtins may be named; any other global (``os.system``, ...) is refused;
- tensor payloads with torch's ``weights_only=True`` loader (DCP's own FileSystemReader does that);
- never byte (pickled object) entries: ``PlaitLoadPlanner`` refuses them before reading anything.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import pathlib
import pickle
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata

from plait.checkpoint.chunks import Chunked
from plait.errors import CheckpointError

SAFE_MODULES = ("torch.distributed.checkpoint.metadata",)
"""Any class of DCP's metadata module (dataclasses and enums, no side effects) may be named."""
SAFE_CLASSES = {("torch.distributed.checkpoint.filesystem", "_StorageInfo")}
"""And these classes of other modules (a piece's file, offset and length); not the module's readers/writers."""
SAFE_BUILTINS = {
    "dict",
    "list",
    "tuple",
    "set",
    "frozenset",
    "int",
    "float",
    "bool",
    "str",
    "bytes",
    "complex",
    "slice",
    "object",
    "bytearray",
}


def _layout(name: str) -> torch.layout:
    """A torch layout by its printed name (what torch pickles a layout as), and nothing else."""
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.layout):
        raise CheckpointError(f"the checkpoint's .metadata names an unknown tensor layout {name!r}")
    return value


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` file, naming only the classes such a file needs."""

    def find_class(self, module: str, name: str) -> Any:
        if module in SAFE_MODULES or (module, name) in SAFE_CLASSES:  # classes only: never a function
            value = getattr(importlib.import_module(module), name, None)
            if isinstance(value, type):
                return value
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _layout
        if module in ("pathlib", "posixpath") and name in ("PosixPath", "PurePosixPath"):
            return getattr(pathlib, name)
        if module == "torch" and name == "Size":
            return torch.Size
        kinds = (torch.dtype, torch.layout, torch.memory_format)
        if module == "torch" and isinstance(getattr(torch, name, None), kinds):
            return getattr(torch, name)
        if module == "builtins" and name in SAFE_BUILTINS:
            return getattr(builtins, name)
        if module == "collections" and name == "OrderedDict":
            import collections

            return collections.OrderedDict
        raise CheckpointError(
            f"the checkpoint's .metadata names {module}.{name}, which a DCP metadata file never needs: refusing to "
            f"load it (unpickling it could run code). Fix: only load checkpoints written by plait / DCP that you trust."
        )


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with ``.metadata`` read by ``MetadataUnpickler``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        if not Path(path).is_file():
            raise CheckpointError(f"{path} is missing: not a complete checkpoint.")
        with self.fs.create_stream(path, "rb") as handle:
            metadata = MetadataUnpickler(handle).load()
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP Metadata.")
        storage_meta = metadata.storage_meta if metadata.storage_meta is not None else StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


def check_tensors(metadata: Metadata, keys: Any) -> None:
    """Refuse to read any of ``keys`` that the checkpoint stores as a pickled object."""
    for fqn in keys:
        stored = metadata.state_dict_metadata.get(fqn)
        if stored is not None and not isinstance(stored, TensorStorageMetadata):
            raise CheckpointError(
                f"checkpoint entry {fqn!r} is a pickled object, not a tensor: plait never writes "
                f"those and does not unpickle them. Fix: re-save the checkpoint with plait."
            )


class PlaitSavePlanner(DefaultSavePlanner):
    """Writes a flat dict of ``Chunked`` objects and tensors (each piece as a compact copy: torch.save of a view
    would write its whole storage; ``staged`` pieces are compact copies already)."""

    def __init__(self, staged: bool = False) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.staged = staged

    def lookup_object(self, index: MetadataIndex) -> Any:
        value = self.state_dict[index.fqn]
        if isinstance(value, Chunked):
            piece = value.__get_tensor_shard__(index)
            return piece if self.staged else piece.detach().clone(memory_format=torch.contiguous_format)
        return super().lookup_object(index)


class PlaitLoadPlanner(DefaultLoadPlanner):
    """Reads into the views of ``Chunked`` objects (and into plain tensors); refuses pickled (byte) entries."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        """As DCP's, without ``_init_state_dict`` (it would replace objects it does not know by None)."""
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> Any:
        assert self.metadata is not None
        check_tensors(self.metadata, self.state_dict)
        return super().create_local_plan()

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        value = self.state_dict[index.fqn]
        if isinstance(value, Chunked):
            return value.__get_tensor_shard__(index)
        return super().lookup_tensor(index)

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise CheckpointError(
            f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object: refusing to load it."
        )


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns that it 'assumes a single process' without a process group: intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message=".*assum.*single.*")
        yield


def write(state: dict[str, Any], folder: Path, no_dist: bool = False, writer: FileSystemWriter | None = None) -> None:
    """Every rank writes its pieces of ``state`` into ``folder`` (a collective unless ``no_dist``)."""
    with _quiet():
        dcp.save(
            state,
            storage_writer=writer if writer is not None else FileSystemWriter(str(folder)),
            planner=PlaitSavePlanner(),
            no_dist=no_dist or not distributed(),
        )


class _AlreadyStaged:
    """DCP's stager protocol for a state that is staged already (host copies made by the caller)."""

    should_synchronize_after_execute = False

    def stage(self, state_dict: Any) -> Any:
        return state_dict

    def close(self) -> None:
        pass


def write_async(staged: dict[str, Any], writer: FileSystemWriter, group: dist.ProcessGroup | None) -> Future[Any]:
    """``dcp.async_save`` of host copies (``staged``) on a background thread over ``group`` (a process group of
    its own: the training's collectives go on meanwhile on theirs), or in this process alone when ``group`` is
    None (no process group, or one rank)."""
    with _quiet():
        result = dcp.async_save(
            staged,
            storage_writer=writer,
            planner=PlaitSavePlanner(staged=True),
            process_group=group,
            async_stager=_AlreadyStaged(),  # type: ignore[arg-type]  # DCP checks the protocol at run time only
            no_dist=group is None,
        )
    if not isinstance(result, Future):  # an AsyncSaveResponse only comes with a stager that returns a future
        raise CheckpointError(f"dcp.async_save returned {type(result).__name__}, not a Future. Fix: report this.")
    return result


def read_metadata(folder: Path) -> Metadata:
    """The checkpoint's DCP metadata (global sizes, dtypes and saved pieces of every entry), read safely."""
    return SafeFileSystemReader(str(folder)).read_metadata()


def read(state: dict[str, Any], folder: Path, no_dist: bool = False) -> None:
    """Fill ``state``'s tensors / views from ``folder`` (a collective unless ``no_dist``)."""
    check_tensors(read_metadata(folder), state)  # here too: DCP would wrap the planner's error in its own
    with _quiet():
        dcp.load(
            state,
            storage_reader=SafeFileSystemReader(str(folder)),
            planner=PlaitLoadPlanner(),
            no_dist=no_dist or not distributed(),
        )
