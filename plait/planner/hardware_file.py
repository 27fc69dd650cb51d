"""A custom cluster for ``plait plan / simulate --hardware FILE.toml``: a TOML file (read with ``tomllib``: data
only, nothing executed) describing one device and the network levels around it.

    name = "my-cluster"
    base = "h100"                     # optional: start from a catalogue entry; the keys below override it
    peak_tflops = 989                 # dense bf16/fp16 (a table {bf16 = .., fp16 = .., fp32 = ..} also works)
    memory_gb = 80
    memory_bandwidth_tb_s = 3.35
    generation = "hopper"             # picks the fitted compute efficiency, or give compute_efficiency = 0.55
    host_bandwidth_gb_s = 50          # PCIe to the host (offload)
    [[levels]]                        # innermost first; bandwidth per device, one direction
    name = "nvlink"
    devices = 8                       # devices this level joins (the first level's is devices_per_node)
    bandwidth_gb_s = 450
    latency_us = 5
    [[levels]]
    name = "leaf"
    devices = 256
    bandwidth_gb_s = 50
    latency_us = 10
    [[levels]]
    name = "spine"                    # the last level joins everything: no devices key
    bandwidth_gb_s = 50
    latency_us = 20
    oversubscription = 2              # 2:1 oversubscribed uplinks: half the bandwidth across the spine

Every problem (unknown key, missing figure, a number that is not positive, levels not growing) is a ConfigError
naming the file, the key and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path
from typing import Any

from plait.errors import ConfigError
from plait.planner.hardware import CATALOGUE, GB, GENERATION_EFFICIENCY, TB, Hardware, NetworkLevel

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

TOP_KEYS = {
    "name": "a name for the cluster",
    "base": f"a catalogue entry to start from ({', '.join(CATALOGUE)})",
    "peak_tflops": "dense bf16/fp16 TFLOP/s per device, or a table by precision",
    "memory_gb": "device memory, GB",
    "memory_bandwidth_tb_s": "device memory bandwidth, TB/s",
    "generation": f"GPU generation ({', '.join(GENERATION_EFFICIENCY)}): picks the fitted compute efficiency",
    "compute_efficiency": "achieved / peak FLOP/s of training matmuls (0 < x <= 1)",
    "host_bandwidth_gb_s": "device <-> host bandwidth (PCIe), GB/s",
    "host_memory_gb": "host RAM per device, GB",
    "host_memory_bandwidth_gb_s": "host DRAM bandwidth per device, GB/s",
    "nvme_bandwidth_gb_s": "NVMe bandwidth per device, GB/s",
    "split_backward": "zero-bubble's (I + W) / B (1.0 on GPUs)",
    "levels": "the network levels, innermost first ([[levels]] tables)",
}
LEVEL_KEYS = ("name", "devices", "bandwidth_gb_s", "latency_us", "oversubscription")


def load_hardware_toml(path: str | Path) -> Hardware:
    """The ``Hardware`` a TOML file describes (module docstring)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(
            f"cannot read hardware file {path}: {error}. Fix: give a TOML file (docs/planner.md)."
        ) from error
    return hardware_from_dict(data, str(path))


def _number(where: str, key: str, value: Any, *, at_most: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= at_most:
        bound = f" and <= {at_most:g}" if math.isfinite(at_most) else ""
        raise ConfigError(f"{where}: {key} = {value!r} must be a number > 0{bound}. Fix: give {key} as such a number.")
    return float(value)


def hardware_from_dict(data: dict[str, Any], where: str) -> Hardware:
    """``load_hardware_toml`` on parsed data; ``where`` names the source in errors."""
    unknown = sorted(set(data) - set(TOP_KEYS))
    if unknown:
        listing = "; ".join(f"{key}: {text}" for key, text in TOP_KEYS.items())
        raise ConfigError(f"{where}: unknown key(s) {unknown}. Fix: use only these keys: {listing}.")
    base_name = data.get("base")
    if base_name is not None and base_name not in CATALOGUE:
        raise ConfigError(
            f"{where}: base = {base_name!r} is not in the catalogue. Fix: use one of {', '.join(CATALOGUE)}."
        )
    base = CATALOGUE[base_name] if base_name else None
    if base is None:
        missing = [k for k in ("peak_tflops", "memory_gb", "memory_bandwidth_tb_s", "levels") if k not in data]
        if missing:
            raise ConfigError(
                f"{where}: {', '.join(missing)} missing. Fix: give them, or start from a catalogue entry with "
                f'base = "h100" (any of {", ".join(CATALOGUE)}) and override what differs.'
            )
    if not isinstance(data.get("name", ""), str) or not data.get("name"):
        raise ConfigError(f'{where}: name is missing or not a string. Fix: e.g. name = "my-cluster".')
    fields: dict[str, Any] = {"name": data["name"], "source": f"{where}"}
    if "peak_tflops" in data:
        fields["peak_flops"] = _peak(where, data["peak_tflops"])
    for key, field, unit in (
        ("memory_gb", "memory_bytes", GB),
        ("memory_bandwidth_tb_s", "memory_bandwidth", TB),
        ("host_bandwidth_gb_s", "host_bandwidth", GB),
        ("host_memory_gb", "host_memory_bytes", GB),
        ("host_memory_bandwidth_gb_s", "host_memory_bandwidth", GB),
        ("nvme_bandwidth_gb_s", "nvme_bandwidth", GB),
        ("split_backward", "split_backward", 1.0),
    ):
        if key in data:
            fields[field] = _number(where, key, data[key]) * unit
    generation = data.get("generation", base.generation if base else "")
    if "generation" in data and generation not in GENERATION_EFFICIENCY:
        raise ConfigError(
            f"{where}: generation = {generation!r} is unknown. Fix: use one of {', '.join(GENERATION_EFFICIENCY)}, "
            f"or give compute_efficiency directly."
        )
    fields["generation"] = generation
    if "compute_efficiency" in data:
        fields["compute_efficiency"] = _number(where, "compute_efficiency", data["compute_efficiency"], at_most=1.0)
    elif generation:
        fields["compute_efficiency"] = GENERATION_EFFICIENCY[generation]
    else:
        raise ConfigError(
            f'{where}: no compute efficiency. Fix: set generation = "hopper" (or {", ".join(GENERATION_EFFICIENCY)}) '
            f"to use the fitted value, or compute_efficiency = 0.5 (achieved / peak FLOP/s of your matmuls)."
        )
    if "levels" in data:
        levels = _levels(where, data["levels"])
        first, last = levels[0], levels[-1]
        fields.update(
            levels=levels,
            devices_per_node=first.devices,
            intra_node_bandwidth=first.bandwidth,
            intra_node_latency=first.latency,
            inter_node_bandwidth=last.effective_bandwidth,
            inter_node_latency=last.latency,
        )
    if base is not None:
        return dataclasses.replace(base, **fields)
    return Hardware(**fields)


def _peak(where: str, value: Any) -> dict[str, float]:
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"bf16", "fp16", "fp32"})
        if unknown or not value:
            raise ConfigError(
                f"{where}: peak_tflops has {unknown or 'no'} precisions. Fix: give peak_tflops = {{bf16 = 989, "
                f"fp16 = 989, fp32 = 494}} (any of bf16, fp16, fp32) or one number for bf16 and fp16."
            )
        return {p: _number(where, f"peak_tflops.{p}", v) * TB for p, v in value.items()}
    peak = _number(where, "peak_tflops", value) * TB
    return {"bf16": peak, "fp16": peak, "fp32": peak / 2}


def _levels(where: str, value: Any) -> tuple[NetworkLevel, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(item, dict) for item in value):
        raise ConfigError(f"{where}: levels must be [[levels]] tables, innermost first. Fix: see docs/planner.md.")
    levels: list[NetworkLevel] = []
    for index, item in enumerate(value):
        at = f"{where}: levels[{index}]"
        unknown = sorted(set(item) - set(LEVEL_KEYS))
        if unknown:
            raise ConfigError(f"{at} has unknown key(s) {unknown}. Fix: use {', '.join(LEVEL_KEYS)}.")
        last = index == len(value) - 1
        devices = item.get("devices", 0 if last else None)
        if devices is None or isinstance(devices, bool) or not isinstance(devices, int) or devices < 0:
            raise ConfigError(
                f"{at}: devices = {devices!r}. Fix: give how many devices this level joins (a whole number; the "
                f"last level joins every device and may leave it out)."
            )
        if levels and devices and devices <= levels[-1].devices:
            raise ConfigError(
                f"{at}: devices = {devices} does not grow past the level inside it ({levels[-1].devices}). Fix: list "
                f"levels innermost first, each joining more devices."
            )
        if not last and devices == 0:
            raise ConfigError(f"{at}: only the last level may join every device (devices = 0). Fix: give its size.")
        for key in ("bandwidth_gb_s", "latency_us"):
            if key not in item:
                raise ConfigError(f"{at}: {key} missing. Fix: e.g. bandwidth_gb_s = 50, latency_us = 10.")
        over = _number(at, "oversubscription", item.get("oversubscription", 1.0))
        if over < 1:
            raise ConfigError(f"{at}: oversubscription = {over} < 1. Fix: 1 for a full-bisection level, 2 for 2:1, ...")
        levels.append(
            NetworkLevel(
                str(item.get("name", f"level{index}")),
                devices,
                _number(at, "bandwidth_gb_s", item["bandwidth_gb_s"]) * GB,
                _number(at, "latency_us", item["latency_us"]) * 1e-6,
                over,
            )
        )
    if levels[0].devices == 0:
        raise ConfigError(f"{where}: the first level must give its devices (the devices per node). Fix: devices = 8.")
    return tuple(levels)


__all__ = ["LEVEL_KEYS", "TOP_KEYS", "hardware_from_dict", "load_hardware_toml"]
