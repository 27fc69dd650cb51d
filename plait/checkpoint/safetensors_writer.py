"""Write a safetensors file one tensor at a time (``plait convert``'s exports stream: never a whole model in memory).

safetensors is an 8-byte little-endian header length N, N bytes of JSON (per tensor its ``dtype``, ``shape`` and
``data_offsets`` [begin, end) into the data that follows, plus ``__metadata__``: string values) and the tensors'
raw bytes, end to end, in the order of their offsets. The header needs only names, dtypes and shapes, so it is
written first (padded with spaces to a multiple of 8 bytes, as the safetensors library writes it) and each
tensor's bytes are then appended as it is read (``fill``: one tensor in memory at a time). The library reads the
result (``safe_open``, ``load_file``, transformers' ``from_pretrained``).

``shards`` groups tensors into files of at most ``max_bytes`` (a tensor larger than that gets a file of its own),
as ``save_pretrained`` shards a model with an index (``model-00001-of-00003.safetensors`` +
``model.safetensors.index.json``; one ``model.safetensors`` when everything fits one file).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch

DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip
Spec = tuple[torch.dtype, tuple[int, ...]]


def nbytes(spec: Spec) -> int:
    return math.prod(spec[1]) * spec[0].itemsize


def write(
    path: Path, specs: dict[str, Spec], read: Callable[[str], torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """Write ``path`` with the tensors of ``specs`` (name -> (dtype, shape)), in that order, each fetched by
    ``read(name)`` just before its bytes are written and dropped right after."""
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, (dtype, shape) in specs.items():
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor {name!r} has dtype {dtype}, which safetensors cannot store")
        size = nbytes((dtype, shape))
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as handle:
        handle.write(len(encoded).to_bytes(8, "little"))
        handle.write(encoded)
        for name, (dtype, shape) in specs.items():
            tensor = read(name)
            if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
                raise ValueError(
                    f"tensor {name!r} came back as {tensor.dtype} {tuple(tensor.shape)}, not {dtype} {shape}"
                )
            handle.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del tensor


def shards(specs: dict[str, Spec], max_bytes: int) -> list[dict[str, Spec]]:
    """``specs`` split, in order, into groups of at most ``max_bytes`` each (a larger tensor alone)."""
    groups: list[dict[str, Spec]] = [{}]
    size = 0
    for name, spec in specs.items():
        if groups[-1] and size + nbytes(spec) > max_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = spec
        size += nbytes(spec)
    return groups


def write_sharded(
    folder: Path,
    specs: dict[str, Spec],
    read: Callable[[str], torch.Tensor],
    max_bytes: int,
    metadata: dict[str, str] | None = None,
) -> list[str]:
    """The tensors of ``specs`` as ``model.safetensors``, or as shards and an index when they exceed
    ``max_bytes`` (module docstring); the names of the files written."""
    groups = shards(specs, max_bytes)
    if len(groups) == 1:
        write(folder / "model.safetensors", specs, read, metadata)
        return ["model.safetensors"]
    names = [f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors" for index in range(len(groups))]
    weight_map = {}
    for name, group in zip(names, groups):
        write(folder / name, group, read, metadata)
        weight_map.update(dict.fromkeys(group, name))
    index = {"metadata": {"total_size": sum(nbytes(spec) for spec in specs.values())}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return [*names, "model.safetensors.index.json"]


__all__ = ["DTYPE_NAMES", "nbytes", "shards", "write", "write_sharded"]
