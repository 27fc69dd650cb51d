"""``plait train --ft`` on one machine: a quorum service and R replica groups, each its own torchrun job.

The launcher starts torchft's Lighthouse on 127.0.0.1 (``lighthouse``), then one ``plait train --ft-group g``
process per replica group: plait's own launcher (torchrun's agent on a loopback rendezvous, ``--max-restarts``,
signals) running S = nproc / R ranks with the group's layout (dp / R data ranks, no replicate axis) into
``<run>/replica-<g>``; ``--ft-spares K`` adds K spare groups (R + K in all, ``plait.ft.session``). A group whose
rank dies is restarted by its own agent and heals from a live group; the other groups' processes never stop. On a cluster the same pieces run by hand: ``plait lighthouse`` once, then
``plait train --ft-group g --ft-groups R --ft-lighthouse URL`` (or torchrun with PLAIT_FT_* set) per group
(docs/fault_tolerance.md). When the groups are done the launcher merges their records into
``<run>/committed.jsonl`` (``plait.ft.log``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from plait.errors import ConfigError
from plait.ft import log as committed_log
from plait.ft.options import GROUP_ENV, GROUPS_ENV, LIGHTHOUSE_ENV, REPLAY_ENV, SPARES_ENV, FTOptions
from plait.logging import get_logger

log = get_logger(__name__)
HEARTBEAT_ENV = "PLAIT_FT_HEARTBEAT_MS"
HEARTBEAT_MS = 2000
"""How long a group may stay silent before the quorum service drops it: the live groups stall this long after a
loss (torchft's managers beat every 100 ms from a thread of their own, so a slow step does not look silent)."""
FAULT_GROUP_ENV = "PLAIT_FT_FAULT_GROUP"
"""A testing aid: the replica groups ("1" or "1,2") that PLAIT_FAULT_INJECT applies to (the others run clean)."""


def lighthouse(
    bind: str = "127.0.0.1:0", heartbeat_ms: int | None = None, join_ms: int | None = None
) -> tuple[Any, str]:
    """torchft's quorum service on ``bind`` and the address replica groups reach it at (its host as bound: the
    Lighthouse names itself by the machine's hostname, which need not resolve to the interface it serves)."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft logs every quorum at info (read when it is imported)
    from torchft._torchft import LighthouseServer

    heartbeat = heartbeat_ms or int(os.environ.get(HEARTBEAT_ENV, str(HEARTBEAT_MS)))
    join = join_ms or int(1000 * min(30.0, FTOptions.timeout_from_env() / 2))  # then a slow group sits one step out
    server = LighthouseServer(bind=bind, min_replicas=1, join_timeout_ms=join, heartbeat_timeout_ms=heartbeat)
    port = urlsplit(server.address()).port
    return server, f"http://{bind.rsplit(':', 1)[0]}:{port}"


def group_overrides(layout: Any, nproc: int) -> tuple[int, int, list[str]]:
    """(R, ranks per group, the --set overrides of a group's layout) for a job layout with dp_replicate = R."""
    resolved = layout.resolve(nproc)
    groups = resolved.dp_replicate
    if groups < 2:
        raise ConfigError(
            f"--ft needs replica groups: layout.dp_replicate={groups}. Fix: --set layout.dp_replicate=2 (or more; it "
            f"must divide dp={resolved.dp})."
        )
    return groups, nproc // groups, ["layout.dp_replicate=1", f"layout.dp={resolved.dp // groups}"]


def _group_command(args: Any, group: int, groups: int, per_group: int, overrides: list[str], out: Path) -> list[str]:
    command = [sys.executable, "-m", "plait", "train", "--nproc", str(per_group), "--out", str(out)]
    command += ["--max-restarts", str(args.max_restarts), "--stop-grace", str(args.stop_grace)]
    if args.preset:
        command += ["--preset", args.preset]
    if args.config:
        command += ["--config", args.config]
    for item in list(args.overrides) + overrides:
        command += ["--set", item]
    if args.backend:
        command += [f"--backend={args.backend}"]
    if getattr(args, "deterministic", False):
        command += ["--deterministic"]
    return command


def _wait(children: list[subprocess.Popen[bytes]], grace_s: float) -> list[int]:
    """Every group's exit code. Once one group has finished the run, the others get ``grace_s`` to finish theirs
    (a group in step with it ends at once); one still restarting or healing is then stopped: there is nothing
    left for it to train."""
    finished_at = None
    while any(child.poll() is None for child in children):
        if finished_at is None and any(child.returncode == 0 for child in children):
            finished_at = time.monotonic()
        if finished_at is not None and time.monotonic() - finished_at > grace_s:
            for group, child in enumerate(children):
                if child.poll() is None:
                    log.warning("replica group %d had not rejoined when the run ended: stopped", group)
                    child.terminate()
            finished_at = float("inf")
        time.sleep(0.2)
    return [int(child.returncode) for child in children]


def run(args: Any, layout: Any) -> int:
    """Run the fault-tolerant job (module docstring); the exit code: 0 once every step is committed by some group."""
    groups, per_group, overrides = group_overrides(layout, args.nproc)
    out = Path(args.out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S")))
    out.mkdir(parents=True, exist_ok=True)
    replay = None
    if args.ft_replay:
        replay_log = committed_log.ReplayLog.read(args.ft_replay)
        replay = out / "replayed.jsonl"
        replay_log.write(replay)
    spares = getattr(args, "ft_spares", 0) or 0
    if spares < 0:
        raise ConfigError(f"--ft-spares {spares}: a count of spare replica groups is >= 0. Fix: e.g. --ft-spares 1.")
    server, address = lighthouse()
    log.info(
        "quorum service (torchft Lighthouse) at %s; %d replica groups (+%d spare) of %d ranks -> %s",
        address,
        groups,
        spares,
        per_group,
        out,
    )
    children = []
    for group in range(groups + spares):
        env = {**os.environ, GROUP_ENV: str(group), GROUPS_ENV: str(groups), LIGHTHOUSE_ENV: address}
        env[SPARES_ENV] = str(spares)
        env.setdefault("RUST_LOG", "warn")  # torchft's quorum servers log every quorum and commit at info
        if replay is not None:
            env[REPLAY_ENV] = str(replay)
        if str(group) not in os.environ.get(FAULT_GROUP_ENV, str(group)).split(","):
            env.pop("PLAIT_FAULT_INJECT", None)
        command = _group_command(args, group, groups, per_group, overrides, committed_log.replica_dir(out, group))
        children.append(subprocess.Popen(command, env=env))

    def forward(signum: int, _frame: Any) -> None:
        for child in children:
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        codes = _wait(children, FTOptions.timeout_from_env())
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        server.shutdown()
    try:
        merged = committed_log.merge(out, groups, groups + spares)
        merged.write(out / committed_log.COMMITTED)
        log.info("%d committed steps -> %s", len(merged.steps), out / committed_log.COMMITTED)
    except ConfigError as error:
        log.error("%s", error)
        return 1
    failed = [g for g, code in enumerate(codes) if code]
    if failed and len(failed) < len(codes):
        log.warning("replica group(s) %s failed for good; the others finished the run", failed)
    return 0 if len(failed) < len(codes) else max(codes)


__all__ = ["group_overrides", "lighthouse", "run"]
