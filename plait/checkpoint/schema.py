"""plait.json's values checked for the types and ranges plait writes, before any of them is used.

A checksum only says that plait.json is the file that was sealed, not that whoever sealed it was plait. Every
value the loader, ``plait checkpoint verify`` or ``plait convert`` uses is therefore checked first: a step that is
not a whole number, a file size of -1 or "1459124" (a string), a file name with a ``/``, a digest that is not 64
hex digits each become one line naming the field, and the checkpoint counts as damaged. Unknown keys are left
alone (a later plait may add some).
"""

from __future__ import annotations

import re
from typing import Any

from plait.files import plain_name

HEX64 = re.compile(r"^[0-9a-f]{64}$")
RUN_ID = re.compile(r"^[0-9a-f]{32}$")
"""A run id (``catalog.new_run_id``): 32 lowercase hex digits."""
STEP_LIMIT = 2**63
"""Steps are below it: what a 64-bit counter (TensorBoard's, a tensor's) holds."""


def _whole(value: Any, minimum: int = 0) -> bool:
    return type(value) is int and value >= minimum


def _optional(meta: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> str | None:
    value = meta.get(key)
    if value is not None and not isinstance(value, kind):
        return f"{key} is a {type(value).__name__} ({str(value)[:40]!r})"
    return None


def file_record_problem(name: Any, record: Any) -> str | None:
    """What is wrong with one entry of ``files`` (None when it is a plain name with rank, bytes and sha256)."""
    problem = plain_name(name)
    if problem is not None:
        return f"files names {problem}"
    if not isinstance(record, dict):
        return f"files[{name!r}] is a {type(record).__name__}, not an object"
    if not _whole(record.get("rank")):
        return f"files[{name!r}].rank is {record.get('rank')!r}, not a rank (a whole number >= 0)"
    if not _whole(record.get("bytes")):
        return f"files[{name!r}].bytes is {record.get('bytes')!r}, not a size (a whole number >= 0)"
    if not isinstance(record.get("sha256"), str) or not HEX64.match(record["sha256"]):
        return f"files[{name!r}].sha256 is {str(record.get('sha256'))[:80]!r}, not 64 hex digits"
    return None


def _optimizer(value: Any) -> str | None:
    if value is None:
        return None
    groups = value.get("param_groups") if isinstance(value, dict) else None
    if not isinstance(groups, list):
        return "optimizer is not an object with a list of param_groups"
    for group in groups:
        names = group.get("names") if isinstance(group, dict) else None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            return "an optimizer param group has no list of parameter names"
        if not isinstance(group.get("hyper"), dict):
            return "an optimizer param group has no object of hyper-parameters"
    return None


def _tensors(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        return f"model_tensors is a {type(value).__name__}, not an object"
    for name, shape in value.items():
        if not isinstance(shape, list) or not all(_whole(n) for n in shape):
            return f"model_tensors[{name!r}] is {str(shape)[:60]}, not a shape (whole numbers >= 0)"
    return None


def problems(meta: dict[str, Any]) -> list[str]:
    """Every malformed value of plait.json ``meta`` (empty when it has the types and ranges plait writes)."""
    found = []
    step: Any = meta.get("step")
    if not (_whole(step) and step < STEP_LIMIT):
        found.append(f"step is {repr(step)[:40]}, not a whole number in [0, 2**63)")
    if meta.get("run") is not None and not (isinstance(meta["run"], str) and RUN_ID.match(meta["run"])):
        found.append(f"run is {repr(meta['run'])[:40]}, not a run id (32 hex digits)")
    if meta.get("world_size") is not None and not _whole(meta.get("world_size"), 1):
        found.append(f"world_size is {meta.get('world_size')!r}, not a whole number >= 1")
    for key in ("layout", "model", "lr_scheduler", "signature"):
        found.append(_optional(meta, key, dict) or "")
    found += [_optimizer(meta.get("optimizer")) or "", _tensors(meta.get("model_tensors")) or ""]
    records = meta.get("files")
    if records is not None and not isinstance(records, dict):
        found.append(f"files is a {type(records).__name__}, not an object")
    elif records is not None:
        found += [file_record_problem(name, record) or "" for name, record in records.items()]
    if "checksum" in meta and not (isinstance(meta["checksum"], str) and HEX64.match(meta["checksum"])):
        found.append("checksum is not 64 hex digits")
    return [line for line in found if line]


__all__ = ["RUN_ID", "STEP_LIMIT", "file_record_problem", "problems"]
