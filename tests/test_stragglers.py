"""Straggler detection (``plait.observe.stragglers``): the window's formulas, when a slow rank is warned about, the
config's checks, and ``plait train``'s worker on 2 gloo ranks where rank 1 is made slow on purpose.

The job (one spawn, three runs of ``plait.train.loop.run``): straggler detection off; on with no slow rank; on with
rank 1 sleeping 0.2 s inside each step's optimizer update (``Engine.apply_update``, part of its compute). Each rank
counts the collectives it issues (``Comm._issue`` and ``Comm.send_recv_batches``, every way plait communicates)
and rank 0 keeps the warnings logged. No wall-clock assertion: the slow rank is slow by 0.2 s per step against a
step of a few milliseconds, which no load on the machine turns around, and the lag threshold of the job (0.5) is
three times the compute of the other rank (two ranks: lag = c / ((c + c') / 2) - 1).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers.harness import run_distributed

from plait.comm.stats import CommStats
from plait.errors import ConfigError
from plait.observe.stragglers import SlowRankWatch, analyse, straggler_scalars
from plait.train.config import RunConfig

STEPS, EVERY, WINDOWS, LAG = 7, 2, 2, 0.5
SLOW_RANK, SLOW_S = 1, 0.2


def test_comm_stats_count_wait_seconds_apart_from_bytes() -> None:
    stats = CommStats()
    stats.record("dp", "all_reduce", 400, 2)
    before = stats.snapshot()
    stats.add_seconds("dp", "all_reduce", 0.25)
    stats.record("tp", "all_gather", 100, 2)
    stats.add_seconds("tp", "all_gather", 0.5)
    delta = stats.since(before)
    assert delta.seconds == 0.75 and delta.counts[("dp", "all_reduce")].calls == 0  # a wait after the launch
    assert stats.seconds == 0.75
    assert "seconds" not in json.dumps(stats.to_dict())  # bytes and calls are deterministic, seconds are not


def test_window_lag_and_wait_by_formula() -> None:
    # 4 ranks, 2 steps: compute sums 2, 2, 2, 4 s -> per step 1, 1, 1, 2; median 1 -> lags 0, 0, 0, 1
    window = analyse(2, [2.0, 2.0, 2.0, 4.0], [1.0, 0.4, 0.6, 0.2], [0, 0, 0, 0])
    assert window.compute == [1.0, 1.0, 1.0, 2.0]
    assert window.lag == [0.0, 0.0, 0.0, 1.0]
    assert window.slowest == 3
    assert window.wait == pytest.approx([0.4, 0.1, 0.2, 0.0])  # comm per step minus the least (0.1 s, rank 3's)
    # two ranks: the median is their mean, so a rank twice as slow has lag 2 / 1.5 - 1 = 1/3
    assert analyse(1, [1.0, 2.0], [0.0, 0.0], [0, 0]).lag == pytest.approx([-1 / 3, 1 / 3])


def test_pipeline_stages_are_compared_within_themselves() -> None:
    # stage 1 (ranks 2, 3) computes twice as long as stage 0 by design: no rank of it is a straggler
    window = analyse(1, [1.0, 1.0, 2.0, 2.0], [0.5, 0.5, 0.1, 0.3], [0, 0, 1, 1])
    assert window.lag == [0.0, 0.0, 0.0, 0.0]
    assert window.wait == pytest.approx([0.0, 0.0, 0.0, 0.2])
    assert window.slowest == 0  # a tie goes to the lowest rank


def test_a_rank_that_stays_slow_is_warned_once_per_episode() -> None:
    watch = SlowRankWatch(threshold=0.2, windows=3)
    seen = [watch.observe(rank, lag) for rank, lag in [(1, 0.5), (1, 0.5), (1, 0.5), (1, 0.9), (1, 0.6)]]
    assert seen == [False, False, True, False, False]
    assert watch.streak == 5
    assert [watch.observe(2, 0.5), watch.observe(1, 0.5)] == [False, False]  # another rank: the streak starts over
    assert [watch.observe(1, 0.1), watch.observe(1, 0.5), watch.observe(1, 0.5)] == [False, False, False]
    assert watch.observe(1, 0.5)  # a new episode (after a window under the threshold) warns again
    assert not any(SlowRankWatch(0.2, 1).observe(0, lag) for lag in [0.2, 0.1, 0.0])  # at the threshold: not slow


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"straggler_every": -1}, "train.straggler_every=-1 must be an integer >= 0 (0 turns it off). Fix:"),
        ({"straggler_lag": -0.1}, "train.straggler_lag=-0.1 must be >= 0"),
        ({"straggler_lag": float("inf")}, "train.straggler_lag=inf must be >= 0"),
        ({"straggler_windows": 0}, "train.straggler_windows=0 must be an integer >= 1. Fix:"),
    ],
)
def test_bad_straggler_settings_are_refused(setting: dict, message: str) -> None:
    with pytest.raises(ConfigError, match="Fix: e.g. train.straggler") as error:
        RunConfig.from_dict({"train": setting})
    assert str(error.value).startswith(message)


def _job(root: str) -> dict:
    import time

    from plait.comm.collectives import Comm
    from plait.distributed import init
    from plait.engine import Engine
    from plait.train.loop import run

    world = init()
    issued: Counter[str] = Counter()
    issue, batches, update = Comm._issue, Comm.send_recv_batches, Engine.apply_update

    def counted_issue(self, axis, op, *args, **kwargs):  # type: ignore[no-untyped-def]
        issued[f"{axis}/{op}"] += 1
        return issue(self, axis, op, *args, **kwargs)

    def counted_batches(self, batches_, axis="pp"):  # type: ignore[no-untyped-def]
        issued[f"{axis}/send_recv"] += 1
        return batches(self, batches_, axis)

    def slow_update(self):  # type: ignore[no-untyped-def]
        time.sleep(SLOW_S)
        return update(self)

    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("plait").addHandler(Keep())
    Comm._issue, Comm.send_recv_batches = counted_issue, counted_batches  # type: ignore[method-assign]
    result: dict = {}
    for name, every, slow in [("off", 0, False), ("even", EVERY, False), ("slow", EVERY, True)]:
        issued.clear()
        warnings.clear()
        Engine.apply_update = slow_update if slow and world.rank == SLOW_RANK else update  # type: ignore[method-assign]
        train = {"steps": STEPS, "global_batch": 8, "eval_every": 0, "samples": 0, "tensorboard": name == "slow"}
        train |= {"straggler_every": every, "straggler_lag": LAG, "straggler_windows": WINDOWS, "out": f"{root}/{name}"}
        run(RunConfig.from_dict({"layout": {"dp": 2}, "train": train}), world)
        result[name] = {"issued": dict(issued), "warnings": list(warnings)}
    Engine.apply_update = update  # type: ignore[method-assign]
    return result


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("stragglers")
    return root, run_distributed(_job, 2, str(root), timeout=300)


def _train(run: Path) -> list[dict]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "train"]


@pytest.mark.distributed
def test_the_slow_rank_is_named_and_warned_about_once(job: tuple[Path, list[dict]]) -> None:
    root, ranks = job
    windows = [r for r in _train(root / "slow") if "straggler_rank" in r]
    assert [r["step"] for r in windows] == [2, 4, 6]  # every EVERY steps, none at the last (7)
    host = windows[0]["straggler_host"]
    for record in windows:
        assert record["straggler_rank"] == SLOW_RANK and record["straggler_lag"] > LAG
        seconds = record["rank_seconds"]
        assert seconds["compute"][SLOW_RANK] > SLOW_S  # the sleep is compute, per step
        assert seconds["wait"][0] > seconds["wait"][SLOW_RANK]  # the fast rank waits for the slow one
        assert record["straggler_lag"] == pytest.approx(
            seconds["compute"][SLOW_RANK] / (sum(seconds["compute"]) / 2) - 1,
            abs=1e-5,  # rounded to 1e-6 per field
        )
    assert [r["rank_seconds"]["steps"] for r in windows] == [1, 2, 2]  # step 1 (warm-up) left out
    assert [r["straggler_windows"] for r in windows] == [1, 2, 3]
    warned = [w for w in ranks[0]["slow"]["warnings"] if "stays slow" in w]
    assert len(warned) == 1, ranks[0]["slow"]["warnings"]  # at step 4 (WINDOWS windows), not again at step 6
    assert f"rank {SLOW_RANK} on host {host} stays slow" in warned[0] and "up to step 4" in warned[0]
    assert not any("stays slow" in w for w in ranks[1]["slow"]["warnings"])  # said once per job, by rank 0


@pytest.mark.distributed
def test_no_slow_rank_no_warning(job: tuple[Path, list[dict]]) -> None:
    root, ranks = job
    assert not any("stays slow" in w for w in ranks[0]["even"]["warnings"])
    windows = [r for r in _train(root / "even") if "straggler_rank" in r]
    assert [r["step"] for r in windows] == [2, 4, 6]
    assert not any("straggler_rank" in r for r in _train(root / "off"))


@pytest.mark.distributed
def test_no_collective_of_its_own_per_step(job: tuple[Path, list[dict]]) -> None:
    _root, ranks = job
    for rank in ranks:
        off, on = Counter(rank["off"]["issued"]), Counter(rank["even"]["issued"])
        # the same collectives step for step; only the start's host names (all_gather_bytes: two all-gathers)
        assert on - off == Counter({"world/all_gather": 2}) and not off - on
        assert rank["slow"]["issued"] == rank["even"]["issued"]


@pytest.mark.distributed
def test_tensorboard_holds_the_straggler_scalars(job: tuple[Path, list[dict]]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, _ranks = job
    events = EventAccumulator(str(root / "slow")).Reload()
    windows = [r for r in _train(root / "slow") if "straggler_rank" in r]
    lags = {e.step: e.value for e in events.Scalars("straggler/lag")}
    assert lags == pytest.approx({r["step"]: r["straggler_lag"] for r in windows}, rel=1e-6)  # float32 events
    assert [e.value for e in events.Scalars("straggler/rank")] == [SLOW_RANK] * len(windows)
    assert straggler_scalars(windows[0])["straggler/compute_s_max"] == max(windows[0]["rank_seconds"]["compute"])
    assert straggler_scalars({"step": 1, "loss": 1.0}) == {}
    assert torch.tensor([e.value for e in events.Scalars("straggler/wait_s_max")]).gt(0).all()
