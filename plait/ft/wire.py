"""A nested state (dicts and lists of tensors, numbers, strings, booleans and None) as bytes, and back, without
pickle: the tensors as one safetensors buffer, the rest as JSON in its ``__metadata__``.

Healing (``plait.ft.transport``) sends a live replica's state over the network with it; a receiver parses the
safetensors header (JSON) and copies raw bytes into tensors of the dtypes and shapes the header names, so a
hostile or corrupt message can fail to parse but never runs code (docs/security.md). Tensors are addressed by
their path in the tree (``"model/3"``); the JSON tree holds ``{"$tensor": path}`` where they were, and dictionary
keys keep their type (JSON keys are strings; a torch optimizer state is keyed by ints), as ``[key, value]`` pairs.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from plait.errors import PlaitError

MAX_HEADER = 100 * 2**20
"""A header longer than this is refused before it is read (safetensors' own limit is the same)."""


class WireError(PlaitError):
    """A message that does not parse as a plait state (truncated, corrupt or not plait's)."""


def _encode(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors[path] = value.detach().to("cpu", copy=True).contiguous()  # own storage: views share theirs
        return {"$tensor": path}
    if isinstance(value, dict):
        items = enumerate(value.items())
        return {"$dict": [[key, _encode(item, f"{path}/{index}", tensors)] for index, (key, item) in items]}
    if isinstance(value, (list, tuple)):
        return {"$list": [_encode(item, f"{path}/{index}", tensors) for index, item in enumerate(value)]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise WireError(
        f"{path or 'the state'} holds a {type(value).__name__}: only tensors, numbers, strings and containers travel"
    )


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if "$tensor" in value:
            if value["$tensor"] not in tensors:
                raise WireError(f"the message names tensor {value['$tensor']!r} but does not hold it")
            return tensors[value["$tensor"]]
        if "$dict" in value:
            return {_key(key): _decode(item, tensors) for key, item in value["$dict"]}
        if "$list" in value:
            return [_decode(item, tensors) for item in value["$list"]]
        raise WireError(f"unknown node {sorted(value)[:3]} in the message")
    return value


def _key(key: Any) -> Any:
    if isinstance(key, (str, int, float, bool)) or key is None:
        return key
    raise WireError(f"a dictionary key of type {type(key).__name__} in the message")


def dumps(state: Any) -> bytes:
    """``state`` as bytes (the module docstring's format)."""
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(state, "", tensors)
    return save_tensors(tensors, metadata={"plait.tree": json.dumps(tree, allow_nan=True)})


def loads(data: bytes) -> Any:
    """The state ``dumps`` wrote (WireError for anything else)."""
    if len(data) < 8:
        raise WireError(f"a message of {len(data)} bytes is shorter than its header length")
    (length,) = struct.unpack("<Q", data[:8])
    if length > min(MAX_HEADER, len(data) - 8):
        raise WireError(f"the message's header claims {length} bytes of {len(data) - 8}")
    try:
        header = json.loads(data[8 : 8 + length])
        tree = json.loads(header.get("__metadata__", {}).get("plait.tree", "null"))
        tensors = load_tensors(data)
    except (ValueError, TypeError, AttributeError, RuntimeError, SafetensorError) as error:
        raise WireError(f"the message does not parse: {error}") from error
    return _decode(tree, tensors)


__all__ = ["WireError", "dumps", "loads"]
