"""DCP reading and writing with plait's ``Chunked`` objects, and without running pickled code on load.

torch.distributed.checkpoint pickles its ``.metadata`` file and would ``torch.load(weights_only=False)`` any
non-tensor value. plait writes tensors only (everything else goes to JSON, plait.json), and reads:

- ``.metadata`` as plain data (``plait.checkpoint.metadata``): DCP's metadata objects are rebuilt from an
  allow-list of constructors with validated fields; no class, function or constant the file names is ever handed
  to the pickle;
- the files ``.metadata`` names only inside the checkpoint's folder (``_RegularFiles``): each a plain file name
  that plait.json records (when it records files), a regular file (never a FIFO, a device or a symbolic link),
  every piece inside its file -- checked before anything is read, and again as each file is opened;
- tensor payloads with torch's ``weights_only=True`` loader (DCP's own FileSystemReader does that);
- never byte (pickled object) entries: ``PlaitLoadPlanner`` refuses them before reading anything.

A failure inside DCP (a ``CheckpointException``, a ``BaseException``) comes back as one ``CheckpointError`` line
(``failures``), never with torch's advice to unpickle.
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from collections.abc import Collection, Generator, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata

from plait import files
from plait.checkpoint import failures, integrity
from plait.checkpoint import metadata as metadata_reader
from plait.checkpoint.chunks import Chunked
from plait.errors import CheckpointError


class _RegularFiles(FileSystem):
    """DCP's local file system, reading only plain file names of the folder that are regular files."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if "r" not in mode or "+" in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with files.open_regular(Path(path), "checkpoint file", CheckpointError) as stream:
            yield stream

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str | os.PathLike[str]:
        return files.inside(Path(path), suffix, "the checkpoint's .metadata", CheckpointError)


def check_storage(folder: Path, metadata: Metadata, recorded: Collection[str] | None) -> None:
    """Refuse a ``.metadata`` whose pieces lie anywhere but in regular files of ``folder`` that plait.json records
    (``recorded``; any plain name when it records none), each piece inside its file."""
    sizes: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = info.relative_path
        if name not in sizes:
            path = files.inside(folder, name, "the checkpoint's .metadata", CheckpointError)
            if recorded is not None and name not in recorded:
                raise CheckpointError(
                    f"the checkpoint's .metadata stores pieces in {name!r}, a file plait.json does not record: "
                    f"refusing to read it. Fix: resume from another checkpoint, or restore this one from a copy."
                )
            problem = files.file_problem(path)
            if problem is not None:
                raise CheckpointError(
                    f"the checkpoint's .metadata stores pieces in {path}, which {problem}: plait reads only regular "
                    f"files inside the checkpoint's folder. Fix: restore the checkpoint from a copy."
                )
            sizes[name] = path.stat().st_size
        if info.offset + info.length > sizes[name]:
            raise CheckpointError(
                f"the checkpoint's .metadata places a piece at bytes {info.offset}..{info.offset + info.length} of "
                f"{name}, which has {sizes[name]} bytes. Fix: restore the checkpoint from a copy."
            )


def _recorded(folder: Path) -> set[str] | None:
    """The file names plait.json of ``folder`` records (None when it records none, or cannot be read)."""
    meta, _problems = integrity.read_meta(folder)
    return set(meta["files"]) if meta is not None and integrity.verified(meta) else None


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with ``.metadata`` read as plain data (``plait.checkpoint.metadata``), its pieces checked
    to lie in the folder's regular files (``check_storage``), and files opened by ``_RegularFiles``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self.fs = _RegularFiles()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        folder = Path(self.path)
        with files.open_regular(folder / integrity.DCP_METADATA, "checkpoint metadata", CheckpointError) as handle:
            metadata = metadata_reader.load(handle)
        check_storage(folder, metadata, _recorded(folder))
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
    try:
        with _quiet():
            dcp.load(
                state,
                storage_reader=SafeFileSystemReader(str(folder)),
                planner=PlaitLoadPlanner(),
                no_dist=no_dist or not distributed(),
            )
    except (CheckpointException, Exception) as error:  # DCP's is a BaseException; one line, never its advice
        raise failures.read_failed(error, folder) from None
