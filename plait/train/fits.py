"""Refuse a run that cannot fit this machine or its data, before anything is allocated (``check_run_fits``).

A typo such as ``model.n_layer=100000``, ``train.global_batch=100000000`` or a crafted ``config.json`` would
otherwise allocate until the allocator fails (a host swapping for minutes, an OOM kill with no word). So before the
model is built, on every rank and in the launcher before any process starts:

* the planner's estimate of one rank's peak (``plait.planner.memory.estimate_memory``: parameters, gradients,
  optimizer states and a training step's activations for this layout, optimizer, micro-batch and sequence length)
  times the ranks that share the memory is compared with what this machine has: host RAM for CPU ranks (the smaller
  of physical memory and the cgroup's limit), the GPU's memory on CUDA (split among the ranks sharing a GPU);
  an estimate above it is refused, naming both figures and the fix. The comparison is with the whole memory, not
  with what is free now, so only a run that cannot fit on an idle machine is refused (no false alarms from other
  jobs, or from peer ranks that started allocating first);
* a global batch larger than the samples the data holds (a token folder's windows, a text file's offsets) is
  refused: every step would repeat samples. (``data.seq_len`` is bounded by the data where it is opened.)

A model the planner cannot describe (an architecture ``plait.planner.hf_config`` does not cost) is not checked:
nothing is refused that cannot be estimated. The planner does not import this module (layers point down).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from plait.errors import ConfigError
from plait.layout import Layout
from plait.logging import get_logger
from plait.models.spec import ModelSpec

log = get_logger(__name__)
GIB = float(1 << 30)
_STATE_KIND = {
    "adamw": "adamw",
    "adam": "adam",
    "nadam": "adam",
    "radam": "adam",
    "adamax": "adam",
    "adagrad": "adagrad",
}
"""The estimator's optimizer kind of each ``train.optimizer`` (fp32 state tensors per element; sgd and rmsprop
depend on the momentum: ``_optimizer_kind``)."""


def model_spec(section: Mapping[str, Any], vocab_size: int, seq_len: int) -> ModelSpec | None:
    """The ``ModelSpec`` of a run's ``[model]`` section (no weights built), or None when the planner cannot
    describe it (the check is then skipped)."""
    from plait.models.build import is_hf_section, model_config

    if not is_hf_section(section):
        return ModelSpec.from_gpt_config(model_config(section, vocab_size, seq_len))
    from plait.models.hf_load import section_fields
    from plait.planner.hf_config import spec_from_hf_dict

    source, _, fields = section_fields(section)  # a num_hidden_layers slice: the planner costs its layers only
    try:
        return spec_from_hf_dict(fields, str(source), source.stem, seq_len)
    except (ValueError, TypeError, OverflowError) as error:  # ConfigError too: a family the planner does not cost
        log.debug("no memory estimate for %s: %s", source, error)
        return None


def _optimizer_kind(train: Any) -> str:
    if train.optimizer in ("sgd", "rmsprop"):
        return {"sgd": "sgd_momentum", "rmsprop": "adam"}[train.optimizer] if train.momentum else train.optimizer
    return _STATE_KIND.get(train.optimizer, "adamw")


def _cgroup_limit() -> float | None:
    """The memory limit of this process's cgroup (v2, then v1), or None when there is none."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # v1 writes a huge number for "no limit"
            return float(text)
    return None


def host_memory() -> float | None:
    """Bytes of host RAM this process may use: physical memory, or the cgroup's limit when smaller (None: unknown)."""
    try:
        physical = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None
    limit = _cgroup_limit()
    return min(physical, limit) if limit else physical


def available(device: torch.device, local_ranks: int) -> tuple[float | None, int, str]:
    """(bytes, ranks sharing them, what they are) for ranks on ``device``; ``local_ranks`` ranks run on this host."""
    if device.type == "cuda":
        total = float(torch.cuda.get_device_properties(device).total_memory)
        sharing = max(1, math.ceil(local_ranks / max(1, torch.cuda.device_count())))
        return total, sharing, f"{torch.cuda.get_device_name(device)}'s memory"
    return host_memory(), max(1, local_ranks), "host RAM"


def check_memory(
    config: Any, layout: Layout, vocab_size: int, seq_len: int, device: torch.device, local_ranks: int
) -> None:
    """ConfigError when the estimate of a rank's peak times the ranks sharing the memory exceeds what this machine
    has (module docstring). ``layout`` is resolved; ``config`` a ``RunConfig``."""
    from plait.planner.memory import estimate_memory

    spec = model_spec(config.model, vocab_size, seq_len)
    memory, sharing, what = available(device, local_ranks)
    if spec is None or memory is None:
        return
    micro = layout.check_batch(config.train.global_batch)
    shape = {"batch": micro, "seq": seq_len, "loss_chunk": config.train.loss_chunk}
    estimate = estimate_memory(spec, layout, _optimizer_kind(config.train), activations=shape, device=device.type)
    need = estimate.reserved + (estimate.host if device.type == "cpu" else 0.0)
    if need * sharing <= memory:
        return
    ranks = f", {need * sharing / GIB:,.1f} GiB for the {sharing} ranks sharing it" if sharing > 1 else ""
    raise ConfigError(
        f"this run needs about {need / GIB:,.1f} GiB per rank{ranks} ({spec.parameters / 1e6:,.1f} M parameters, "
        f"micro-batch {micro} x {seq_len} tokens: plait.planner's estimate of the {estimate.peak_phase} phase), but "
        f"{what} is {memory / GIB:,.1f} GiB. Fix: a smaller model or train.global_batch, more layout.microbatches, "
        f"recomputation (layout.recompute), chunked cross-entropy (train.loss_chunk) or ZeRO / more ranks (plait plan "
        f"suggests a layout)."
    )


def check_batch_fits_data(global_batch: int, dataset: Any, where: str) -> None:
    """ConfigError when the global batch is larger than the distinct samples ``dataset`` holds (a synthetic task,
    which has no end, is not bounded)."""
    samples = getattr(dataset, "num_windows", None) or getattr(dataset, "num_offsets", None)
    if isinstance(samples, int) and global_batch > samples:
        raise ConfigError(
            f"train.global_batch={global_batch} is larger than the {samples:,} samples of {where} (windows of "
            f"data.seq_len={dataset.seq_len} tokens): every step would repeat samples. Fix: train.global_batch <= "
            f"{samples:,}, a smaller data.seq_len, or more data."
        )


def local_world_size() -> int:
    """The ranks on this host: torchrun's ``LOCAL_WORLD_SIZE`` (1 outside torchrun)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)


def check_run_fits(config: Any, layout: Layout, dataset: Any, device: torch.device, local_ranks: int) -> None:
    """Both checks of the module docstring, before the model is built (every rank, and the launcher)."""
    check_batch_fits_data(config.train.global_batch, dataset, config.data.path or config.data.name)
    check_memory(config, layout, dataset.vocab_size, dataset.seq_len, device, local_ranks)


__all__ = [
    "available",
    "check_batch_fits_data",
    "check_memory",
    "check_run_fits",
    "host_memory",
    "local_world_size",
    "model_spec",
]
