"""What a user must know about a run, said once: a resume and what changed since, the weights a run starts from,
the time a job took across restarts, and what to run next.

``plait train`` logs these from rank 0 (the rank-aware logger), each as one line:

- ``resumed``: "resuming runs/x at step 300 of 600 (changed since its last run: train.steps 300 -> 600)": the
  run folder's ``config.toml`` is the configuration of the run before this one, compared setting by setting with
  this one (``config_changes``; the run folder's own path is left out, it is the same folder however spelled);
- ``starting_weights``: "starting from the weights of runs/base/ckpt/step-00000600 (train.init_from)";
- ``job_seconds``: under ``--max-restarts`` the launcher records when the job started (``JOB_STARTED_ENV``), so
  the closing line gives the job's time as well as this attempt's;
- ``next_steps``: the commands that go on from a finished run (generate, inspect, export, train further).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from plait.logging import get_logger

log = get_logger(__name__)
JOB_STARTED_ENV = "PLAIT_JOB_STARTED"
"""Set by ``plait train``'s launcher for its workers: the job's start (seconds since the epoch)."""
_IGNORED = {"train.out"}
"""Settings whose change is not a change of the run (the same folder, however spelled)."""

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def _flat(section: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(section, dict):
        return {prefix: section}
    out: dict[str, Any] = {}
    for key, value in section.items():
        out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def config_changes(previous_toml: str, current: dict[str, Any]) -> list[str]:
    """``["train.steps 300 -> 600", ...]``: the settings of ``current`` (``RunConfig.to_dict()``) that differ
    from the configuration TOML ``previous_toml`` (a run folder's config.toml); [] when it cannot be read."""
    try:
        before = _flat(tomllib.loads(previous_toml))
    except ValueError:
        return []
    after = _flat(current)
    changed = []
    for key in sorted(set(before) | set(after)):
        if key in _IGNORED or before.get(key) == after.get(key):
            continue
        changed.append(f"{key} {_show(before.get(key))} -> {_show(after.get(key))}")
    return changed


def _show(value: Any) -> str:
    return "(unset)" if value is None else repr(value) if isinstance(value, str) else str(value)


def resumed(run_dir: Path, step: int, total: int, previous_toml: str | None, current: dict[str, Any]) -> None:
    """Log that this run resumes ``run_dir`` at ``step`` of ``total``, and what changed since its last run."""
    changes = config_changes(previous_toml, current) if previous_toml is not None else []
    said = f"changed since its last run: {'; '.join(changes)}" if changes else "same configuration as its last run"
    log.info("resuming %s at step %d of %d (%s)", run_dir, step, total, said)


def starting_weights(description: str, setting: str) -> None:
    """Log where the run's starting weights come from."""
    log.info("starting from the weights of %s (%s)", description, setting)


def job_seconds() -> float | None:
    """Seconds since the job started (the launcher's record), or None when no launcher recorded it."""
    started = os.environ.get(JOB_STARTED_ENV)
    try:
        return time.time() - float(started) if started else None
    except ValueError:
        return None


def next_steps(run_dir: Path, saved: bool) -> None:
    """Log the commands that go on from a finished run in ``run_dir`` (``saved``: it has checkpoints)."""
    if not saved:
        log.info("next: plait runs %s (what the run folder holds); set train.save_every to keep the weights", run_dir)
        return
    log.info(
        "next: plait generate %s --prompt TEXT | plait runs %s | plait convert %s/ckpt model.safetensors (or an HF "
        "folder) | train further: the same command with --set train.steps=N",
        run_dir,
        run_dir,
        run_dir,
    )


__all__ = ["JOB_STARTED_ENV", "config_changes", "job_seconds", "next_steps", "resumed", "starting_weights"]
