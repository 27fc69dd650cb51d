"""Fault-tolerant jobs for the tests (``plait train --ft``): run one, read what it did, and train one device on
exactly the batches it committed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from helpers.processes import ENV

from plait.data import ShardedBatches
from plait.distributed import World
from plait.ft.log import ReplayLog, replica_dir
from plait.train.config import load_config
from plait.train.loop import build

SETTINGS = [
    "layout.dp_replicate=2",
    "layout.zero=3",
    "model.n_layer=4",
    "model.d_model=128",
    "train.eval_every=0",
    "train.samples=0",
    "train.max_grad_norm=0.5",  # clipped: a uniform gradient-scale error would hide under an unclipped Adam
    "train.lr=5e-4",  # at 3e-3 this tiny model's training is chaotic: rounding grows to 1e-2 in 150 steps
]
"""HSDP with two replica groups of 2 ranks, ZeRO-3 inside each; a model big enough that a restarted group comes
back (about 15 s on a busy 2-core machine) while the live group still trains (about 0.2 s per step)."""
FT_ENV = {**ENV, "PLAIT_FT_HEARTBEAT_MS": "2000", "PLAIT_FT_TIMEOUT_S": "30"}


def run_ft(
    out: Path, steps: int, extra: list[str] = (), env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """``plait train --ft`` on 4 local processes (2 groups of 2) into ``out``."""
    command = [sys.executable, "-m", "plait", "train", "--ft", "--nproc", "4", "--out", str(out), "--max-restarts", "1"]
    for setting in [*SETTINGS, f"train.steps={steps}", f"train.save_every={steps}"]:
        command += ["--set", setting]
    return subprocess.run(
        command + list(extra), env={**FT_ENV, **(env or {})}, capture_output=True, text=True, timeout=timeout
    )


def starts(out: Path, group: int) -> list[dict]:
    """Every start of a rank of ``group`` (rank, pid, attempt)."""
    return [json.loads(line) for line in (replica_dir(out, group) / "starts.jsonl").read_text().splitlines()]


def step_records(out: Path, group: int) -> dict[int, dict]:
    path = replica_dir(out, group) / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in records if "ft_groups" in r}


def one_device(out: Path, steps: int) -> dict[str, torch.Tensor]:
    """One process trained, at each step, on the rows of the global batch that the committed groups read
    (group g of R: rows [g G/R, (g+1) G/R)); returns its parameters."""
    log = ReplayLog.read(out)
    config = load_config(replica_dir(out, 0) / "config.toml", ["layout.dp=1", "layout.zero=0", "train.out=''"])
    engine, dataset, _ = build(config, World(0, 1, 0, torch.device("cpu"), None))
    global_batch, groups = config.train.global_batch, log.group_count
    batches = ShardedBatches(dataset, global_batch, 0, 1)
    share = global_batch // groups
    for step in range(1, steps + 1):
        inputs, targets = batches.batch_at(step - 1)
        rows = torch.cat([torch.arange(g * share, (g + 1) * share) for g in log.groups(step)])
        engine.train_step((inputs[rows], targets[rows]))
    return {name: p.detach().clone() for name, p in engine.module.named_parameters()}
