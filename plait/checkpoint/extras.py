"""What a checkpoint keeps beside the tensors: optimizer hyper-parameters and the lr scheduler (JSON, in
plait.json) and each rank's random generators (tensors, in ``rng-rank<R>.safetensors``).

Random states are restored only when the loading job has the saved layout and world size (the same rank then
continues the same stream, so dropout draws the same masks as an uninterrupted run); under another layout the
new job's seeds stay, and the load says so.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import torch

from plait import files
from plait.logging import get_logger

log = get_logger(__name__)


def to_json(value: Any) -> Any:
    """``value`` with tensors as numbers / lists and tuples as lists (what json.dumps accepts)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value if not (isinstance(value, float) and not math.isfinite(value)) else str(value)
    raise TypeError(f"{type(value).__name__} is not representable in a checkpoint's JSON")


def _like(saved: Any, current: Any) -> Any:
    """``saved`` (from JSON) in the type of ``current``: tensors filled in place, lists back to tuples."""
    if isinstance(current, torch.Tensor):
        current.copy_(torch.as_tensor(saved, dtype=current.dtype))
        return current
    if isinstance(current, tuple) and isinstance(saved, list):
        return tuple(saved)
    if isinstance(current, float) and isinstance(saved, str):
        return float(saved)
    return saved


def param_groups(optimizer: torch.optim.Optimizer, names: list[list[str]]) -> list[dict[str, Any]]:
    """The hyper-parameters of each param group with the parameter names it steps."""
    out = []
    for group, members in zip(optimizer.param_groups, names):
        hyper = {}
        for key, value in group.items():
            if key == "params":
                continue
            try:
                hyper[key] = to_json(value)
            except TypeError:
                log.warning("optimizer hyper-parameter %r (%s) is not saved", key, type(value).__name__)
        out.append({"names": members, "hyper": hyper})
    return out


def load_param_groups(optimizer: torch.optim.Optimizer, names: list[list[str]], saved: list[dict[str, Any]]) -> None:
    """Set each group's hyper-parameters from the saved group that holds its first parameter."""
    where = {name: entry["hyper"] for entry in saved for name in entry["names"]}
    for group, members in zip(optimizer.param_groups, names):
        hyper = next((where[name] for name in members if name in where), None)
        if hyper is None:
            log.warning("no saved hyper-parameters for the param group of %s: keeping the current ones", members[:3])
            continue
        for key, value in hyper.items():
            if key != "params":
                group[key] = _like(value, group.get(key))


def scheduler_state(scheduler: Any) -> Any:
    return None if scheduler is None else to_json(scheduler.state_dict())


def load_scheduler(scheduler: Any, saved: Any) -> None:
    if scheduler is None:
        return
    if saved is None:
        log.info("the checkpoint has no lr scheduler state: the scheduler starts over")
        return
    current = scheduler.state_dict()
    scheduler.load_state_dict({k: _like(v, current.get(k)) for k, v in saved.items()})


# ----------------------------------------------------------------- random generators
def rng_file(folder: Path, rank: int) -> Path:
    return folder / f"rng-rank{rank:05d}.safetensors"


def save_rng(folder: Path, rank: int) -> None:
    """This rank's torch CPU (and CUDA) generator and Python ``random`` state as tensors."""
    from safetensors.torch import save_file

    version, internal, gauss = random.getstate()
    tensors = {"torch_cpu": torch.get_rng_state(), "python": torch.tensor(internal, dtype=torch.int64)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["torch_cuda"] = torch.cuda.get_rng_state()
    save_file(tensors, str(rng_file(folder, rank)), metadata={"python_version": str(version), "gauss": repr(gauss)})


def load_rng(folder: Path, rank: int) -> bool:
    """Restore what ``save_rng`` wrote for ``rank``; False (with a warning when it is malformed: one rank must not
    fail alone) when the file is missing, not a regular file or not a generator state."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    path = rng_file(folder, rank)
    problem = files.file_problem(path)
    if problem is not None:
        if problem != "is missing":
            log.warning("%s %s: random generators not restored", path, problem)
        return False
    try:
        tensors = load_file(str(path))
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
        gauss = meta.get("gauss", "None")
        python = (
            int(meta.get("python_version", 3)),
            tuple(int(v) for v in tensors["python"].tolist()),
            None if gauss == "None" else float(gauss),
        )
        torch.set_rng_state(tensors["torch_cpu"])
        if "torch_cuda" in tensors and torch.cuda.is_available():
            torch.cuda.set_rng_state(tensors["torch_cuda"])
        random.setstate(python)
    except (SafetensorError, KeyError, ValueError, TypeError, RuntimeError) as error:
        log.warning("%s is not a random generator state (%s): random generators not restored", path, error)
        return False
    return True
