"""Run a function on N local ranks in spawned processes, the way torchrun would, and fail fast and clearly.

``run_local(fn, world_size, *args)`` starts N processes (forkserver with torch and plait preloaded, so each starts
in a fraction of a second), sets RANK / WORLD_SIZE / LOCAL_RANK like torchrun, initialises a process group
(gloo by default) through a file:// rendezvous, calls ``fn(*args)`` on every rank and returns the list of their
return values (rank order). If a rank raises, ``LaunchError`` re-raises the first error with its rank and
traceback, after giving the other ranks a moment to report theirs; a rank that dies without a word (killed,
os._exit) is named with its exit code; if the whole run outlasts ``timeout`` every process is killed and the
error names the ranks that had not finished. Nothing hangs.

This is plait's one local launcher for functions (tests, ``plait calibrate``, benchmarks that measure inside
ranks). ``plait train`` launches whole programs through torchrun's own launcher instead, and the parameter
server starts its servers and workers (no process group, restartable one by one) with its own ``LocalCluster``
(``plait.param_server.launch``).

Ranks die with their launcher (``die_with_parent``). torchrun starts each rank in a session of its own, so a
launcher killed outright (SIGKILL, the OOM killer) takes nothing with it: its ranks would train on and keep writing
the run folder, where a resumed job then writes too. So every rank, at start-up, asks the kernel for SIGKILL when
its parent ends (Linux ``prctl(PR_SET_PDEATHSIG)``) and checks that its parent is still the process that started
it (the launcher may have died before the request was made); a thread watching the parent's pid does the same on
other systems. A rank stopped this way is gone within a second, exits non-zero and publishes nothing. Processes
that a forkserver starts (``run_local``'s ranks, the parameter server's ``LocalCluster``) are not children of the
process that asked for them, so they watch that process's pid instead (``die_with_process``).
"""

from __future__ import annotations

import ctypes
import datetime
import io
import multiprocessing as mp
import os
import queue
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from plait.errors import PlaitError
from plait.logging import get_logger

log = get_logger(__name__)
GRACE_S = 20.0
"""After the first failure, how long the other ranks get to report their own errors before they are killed."""
LAUNCHER_PID_ENV = "PLAIT_LAUNCHER_PID"
"""Set by ``plait train``'s launcher for its ranks: the pid of the process that starts them (their parent)."""
ORPHANED_EXIT_CODE = 125
"""What a rank exits with when its parent watch (not the kernel's SIGKILL) finds its launcher gone."""
PARENT_POLL_S = 0.5
_PR_SET_PDEATHSIG = 1


class LaunchError(PlaitError):
    """One or more ranks failed, died or timed out; ``failures`` maps rank -> what happened."""

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures


def _set_parent_death_signal(sig: int) -> bool:
    """Linux: have the kernel send ``sig`` to this process when its parent thread ends; False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _exit_orphaned(name: str, parent: int) -> None:
    log.error(
        "%s: its launcher (pid %d) is gone; stopping at once (exit code %d) so that nothing more is written "
        "to the run folder. Fix: start the job again (it resumes from the last published checkpoint).",
        name,
        parent,
        ORPHANED_EXIT_CODE,
    )
    sys.stderr.flush()
    os._exit(ORPHANED_EXIT_CODE)


def _watch_parent(name: str, parent: int, poll_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(poll_s)
    _exit_orphaned(name, parent)


def die_with_parent(name: str, parent: int | None = None, poll_s: float = PARENT_POLL_S) -> int:
    """Make this process end when ``parent`` (default: its current parent) ends; returns the parent's pid.

    SIGKILL from the kernel at the parent's death where Linux offers it, and on every system a daemon thread that
    exits with ``ORPHANED_EXIT_CODE`` once the parent's pid is no longer this process's parent. If ``parent``
    is already gone (it died before this call: the process was reparented), this exits at once. Call it first
    thing in a process started by a launcher (with the launcher's pid from ``LAUNCHER_PID_ENV`` where it is set:
    the kernel's signal follows whoever is the parent at the time of the call)."""
    parent = os.getppid() if parent is None else parent
    _set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:
        _exit_orphaned(name, parent)
    threading.Thread(target=_watch_parent, args=(name, parent, poll_s), name="plait-parent-watch", daemon=True).start()
    return parent


def _identity(pid: int) -> str | None:
    """Linux: ``pid``'s start time (/proc/PID/stat field 22), which with the pid names one process even after the
    pid is reused; None for a process that is gone or a zombie, "" where /proc is not available."""
    if not os.path.isdir("/proc"):
        return ""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _is_alive(pid: int, identity: str | None) -> bool:
    if identity:
        return _identity(pid) == identity
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _watch_process(name: str, pid: int, identity: str | None, poll_s: float) -> None:
    while _is_alive(pid, identity):
        time.sleep(poll_s)
    _exit_orphaned(name, pid)


def die_with_process(name: str, pid: int, poll_s: float = PARENT_POLL_S) -> None:
    """Make this process end (``ORPHANED_EXIT_CODE``) within ``poll_s`` of the end of ``pid``, a process that is not
    its parent: the one that asked a forkserver for it (``run_local``, the parameter server's ``LocalCluster``),
    whose children the kernel's parent-death signal cannot reach (the forkserver outlives its caller as long as any
    of its children lives). Exits at once if ``pid`` is already gone."""
    identity = _identity(pid)
    if identity is None or not _is_alive(pid, identity):
        _exit_orphaned(name, pid)
    threading.Thread(
        target=_watch_process, args=(name, pid, identity, poll_s), name="plait-launcher-watch", daemon=True
    ).start()


def launcher_pid() -> int | None:
    """The pid of ``plait train``'s launcher when this process is one of its ranks (``LAUNCHER_PID_ENV``)."""
    text = os.environ.get(LAUNCHER_PID_ENV, "")
    return int(text) if text.isdigit() else None


def spawn_context() -> mp.context.ForkServerContext:
    """A forkserver context whose server has torch and plait imported: each process starts in a fraction of a
    second instead of importing torch again."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "plait"])
    return ctx


def _to_bytes(value: Any) -> bytes:
    """Serialise a result (tensors included) by value: torch's queue would share tensor storage through file
    descriptors that vanish when the worker exits."""
    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _from_bytes(payload: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(payload), weights_only=False)  # our own workers' results, not a user file


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    init_file: str,
    comm_timeout_s: float,
    backend: str,
    results: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    owner: int,
    env: dict[str, str],
) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
        PLAIT_TIMEOUT_S=str(comm_timeout_s),
    )
    os.environ.update(env)  # before the process group starts: NCCL reads NCCL_ALGO / NCCL_PROTO when it does
    try:
        die_with_process(f"rank {rank}", owner)  # the process that called run_local
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=comm_timeout_s),
        )
        value = fn(*args, **kwargs)
        results.put((rank, "ok", _to_bytes(value)))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    comm_timeout_s: float = 30.0,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` local ranks; return their results in rank order. ``fn`` and
    its arguments must be picklable (a module-level function); results are sent back by value. ``env``: variables
    set in each rank's environment before its process group starts (``plait.determinism.DETERMINISTIC_ENV``)."""
    ctx = spawn_context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="plait-launch-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        owner = os.getpid()  # the ranks die with this process
        procs = [
            ctx.Process(
                target=_worker,
                args=(fn, r, world_size, init_file, comm_timeout_s, backend, results, args, kwargs, owner, env or {}),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for proc in procs:
            proc.start()
        try:
            return _collect(procs, results, world_size, timeout)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
            for proc in procs:
                proc.join(timeout=5)


def _collect(procs: list[Any], results: Any, world_size: int, timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    first_failure_at: float | None = None
    while len(values) + len(failures) < world_size:
        now = time.monotonic()
        if now > deadline:
            pending = [r for r in range(world_size) if r not in values and r not in failures]
            for r in pending:
                failures[r] = f"did not finish within the {timeout:g} s test timeout (hung or too slow)"
            break
        if first_failure_at is not None and now > first_failure_at + GRACE_S:
            for r in range(world_size):
                if r not in values and r not in failures:
                    failures[r] = "still running when another rank had failed; killed"
            break
        try:
            rank, status, payload = results.get(timeout=0.2)
        except queue.Empty:
            for r, proc in enumerate(procs):
                if r not in values and r not in failures and not proc.is_alive() and proc.exitcode not in (0, None):
                    time.sleep(0.3)  # its report may still be in the pipe
                    if results.empty():
                        failures[r] = f"died with exit code {proc.exitcode} without reporting (killed or os._exit)"
                        first_failure_at = first_failure_at or time.monotonic()
            continue
        if status == "ok":
            values[rank] = _from_bytes(payload)
        else:
            failures[rank] = payload
            first_failure_at = first_failure_at or time.monotonic()
    if failures:
        text = "\n".join(f"--- rank {r}: {failures[r]}" for r in sorted(failures))
        raise LaunchError(f"{len(failures)} of {world_size} ranks failed:\n{text}", failures)
    return [values[r] for r in range(world_size)]


__all__ = [
    "GRACE_S",
    "LAUNCHER_PID_ENV",
    "ORPHANED_EXIT_CODE",
    "LaunchError",
    "die_with_parent",
    "die_with_process",
    "launcher_pid",
    "run_local",
    "spawn_context",
]
