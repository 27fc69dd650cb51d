"""Preemption-safe stop: SIGTERM or SIGINT ends a training run after a completed step, with a checkpoint of it.

A cluster scheduler tells a preempted job to stop with SIGTERM (Ctrl-C is SIGINT). ``StopRequest`` is the handler
a training process installs: it only records the first signal (a handler that raised could do so inside a
collective and leave the peers waiting). The training loop reads the record at each step boundary, and the ranks
agree on it through the all-gather every step already makes (``plait.train.metrics.StepMeter.measure``: one more
number per rank, no collective of its own), so every rank stops after the same step: they save that step
together, rank 0 logs one line (the signal, the step, how to resume) and each process exits with
``stop_exit_code``: 128 + the signal's number (143 for SIGTERM, 130 for SIGINT), as a shell reports a process
the signal ended.

A second signal: a process started by a launcher (torchrun's agent, or ``plait train``'s own) leaves it to the
launcher, which forwarded the first one and stops at once on its second (its workers die with it:
``plait.launch.die_with_parent``); a scheduler that signals every process of a job (Slurm) would otherwise turn
its one SIGTERM and the launcher's forwarded copy into two. A lone process (``plait train --nproc 1``) is its own
launcher: its second signal ends it at once, the default action restored.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
RESUME_COMMAND_ENV = "PLAIT_RESUME_COMMAND"
"""Set by ``plait train``'s launcher for its workers: the command line that resumes the run."""


def stop_exit_code(signum: int) -> int:
    """The exit status of a process stopped by ``signum``: 128 + its number (SIGTERM 143, SIGINT 130)."""
    return 128 + int(signum)


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopRequest:
    """The first SIGTERM / SIGINT this process receives (``signum``, 0 while none), for the loop to act on."""

    def __init__(self, lone: bool) -> None:
        self.lone = lone
        """No launcher above this process: a second signal ends it at once."""
        self.signum = 0
        self._previous: dict[int, object] = {}

    def install(self) -> StopRequest:
        """Handle SIGTERM and SIGINT in this process until ``restore`` (from the main thread; elsewhere, where
        Python allows no handler, nothing changes)."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def restore(self) -> None:
        """Put back the handlers ``install`` replaced."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.signum:
            self.signum = signum  # only a record: the loop stops at the next step boundary
            return
        if self.lone:  # the second signal: stop at once, as if no handler were installed
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


def resume_command(run_dir: str) -> str:
    """The command that resumes this run: plait's launcher passes its own (``RESUME_COMMAND_ENV``); a lone
    ``plait train`` is its own command line (with the run folder it chose); under torchrun, its command again."""
    given = os.environ.get(RESUME_COMMAND_ENV)
    if given:
        return given
    if "LOCAL_RANK" in os.environ:
        return f"the same torchrun command (same --out {shlex.quote(run_dir)})"
    args = sys.argv[1:]
    if "--out" not in args and not any(arg.startswith("--out=") for arg in args):
        args += ["--out", run_dir]
    return shlex.join(["plait", *args])


__all__ = ["RESUME_COMMAND_ENV", "STOP_SIGNALS", "StopRequest", "resume_command", "signal_name", "stop_exit_code"]
