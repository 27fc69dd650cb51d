"""Per-step fault tolerance across HSDP replica groups (plait/ft, docs/fault_tolerance.md): a rank killed mid-run
costs its group a restart and a heal from a live group, never the other groups' processes; the run equals its
replay bitwise and one device trained on the committed batches within rounding."""

from __future__ import annotations

import json
import math
import struct

import pytest
import torch
from helpers import ft

from plait.checkpoint import load_full_state
from plait.errors import ConfigError
from plait.ft import wire
from plait.ft.log import ReplayLog, merge, replica_dir
from plait.ft.options import FTOptions

# ----------------------------------------------------------------- the message format: no pickle, hostile input


def test_a_state_travels_as_tensors_and_json_keys_keep_their_types():
    state = {
        "user": {"entries": {"model/w": [torch.arange(6.0).view(2, 3)[:, 1:]], 3: torch.tensor(2.5)}},
        "torchft": {"step": 7, "batches_committed": 14},
        "list": [1, None, "x", 1e-300, True],
    }
    back = wire.loads(wire.dumps(state))
    assert torch.equal(back["user"]["entries"]["model/w"][0], torch.tensor([[1.0, 2.0], [4.0, 5.0]]))
    assert back["user"]["entries"][3].item() == 2.5 and 3 in back["user"]["entries"]  # an int key stays an int
    assert back["torchft"] == {"step": 7, "batches_committed": 14} and back["list"] == [1, None, "x", 1e-300, True]


def test_views_of_one_buffer_travel_as_copies():
    flat = torch.arange(8.0)
    back = wire.loads(wire.dumps({"a": flat[:4], "b": flat[4:]}))  # safetensors refuses shared storage: copied
    assert torch.equal(back["a"], flat[:4]) and torch.equal(back["b"], flat[4:])


@pytest.mark.adversarial
@pytest.mark.parametrize(
    "message",
    [
        b"",
        b"\x00" * 7,
        struct.pack("<Q", 2**40) + b"{}",  # a header longer than the message
        struct.pack("<Q", 2) + b"{]",  # not JSON
        wire.dumps({"t": torch.ones(4)})[:-3],  # cut short
        struct.pack("<Q", 60)
        + json.dumps({"__metadata__": {"plait.tree": json.dumps({"$tensor": "/x"})}}).encode().ljust(60),
        struct.pack("<Q", 62)
        + json.dumps({"__metadata__": {"plait.tree": json.dumps({"$pickle": "os.system"})}}).encode().ljust(62),
    ],
)
def test_a_hostile_or_broken_message_is_a_wire_error_never_code(message):
    with pytest.raises(wire.WireError):
        wire.loads(message)


def test_objects_that_are_not_data_do_not_travel():
    with pytest.raises(wire.WireError, match="only tensors"):
        wire.dumps({"f": print})


# ----------------------------------------------------------------- configuration, one line each


@pytest.mark.parametrize(
    "env, words",
    [
        ({"PLAIT_FT_GROUPS": "2", "PLAIT_FT_GROUP": "2", "PLAIT_FT_LIGHTHOUSE": "http://h:1"}, "must be below"),
        ({"PLAIT_FT_GROUPS": "0", "PLAIT_FT_GROUP": "0", "PLAIT_FT_LIGHTHOUSE": "http://h:1"}, "integer >= 1"),
        ({"PLAIT_FT_GROUPS": "2", "PLAIT_FT_GROUP": "0"}, "plait lighthouse"),
        ({"PLAIT_FT_GROUPS": "2", "PLAIT_FT_GROUP": "0", "PLAIT_FT_LIGHTHOUSE": "h", "PLAIT_FT_TIMEOUT_S": "0"}, "> 0"),
        (
            {"PLAIT_FT_GROUPS": "2", "PLAIT_FT_GROUP": "0", "PLAIT_FT_LIGHTHOUSE": "h", "PLAIT_FT_MIN_GROUPS": "3"},
            "exceeds",
        ),
        (
            {"PLAIT_FT_GROUPS": "2", "PLAIT_FT_GROUP": "0", "PLAIT_FT_LIGHTHOUSE": "h", "PLAIT_FT_FAULT": "where=x"},
            "sync or heal",
        ),
    ],
)
def test_bad_fault_tolerance_settings_are_one_line_with_the_fix(env, words):
    with pytest.raises(ConfigError, match=words) as error:
        FTOptions.from_env(env)
    assert "Fix:" in str(error.value)


def test_no_settings_is_plain_training():
    assert FTOptions.from_env({}) is None


def test_the_committed_log_merges_the_groups_records_and_refuses_a_disagreement(tmp_path):
    for group, steps in ((0, {1: [0, 1], 2: [0], 3: [0, 1]}), (1, {1: [0, 1], 3: [0, 1]})):
        folder = replica_dir(tmp_path, group)
        folder.mkdir(parents=True)
        (folder / "ft.json").write_text(json.dumps({"model": {"n_layer": 2}}))
        lines = [json.dumps({"kind": "train", "step": s, "ft_groups": g}) for s, g in steps.items()]
        (folder / "metrics.jsonl").write_text("\n".join(lines + ['{"cut']) + "\n")
    log = merge(tmp_path, 2)
    assert log.steps == {1: [0, 1], 2: [0], 3: [0, 1]}
    log.write(tmp_path / "committed.jsonl")
    assert ReplayLog.read(tmp_path).steps == log.steps
    with pytest.raises(ConfigError, match="another job: model"):
        log.check({"model": {"n_layer": 4}}, 2)
    with pytest.raises(ConfigError, match="no step 4"):
        log.groups(4)
    (replica_dir(tmp_path, 1) / "metrics.jsonl").write_text(json.dumps({"step": 2, "ft_groups": [0, 1]}) + "\n")
    with pytest.raises(ConfigError, match="disagree on the quorum of step 2"):
        merge(tmp_path, 2)


# ----------------------------------------------------------------- a rank killed mid-run


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.cli
@pytest.mark.timeout(900)  # two fault-tolerant runs and a reference: ~2 min on 2 idle cores, more when busy
def test_a_killed_rank_heals_from_a_live_group_and_the_run_replays_bitwise(tmp_path):
    steps, run = 160, tmp_path / "run"
    # steps of 0.2 s at least: the restarted group (~20 s on a busy 2-core machine) rejoins a run still going
    kill = {
        "PLAIT_FT_FAULT_GROUP": "1",
        "PLAIT_FAULT_INJECT": "rank=1,step=4,action=kill",
        "PLAIT_FT_STEP_DELAY_S": "0.2",
    }
    done = ft.run_ft(run, steps, env=kill)
    assert done.returncode == 0, done.stderr[-3000:]
    survivors, restarted = ft.starts(run, 0), ft.starts(run, 1)
    assert [s["attempt"] for s in survivors] == [0, 0]  # group 0's two ranks ran once: their pids never changed
    assert sorted(s["attempt"] for s in restarted) == [0, 0, 1, 1]  # group 1 was restarted by its own agent
    records, healed = ft.step_records(run, 0), ft.step_records(run, 1)
    assert len(records) == steps and records[1]["ft_groups"] == [0, 1] and records[4]["ft_groups"] == [0]
    joined = min(s for s, r in healed.items() if s > 4)
    assert "ft_healed_from_step" in healed[joined] and records[steps]["ft_groups"] == [0, 1]  # healed, then whole
    assert all(records[s]["loss"] == healed[s]["loss"] for s in healed)  # the same quorum loss in both groups
    final = [load_full_state(replica_dir(run, g) / "ckpt")[0] for g in (0, 1)]
    assert all(torch.equal(final[0][name], final[1][name]) for name in final[0])  # every replica bitwise equal

    replay = tmp_path / "replay"
    again = ft.run_ft(replay, steps, extra=["--ft-replay", str(run)])
    assert again.returncode == 0, again.stderr[-3000:]
    replayed = load_full_state(replica_dir(replay, 0) / "ckpt")[0]
    assert all(torch.equal(replayed[name], final[0][name]) for name in final[0])  # the replay: the same bits
    assert [r["loss"] for r in ft.step_records(replay, 0).values()] == [r["loss"] for r in records.values()]

    reference, losses = ft.one_device(run, steps)
    for name, value in reference.items():
        # fp32: the groups' token means are combined as sum_g N_g G_g / N (one device sums the tokens at once) and
        # ZeRO-3 reduces in another order: rounding of ~1e-7 per step, which SGD with momentum carries without
        # amplifying it (measured: parameters 2.4e-7, losses 1.2e-6 apart after 160 steps).
        torch.testing.assert_close(final[0][name], value, rtol=1e-5, atol=1e-5, msg=name)
    assert all(abs(records[s]["loss"] - losses[s - 1]) < 1e-5 for s in records)  # every step's loss, the fault's too


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.cli
@pytest.mark.timeout(900)  # a run with a spare and its replay: ~1.5 min on 2 idle cores, more when busy
def test_a_spare_takes_a_lost_groups_slot_at_once_and_the_run_equals_one_without_faults(tmp_path):
    """R = 2 groups of one rank and a spare: group 1 killed before step 4. The quorum drops group 1 at step 4 (slot
    1 untrained there), the spare trains slot 1 from step 5 on, until group 1 is back: every other step trains
    both slots, the run replays bitwise, and one device on the committed rows matches it."""
    steps, run = 80, tmp_path / "run"
    kill = {
        "PLAIT_FT_FAULT_GROUP": "1",
        "PLAIT_FAULT_INJECT": "rank=0,step=4,action=kill",
        "PLAIT_FT_STEP_DELAY_S": "0.2",
        "PLAIT_FT_REJOIN_DELAY_S": "5",  # group 1 comes back well after the spare took its slot
    }
    done = ft.run_ft(run, steps, extra=["--ft-spares", "1"], env=kill, nproc=2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [s["attempt"] for s in ft.starts(run, 0) + ft.starts(run, 2)] == [0, 0]  # survivor and spare: never
    assert sorted(s["attempt"] for s in ft.starts(run, 1)) == [0, 1]  # group 1: restarted by its agent
    records, lost, spare = (ft.step_records(run, g) for g in (0, 1, 2))
    assert len(records) == steps and records[4]["ft_groups"] == [0]  # the fault's step: group 1 left the quorum
    assert all(r["ft_groups"] == [0, 1] for s, r in records.items() if s != 4)  # every other step: both slots
    assert spare[3]["ft_slot"] is None and spare[5]["ft_slot"] == 1  # the spare trained slot 1 from step 5 on
    back = min(s for s, r in lost.items() if s > 4)
    assert "ft_healed_from_step" in lost[back] and lost[back + 1]["ft_slot"] == 1  # group 1 healed, back in its slot
    assert spare[back]["ft_slot"] == 1 and spare[back + 1]["ft_slot"] is None  # and the spare stepped back
    final = [load_full_state(replica_dir(run, g) / "ckpt")[0] for g in (0, 1, 2)]
    assert all(torch.equal(final[0][name], other[name]) for other in final[1:] for name in final[0])

    replay = tmp_path / "replay"
    again = ft.run_ft(replay, steps, extra=["--ft-replay", str(run)], nproc=2)  # no faults, no spare
    assert again.returncode == 0, again.stderr[-3000:]
    replayed = load_full_state(replica_dir(replay, 0) / "ckpt")[0]
    assert all(torch.equal(replayed[name], final[0][name]) for name in final[0])  # the same bits
    reference, _ = ft.one_device(run, steps)
    for name, value in reference.items():  # fp32 rounding of the combine (test_a_killed_rank..., its tolerance)
        torch.testing.assert_close(final[0][name], value, rtol=1e-5, atol=1e-5, msg=name)


# ----------------------------------------------------------------- what listens, and where


@pytest.mark.adversarial
def test_quorum_servers_listen_on_loopback_by_default(monkeypatch):
    """torchft's Manager starts its quorum server on [::] (every interface); plait rebinds it to PLAIT_FT_BIND,
    127.0.0.1 unless set, and the launcher's Lighthouse serves on 127.0.0.1."""
    import torchft._torchft as native
    import torchft.manager as manager_module

    from plait.ft.launch import lighthouse
    from plait.ft.session import _bind_manager_server

    binds = []
    monkeypatch.setattr(native, "ManagerServer", lambda *args, bind, **kwargs: binds.append(bind))
    monkeypatch.setattr(manager_module, "ManagerServer", manager_module.ManagerServer)  # restored after the test
    _bind_manager_server(
        FTOptions.from_env({"PLAIT_FT_GROUPS": "2", "PLAIT_FT_GROUP": "0", "PLAIT_FT_LIGHTHOUSE": "h"}).bind
    )
    manager_module.ManagerServer(replica_id="g", bind="[::]:29512")
    assert binds == ["127.0.0.1:29512"]
    monkeypatch.undo()
    server, address = lighthouse()
    try:
        assert address.startswith("http://127.0.0.1:")
    finally:
        server.shutdown()


class _TwoGroups:
    """A stand-in for the quorum's Comm: group 1's rows are given, this rank plays group 0 (or the reverse)."""

    device = torch.device("cpu")

    def __init__(self, other_row, other_grads, other_first):
        self.other = {5: other_row, other_grads.numel(): other_grads}
        self.other_first = other_first

    def all_gather(self, tensor, axis, async_op=False):
        rows = [self.other[tensor.numel()].to(tensor.dtype), tensor]
        out = torch.cat(rows if self.other_first else rows[::-1])

        class Done:
            def wait(self):
                return out

        return Done() if async_op else out


@pytest.mark.parametrize("other_first", [False, True])
def test_groups_with_uneven_tokens_are_weighed_by_their_tokens_in_group_order(other_first):
    """The cross-group gradient is sum_g N_g G_g / sum_g N_g, whatever order the quorum lists the groups in; the
    end-to-end runs (test_a_killed_rank...) score as many tokens in each group, so uneven counts are checked here."""
    from plait.ft.combine import combine

    mine, theirs = torch.tensor([1.0, -2.0, 4.0, 0.5]), torch.tensor([3.0, 5.0, -1.0, 2.0])  # 4: not a row
    n_mine, n_theirs, l_mine, l_theirs = 30.0, 90.0, 2.0, 1.0
    other_row = torch.tensor([1.0, n_theirs, n_theirs * l_theirs, 1.0, 0.0], dtype=torch.float64)  # job code 0
    comm = _TwoGroups(other_row, theirs * n_theirs, other_first)
    grad = mine.clone()
    done = combine([grad], comm, 0, n_mine, torch.tensor(l_mine))
    torch.testing.assert_close(grad, (n_mine * mine + n_theirs * theirs) / (n_mine + n_theirs))  # fp32 of 3 terms
    assert done.slots == [0, 1] and done.weights == [n_mine, n_theirs]
    assert done.loss == pytest.approx((n_mine * l_mine + n_theirs * l_theirs) / (n_mine + n_theirs), rel=1e-12)
    zero = mine.clone()
    combine([zero], comm, 0, 0.0, torch.tensor(float("nan")))  # a group outside the logged quorum: exact zeros
    torch.testing.assert_close(zero, theirs * n_theirs / n_theirs)
    moved = mine.clone()  # a group whose place changed (or that heals) at this step: zeros, and its slot untrained
    done = combine([moved], comm, 0, n_mine, torch.tensor(l_mine), trained=False)
    assert torch.equal(moved, theirs * n_theirs / n_theirs) and done.trained == [False, True]
    with pytest.raises(ConfigError, match="another job"):  # a group of another job: refused before gradients move
        combine([mine.clone()], comm, 0, n_mine, torch.tensor(l_mine), job=12345)


def test_a_step_whose_committed_groups_scored_no_token_is_no_divergence():
    """The quorum's loss is 0/0 when the committed groups scored nothing (instruction rows all prompt, the other
    group lost): the step is recorded with a null loss and the run goes on, also in a replay's group that scored
    tokens but was not committed; a NaN over scored tokens still stops the run."""
    from plait.engine import StepStats
    from plait.errors import PlaitError
    from plait.ft.combine import Combined, report
    from plait.train.metrics import check_step

    def step(scored: int, slots: list[int], weights: list[float]) -> StepStats:
        stats = StepStats(5, torch.tensor(1.5 if scored else float("nan")), 256, 0.1, scored=torch.tensor(scored))
        total = sum(weights)
        report(stats, Combined(slots, weights, [True] * len(slots), 1.5 if total else float("nan")))
        return stats

    check_step(step(0, [0], [0.0]))  # alone, and nothing scored
    replayed = step(55, [0, 1], [0.0, 0.0])  # a replay: this group (55 tokens) was not committed at the step
    assert replayed.scored == 0 and math.isnan(replayed.loss)
    check_step(replayed)
    diverged = step(55, [0, 1], [0.0, 55.0])
    diverged._loss = float("nan")
    with pytest.raises(PlaitError, match="training diverged"):
        check_step(diverged)
