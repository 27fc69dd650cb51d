"""Fault tolerance for ``plait train``: a hang watchdog, an injected fault for tests, and resuming metrics.

A job survives a dead rank by restarting: ``plait train --max-restarts N`` runs the workers under torchrun's
elastic agent, which stops every worker when one exits non-zero and starts them all again (at most N times);
each resumes from ``<run>/ckpt``. Dying is easy to notice; hanging is not, so every rank runs a ``Watchdog``:

* inside a collective (a frame of ``plait/comm`` or ``torch/distributed`` on the main thread's stack) the
  collective's own timeout applies (``PLAIT_TIMEOUT_S``; ``CommError`` names rank, axis and op);
* outside one (a deadlocked Python loop, a hung data loader) no progress for ``PLAIT_WATCHDOG_S`` seconds
  (default half of ``PLAIT_TIMEOUT_S``, so it speaks before the peers' collectives time out; 0 turns it off)
  logs the rank, its last operation and where the main thread is, and exits with ``WATCHDOG_EXIT_CODE``.
  The agent then tears the other workers down and restarts the job or fails it, naming the rank.

``PLAIT_FAULT_INJECT="rank=1,step=8"`` (a testing aid) makes rank 1 die just before training step 8, on the
first attempt only (torchrun's ``TORCHELASTIC_RESTART_COUNT`` is 0), so the restarted job completes. Options:
``action=exit`` (``os._exit(code)``, default), ``kill`` (SIGKILL) or ``hang`` (wait forever: the watchdog's
case); ``code=1``; ``attempt=0`` (the restart attempt it fires on).

One job per run folder (``RunFolderLock``): the process that owns a job (``plait train``'s launcher, else rank 0)
holds an exclusive ``flock`` on ``<run>/.plait.lock`` for the job's life, and a second job on the same folder (a
resume started while the old job still runs) is refused before it starts anything, naming the holder's pid. The
kernel drops the lock when its holder dies, however it dies, so a stale lock never blocks a resume; the ranks of
a dead launcher die with it (``plait.launch.die_with_parent``), so nothing writes the folder unlocked.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.errors import ConfigError
from plait.launch import ORPHANED_EXIT_CODE
from plait.logging import get_logger

log = get_logger(__name__)
FAULT_ENV = "PLAIT_FAULT_INJECT"
WATCHDOG_ENV = "PLAIT_WATCHDOG_S"
WATCHDOG_EXIT_CODE = 124
"""What a rank stopped by the watchdog exits with (as GNU timeout does)."""
COLLECTIVE_PATHS = (os.path.join("plait", "comm", ""), os.path.join("torch", "distributed", ""))
"""A main-thread frame from these folders means "inside a collective": its own timeout applies there."""
_ELASTIC = os.path.join("torch", "distributed", "elastic", "")
ACTIONS = ("exit", "kill", "hang")
LOCK_NAME = ".plait.lock"


def restart_count(environ: Mapping[str, str] = os.environ) -> int:
    """Which attempt this is: 0 on the first, n after the n-th restart by torchrun's agent."""
    return int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


@dataclass(frozen=True)
class Fault:
    """A failure to inject: ``rank`` does ``action`` just before training step ``step`` of attempt ``attempt``."""

    rank: int
    step: int
    action: str = "exit"
    code: int = 1
    attempt: int = 0

    @classmethod
    def parse(cls, text: str) -> Fault:
        """Read ``"rank=1,step=8[,action=exit|kill|hang][,code=1][,attempt=0]"``."""
        fields: dict[str, Any] = {}
        usage = f'Fix: e.g. {FAULT_ENV}="rank=1,step=8" (optional: action=exit|kill|hang, code=1, attempt=0).'
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or key not in ("rank", "step", "action", "code", "attempt"):
                raise ConfigError(
                    f"{FAULT_ENV}={text!r}: {item!r} is not rank=, step=, action=, code= or attempt=. {usage}"
                )
            if key == "action":
                if value not in ACTIONS:
                    raise ConfigError(f"{FAULT_ENV}={text!r}: action={value!r} is not one of {ACTIONS}. {usage}")
                fields[key] = value
            else:
                try:
                    fields[key] = int(value)
                except ValueError:
                    raise ConfigError(f"{FAULT_ENV}={text!r}: {key}={value!r} is not an integer. {usage}") from None
        if "rank" not in fields or "step" not in fields:
            raise ConfigError(f"{FAULT_ENV}={text!r} needs both rank= and step=. {usage}")
        fault = cls(**fields)
        if fault.rank < 0 or fault.step < 1 or fault.attempt < 0:
            raise ConfigError(f"{FAULT_ENV}={text!r}: rank and attempt must be >= 0 and step >= 1. {usage}")
        return fault

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Fault | None:
        text = environ.get(FAULT_ENV, "").strip()
        return cls.parse(text) if text else None

    def fire_if_due(self, rank: int, step: int, attempt: int) -> None:
        """Die (or hang) here if this is the rank, step and attempt the fault names."""
        if (rank, step, attempt) != (self.rank, self.step, self.attempt):
            return
        log.error("rank %d: %s injects '%s' before step %d (attempt %d)", rank, FAULT_ENV, self.action, step, attempt)
        sys.stderr.flush()
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.action == "hang":
            while True:  # deadlocked on purpose: only the watchdog (or the launcher) ends this process
                threading.Event().wait(3600)
        os._exit(self.code)


def watchdog_seconds(environ: Mapping[str, str] = os.environ) -> float:
    """``PLAIT_WATCHDOG_S``, default half of ``PLAIT_TIMEOUT_S`` (300 s); 0 turns the watchdog off."""
    text = environ.get(WATCHDOG_ENV, "").strip()
    if not text:
        return float(environ.get("PLAIT_TIMEOUT_S", "300")) / 2
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise ConfigError(
            f"{WATCHDOG_ENV}={text!r} must be a number of seconds >= 0. Fix: e.g. {WATCHDOG_ENV}=60 "
            f"(0 turns the hang watchdog off)."
        )
    return seconds


def _exit_hung(report: str) -> None:
    log.error("%s", report)
    sys.stderr.flush()
    os._exit(WATCHDOG_EXIT_CODE)


class Watchdog:
    """Reports (and by default ends) the watched thread when it makes no progress outside a collective.

    Progress is a ``beat(operation)`` or the watched thread seen inside a collective (checked every
    ``poll_s``); ``timeout_s`` without either calls ``on_hang`` with a report naming the rank, the last
    operation and the watched thread's stack. The watched thread is the one that creates the watchdog.
    """

    def __init__(
        self,
        rank: int,
        timeout_s: float,
        on_hang: Callable[[str], None] = _exit_hung,
        collective_paths: tuple[str, ...] = COLLECTIVE_PATHS,
        poll_s: float | None = None,
    ) -> None:
        self.rank, self.timeout_s, self.on_hang, self.collective_paths = rank, timeout_s, on_hang, collective_paths
        self.poll_s = poll_s if poll_s is not None else min(1.0, max(0.01, timeout_s / 20))
        self.operation, self._progress, self._timed = "starting", time.monotonic(), True
        self._watched = threading.get_ident()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, operation: str, timed: bool = True) -> None:
        """Record progress: the watched thread now does ``operation``; ``timed=False`` suspends the watch until
        the next beat (for work of unbounded length outside collectives, such as building a large model)."""
        self.operation, self._progress, self._timed = operation, time.monotonic(), timed

    def start(self) -> Watchdog:
        if self.timeout_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"plait-watchdog-rank{self.rank}", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _stack(self) -> list[traceback.FrameSummary]:
        frame = sys._current_frames().get(self._watched)
        return traceback.extract_stack(frame) if frame is not None else []

    def in_collective(self, stack: list[traceback.FrameSummary]) -> bool:
        """Whether a frame of the stack is in a collective (torch.distributed.elastic's wrappers do not count)."""
        return any(
            path in entry.filename and _ELASTIC not in entry.filename
            for entry in stack
            for path in self.collective_paths
        )

    def report(self, idle_s: float, stack: list[traceback.FrameSummary]) -> str:
        where = "".join(traceback.format_list(stack[-8:])).rstrip() or "  (not running)"
        return (
            f"rank {self.rank}: hang watchdog: no progress for {idle_s:.1f} s outside any collective "
            f"({WATCHDOG_ENV}={self.timeout_s:g}); last operation: {self.operation}. The main thread is at:\n"
            f"{where}\nExiting with code {WATCHDOG_EXIT_CODE} so that the launcher stops (or restarts) the job."
        )

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            stack = self._stack()
            now = time.monotonic()
            if not self._timed or self.in_collective(stack):
                self._progress = now  # untimed, or in a collective: its own timeout covers it
                continue
            idle = now - self._progress
            if idle > self.timeout_s:
                self.on_hang(self.report(idle, stack))
                return


class RankGuard:
    """One rank's fault handling in the training loop: the watchdog and the injected fault (if any)."""

    def __init__(self, rank: int, watchdog: Watchdog, fault: Fault | None = None, attempt: int = 0) -> None:
        self.rank, self.watchdog, self.fault, self.attempt = rank, watchdog, fault, attempt

    @classmethod
    def from_env(cls, rank: int, environ: Mapping[str, str] = os.environ) -> RankGuard:
        """Read ``PLAIT_WATCHDOG_S``, ``PLAIT_FAULT_INJECT`` and torchrun's restart count (ConfigError if bad)."""
        return cls(rank, Watchdog(rank, watchdog_seconds(environ)), Fault.from_env(environ), restart_count(environ))

    def __enter__(self) -> RankGuard:
        self.watchdog.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.watchdog.stop()

    def beat(self, operation: str, timed: bool = True) -> None:
        self.watchdog.beat(operation, timed)

    def batches(self, loader: Iterable[Any], engine: Any) -> Iterator[Any]:
        """``loader``'s batches, beating (and firing the injected fault) around each one for ``engine.step + 1``."""
        batches = iter(loader)
        while True:
            step = engine.step + 1
            self.beat(f"step {step}: loading the batch")
            if self.fault is not None:
                self.fault.fire_if_due(self.rank, step, self.attempt)
            try:
                batch = next(batches)
            except StopIteration:
                return
            self.beat(f"step {step}: train_step")
            yield batch


def resume_metrics(path: Path, step: int, total_steps: int) -> int:
    """Drop the records a resumed run will write again: those after ``step`` (the checkpoint it resumes from).

    Records at ``step`` itself were written before that checkpoint was saved, except a final evaluation (written
    once the run reaches ``total_steps``), which the resumed run repeats. Unreadable lines (a crash mid-write)
    go too. Rewrites ``path`` atomically; returns how many records were dropped.
    """
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            at = int(record.get("step", 0))
        except (ValueError, TypeError, AttributeError):
            dropped += 1
            continue
        if at > step or (at == step >= total_steps and record.get("kind") == "eval"):
            dropped += 1
        else:
            kept.append(line + "\n")
    if dropped:
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
        log.info("resuming at step %d: dropped %d record(s) after it from %s", step, dropped, path)
    return dropped


class RunFolderLock:
    """An exclusive lock on a run folder for one job's life (module docstring); ``acquire`` or ConfigError."""

    def __init__(self, run_dir: Path, fd: int) -> None:
        self.run_dir, self.fd = run_dir, fd

    @classmethod
    def acquire(cls, run_dir: str | Path) -> RunFolderLock:
        """Lock ``run_dir`` (created if missing) for this process; refuse if another job holds it."""
        run_dir = Path(run_dir)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as error:
            raise ConfigError(
                f"cannot use the run folder {run_dir}: {error.strerror or error}. Fix: pass --out with a folder "
                f"this user may write (not a file)."
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "a process"
            os.close(fd)
            raise ConfigError(
                f"the run folder {run_dir} is in use by another plait train job ({holder}): two jobs writing one "
                f"folder would mix their checkpoints and metrics. Fix: wait for that job to end or stop it, or "
                f"pass another --out."
            ) from None
        except OSError as error:  # a filesystem without locks: train, but say what is not guarded
            log.warning(
                "cannot lock the run folder %s (%s): a second job started on it would not be refused",
                run_dir,
                error.strerror or error,
            )
            return cls(run_dir, fd)
        os.ftruncate(fd, 0)
        os.pwrite(
            fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0
        )
        return cls(run_dir, fd)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the descriptor drops the lock
            self.fd = -1

    def __enter__(self) -> RunFolderLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def describe_exit(code: int) -> str:
    """``exit code N`` with what it means when plait knows (the watchdog's code, a stop or a kill by a signal)."""
    if code == WATCHDOG_EXIT_CODE:
        return f"exit code {code}: stopped by the hang watchdog"
    if code == ORPHANED_EXIT_CODE:
        return f"exit code {code}: stopped because its launcher died"
    if code - 128 in (signal.SIGTERM, signal.SIGINT):  # plait.train.stop.stop_exit_code
        return f"exit code {code}: stopped by {signal.Signals(code - 128).name}"
    if code < 0:
        try:
            return f"exit code {code}: killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit code {code}"
