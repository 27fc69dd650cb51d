"""The committed log of a fault-tolerant run: which replica groups' batches every step trained on.

Each group's rank 0 records, per committed step, the data slots its quorum trained (``ft_groups`` in its
``replica-<g>/metrics.jsonl``: slot s is the s-th of the R shares of the global batch, trained by whichever group
held place s in the quorum; without faults group s) and, at its start, the job's fingerprint
(``replica-<g>/ft.json``). The launcher merges them into ``<run>/committed.jsonl``: a header line
``{"fingerprint": ..., "groups": R}``, then one line ``{"step": s, "groups": [...]}`` per step. Groups that were
alive at a step agree on its quorum (they summed the same rows); a disagreement is an error, not a choice.

``plait train --ft-replay <run>`` trains the same job with every group alive and, at step s, the slots outside
the logged ones contributing zero weight (``plait.ft.combine``): bitwise the run that was logged. One device
trained on the committed groups' rows of each step equals both, within rounding (tests/test_ft.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plait.errors import ConfigError

COMMITTED = "committed.jsonl"
FINGERPRINT = "ft.json"


def replica_dir(run: str | Path, group: int) -> Path:
    """Where replica group ``group`` of a fault-tolerant run writes its records and checkpoints."""
    return Path(run) / f"replica-{group}"


@dataclass
class ReplayLog:
    """A committed log (module docstring)."""

    fingerprint: dict[str, Any]
    group_count: int
    steps: dict[int, list[int]] = field(default_factory=dict)

    def groups(self, step: int) -> list[int]:
        """The groups committed at ``step`` (1-based, as metrics.jsonl counts)."""
        if step not in self.steps:
            raise ConfigError(
                f"the committed log has no step {step} (it has 1..{max(self.steps, default=0)}). Fix: replay at most "
                f"as many steps as the run committed (--set train.steps={max(self.steps, default=0)})."
            )
        return self.steps[step]

    def committed(self, step: int, group: int) -> bool:
        return group in self.groups(step)

    def check(self, fingerprint: dict[str, Any], groups: int) -> None:
        """Refuse a replay of another job (one line naming what differs)."""
        differences = sorted(
            k for k in set(fingerprint) | set(self.fingerprint) if fingerprint.get(k) != self.fingerprint.get(k)
        )
        if differences or groups != self.group_count:
            what = ", ".join(differences) or f"{groups} replica groups instead of {self.group_count}"
            raise ConfigError(
                f"the committed log is of another job: {what} differ. Fix: replay with the run's own configuration "
                f"(its replica-0/config.toml) and layout."
            )

    @classmethod
    def read(cls, path: str | Path) -> ReplayLog:
        path = Path(path)
        if path.is_dir():
            path = path / COMMITTED
        try:
            lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        except (OSError, ValueError) as error:
            raise ConfigError(
                f"cannot read the committed log {path}: {error}. Fix: name a fault-tolerant run's folder."
            ) from error
        if not lines or "fingerprint" not in lines[0]:
            raise ConfigError(f"{path} has no header line with the job's fingerprint. Fix: name a file plait wrote.")
        log = cls(lines[0]["fingerprint"], int(lines[0]["groups"]))
        for line in lines[1:]:
            log.steps[int(line["step"])] = [int(g) for g in line["groups"]]
        return log

    def write(self, path: Path) -> None:
        lines = [json.dumps({"fingerprint": self.fingerprint, "groups": self.group_count})]
        lines += [json.dumps({"step": step, "groups": groups}) for step, groups in sorted(self.steps.items())]
        path.write_text("\n".join(lines) + "\n")


def merge(run: str | Path, groups: int, folders: int | None = None) -> ReplayLog:
    """The committed log of ``run`` from the records of its ``folders`` groups (R + spares; ``groups``: R, the data
    slots) (ConfigError when they disagree or miss a step)."""
    fingerprint: dict[str, Any] | None = None
    steps: dict[int, list[int]] = {}
    for group in range(folders or groups):
        folder = replica_dir(run, group)
        if (folder / FINGERPRINT).is_file() and fingerprint is None:
            fingerprint = json.loads((folder / FINGERPRINT).read_text())
        metrics = folder / "metrics.jsonl"
        if not metrics.is_file():
            continue
        for line in metrics.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut by a kill
            if "ft_groups" not in record:
                continue
            step, members = int(record["step"]), sorted(int(g) for g in record["ft_groups"])
            if steps.setdefault(step, members) != members:
                raise ConfigError(
                    f"{run}: replica groups disagree on the quorum of step {step} ({steps[step]} and {members}): the "
                    f"records were mixed with another run's. Fix: replay a run folder written by one job."
                )
    if fingerprint is None:
        raise ConfigError(f"{run} has no replica-<g>/{FINGERPRINT}: it is not a fault-tolerant run's folder.")
    gaps = [s for s in range(1, max(steps, default=0) + 1) if s not in steps]
    if gaps:
        raise ConfigError(f"{run}: no group recorded step(s) {gaps[:5]}: the log is incomplete.")
    return ReplayLog(fingerprint, groups, steps)


__all__ = ["COMMITTED", "FINGERPRINT", "ReplayLog", "merge", "replica_dir"]
