"""Linux processes as /proc shows them (whether a pid is alive, not a zombie; a process's children) and the tiny
``plait train`` job, for the tests that signal or kill launchers and ranks and check what is left."""

from __future__ import annotations

import os
import sys
from pathlib import Path

LINUX = sys.platform.startswith("linux")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PLAIT_TIMEOUT_S": "120"}
"""The environment of a ``plait train`` the process tests start (one thread per rank, collectives time out)."""
JOB = ["--nproc", "2"] + [
    arg
    for setting in ("train.eval_every=0", "train.global_batch=8", "model.n_layer=1", "model.d_model=32")
    for arg in ("--set", setting)
]
"""A tiny two-rank job (dp=2) on the synthetic task; the tests add steps, checkpoints and --out."""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (exists and is neither a zombie nor dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def children(pid: int) -> list[int]:
    """The pids whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return found
