"""DualPipeV's overlapped pair: the forward chunk of one micro-batch and the backward chunk of another, together.

DeepSeek-V3 (sec. 3.2.1, DualPipe) pairs, in the steady state, a forward chunk with a backward chunk of another
micro-batch on the same rank, so that each one's expert-parallel all-to-alls travel while the other computes.
Here the pair runs as two cooperating threads that hand one *baton* back and forth (``Baton``): only the holder
runs, so the pair is one deterministic sequence of operations. The switch points are the exchanges: an ep
all-to-all issued asynchronously calls ``Comm.overlap`` (``Baton.switch``) before it waits, so the other chunk
computes while the rows are on the wire. The forward holds the baton first; the backward starts at the forward's
first exchange (at its end if it has none).

Why it is sound:

- *Same results*: the same operations on the same tensors (the two chunks touch disjoint stages: their
  parameters, saved activations and gradients are their own), so the pair is bitwise the sequential pair.
- *Same collective order on every peer*: the switch points do not depend on timing, and the ranks of every group
  but pp (ep, tp, cp, dp) run the same program, so each issues its collectives in the same order.
- *No deadlock on the pipeline's messages*: the runtime waits for both chunks' inputs before the pair starts and
  posts both outputs after it ends; that is the dependency rule of the pair swapped (the backward first), which
  the simulator proves deadlock-free for DualPipeV's pairs (``tests/test_pipeline_overlap.py``, p = 2..8).

Where nothing is exchanged (no ep) the pair would only add a thread, so the runtime fuses only under ep > 1, on a
transport whose receives are posted ahead (gloo). Under ZeRO-3 each chunk runs in its own stage's scope, whose
gathers are issued at the same points of the same sequence on every rank (``zero/fsdp_pipeline.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from plait.logging import get_logger

logger = get_logger(__name__)


class Baton:
    """Two parties, 0 and 1, of which only the holder runs (party 0 first). ``switch`` hands the baton to the other
    party while it still runs and blocks until it comes back; ``finish`` hands it over for good."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._holder = 0
        self._running = [True, True]
        self._party: dict[int, int] = {}

    def enter(self, party: int) -> None:
        """Bind the calling thread to ``party`` and wait for the baton."""
        with self._cond:
            self._party[threading.get_ident()] = party
            self._cond.wait_for(lambda: self._holder == party)

    def switch(self) -> None:
        """Let the other party run until it switches back or finishes (nothing when it has finished)."""
        me = self._party[threading.get_ident()]
        with self._cond:
            if not self._running[1 - me]:
                return
            self._holder = 1 - me
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._holder == me)

    def finish(self) -> None:
        """The calling party is done: the other one holds the baton from now on."""
        me = self._party[threading.get_ident()]
        with self._cond:
            self._running[me] = False
            self._holder = 1 - me
            self._cond.notify_all()


def run_pair(
    first: Callable[[], None], second: Callable[[], None], install: Callable[[Callable[[], None] | None], None]
) -> None:
    """Run ``first`` on this thread and ``second`` on a helper thread, one at a time, switching where either calls
    the hook that ``install`` sets (``Baton.switch``; ``install(None)`` removes it after). Returns when both are
    done; an exception of either is raised here (``first``'s first)."""
    baton = Baton()
    errors: list[BaseException] = []

    def helper() -> None:
        baton.enter(1)
        try:
            second()
        except BaseException as error:  # noqa: BLE001 - handed to the calling thread
            errors.append(error)
        finally:
            baton.finish()

    thread = threading.Thread(target=helper, name="plait-pipeline-pair", daemon=True)
    baton.enter(0)
    install(baton.switch)
    thread.start()
    try:
        first()
    finally:
        baton.finish()
        thread.join()
        install(None)
    if errors:
        raise errors[0]


__all__ = ["Baton", "run_pair"]
