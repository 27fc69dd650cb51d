"""A rank's lowered actions as the runtime posts them: compute actions and batches of transfers.

``lower`` (schedule.py) places every send right after its producer and every recv at the same point of one global
order, and the runtime posts each run of consecutive transfers as one batch: correct on any transport, even one
that runs a group's operations in order (NCCL runs a communicator's sends and receives on one stream, so a receive
posted early would hold up the sends queued behind it).

Where each message progresses on its own (gloo: every send and receive is matched and moved by the transport's
I/O threads as soon as both ends are posted), receives can be posted ahead. A receive posted after the message
has arrived costs a hand-over: the bytes wait in the socket until the receive is posted, and only then are read,
on the critical path; posted ``k`` compute actions earlier, they are read while this rank computes. Moving
receives earlier keeps their order (per peer, gloo matches receives to sends first-posted, first-matched), and
every wait stays where it was: a rank waits for a receive only before the compute that consumes it, and for its
sends only where it did before, so a lowering that completes still completes. The cost is ``k`` more receive
buffers alive (each one stage input or output gradient).
"""

from __future__ import annotations

from collections.abc import Sequence

from plait.parallel.pipeline.schedule import Action, Kind

Batch = tuple[Action, ...]
"""Transfers waited for together (one ``Pending``)."""
Post = tuple[Batch, ...]
"""Batches posted by one call (``Comm.send_recv_batches``, one ``batch_isend_irecv``): the runtime posts one
``Post`` wherever the rank's list has transfers, and waits for each batch on its own."""

RECV_KINDS = frozenset({Kind.RECV_FORWARD, Kind.RECV_BACKWARD})


def ahead(slot: int, lookahead: int) -> int:
    """Where receives lowered before compute action ``slot`` are posted: ``lookahead`` computes earlier, but not
    before the step's first compute unless they were there (the first compute starts the pipeline: nothing
    else goes in front of it)."""
    return slot if slot == 0 else max(1, slot - lookahead)


def program(actions: Sequence[Action], recv_lookahead: int | None) -> list[Action | Post]:
    """``actions`` (one rank's lowered list) as compute actions and posts of transfer batches, in order.

    ``recv_lookahead=None``: each run of consecutive transfers is one batch, posted alone where the lowering put
    it. An integer ``k >= 0``: sends stay where they are, as one batch, and each run's receives become their own
    batch, posted ``k`` compute actions earlier (``ahead``), in their original order, after the sends posted at the
    same point; the batches due at one point are posted together (one ``Post``)."""
    if recv_lookahead is not None and recv_lookahead < 0:
        raise ValueError(f"recv_lookahead must be >= 0 or None, got {recv_lookahead}")
    runs: list[list[Action]] = [[]]  # runs[c]: the transfers posted before compute action c
    computes: list[Action] = []
    for action in actions:
        if action.is_comm:
            runs[-1].append(action)
        else:
            computes.append(action)
            runs.append([])
    if recv_lookahead is None:
        out: list[Action | Post] = []
        for run, compute in zip(runs, [*computes, None]):
            if run:
                out.append((tuple(run),))
            if compute is not None:
                out.append(compute)
        return out
    posts: list[list[Batch]] = [[] for _ in runs]  # posts[c]: the batches posted before compute action c
    for c, run in enumerate(runs):  # sends first: a peer may be waiting for them
        posts[c].append(tuple(a for a in run if a.kind not in RECV_KINDS))
    for c, run in enumerate(runs):  # a run's receives move earlier, as one batch (waited for as one)
        posts[ahead(c, recv_lookahead)].append(tuple(a for a in run if a.kind in RECV_KINDS))
    out = []
    for c in range(len(runs)):
        post = tuple(batch for batch in posts[c] if batch)
        if post:
            out.append(post)
        if c < len(computes):
            out.append(computes[c])
    return out


__all__ = ["RECV_KINDS", "Batch", "Post", "ahead", "program"]
