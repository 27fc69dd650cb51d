"""LocalSGD and DiLoCo under per-step fault tolerance (plait/ft/outer.py, docs/fault_tolerance.md): a quorum per
window of H inner steps, the outer step over it, and a rollback of the window when it does not commit.

- Fault-free (LocalSGD unclipped, DiLoCo clipped): ``plait train --ft`` (R = 2 groups of 2 ZeRO-3 ranks, H = 4) equals the same job without
  --ft (semi-synchronous HSDP, ``plait.parallel.semisync``) and the one-process simulation over its committed log
  (tests/helpers/ft.py, with tests/helpers/semisync_reference.py's outer step).
- A rank of group 1 SIGKILLed mid-window: the job exits 0, group 0's processes never restart, group 1 heals at a
  window's start, every replica ends bitwise equal, the run equals its --ft-replay bitwise and the simulation over
  its committed log within fp32 rounding.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ft

from plait.checkpoint import load_full_state
from plait.errors import ConfigError
from plait.ft.log import ReplayLog, merge, replica_dir

EVERY = 4
SMALL = ["model.n_layer=2", "model.d_model=64", f"train.sync_every={EVERY}"]
"""A smaller model than the synchronous tests' (ft.SETTINGS, which these override): only the fault's test needs
the live group to outlast a restart, and its step delay sees to that."""


def _settings(mode: str) -> list[str]:
    """DiLoCo clipped (ft.SETTINGS: max_grad_norm=0.5), LocalSGD unclipped."""
    return [*SMALL, f"train.sync={mode}"] + (["train.max_grad_norm=0"] if mode == "localsgd" else [])


def _extra(mode: str) -> list[str]:
    return [arg for setting in _settings(mode) for arg in ("--set", setting)]


def _without_ft(out: Path, steps: int, mode: str) -> subprocess.CompletedProcess[str]:
    """The same job as semi-synchronous HSDP in one torchrun job (no quorum, no --ft)."""
    command = [sys.executable, "-m", "plait", "train", "--nproc", "4", "--out", str(out)]
    for setting in [*ft.SETTINGS, f"train.steps={steps}", f"train.save_every={steps}", *_settings(mode)]:
        command += ["--set", setting]
    return subprocess.run(command, env=ft.FT_ENV, capture_output=True, text=True, timeout=600)


def _losses(out: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if r.get("kind") == "train"}


def _window_losses(records: dict[int, dict]) -> dict[int, float]:
    """Every step's quorum loss, from each window's last record (``ft_window_loss``)."""
    return {end - EVERY + 1 + i: loss for end, r in records.items() for i, loss in enumerate(r["ft_window_loss"])}


def _final(out: Path) -> list[dict[str, torch.Tensor]]:
    return [load_full_state(replica_dir(out, g) / "ckpt")[0] for g in (0, 1)]


def _bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def _matches_the_simulation(run: Path, steps: int, params: dict[str, torch.Tensor], losses: dict[int, float]) -> None:
    reference, expected = ft.semisync_one_process(run, steps)
    for name, value in reference.items():
        # fp32: inside a group ZeRO-3 reduce-scatters over 2 ranks where one device sums a batch at once (rounding of
        # ~1e-7 per step) and SGD with momentum carries it; measured 1.5e-8 (LocalSGD, 12 steps) and 3.6e-7 (DiLoCo,
        # 48 steps with a lost window) apart at most, losses 2.6e-7 relative
        torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=name)
    for step, loss in losses.items():  # float64 sums of fp32 token means: fp32 rounding
        assert abs(loss - expected[step - 1]) <= 1e-5 * abs(expected[step - 1]), (step, loss, expected[step - 1])


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.cli
@pytest.mark.timeout(600)  # two 4-process runs and a one-process simulation: ~1.5 min on 2 busy cores
@pytest.mark.parametrize("mode", ["localsgd", "diloco"])
def test_fault_free_equals_semisync_hsdp_and_the_simulation(tmp_path, mode):
    steps, run, plain = 3 * EVERY, tmp_path / "ft", tmp_path / "plain"
    done = ft.run_ft(run, steps, extra=_extra(mode))
    assert done.returncode == 0, done.stderr[-3000:]
    records, other = ft.step_records(run, 0), ft.step_records(run, 1)
    assert sorted(records) == [EVERY, 2 * EVERY, 3 * EVERY], records  # one committed record per window
    assert all(r["ft_groups"] == [0, 1] and r["ft_window"] == EVERY and r["ft_attempts"] == 1 for r in records.values())
    assert all(r["ft_slot"] == 0 and r["ft_members"] == 2 for r in records.values())
    assert ReplayLog.read(run).steps == {s: [0, 1] for s in range(1, steps + 1)}  # every step of every window
    inner = [json.loads(line) for line in (replica_dir(run, 0) / "metrics.jsonl").read_text().splitlines()]
    inner_1 = {r["step"]: r for r in map(json.loads, (replica_dir(run, 1) / "metrics.jsonl").read_text().splitlines())}
    for r in inner:
        if r.get("kind") == "train" and r["step"] % EVERY:  # an inner step: each group reports its own token mean
            assert r["ft_loss_of"] == "group" and r["loss"] != inner_1[r["step"]]["loss"], r
    final = _final(run)
    assert _bitwise(final[0], final[1])  # every replica holds theta after the last outer step

    without = _without_ft(plain, steps, mode)
    assert without.returncode == 0, without.stderr[-3000:]
    hsdp = load_full_state(plain / "ckpt")[0]
    # the same sums in the same order: each group's reduce-scatter over its 2 ranks, then (theta_0 + theta_1) / 2
    assert _bitwise(hsdp, final[0]), "--ft and semi-synchronous HSDP hold other parameters"
    quorum = _window_losses(records)
    assert quorum == _window_losses(other)  # both groups computed the same quorum losses
    for step, loss in _losses(plain).items():  # HSDP sums (S, N) over dp x cp; --ft sums N_g L_g: fp32 rounding
        assert abs(quorum[step] - loss) <= 1e-6 * abs(loss), (step, quorum[step], loss)
    _matches_the_simulation(run, steps, final[0], quorum)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.cli
@pytest.mark.timeout(900)  # a faulty run (a restart, a failed window), its replay and a simulation: ~3 min busy
@pytest.mark.long  # make test-ft: a kill variant (tests/test_ft.py kills in CI)
def test_a_rank_killed_mid_window_costs_the_window_and_the_run_replays_bitwise(tmp_path):
    steps, run = 12 * EVERY, tmp_path / "run"
    kill = {  # rank 1 of group 1 dies before step 6: inside the window of steps 5-8
        "PLAIT_FT_FAULT_GROUP": "1",
        "PLAIT_FAULT_INJECT": "rank=1,step=6,action=kill",
        "PLAIT_FT_STEP_DELAY_S": "0.8",  # outlasts the restart: 48 x 0.8 s; a restart took 14 s
    }
    done = ft.run_ft(run, steps, extra=_extra("diloco"), env=kill)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [s["attempt"] for s in ft.starts(run, 0)] == [0, 0]  # group 0's two ranks ran once: pids unchanged
    assert sorted(s["attempt"] for s in ft.starts(run, 1)) == [0, 0, 1, 1]  # group 1 restarted by its own agent
    records, healed = ft.step_records(run, 0), ft.step_records(run, 1)
    assert sorted(records) == list(range(EVERY, steps + 1, EVERY)), sorted(records)
    assert records[EVERY]["ft_groups"] == [0, 1] and records[2 * EVERY]["ft_attempts"] >= 2  # the window redone
    joined = min(s for s in healed if s > EVERY)  # group 1 heals at a window's start, from step 0
    assert healed[joined]["ft_healed_from_step"] == 0 and records[steps]["ft_groups"] == [0, 1]
    assert all(records[s]["ft_window_loss"] == healed[s]["ft_window_loss"] for s in healed if s >= joined)
    final = _final(run)
    assert _bitwise(final[0], final[1])  # every replica bitwise equal

    replay = tmp_path / "replay"
    again = ft.run_ft(replay, steps, extra=[*_extra("diloco"), "--ft-replay", str(run)])
    assert again.returncode == 0, again.stderr[-3000:]
    assert _bitwise(_final(replay)[0], final[0])  # the replay: the same bits
    assert _window_losses(ft.step_records(replay, 0)) == _window_losses(records)
    _matches_the_simulation(run, steps, final[0], _window_losses(records))


# ----------------------------------------------------------------- no processes


def test_the_committed_log_gives_every_step_its_windows_groups(tmp_path):
    for group, windows in ((0, {4: [0, 1], 8: [0], 12: [0, 1]}), (1, {4: [0, 1], 12: [0, 1]})):
        folder = replica_dir(tmp_path, group)
        folder.mkdir(parents=True)
        (folder / "ft.json").write_text(json.dumps({"model": {"n_layer": 2}}))
        inner = [json.dumps({"kind": "train", "step": s, "ft_loss_of": "group"}) for s in range(1, 13) if s % 4]
        lines = [json.dumps({"step": s, "ft_groups": g, "ft_window": 4}) for s, g in windows.items()]
        (folder / "metrics.jsonl").write_text("\n".join(inner + lines) + "\n")
    log = merge(tmp_path, 2)
    assert log.steps == {s: [0] if 5 <= s <= 8 else [0, 1] for s in range(1, 13)}
    (replica_dir(tmp_path, 1) / "metrics.jsonl").write_text(
        json.dumps({"step": 8, "ft_groups": [0, 1], "ft_window": 4})
    )
    with pytest.raises(ConfigError, match="disagree on the quorum of step 5"):
        merge(tmp_path, 2)


def test_a_run_that_ends_inside_a_window_is_refused_before_any_step(tmp_path, monkeypatch):
    from plait.train import replicas
    from plait.train.config import RunConfig

    for name, value in {"PLAIT_FT_GROUPS": "2", "PLAIT_FT_GROUP": "0", "PLAIT_FT_LIGHTHOUSE": "http://h:1"}.items():
        monkeypatch.setenv(name, value)
    train = {"sync": "diloco", "sync_every": 4, "save_every": 8, "steps": 10}
    config = RunConfig.from_dict({"layout": {"dp": 2}, "train": train})
    assert replicas.engine_sync(config.train) is None  # under --ft the quorum runs the outer step, not the engine
    with pytest.raises(ConfigError, match=r"train.steps=10 ends inside a window.*Fix: .*\(e.g. 8\)"):
        replicas.start(config, None, None, tmp_path)
    assert not (tmp_path / "ft.json").exists()


def test_spares_are_refused_under_semisync():
    """A spare would take a lost group's slot, but a semi-synchronous group's inner state belongs to its slot."""
    from types import SimpleNamespace

    from plait.ft.outer import QuorumWindows
    from plait.parallel.semisync import SemiSync

    session = SimpleNamespace(options=SimpleNamespace(spares=1), engine=None)
    with pytest.raises(ConfigError, match=r"--ft-spares 1 with train.sync='diloco'.*Fix: --ft-spares 0"):
        QuorumWindows(SemiSync("diloco", every=4), session)
