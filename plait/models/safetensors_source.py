"""Rectangles of the tensors of safetensors files, read with ``pread``-style reads of exactly their bytes.

``SafetensorsSource`` is the ``plait.parallel.materialize.WeightSource`` of a ``.safetensors`` file or of a
``save_pretrained`` folder's shards: a rank asks for the rectangles it keeps (rows of its ZeRO-3 shard, its tp
slice) and only their bytes are read, into the destination tensor (a buffer only when the file's dtype differs):
a rectangle spanning whole rows is one read, one cut along dim 1 one read per row. Nothing is memory-mapped, so a
rank's resident memory grows by what it keeps and nothing else (``benchmarks/startup_memory.py``).

safetensors is an 8-byte little-endian header length N, N bytes of JSON (per tensor: ``dtype``, ``shape``,
``data_offsets`` [begin, end) relative to the end of the header) and the raw bytes. Each file is validated by the
safetensors library when the source is made (``hf_load.safetensors_file``: a regular file, a consistent header)
and, at each read, opened with ``plait.files.open_regular`` (a regular file, no link, never blocking) and its header
parsed again from that same handle: every entry read is checked (its dtype known, its bytes inside the file and
as many as its shape needs), so a file swapped or truncated since is one ``ConfigError`` line. Reading never runs
code.
"""

from __future__ import annotations

import io
import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from plait import files, hf_folders
from plait.errors import ConfigError
from plait.models.hf_load import check_weights_folder, safetensors_file, weight_files

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip
MAX_HEADER = 100 << 20
"""safetensors' own limit on the header's size."""
Request = tuple[str, tuple[slice, ...], torch.Tensor]


def _header(handle: io.BufferedReader, path: Path) -> tuple[dict[str, Any], int, int]:
    """(the header's entries, where the data starts, the data's length) of the open file ``handle``."""
    size = os.fstat(handle.fileno()).st_size
    raw = handle.read(8)
    length = int.from_bytes(raw, "little") if len(raw) == 8 else -1
    if not 0 < length <= min(MAX_HEADER, size - 8):
        raise _invalid(path, "its header length does not fit the file")
    try:
        header = json.loads(handle.read(length))
    except (ValueError, RecursionError):
        raise _invalid(path, "its header is not JSON") from None
    if not isinstance(header, dict):
        raise _invalid(path, "its header is not a JSON object")
    return header, 8 + length, size - 8 - length


def _invalid(path: Path, reason: str) -> ConfigError:
    return ConfigError(
        f"{path} is not a valid safetensors file ({reason}). Fix: export or save it again (plait convert, "
        f"save_pretrained(safe_serialization=True)), or restore it from a copy."
    )


def _entry(header: dict[str, Any], name: str, data: int, path: Path) -> tuple[torch.dtype, tuple[int, ...], int]:
    """(dtype, shape, offset of the first byte in the file) of ``name``, checked against the file."""
    entry = header.get(name)
    if not isinstance(entry, dict):
        raise _invalid(path, f"it has no tensor {name!r} now")
    dtype, shape, offsets = DTYPES.get(str(entry.get("dtype"))), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise _invalid(path, f"tensor {name!r} has a malformed shape")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets):
        raise _invalid(path, f"tensor {name!r} has malformed data_offsets")
    if dtype is None:
        raise _invalid(path, f"tensor {name!r} has a dtype plait does not read")
    begin, end = offsets
    dims = tuple(shape)
    if not 0 <= begin <= end <= data or end - begin != math.prod(dims) * dtype.itemsize:
        raise _invalid(path, f"tensor {name!r} claims bytes the file does not hold")
    return dtype, dims, begin


def _read_into(handle: io.BufferedReader, at: int, out: torch.Tensor, path: Path) -> None:
    """Fill the contiguous tensor ``out`` with the bytes at ``at``."""
    view = out.reshape(-1).view(torch.uint8).numpy().data
    handle.seek(at)
    done = 0
    while done < len(view):
        got = handle.readinto(view[done:])
        if not got:
            raise _invalid(path, "it ends before a tensor's bytes")
        done += got


def read_box(
    handle: io.BufferedReader,
    entry: tuple[torch.dtype, tuple[int, ...], int],
    index: tuple[slice, ...],
    out: torch.Tensor,
    path: Path,
) -> None:
    """``out`` = the rectangle ``index`` (one slice per dim) of the tensor ``entry`` of the open file."""
    dtype, shape, start = entry
    buffer = out if out.dtype == dtype and out.is_contiguous() else torch.empty(out.shape, dtype=dtype)
    bounds = [(s.start or 0, shape[d] if s.stop is None else s.stop) for d, s in enumerate(index)]
    if any(not 0 <= lo <= hi <= shape[d] for d, (lo, hi) in enumerate(bounds)):
        raise ValueError(f"rectangle {index} is outside the tensor of shape {shape}")
    row = math.prod(shape[1:]) * dtype.itemsize
    whole_rows = all(bounds[d] == (0, shape[d]) for d in range(1, len(shape)))
    if not shape or whole_rows:
        _read_into(handle, start + (bounds[0][0] * row if shape else 0), buffer, path)
    elif len(shape) == 2:
        (r0, r1), (c0, _c1) = bounds
        for r in range(r0, r1):
            _read_into(handle, start + r * row + c0 * dtype.itemsize, buffer[r - r0], path)
    else:  # a cut past dim 1 of a 3-d or larger tensor: read its rows whole, keep the rectangle
        rows = torch.empty((bounds[0][1] - bounds[0][0], *shape[1:]), dtype=dtype)
        _read_into(handle, start + bounds[0][0] * row, rows, path)
        buffer.copy_(rows[(slice(None),) + tuple(index[1:])])
    if buffer is not out:
        out.copy_(buffer)


class SafetensorsSource:
    """The tensors of safetensors files (one file, or a ``save_pretrained`` folder's shards), read by rectangle
    (module docstring)."""

    def __init__(self, paths: list[Path], description: str) -> None:
        self.description = description
        self.paths = paths
        self._where: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self.header: dict[str, str] = {}
        """The first file's string metadata (``__metadata__``: plait convert's record of the model)."""
        for path in paths:
            with safetensors_file(path) as handle:
                self.header = self.header or dict(handle.metadata() or {})
                for name in handle.keys():
                    if name in self._where:
                        raise ConfigError(
                            f"{description}: tensor {name!r} is in both {self._where[name].name} and {path.name}. "
                            f"Fix: save the model again with save_pretrained."
                        )
                    self._where[name] = path
                    self._shapes[name] = tuple(handle.get_slice(name).get_shape())

    @classmethod
    def of_folder(cls, folder: Path) -> SafetensorsSource:
        """The weights of a ``save_pretrained`` folder (``check_weights_folder``, then ``weight_files``)."""
        check_weights_folder(folder)
        paths = [hf_folders.resolve(folder, name) for name in weight_files(folder)]  # hub-cache links to blobs
        return cls(paths, f"the Hugging Face folder {folder}")

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def read(self, requests: list[Request]) -> None:
        by_file: dict[Path, list[Request]] = {}
        for request in requests:
            by_file.setdefault(self._where[request[0]], []).append(request)
        for path, wanted in by_file.items():
            with files.open_regular(path, "safetensors file") as handle:
                header, data, length = _header(handle, path)
                for name, index, out in wanted:
                    entry = _entry(header, name, length, path)
                    if entry[1] != self._shapes[name]:
                        raise _invalid(path, f"tensor {name!r} changed shape since it was opened")
                    read_box(handle, (entry[0], entry[1], data + entry[2]), index, out, path)


__all__ = ["SafetensorsSource", "read_box"]
