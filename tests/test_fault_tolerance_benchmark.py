"""benchmarks/fault_tolerance.py reads its jobs' records as its docstring defines (the jobs themselves run in the
benchmark: ``python -m benchmarks.fault_tolerance --quick``): the time lost per fault from synthetic timelines
whose answers are known, the bytes crossing nodes from per-rank counts, and record times across a rewrite."""

from __future__ import annotations

import json
import os
import time

import pytest

from benchmarks.fault_tolerance import Job, RecordTimes, crossing_bytes, fault_ft, fault_restart
from plait import Layout


def _write(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_ft_time_lost_from_a_timeline(tmp_path):
    # steps of 1 s; kill after step 9 (at t=9); step 10 stalls 3 s (t=13); steps 11..14 by group 0 alone
    # (t=14..17); group 1 back at step 15 (t=18). Whole steps in (9, 18]: 10..14 half, 15 whole: 3.5 steps.
    times = {s: float(s) for s in range(1, 10)} | {10: 13.0} | {s: 3.0 + s for s in range(11, 21)}
    ones = {s: [0, 1] if s < 10 or s >= 15 else [0] for s in times}

    def record(step, groups, **extra):
        return {"kind": "train", "step": step, "ft_groups": groups, "ft_time": times[step], **extra}

    survivor = [record(s, ones[s], ft_attempts=2 if s == 10 else 1, ft_quorum_s=2.5 if s == 10 else 0.0) for s in times]
    killed = [record(s, ones[s]) for s in range(1, 10)] + [record(15, [0, 1], ft_healed_from_step=8)]
    _write(tmp_path / "replica-0" / "metrics.jsonl", survivor)
    _write(tmp_path / "replica-1" / "metrics.jsonl", killed)
    starts = [{"rank": r, "attempt": a, "time": 1.0 if a == 0 else 16.5} for a in (0, 1) for r in (0, 1)]
    _write(tmp_path / "replica-1" / "starts.jsonl", starts)
    row = fault_ft(Job(tmp_path, 0, ""), kill=10)
    assert row["step_s"] == 1.0
    assert row["no_progress_s"] == pytest.approx(3.0)  # 13 - 9 - 1
    assert row["full_s"] == pytest.approx(8.0)  # 18 - 9 - 1
    assert row["capacity_s"] == pytest.approx(9.0 - 3.5)
    assert row["capacity_at_T_s"] == pytest.approx(3.0 + (8.0 - 3.0) / 2)  # group 0 went on: half the rest lost
    assert row["failed_attempts"] == 1 and row["restarted_s"] == pytest.approx(7.5)
    assert (row["healed_from"], row["healed_at"], row["degraded_steps"]) == (8, 15, 5)


def test_restart_time_lost_counts_the_gap_and_the_redone_steps():
    # steps of 1 s, saved at 20, kill before 25 (step 24 at t=24); relaunched, step 21 again at t=40, then 1 s each
    seen = [(float(s), s) for s in range(1, 25)]
    seen += [(35.0 + 0.001 * s, s) for s in range(1, 21)]  # the kept records, read again after the rewrite
    seen += [(19.0 + s, s) for s in range(21, 30)]
    job = Job(None, 0, "restart 1 of 1: resuming at step 20", seen)
    row = fault_restart(job, kill=25)
    assert (row["resumed_from"], row["redone"]) == (20, 4)
    assert row["down_s"] == pytest.approx(40 - 24 - 1)
    lost = (row["full_s"], row["capacity_s"], row["capacity_at_T_s"], row["no_progress_s"])
    assert lost == pytest.approx((44 - 24 - 1,) * 4)
    assert row["redo_s"] == pytest.approx(4.0)


def test_bytes_crossing_two_nodes_follow_the_rings():
    per_rank = {"replicate": [10] * 4, "shard": [100] * 4, "dp": [1000] * 4}
    # HSDP: every replicate partner is on the other node; shard groups are the nodes; the dp ring 0 1 2 3
    # crosses at 1 -> 2 and 3 -> 0
    assert crossing_bytes(per_rank, Layout(dp=4, dp_replicate=2, zero=3)) == 4 * 10 + 2 * 1000
    assert crossing_bytes({"dp": [7, 8, 9, 10]}, Layout(dp=4, zero=3)) == 8 + 10


def _until_seen(poller: RecordTimes, count: int) -> None:
    """Wait (10 s at most, a loaded machine) until the poller has seen ``count`` records."""
    deadline = time.monotonic() + 10
    while len(poller.seen) < count and time.monotonic() < deadline:
        time.sleep(0.005)


def test_record_times_read_a_rewritten_file_again(tmp_path):
    path = tmp_path / "metrics.jsonl"
    poller = RecordTimes(path, every=0.001)
    poller.start()
    with open(path, "w") as handle:
        for step in (1, 2, 3):
            handle.write(json.dumps({"kind": "train", "step": step}) + "\n")
            handle.flush()
            _until_seen(poller, step)
        handle.write('{"kind": "train", "st')  # a line cut short: never a record of its own
        handle.flush()
    rewritten = tmp_path / "metrics.jsonl.tmp"
    rewritten.write_text(json.dumps({"kind": "train", "step": 1}) + "\n" + json.dumps({"kind": "eval", "step": 1}))
    os.replace(rewritten, path)  # as resume_metrics does: a new file, read from its start
    _until_seen(poller, 4)
    with open(path, "a") as handle:
        handle.write("\n" + json.dumps({"kind": "train", "step": 2}) + "\n")  # ends the eval line: not a step
    _until_seen(poller, 5)
    poller.done.set()
    poller.join()
    assert [step for _, step in poller.seen] == [1, 2, 3, 1, 2]
    assert [t for t, _ in poller.seen] == sorted(t for t, _ in poller.seen)
