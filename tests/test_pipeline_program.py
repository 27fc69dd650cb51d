"""``program``: a rank's lowered actions as the runtime posts them, receives ahead where the transport allows.

The checks run every schedule's programs together under the semantics of a transport whose messages progress on
their own (gloo): a posted transfer completes once its peer is posted, the i-th message one rank sends another
lands in the i-th receive the other posted for it, a compute waits for the batch holding its input, and 1F1B
waits its posted sends first (``PipelineRunner.SENDS_BEFORE_COMPUTE``). Every program must finish and every
message land in the receive meant for it.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest

from plait.parallel.pipeline.program import RECV_KINDS, ahead, program
from plait.parallel.pipeline.runtime import PipelineRunner
from plait.parallel.pipeline.schedule import Action, Schedule, build_schedule, lower

SEND_KINDS = ("SF", "SB")


def lowered(name: str, p: int, m: int, v: int = 1) -> Schedule:
    return lower(build_schedule(name, p, m, v))


def run_programs(schedule: Schedule, lookahead: int | None) -> None:
    """Execute every rank's program until all finish; AssertionError on a deadlock or a mismatched message."""
    programs = [program(actions, lookahead) for actions in schedule.actions]
    sends_first = schedule.name in PipelineRunner.SENDS_BEFORE_COMPUTE
    position = [0] * schedule.p
    posted_sends: dict[tuple[int, int], list[Action]] = defaultdict(list)  # (from rank, to rank) -> in order
    posted_recvs: dict[tuple[int, int], list[Action]] = defaultdict(list)
    batch_of: dict[Action, tuple[Action, ...]] = {}
    open_sends: list[list[tuple[Action, ...]]] = [[] for _ in range(schedule.p)]

    def route(rank: int, action: Action) -> tuple[int, int]:
        other = schedule.rank_of(schedule.required_peer(action).stage)
        return (rank, other) if action.kind in SEND_KINDS else (other, rank)

    def landed(rank: int, action: Action) -> bool:
        """A posted transfer is complete once the message at its place in its route's order is posted."""
        key = route(rank, action)
        mine, theirs = (posted_sends, posted_recvs) if action.kind in SEND_KINDS else (posted_recvs, posted_sends)
        index = mine[key].index(action)
        if index >= len(theirs[key]):
            return False
        peer = theirs[key][index]
        assert schedule.required_peer(action) == peer, f"{action} on rank {rank} is matched with {peer}"
        return True

    def can_run(rank: int, item: Action | tuple[Action, ...]) -> bool:
        if isinstance(item, tuple):
            return True  # posting never blocks
        receives = [c for c in schedule.comms(item) if c.kind in RECV_KINDS]
        assert all(c in batch_of for c in receives), f"rank {rank} runs {item} before posting its receive"
        needed = [batch_of[c] for c in receives]
        if sends_first:
            needed += open_sends[rank]
        return all(landed(rank, a) for batch in needed for a in batch)

    while True:
        progressed = False
        for rank, items in enumerate(programs):
            while position[rank] < len(items) and can_run(rank, items[position[rank]]):
                item = items[position[rank]]
                if isinstance(item, tuple):  # a post: its batches, each waited for on its own
                    for batch in item:
                        for action in batch:
                            batch_of[action] = batch
                            kind = posted_sends if action.kind in SEND_KINDS else posted_recvs
                            kind[route(rank, action)].append(action)
                        if any(a.kind in SEND_KINDS for a in batch):
                            open_sends[rank].append(batch)
                elif sends_first:
                    open_sends[rank] = []
                position[rank] += 1
                progressed = True
        if all(position[r] == len(programs[r]) for r in range(schedule.p)):
            break
        blocked = {r: programs[r][position[r]] for r in range(schedule.p) if position[r] < len(programs[r])}
        assert progressed, f"{schedule.name} p={schedule.p} m={schedule.m} lookahead={lookahead}: deadlock at {blocked}"
    for rank in range(schedule.p):  # the step's end waits every send
        for batch in open_sends[rank]:
            assert all(landed(rank, a) for a in batch if a.kind in SEND_KINDS)


CASES = [
    (name, p, m, v)
    for name, p, m in itertools.product(("naive", "gpipe", "1f1b", "zero-bubble", "pipedream"), (2, 3, 4), (1, 2, 5, 8))
    for v in (1,)
] + [("interleaved", p, m, 2) for p, m in ((2, 2), (2, 4), (4, 4), (4, 8), (3, 6))]
CASES += [("zb-v", p, m, 2) for p, m in ((2, 1), (2, 3), (2, 4), (3, 5), (4, 2), (4, 8), (4, 11))]
CASES += [("dualpipev", p, m, 2) for p, m in ((2, 4), (2, 5), (3, 6), (4, 8), (4, 11))]


@pytest.mark.parametrize("lookahead", [None, 0, 1, 2, 5])
@pytest.mark.parametrize(("name", "p", "m", "v"), CASES)
def test_every_schedule_completes_with_receives_posted_ahead(name, p, m, v, lookahead):
    run_programs(lowered(name, p, m, v), lookahead)  # every case is a valid schedule: none is skipped


@pytest.mark.parametrize("lookahead", [0, 1, 2, 5])
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zero-bubble", "zb-v", "dualpipev"])
def test_receives_move_ahead_in_order_and_sends_stay(name, lookahead):
    schedule = lowered(name, 4, 8, 2 if name in ("interleaved", "zb-v", "dualpipev") else 1)
    for actions in schedule.actions:
        items = program(actions, lookahead)
        flat = [a for item in items for a in (sum(item, ()) if isinstance(item, tuple) else (item,))]
        assert sorted(map(str, flat)) == sorted(map(str, actions)), "every action exactly once"
        computes = [a for a in actions if not a.is_comm]
        assert [a for a in flat if not a.is_comm] == computes, "compute order unchanged"
        recvs = [a for a in actions if a.kind in RECV_KINDS]
        assert [a for a in flat if a.kind in RECV_KINDS] == recvs, "receives keep their order (gloo matches FIFO)"

        def slots(sequence: list) -> dict[Action, int]:  # transfer -> computes done before it is posted
            done, out = 0, {}
            for a in sequence:
                if a.is_comm:
                    out[a] = done
                else:
                    done += 1
            return out

        before, after = slots(list(actions)), slots(flat)
        for a in actions:
            if a.kind in RECV_KINDS:
                assert after[a] == ahead(before[a], lookahead), f"{a} moves {lookahead} computes ahead"
            elif a.is_comm:
                assert after[a] == before[a], f"{a} stays where lowered"
        posts = [item for item in items if isinstance(item, tuple)]
        assert len(posts) == len({after[post[0][0]] for post in posts}), "one post per point of the list"
        for post in posts:  # receives and sends never share a batch; a batch is one lowered run's receives
            assert all(post), "no empty batch"
            assert all(batch[0].kind in RECV_KINDS for batch in post[1:]), "the sends' batch, if any, comes first"
            for batch in post:
                assert all(a.kind in RECV_KINDS for a in batch) or not any(a.kind in RECV_KINDS for a in batch)
                if batch[0].kind in RECV_KINDS:
                    assert len({before[a] for a in batch}) == 1, f"{batch} mixes receives of two lowered runs"


def test_no_lookahead_posts_each_lowered_run_as_one_batch():
    schedule = lowered("1f1b", 2, 4)
    for actions in schedule.actions:
        items = program(actions, None)
        runs = [tuple(g) for comm, g in itertools.groupby(actions, key=lambda a: a.is_comm) if comm]
        assert [item for item in items if isinstance(item, tuple)] == [(run,) for run in runs]
        assert [a for a in items if not isinstance(a, tuple)] == [a for a in actions if not a.is_comm]


def test_negative_lookahead_is_refused():
    with pytest.raises(ValueError, match="recv_lookahead"):
        program(lowered("gpipe", 2, 2).actions[0], -1)


def test_merging_receives_of_two_runs_deadlocks_and_the_checker_sees_it():
    """The checker is not vacuous: a rank's receives of two lowered runs as one batch (waited for as one)
    deadlock naive at p=2, m=2: rank 1 waits for micro-batch 1's activation before it has run micro-batch 0."""
    schedule = lowered("naive", 2, 2)
    rank1 = [a for a in schedule.actions[1] if a.kind not in RECV_KINDS]
    merged = Schedule(2, 2, [schedule.actions[0], [*[a for a in schedule.actions[1] if a.kind in RECV_KINDS], *rank1]])
    with pytest.raises(AssertionError, match="deadlock"):
        run_programs(merged, None)
