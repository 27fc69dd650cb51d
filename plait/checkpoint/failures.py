"""What went wrong in a checkpoint read or write, said in one line with its root cause and the fix.

torch.distributed.checkpoint reports any failure of any rank as a ``CheckpointException``, which derives from
``BaseException`` (an ``except Exception`` misses it) and prints every rank's whole traceback. Its root cause
is often far from its last line: a full disk shows as torch's zip writer's "unexpected pos 704 vs 598", and a
data file that is not a plain tensor as torch's advice to re-run ``torch.load`` with ``weights_only=False`` --
advice plait must never pass on, since following it would unpickle (run) whatever the file holds.

``save_failed`` and ``read_failed`` turn any such failure into a ``CheckpointError`` of one line: a plait error
raised inside DCP comes back as itself; a full disk is named as such (an ``ENOSPC`` / ``EDQUOT`` errno anywhere
in the chain, its text, or -- for torch's zip writer, which drops the errno -- a nearly full device right after
the failure); anything else as its exception's first line, without torch's unpickling advice.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from plait import files
from plait.errors import CheckpointError, PlaitError

UNPICKLING = re.compile(r"weights[ _-]only", re.IGNORECASE)
WRITE_FAILURES: tuple[type[BaseException], ...] = (Exception, CheckpointException)
"""What a failed checkpoint write may raise (DCP's exception is a BaseException; KeyboardInterrupt is not caught)."""


def causes(error: BaseException) -> list[BaseException]:
    """``error``, every rank's failure inside a ``CheckpointException``, and each one's causes, outermost first."""
    found: list[BaseException] = []
    pending = [error]
    while pending:
        current = pending.pop(0)
        if any(current is seen for seen in found):
            continue
        found.append(current)
        if isinstance(current, CheckpointException):
            pending += [failure for failure, _trace in current.failures.values()]
        pending += [e for e in (current.__cause__, current.__context__) if e is not None]
    return found


def first_line(error: BaseException) -> str:
    """``TypeName: first line of the message`` of ``error``'s root cause; a refused unpickling (torch's
    ``weights_only`` loader anywhere in the chain) as what it means, never with torch's advice to unpickle."""
    chain = causes(error)
    root = _root(error)
    lines = [line.strip() for line in str(root).splitlines() if line.strip()]
    detail = lines[0] if lines else type(root).__name__
    if any(isinstance(e, pickle.UnpicklingError) or UNPICKLING.search(str(e)) for e in chain):
        if UNPICKLING.search(detail):
            found = re.search(r"(Unsupported global|Trying to load unsupported)[^\n]*", str(root))
            detail = found.group(0).strip() if found else "it names what a tensor never needs"
        return (
            f"a data file holds a pickled object that is not a plain tensor ({detail.rstrip('.')}): refused, since "
            f"unpickling it could run code"
        )
    return f"{type(root).__name__}: {detail}"


def disk_problem(error: BaseException, folder: Path) -> str | None:
    """The disk-level root cause of a failed write into ``folder`` (None when it is not one): ``plait.files``'
    rule, shared by every writer, over every rank's failure and its causes."""
    return files.disk_problem([e for e in causes(error) if not isinstance(e, CheckpointException)], folder)


def save_failed(error: BaseException, folder: Path, what: str) -> CheckpointError:
    """The one-line error of a failed save (``what``: e.g. "rank 0: the save of step 5 under ckpt") into
    ``folder`` (its ``.partial`` folder, removed afterwards by the caller)."""
    disk = disk_problem(error, folder)
    if disk is not None:
        return CheckpointError(
            f"{what} failed: {disk}. The previous checkpoint is intact and `latest` still names it; the partial "
            f"save is removed. Fix: free space on that disk (or save to a larger one: another train.out or "
            f"checkpoint root), or keep fewer checkpoints (train.keep_checkpoints)."
        )
    plait = next((e for e in causes(error) if isinstance(e, PlaitError)), None)
    reason = str(plait) if plait is not None else first_line(error)
    return CheckpointError(
        f"{what} failed: {reason}. The previous checkpoint is intact and `latest` still names it; the partial save "
        f"is removed. Fix: check the disk (space, permissions) and the other ranks' errors."
    )


def read_failed(error: BaseException, folder: Path) -> PlaitError:
    """The error of a failed read of the checkpoint in ``folder``: a plait error raised inside DCP as itself,
    anything else as one line without torch's advice to unpickle."""
    plait = next((e for e in causes(error) if isinstance(e, PlaitError)), None)
    if plait is not None:
        return plait
    return CheckpointError(
        f"reading checkpoint {folder} failed: {first_line(error)}. Fix: resume from another checkpoint, or "
        f"restore its files from a copy (`plait checkpoint verify` checks them)."
    )


def _root(error: BaseException) -> BaseException:
    """The innermost failure: the last cause of the first rank's failure."""
    chain = [e for e in causes(error) if not isinstance(e, CheckpointException)]
    if not chain:
        return error
    first = chain[0]
    for _ in range(32):  # a cause chain is short; never loop on a cyclic one
        inner = first.__cause__ or first.__context__
        if inner is None:
            break
        first = inner
    return first


__all__ = ["WRITE_FAILURES", "causes", "disk_problem", "first_line", "read_failed", "save_failed"]
