"""Fault tolerance (issue 34), side by side in one run on 4 CPU processes: what a killed rank costs under
``plait train --ft`` and under restart-and-resume, what ``--ft`` costs per step when nothing fails, and HSDP
against ZeRO-3 over all ranks with the 4 processes treated as 2 nodes.

``python -m benchmarks.fault_tolerance [--quick] [--out BENCHMARKS.md]`` starts ``plait train`` jobs (gloo, one
thread per rank) of one tiny GPT (tests/helpers/ft.py's settings: 4 layers x d_model 128 on the addition task,
ZeRO-3, clip 0.5, lr 5e-4) and reads what they write (``metrics.jsonl``, ``replica-<g>/starts.jsonl``).

**1. Time lost per fault.** The same kill (``PLAIT_FAULT_INJECT="rank=1,step=k,action=kill"``: SIGKILL just before
step k, k - 1 steps committed) in two jobs of the same layout, R = 2 replica groups of 2 ZeRO-3 ranks:

- ``--ft``: ``plait train --ft --nproc 4 --max-restarts 1`` (``PLAIT_FT_FAULT_GROUP=1``: rank 1 of group 1 dies;
  group 0 goes on alone, group 1 is restarted by its own agent and heals from group 0 over the network), at
  heartbeat timeouts of 2 s (plait's default) and 1 s; and the same with ``--ft-spares 1`` (a third group of 2
  ranks that steps with weight 0 and takes group 1's data slot once the quorum drops it: 6 processes);
- restart-and-resume: ``plait train --nproc 4 --max-restarts 1`` with ``layout.dp=4, dp_replicate=2`` (HSDP in
  one job): every rank is stopped, relaunched, reloads the checkpoint of step c = save_every x floor((k-1) /
  save_every) and trains steps c+1..k-1 again.

Both save every ``save_every`` steps. Times are unix seconds: ``--ft`` records each commit's time (``ft_time``);
for the restart job a thread of this process notes when each record appears in ``metrics.jsonl`` (polled every
5 ms). t_kill is the commit of step k - 1 (the killed rank dies right after it, at its next step's start), T the
median seconds between consecutive commits before the kill (each job's own), and an uninterrupted job would have
committed step k at t_kill + T. Then, per job:

- **until full strength**: ``--ft``, t(first commit by all R groups after the kill) - t_kill - T (the issue's "from
  the kill until the job commits steps at full strength again"); restart, t(step k) - t_kill - T (kill ->
  relaunch -> load -> redo c+1..k-1 -> the first new step);
- **capacity lost**: the same window minus the work committed in it at full strength's rate, (t_end - t_kill) -
  T x sum over the steps committed in (t_kill, t_end] of |groups| / R (a step one group of two commits trains half
  the global batch: half a step of work; steps redone after a restart are not new work);
- **capacity lost at T**: the same, with the live groups' steps counted at the full-strength step T: no progress
  + (until full strength - no progress) x (R - live groups) / R. On this machine the live group has the cores to
  itself and steps faster than T, which the measured capacity counts as work; on nodes of its own it would not;
- **no progress**: t(first new step after the kill) - t_kill - T: ``--ft``, the failed step's attempt and the
  quorum's wait for the dead group's heartbeat to lapse (``PLAIT_FT_HEARTBEAT_MS``); restart, the whole loss.

For restart-and-resume the four are one number. The target (>= 5x less time lost with ``--ft``) is checked
against each.

**2. Overhead of --ft per step when nothing fails.** Rounds of three fresh jobs in alternating order (A B C,
C B A, ...), the same model, steps and batches: ``--ft`` (2 groups of 2), HSDP without ``--ft`` (one job,
``dp=4, dp_replicate=2, zero=3``) and ZeRO-3 over all 4 ranks (part 3). A step's time is its step call as the
records give it: ``seconds`` (``Engine.train_step``, rank 0; under ``--ft`` the cross-group exchange and
``should_commit`` run inside it) plus, under ``--ft``, ``ft_quorum_s`` (the rest of ``FaultTolerantSteps.
train_step``: the quorum), the max of the two groups; what follows a step (the metrics' all-gather, the record)
is the same code in every job and left out. Per job the median over the steps after ``warmup``; **ft / HSDP** is
the median over rounds of the round's ratio (min..max). The wall seconds between commits are shown too (``--ft``:
``ft_time``; the others: the polled appearance of records, +-5 ms).

**3. HSDP vs ZeRO-3 over 4 ranks as 2 nodes** (ranks 0-1 node A, 2-3 node B): step time (part 2's jobs) and the
bytes crossing nodes per step. ``plait.comm`` counts each rank's wire bytes per mesh axis under the ring model
(``comm_bytes_per_rank``); a rank's bytes on an axis cross when its successor in its ring of that axis
(``plait.mesh.RankGrid.groups``) lives on the other node. HSDP: the ``replicate`` all-reduce, every rank's
partner across (theory 4 ranks x 2(R-1)/R x 4 P/N = 8 P bytes, N = 2 ranks per group); ZeRO-3 at dp = 4: the ring
0 1 2 3 crosses at 1 -> 2 and 3 -> 0, so 2 of the 4 ranks' 3 (n-1)/n x 4 P (two all-gathers and a reduce-scatter)
cross: 18 P bytes, P the parameters (padding aside).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.report import busy_cpu_seconds, conditions, machine, replace_block
from plait import Layout
from plait.mesh import RankGrid

MODEL = [
    "model.n_layer=4",
    "model.d_model=128",
    "train.eval_every=0",
    "train.samples=0",
    "train.max_grad_norm=0.5",
    "train.lr=5e-4",
    "train.log_every=1",
]
"""tests/helpers/ft.py's job (the addition task, seq 64, the default global batch)."""
HSDP = ["layout.dp=4", "layout.dp_replicate=2", "layout.zero=3"]
ZERO3 = ["layout.dp=4", "layout.zero=3"]
NODES = (0, 0, 1, 1)
"""The node of each rank in part 3."""
ENV = {
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
    "PLAIT_TIMEOUT_S": "120",
    "PLAIT_FT_TIMEOUT_S": "30",
    "RUST_LOG": "error",
}


@dataclass
class Settings:
    """What one run measures (the defaults fit ~10 minutes of a loaded 2-core machine; ``--quick`` a smoke test)."""

    kill_step: int = 30
    save_every: int = 20
    ft_steps: int = 400
    """Steps of the ``--ft`` fault job: the surviving group must still train when the killed one comes back."""
    restart_steps: int = 60
    rounds: int = 3
    steps: int = 150
    warmup: int = 10
    faults: tuple[tuple[int, int], ...] = ((2000, 0), (1000, 0), (2000, 1), (1000, 1))
    """The ``--ft`` fault jobs: (the quorum service's heartbeat timeout in ms, spare groups). A dead group is dropped
    from the quorum once its heartbeat lapses (2 s: plait's default), which bounds the step that stalls; with a
    spare (``--ft-spares 1``) the job is back at full strength at that step."""

    @classmethod
    def quick(cls) -> Settings:
        return cls(6, 4, 200, 12, 1, 12, 2, ((2000, 0), (2000, 1)))


# ----------------------------------------------------------------- running jobs


class RecordTimes(threading.Thread):
    """When each record of ``path`` (a ``metrics.jsonl``) appears: (unix time, step) per train record, polled
    every ``every`` seconds. A resumed job rewrites the file (``plait.train.fault.resume_metrics``): it is read
    again from its start, so the records it kept appear twice."""

    def __init__(self, path: Path, every: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.path, self.every, self.seen = path, every, []
        self.done = threading.Event()
        self._inode, self._offset, self._partial = -1, 0, b""

    def run(self) -> None:
        while not self.done.is_set():
            self._poll()
            time.sleep(self.every)
        self._poll()

    def _poll(self) -> None:
        try:
            status = os.stat(self.path)
        except FileNotFoundError:
            return
        if status.st_ino != self._inode or status.st_size < self._offset:
            self._inode, self._offset, self._partial = status.st_ino, 0, b""
        if status.st_size <= self._offset:
            return
        with open(self.path, "rb") as handle:
            handle.seek(self._offset)
            data = handle.read()
        now = time.time()
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("kind") == "train":
                self.seen.append((now, int(record["step"])))


@dataclass
class Job:
    """One finished ``plait train``: its folder, exit code, stderr and (without ``--ft``) when its records came."""

    out: Path
    code: int
    stderr: str
    seen: list[tuple[float, int]] = field(default_factory=list)

    def records(self, group: int | None = None) -> list[dict[str, Any]]:
        folder = self.out if group is None else self.out / f"replica-{group}"
        lines = (folder / "metrics.jsonl").read_text().splitlines()
        return [r for r in (json.loads(line) for line in lines if line.strip()) if r.get("kind") == "train"]

    def starts(self, group: int) -> list[dict[str, Any]]:
        lines = (self.out / f"replica-{group}" / "starts.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]


def train(
    out: Path,
    steps: int,
    layout: list[str],
    ft: bool,
    save_every: int = 0,
    env: dict[str, str] | None = None,
    spares: int = 0,
) -> Job:
    """``plait train`` on 4 local processes (and ``spares`` spare groups of 2 under ``--ft``) into ``out``
    (``--max-restarts 1`` when it saves)."""
    command = [sys.executable, "-m", "plait", "train", "--nproc", "4", "--out", str(out)]
    command += ["--ft"] * ft + ["--max-restarts", "1"] * bool(save_every) + ["--ft-spares", str(spares)] * bool(spares)
    for setting in [*MODEL, *layout, f"train.steps={steps}", f"train.save_every={save_every}"]:
        command += ["--set", setting]
    root = Path(__file__).resolve().parent.parent
    environ = {**os.environ, **ENV, **(env or {}), "PYTHONPATH": str(root)}
    poller = None if ft else RecordTimes(out / "metrics.jsonl")
    if poller is not None:
        poller.start()
    stderr = out.with_suffix(".stderr")
    with open(stderr, "w") as handle:
        done = subprocess.run(command, env=environ, stdout=subprocess.DEVNULL, stderr=handle, timeout=900, cwd=root)
    if poller is not None:
        poller.done.set()
        poller.join()
    text = stderr.read_text()
    if done.returncode != 0:
        raise JobFailed(f"{' '.join(command)} failed ({done.returncode}):\n{text[-3000:]}")
    return Job(out, done.returncode, text, poller.seen if poller is not None else [])


class JobFailed(RuntimeError):
    """A ``plait train`` of the benchmark exited non-zero."""


def train_again_once(out: Path, *args: Any, **kwargs: Any) -> Job:
    """``train``, once more in a fresh folder if it fails (on a shared machine a job is sometimes stopped from
    outside: a SIGTERM it did not ask for); a second failure ends the benchmark."""
    try:
        return train(out, *args, **kwargs)
    except JobFailed as error:
        print(f"{str(error)[:400]}\n... retrying once", file=sys.stderr)  # noqa: T201 - a command-line report
        return train(out.with_name(out.name + "-again"), *args, **kwargs)


def steady_step(times: dict[int, float], first: int, last: int) -> float:
    """The median seconds between consecutive commits of steps ``first``..``last``."""
    gaps = [times[s] - times[s - 1] for s in range(first + 1, last + 1) if s in times and s - 1 in times]
    return statistics.median(gaps)


# ----------------------------------------------------------------- 1. time lost per fault


def fault_ft(job: Job, kill: int, groups: int = 2) -> dict[str, Any]:
    """Part 1's figures for the ``--ft`` job (module docstring); group 1 was the one killed."""
    survivor = {r["step"]: r for r in job.records(0)}
    killed = job.records(1)
    times = {s: r["ft_time"] for s, r in survivor.items()}
    t_kill = next(r["ft_time"] for r in killed if r["step"] == kill - 1)
    step = steady_step(times, min(5, kill - 2), kill - 1)
    whole = [s for s in sorted(survivor) if s >= kill and len(survivor[s]["ft_groups"]) == groups]
    restarted = max(s["time"] for s in job.starts(1) if s["attempt"] == 1)
    healed = next((r for r in killed if "ft_healed_from_step" in r), None)
    row: dict[str, Any] = {
        "step_s": step,
        "no_progress_s": times[kill] - t_kill - step,
        "failed_attempts": survivor[kill]["ft_attempts"] - 1,
        "slots_at_kill": len(survivor[kill]["ft_groups"]),
        "quorum_wait_s": survivor[kill]["ft_quorum_s"],
        "restarted_s": restarted - t_kill,
        "healed_from": healed["ft_healed_from_step"] if healed else None,
        "healed_at": healed["step"] if healed else None,
        "full_s": None,
        "capacity_s": None,
        "capacity_at_T_s": None,
    }
    if whole:
        t_full = times[whole[0]]
        work = sum(len(survivor[s]["ft_groups"]) / groups for s in survivor if t_kill < times[s] <= t_full)
        row["full_s"] = t_full - t_kill - step
        row["capacity_s"] = t_full - t_kill - step * work
        alive = len(survivor[kill]["ft_groups"])  # the groups that went on
        row["capacity_at_T_s"] = row["no_progress_s"] + (row["full_s"] - row["no_progress_s"]) * (1 - alive / groups)
        row["degraded_steps"] = sum(1 for s in survivor if kill <= s < whole[0])
    return row


def fault_restart(job: Job, kill: int) -> dict[str, Any]:
    """Part 1's figures for the restart-and-resume job (module docstring), from when its records appeared."""
    first: dict[int, float] = {}
    for seen, step in job.seen:
        first.setdefault(step, seen)
    t_kill = first[kill - 1]
    resumed = re.search(r"resuming at step (\d+)", job.stderr)
    resume = int(resumed.group(1)) if resumed else 0
    after = {}
    for seen, step in job.seen:  # the steps the relaunched job committed (those it kept reappear: skipped)
        if seen > t_kill and step > resume:
            after.setdefault(step, seen)
    step = steady_step(first, min(5, kill - 2), kill - 1)
    lost = after[kill] - t_kill - step
    return {
        "step_s": step,
        "resumed_from": resume,
        "down_s": after[resume + 1] - t_kill - step,
        "redo_s": after[kill] - after[resume + 1],
        "redone": kill - 1 - resume,
        "full_s": lost,
        "capacity_s": lost,
        "capacity_at_T_s": lost,
        "no_progress_s": lost,
    }


def _ratio(restart: float | None, ft: float | None) -> str:
    if restart is None or ft is None:
        return "-"
    return f"{restart / ft:.1f}x" if ft > 0 else "inf"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _column(ms: int, spares: int) -> str:
    return f"`--ft`{' + 1 spare' * bool(spares)}, heartbeat {ms / 1000:g} s"


def fault_table(fts: dict[tuple[int, int], dict[str, Any]], restart: dict[str, Any], settings: Settings) -> str:
    """Part 1's table: a ``--ft`` column per (heartbeat timeout, spares), restart-and-resume, and their ratios."""
    measures = [
        ("until full strength (the issue's measure)", "full_s"),
        ("capacity lost (job-seconds)", "capacity_s"),
        ("capacity lost, the live groups' steps counted at T", "capacity_at_T_s"),
        ("no progress", "no_progress_s"),
    ]
    names = [_column(*key) for key in fts]
    short = [f"{ms / 1000:g} s{' +spare' * bool(spares)}" for ms, spares in fts]
    rows = [
        "| time lost per fault (s, one normal step T deducted) | "
        + " | ".join(names)
        + " | restart-and-resume | "
        + " | ".join(f"restart / ft ({name})" for name in short)
        + " | target |",
        "|---|" + "---:|" * (2 * len(fts) + 2),
    ]
    for name, key in measures:
        values, ratios, met = [], [], []
        for ft in fts.values():
            values.append(_s(ft[key]))
            ratios.append(_ratio(restart[key], ft[key]))
            met.append(ft[key] is not None and (ft[key] <= 0 or restart[key] / ft[key] >= 5))
        verdict = ", ".join(f"{'met' if m else 'not met'} ({name})" for m, name in zip(met, short))
        rows.append(f"| {name} | {' | '.join(values)} | {_s(restart[key])} | {' | '.join(ratios)} | >= 5x: {verdict} |")
    k = settings.kill_step
    steps = ", ".join(f"{1e3 * ft['step_s']:.0f}" for ft in fts.values())
    notes = [
        f"\nKill: rank 1 (of group 1 under `--ft`) before step {k}, `train.save_every={settings.save_every}`. "
        f"T = {steps} ms (`--ft`), "
        f"{1e3 * restart['step_s']:.0f} ms (restart)."
    ]
    for key, ft in fts.items():
        notes.append(
            f"{_column(*key)}: step {k} committed with {ft['slots_at_kill']} of 2 data slots after "
            f"{ft['failed_attempts']} failed attempt(s) and {ft['quorum_wait_s']:.2f} s in the quorum; group 1's ranks "
            f"restarted (built, ready to heal) {ft['restarted_s']:.2f} s after the kill, healed from step "
            f"{ft['healed_from']} (its checkpoint) to {ft['healed_at']} over the network; "
            f"{ft.get('degraded_steps', '-')} steps committed with one slot."
        )
    notes.append(
        f"Restart: resumed from step {restart['resumed_from']}; {_s(restart['down_s'])} s with no step at all "
        f"(kill -> relaunch -> load -> first step), then {restart['redone']} step(s) redone in "
        f"{_s(restart['redo_s'])} s."
    )
    return "\n".join(rows) + "\n" + "\n".join(notes) + "\n"


# ----------------------------------------------------------------- 2 and 3. steps without faults


def step_times(job: Job, ft: bool, warmup: int) -> dict[str, Any]:
    """Median step-call seconds after ``warmup`` steps, the quorum's share (``--ft``) and the wall between commits."""
    if ft:
        groups = [{r["step"]: r for r in job.records(g)} for g in (0, 1)]
        steps = [s for s in sorted(groups[0]) if s > warmup and s in groups[1]]
        calls = [max(g[s]["seconds"] + g[s]["ft_quorum_s"] for g in groups) for s in steps]
        quorum = [max(g[s]["ft_quorum_s"] for g in groups) for s in steps]
        times = {s: groups[0][s]["ft_time"] for s in steps}
        return {
            "call": statistics.median(calls),
            "quorum": statistics.median(quorum),
            "seconds": statistics.median(max(g[s]["seconds"] for g in groups) for s in steps),
            "wall": steady_step(times, steps[0], steps[-1]),
            "bytes": groups[0][steps[-1]]["comm_bytes"],
        }
    records = {r["step"]: r for r in job.records()}
    steps = [s for s in sorted(records) if s > warmup]
    first: dict[int, float] = {}
    for seen, step in job.seen:
        first.setdefault(step, seen)
    return {
        "call": statistics.median(records[s]["seconds"] for s in steps),
        "seconds": statistics.median(records[s]["seconds"] for s in steps),
        "wall": steady_step(first, steps[0], steps[-1]),
        "per_rank": records[steps[-1]]["comm_bytes_per_rank"],
    }


def crossing_bytes(per_rank: dict[str, list[int]], layout: Layout) -> int:
    """Bytes of one step that cross nodes (``NODES``): a rank's bytes on an axis whose ring successor in that
    axis's group sits on the other node (module docstring)."""
    grid, total = RankGrid.from_layout(layout), 0
    for axis, counts in per_rank.items():
        for group in grid.groups(axis):
            for place, rank in enumerate(group):
                if NODES[rank] != NODES[group[(place + 1) % len(group)]]:
                    total += counts[rank]
    return total


def parameter_count() -> int:
    """P of the benchmark's model (built on one process)."""
    import torch

    from plait.distributed import World
    from plait.train.config import load_config
    from plait.train.loop import build

    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "config.toml"
        config.write_text("")
        run = load_config(config, [*MODEL, "layout.dp=1", "train.out=''"])
        engine, _, _ = build(run, World(0, 1, 0, torch.device("cpu"), None))
    return sum(p.numel() for p in engine.module.parameters())


def steady_tables(rounds: list[dict[str, dict[str, Any]]], parameters: int) -> str:
    names = {"ft": "`--ft`, 2 groups of 2 (ZeRO-3 inside)", "hsdp": "HSDP, one job", "zero3": "ZeRO-3, dp=4"}

    def median(name: str, key: str) -> float:
        return statistics.median(r[name][key] for r in rounds)

    ratios = {name: [r[name]["call"] / r["hsdp"]["call"] for r in rounds] for name in names}
    rows = [
        "| job | step call ms (median over rounds) | of it: quorum ms | vs HSDP, paired by round (min..max) | "
        "wall ms between commits | vs HSDP |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, title in names.items():
        quorum = f"{1e3 * median(name, 'quorum'):.1f}" if name == "ft" else "-"
        low, high = min(ratios[name]), max(ratios[name])
        rows.append(
            f"| {title} | {1e3 * median(name, 'call'):.1f} | {quorum} | {statistics.median(ratios[name]):.3f} "
            f"({low:.3f}..{high:.3f}) | {1e3 * median(name, 'wall'):.1f} | "
            f"{median(name, 'wall') / median('hsdp', 'wall'):.3f} |"
        )
    last = rounds[-1]
    hsdp = crossing_bytes(last["hsdp"]["per_rank"], Layout(dp=4, dp_replicate=2, zero=3))
    zero3 = crossing_bytes(last["zero3"]["per_rank"], Layout(dp=4, zero=3))
    ft_cross = 4 * last["ft"]["bytes"].get("replicate", 0)  # every rank's cross-group exchange crosses
    theory = {"hsdp": 8 * parameters, "zero3": 18 * parameters}
    rows += [
        "",
        "| 4 ranks as 2 nodes (0-1, 2-3) | bytes crossing nodes per step (measured) | theory (padding aside) | "
        "measured / theory | vs ZeRO-3 |",
        "|---|---:|---:|---:|---:|",
        f"| HSDP (`replicate` crosses) | {hsdp:,} | {theory['hsdp']:,} | {hsdp / theory['hsdp']:.4f} | "
        f"{hsdp / zero3:.3f} |",
        f"| ZeRO-3 dp=4 (ring 0 1 2 3) | {zero3:,} | {theory['zero3']:,} | {zero3 / theory['zero3']:.4f} | 1.000 |",
        f"| `--ft` (its cross-group all-gather) | {ft_cross:,} | {theory['hsdp']:,} | "
        f"{ft_cross / theory['hsdp']:.4f} | {ft_cross / zero3:.3f} |",
    ]
    return "\n".join(rows) + "\n"


# ----------------------------------------------------------------- the run


def measure(settings: Settings, folder: Path) -> str:
    """Every part's jobs in one run; the markdown section."""
    kill = {"PLAIT_FAULT_INJECT": f"rank=1,step={settings.kill_step},action=kill"}
    k, every = settings.kill_step, settings.save_every
    fts = {}
    for ms, spares in settings.faults:
        env = {**kill, "PLAIT_FT_FAULT_GROUP": "1", "PLAIT_FT_HEARTBEAT_MS": str(ms)}
        job = train_again_once(folder / f"fault-ft-{ms}-{spares}", settings.ft_steps, HSDP, True, every, env, spares)
        fts[(ms, spares)] = fault_ft(job, k)
    restart_job = train_again_once(folder / "fault-restart", settings.restart_steps, HSDP, False, every, kill)
    fault = fault_table(fts, fault_restart(restart_job, k), settings)
    heartbeat = {"PLAIT_FT_HEARTBEAT_MS": str(settings.faults[0][0])}
    rounds = []
    order = [("ft", HSDP, True), ("hsdp", HSDP, False), ("zero3", ZERO3, False)]
    for number in range(settings.rounds):
        result = {}
        for name, layout, ft in order if number % 2 == 0 else order[::-1]:
            job = train_again_once(folder / f"{name}-{number}", settings.steps, layout, ft, env=heartbeat)
            result[name] = step_times(job, ft, settings.warmup)
        rounds.append(result)
    steady = steady_tables(rounds, parameter_count())
    return (
        f"### Time lost per fault\n\n{fault}\n### Steps without faults: the cost of `--ft`, and HSDP vs ZeRO-3 "
        f"as 2 nodes\n\n{settings.rounds} round(s) of {settings.steps} steps per job (the first "
        f"{settings.warmup} not counted), alternating order.\n\n{steady}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke test: few steps, one round (figures mean little)")
    parser.add_argument("--out", type=Path, default=None, help="rewrite the bench:fault_tolerance block of this file")
    args = parser.parse_args()
    settings = Settings.quick() if args.quick else Settings()
    info = machine()
    started, before = time.perf_counter(), busy_cpu_seconds()
    with tempfile.TemporaryDirectory() as folder:
        section = measure(settings, Path(folder))
    after = busy_cpu_seconds()
    info["wall_s"] = time.perf_counter() - started
    info["foreign_cpu_s"] = max(0.0, (after[0] - before[0]) - (after[1] - before[1]))
    command = "python -m benchmarks.fault_tolerance" + " --quick" * args.quick + " --out BENCHMARKS.md" * bool(args.out)
    text = (
        f"`{command}`\n\n{section}\nplait {info['plait']}, {time.strftime('%Y-%m-%d')}. Machine: {info['nproc']} "
        f"cores, {info['cpu']}, torch {info['torch']}; {conditions(info)}; 1-minute load {os.getloadavg()[0]:.2f} "
        f"after it.\n"
    )
    if args.out is not None:
        replace_block(args.out, "fault_tolerance", text)
    print(text)  # noqa: T201 - a command-line report


if __name__ == "__main__":
    main()
