"""What a run folder holds, read without changing it: ``plait runs`` (``plait.cli.runs``).

A run folder (``plait train --out RUN``) holds ``config.toml`` (the resolved configuration), ``metrics.jsonl``
(a record per step and per evaluation), ``summary.json`` (written when the run finished), ``ckpt/`` (the
checkpoints), ``loss.png`` and the lock ``.plait.lock`` that the running job holds. ``read_run`` turns them
into a ``RunInfo``:

- *status*: **running** when a process holds the lock (flock: a job that died released it, so a stale lock file
  is not a running job); **finished** when ``summary.json`` records the last step the metrics reached and the
  steps the configuration asked for; otherwise **stopped at step N**: the job failed, was killed or was stopped
  before ``train.steps`` (a stopped job resumes from its newest intact checkpoint);
- the losses: the first and the last training loss, the last evaluation;
- the checkpoints, newest first, with their state (``plait.checkpoint.catalog.status``; sizes only unless
  ``verify``; one of another run, copied in, is damaged) and which one ``latest`` names;
- the commands that go on from here: resume (the same ``--out``), generate, export.

Nothing here trusts the folder's content: a file that is missing or malformed is reported, never raised.
"""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plait.checkpoint.catalog import INTACT, entries, latest_name, run_id, status
from plait.errors import CheckpointError, ConfigError
from plait.train.fault import LOCK_NAME

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib

RUNNING, FINISHED, STOPPED, EMPTY = "running", "finished", "stopped", "not started"
_MARKERS = ("config.toml", "metrics.jsonl", "summary.json", "ckpt")


@dataclass
class Checkpoint:
    """One step folder of the run: its step, state ("intact", "damaged", ...), problems and size."""

    step: int
    name: str
    state: str
    problems: list[str]
    bytes: int
    latest: bool


@dataclass
class RunInfo:
    """A run folder as ``read_run`` found it (module docstring)."""

    path: Path
    status: str
    holder: str = ""
    """Who holds the lock, as the job wrote it (pid, host, since when), while running."""
    last_step: int = 0
    steps: int | None = None
    """``train.steps`` of config.toml (None when it is missing or unreadable)."""
    world_size: int | None = None
    first_loss: float | None = None
    last_loss: float | None = None
    last_eval: dict[str, Any] | None = None
    layout: str = ""
    """The layout as the job resolved it (summary.json's), once finished."""
    config: dict[str, Any] = field(default_factory=dict)
    checkpoints: list[Checkpoint] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What could not be read (a malformed file), said instead of raised."""

    @property
    def picture(self) -> Path | None:
        picture = self.path / "loss.png"
        return picture if picture.is_file() else None

    @property
    def resumable(self) -> Checkpoint | None:
        """The checkpoint a resumed job would load: the newest one that is not damaged or incomplete."""
        return next((c for c in self.checkpoints if c.state in (INTACT, "unverified")), None)


def is_run_folder(path: Path) -> bool:
    """Whether ``path`` looks like a run folder (holds one of the files ``plait train`` writes)."""
    return path.is_dir() and any((path / name).exists() for name in _MARKERS)


def lock_holder(path: Path) -> str | None:
    """Who holds the run folder's lock (what they wrote in it), or None when no process holds it."""
    lock = path / LOCK_NAME
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.pread(fd, 256, 0).decode(errors="replace").strip() or "a process"
    except OSError:
        return None
    finally:
        os.close(fd)  # closing releases a lock this call took
    return None


def _records(path: Path, notes: list[str]) -> list[dict[str, Any]]:
    found = []
    try:
        with open(path / "metrics.jsonl", encoding="utf-8", errors="replace") as stream:
            for number, line in enumerate(stream, 1):
                try:
                    record = json.loads(line)
                except ValueError:
                    notes.append(f"metrics.jsonl line {number} is not JSON (a record cut short?)")
                    continue
                if isinstance(record, dict) and isinstance(record.get("step"), int):
                    found.append(record)
    except FileNotFoundError:
        pass
    except OSError as error:
        notes.append(f"metrics.jsonl cannot be read ({error.strerror or error})")
    return found


def _json(path: Path, notes: list[str]) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        notes.append(f"{path.name} cannot be read ({error})")
        return None
    return value if isinstance(value, dict) else None


def _config(path: Path, notes: list[str]) -> dict[str, Any]:
    try:
        return tomllib.loads((path / "config.toml").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        notes.append(f"config.toml cannot be read ({error})")
        return {}


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def read_run(path: str | Path, verify: bool = False) -> RunInfo:
    """The run folder at ``path`` (module docstring); ``verify`` reads every checkpoint file's SHA-256."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"{path} is not a folder. Fix: give a run folder (plait train --out) or a folder of them.")
    notes: list[str] = []
    config = _config(path, notes)
    steps = config.get("train", {}).get("steps")
    records = _records(path, notes)
    train = [r for r in records if r.get("kind", "train") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    summary = _json(path / "summary.json", notes)
    ckpt = path / "ckpt"
    pointer = latest_name(ckpt)
    try:
        run = run_id(ckpt)  # a checkpoint of another run (copied in) is damaged for this run
    except CheckpointError as error:
        run = None
        notes.append(str(error))
    checkpoints = []
    for entry in entries(ckpt):
        found = status(entry, deep=verify, run=run)
        checkpoints.append(
            Checkpoint(entry.step, entry.name, found.state, found.problems, found.bytes, entry.name == pointer)
        )
    last_step = max([r["step"] for r in train] + [c.step for c in checkpoints if c.state == INTACT] + [0])
    holder = lock_holder(path)
    if holder is not None:
        state = RUNNING
    elif summary is not None and summary.get("steps") == last_step and (steps is None or last_step >= steps):
        state = FINISHED
    elif last_step or checkpoints:
        state = STOPPED
    else:
        state = EMPTY
    world = summary.get("world_size") if summary else None
    if world is None and train and isinstance(train[-1].get("max_rss_bytes"), list):
        world = len(train[-1]["max_rss_bytes"])  # one figure per rank
    return RunInfo(
        path=path,
        status=state,
        holder=holder or "",
        last_step=last_step,
        steps=steps if isinstance(steps, int) else None,
        world_size=world if isinstance(world, int) else None,
        first_loss=_number(train[0].get("loss")) if train else None,
        last_loss=_number(train[-1].get("loss")) if train else None,
        last_eval=evals[-1] if evals else None,
        layout=str(summary.get("layout", "")) if summary else "",
        config=config,
        checkpoints=checkpoints,
        notes=notes,
    )


def _model(config: dict[str, Any]) -> str:
    model = config.get("model", {})
    if model.get("hf"):
        return f"Hugging Face model {model['hf']}"
    if model.get("preset"):
        return f"preset {model['preset']}"
    sizes = ", ".join(f"{k} {model[k]}" for k in ("n_layer", "d_model", "n_head", "n_experts") if k in model)
    return f"plait GPT ({sizes})" if sizes else "plait GPT"


def _data(config: dict[str, Any]) -> str:
    data = config.get("data", {})
    if data.get("sources"):
        return "mixture of " + ", ".join(str(s.get("path")) for s in data["sources"] if isinstance(s, dict))
    return f"{data.get('name', '?')}" + (f" {data['path']}" if data.get("path") else "")


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"


def describe(info: RunInfo, verify: bool = False) -> list[str]:
    """``plait runs RUN``'s lines: status, configuration, losses, checkpoints, picture and what to run next."""
    run = str(info.path)
    of = f" of {info.steps}" if info.steps is not None else ""
    state = {
        RUNNING: f"running ({info.holder}), at step {info.last_step}{of}",
        FINISHED: f"finished: {info.last_step} steps",
        STOPPED: f"stopped at step {info.last_step}{of} (failed, killed or interrupted before the end)",
        EMPTY: "not started (no step recorded)",
    }[info.status]
    lines = [f"run {run}", f"  status       {state}"]
    if info.config:
        layout = info.config.get("layout", {})
        degrees = " ".join(
            f"{k}={'rest' if layout[k] == -1 else layout[k]}"
            for k in ("dp", "tp", "pp", "cp", "ep")
            if layout.get(k, 1) != 1
        )
        world = f", {info.world_size} rank(s)" if info.world_size else ""
        lines.append(f"  config       {run}/config.toml: {_model(info.config)}; data {_data(info.config)}")
        lines.append(f"  layout       {info.layout or degrees or 'one process'}{world}")
    if info.last_loss is not None:
        first = f" (step 1: {info.first_loss:.4f})" if info.first_loss is not None else ""
        lines.append(f"  loss         {info.last_loss:.4f} at step {info.last_step}{first}")
    if info.last_eval is not None and _number(info.last_eval.get("loss")) is not None:
        accuracy = _number(info.last_eval.get("accuracy"))
        shown = f", accuracy {100 * accuracy:.1f}%" if accuracy is not None else ""
        lines.append(f"  evaluation   loss {info.last_eval['loss']:.4f}{shown} at step {info.last_eval['step']}")
    if info.checkpoints:
        lines.append("  checkpoints" + ("" if verify else "  (sizes checked; --verify reads every byte)"))
        for c in info.checkpoints:
            why = f": {'; '.join(c.problems)}" if c.problems else ""
            latest = "  <- latest" if c.latest else ""
            lines.append(f"    {c.name}  {c.state}{why}, {_size(c.bytes)}{latest}")
    else:
        lines.append("  checkpoints  none (train.save_every = 0 keeps none)")
    if info.picture is not None:
        lines.append(f"  picture      {info.picture}")
    lines += [f"  note         {note}" for note in info.notes]
    lines += _next(info)
    return lines


def _next(info: RunInfo) -> list[str]:
    run, ckpt = str(info.path), info.resumable
    nproc = f" --nproc {info.world_size}" if info.world_size else ""
    lines = []
    if info.status == STOPPED and ckpt is not None:
        lines.append(
            f"  resume       plait train --config {run}/config.toml --out {run}{nproc}   (from step {ckpt.step})"
        )
    elif info.status == STOPPED and info.checkpoints:
        lines.append(
            f"  resume       no intact checkpoint: a job on this folder refuses to start (nothing is deleted); "
            f"plait checkpoint verify {run} names the damage"
        )
    elif info.status == STOPPED:
        lines.append("  resume       no checkpoint (train.save_every = 0): a new job on this folder starts at step 0")
    elif info.status == FINISHED and ckpt is not None:
        lines.append(
            f"  train on     plait train --config {run}/config.toml --out {run}{nproc} --set train.steps=N"
            f"   (N > {info.last_step})"
        )
    if ckpt is not None:
        lines.append(f"  generate     plait generate {run} --prompt TEXT")
        lines.append(f"  export       plait convert {run}/ckpt model.safetensors")
    return lines


def find_runs(folder: str | Path) -> list[Path]:
    """The run folders directly under ``folder`` (sorted by name), or ``[folder]`` when it is one itself."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(
            f"{folder} is not a folder. Fix: give a run folder (plait train --out) or a folder of them (runs/)."
        )
    if is_run_folder(folder):
        return [folder]
    return sorted(p for p in folder.iterdir() if not p.is_symlink() and is_run_folder(p))


__all__ = ["RunInfo", "describe", "find_runs", "is_run_folder", "lock_holder", "read_run"]
