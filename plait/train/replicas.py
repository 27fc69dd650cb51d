"""``plait train`` under per-step fault tolerance (``plait.ft``): what a replica group's run changes.

A group is a job of its own (its own world, its layout with dp / R data ranks), but it reads the data of a job of
R x its data ranks: in data slot s it reads data rank s x D + d of D x R (d: the rank's data index in the group),
so the R slots together train exactly the global batch the configuration names. Which group trains slot s is the
quorum's choice at each step (``plait.ft.session``: its place in the quorum; a spare group takes a lost group's
slot); data is a pure function of (seed, step, data rank), so whichever group reads slot s at step s reads what
an uninterrupted run would have read.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from plait.data import ShardedBatches
from plait.errors import ConfigError
from plait.ft.log import FINGERPRINT
from plait.ft.options import FTOptions
from plait.parallel.semisync import SemiSync
from plait.train.config import RunConfig, TrainConfig
from plait.train.fault import restart_count

STARTS = "starts.jsonl"
"""Every start of a rank of the group (rank, pid, restart attempt): which processes ran it, and which were replaced."""

NOT_TRAINING = (
    "out",
    "steps",
    "log_every",
    "eval_every",
    "eval_batches",
    "save_every",
    "keep_checkpoints",
    "keep_every",
    "tensorboard",
    "samples",
    "sample_tokens",
    "async_save",
)
"""Settings that do not change what a step computes: replica groups (and a replay) may differ in them."""


def fingerprint(config: RunConfig) -> dict[str, Any]:
    """What every replica group of one job must share: the model, data, layout and the training settings that
    change a step (a group started with anything else is refused when it heals)."""
    whole = config.to_dict()
    whole["train"] = {k: v for k, v in whole.get("train", {}).items() if k not in NOT_TRAINING}
    return json.loads(json.dumps(whole, sort_keys=True, default=str))


class SlotBatches:
    """The batches of every data slot, for one rank of a replica group (module docstring): ``batch_at(slot, step)``.
    Each slot's loader is built when the group first trains that slot (a loader is a few integers)."""

    def __init__(self, dataset: Any, global_batch: int, index: int, size: int, slots: int, start_step: int) -> None:
        self.dataset, self.global_batch, self.index, self.size = dataset, global_batch, index, size
        self.slots, self.start_step = slots, start_step
        self._loaders: dict[int, ShardedBatches] = {}

    def batch_at(self, slot: int, step: int) -> Any:
        if not 0 <= slot < self.slots:
            raise ValueError(f"data slot {slot} outside 0..{self.slots - 1}")
        if slot not in self._loaders:
            rank = slot * self.size + self.index
            self._loaders[slot] = ShardedBatches(
                self.dataset, self.global_batch, rank, self.slots * self.size, start_step=self.start_step
            )
        return self._loaders[slot].batch_at(step)


def engine_sync(train: TrainConfig) -> SemiSync | None:
    """The ``SemiSync`` the engine itself runs: ``train.semisync()``, except under fault tolerance, where a group's
    engine trains synchronously inside the group and its session runs the outer step over the quorum
    (``plait.ft.outer``)."""
    return None if FTOptions.from_env() is not None else train.semisync()


def start(config: RunConfig, engine: Any, world: Any, run_dir: Path) -> Any:
    """The group's ``FaultTolerantSteps`` when the environment asks for fault tolerance, else None; rank 0 of the
    group records the job's fingerprint in its folder (``plait.ft.log`` merges it)."""
    options = FTOptions.from_env()
    if options is None:
        return None
    from plait.ft.session import FaultTolerantSteps

    sync = config.train.semisync()
    if sync is not None and config.train.steps % sync.every:
        raise ConfigError(
            f"--ft with train.sync={config.train.sync!r}: train.steps={config.train.steps} ends inside a window of "
            f"train.sync_every={sync.every} steps, which no quorum would commit. Fix: train.steps a multiple of "
            f"{sync.every} (e.g. {max(sync.every, config.train.steps // sync.every * sync.every)})."
        )
    print_ = fingerprint(config)
    run_dir.mkdir(parents=True, exist_ok=True)
    if world.rank == 0:
        (run_dir / FINGERPRINT).write_text(json.dumps(print_, indent=1, sort_keys=True))
    start = {"rank": world.rank, "pid": os.getpid(), "attempt": restart_count(), "time": round(time.time(), 3)}
    with open(run_dir / STARTS, "a") as handle:  # one short line per write: appends of ranks do not interleave
        handle.write(json.dumps(start) + "\n")
    return FaultTolerantSteps(options, engine, world, print_, sync)


__all__ = ["SlotBatches", "engine_sync", "fingerprint", "start"]
