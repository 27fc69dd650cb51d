"""The faults of issue 34 that a fault-tolerant job must survive, beyond one killed rank (tests/test_ft.py): a kill
inside the cross-group exchange, two groups lost at once, the healing peer killed while it serves, the quorum
service gone, a replica that comes back with another configuration, and two torchrun agents as two nodes, one
killed. Each runs a few minutes on a busy 2-core machine: marker long (make test-ft runs them)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import ft

from plait.checkpoint import load_full_state
from plait.ft.log import replica_dir

pytestmark = [pytest.mark.distributed, pytest.mark.long, pytest.mark.cli, pytest.mark.timeout(900)]
THREE_GROUPS = ["--nproc", "3"] + [
    arg for s in ("layout.dp_replicate=3", "layout.zero=0", "train.global_batch=48") for arg in ("--set", s)
]
"""Three replica groups of one rank (a global batch that splits three ways)."""


def _equal_replicas(run, groups):
    final = [load_full_state(replica_dir(run, g) / "ckpt")[0] for g in groups]
    return all(torch.equal(final[0][name], other[name]) for other in final[1:] for name in final[0])


def test_a_group_killed_inside_the_cross_group_exchange(tmp_path):
    run, steps = tmp_path / "run", 120
    env = {"PLAIT_FT_FAULT": "where=sync,step=5,group=1", "PLAIT_FT_STEP_DELAY_S": "0.2"}
    done = ft.run_ft(run, steps, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [s["attempt"] for s in ft.starts(run, 0)] == [0, 0]  # the live group's processes never changed
    records = ft.step_records(run, 0)
    assert records[4]["ft_groups"] == [0, 1] and records[5]["ft_groups"] == [0] and records[5]["ft_attempts"] >= 2
    assert records[steps]["ft_groups"] == [0, 1] and _equal_replicas(run, (0, 1))


def test_two_groups_lost_at_once_and_the_last_carries_on(tmp_path):
    run, steps = tmp_path / "run", 120
    env = {
        "PLAIT_FT_FAULT_GROUP": "1,2",
        "PLAIT_FAULT_INJECT": "rank=0,step=4,action=kill",
        "PLAIT_FT_STEP_DELAY_S": "0.3",
    }
    done = ft.run_ft(run, steps, extra=THREE_GROUPS, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [s["attempt"] for s in ft.starts(run, 0)] == [0]
    records = ft.step_records(run, 0)
    assert records[4]["ft_groups"] == [0] and records[steps]["ft_groups"] == [0, 1, 2]
    assert _equal_replicas(run, (0, 1, 2))


def test_the_healing_peer_killed_while_it_serves(tmp_path):
    run, steps = tmp_path / "run", 120
    env = {
        "PLAIT_FT_FAULT_GROUP": "2",
        "PLAIT_FAULT_INJECT": "rank=0,step=4,action=kill",
        "PLAIT_FT_FAULT": "where=heal,group=0",
        "PLAIT_FT_STEP_DELAY_S": "0.3",
    }
    done = ft.run_ft(run, steps, extra=THREE_GROUPS, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dying while sending" in done.stderr  # group 0 served group 2 and died mid-transfer
    assert [s["attempt"] for s in ft.starts(run, 1)] == [0]  # group 1 carried on throughout
    assert ft.step_records(run, 1)[steps]["ft_groups"] == [0, 1, 2] and _equal_replicas(run, (0, 1, 2))


def test_the_quorum_service_gone_is_a_clear_error_and_the_checkpoint_stays(tmp_path):
    server, address = ft.start_lighthouse()
    env = {**ft.FT_ENV, "PLAIT_FT_TIMEOUT_S": "10", "PLAIT_FT_STEP_DELAY_S": "0.2"}
    groups = []
    for g in (0, 1):  # stderr to a file: a pipe nobody reads fills and blocks the rank
        with open(tmp_path / f"group-{g}.log", "w") as err:
            command = [sys.executable, "-m", *ft.group_command(tmp_path, g, 2, address, 500), "--nproc", "2"]
            groups.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=err))
    try:
        ft.wait_for_step(tmp_path, 0, 11, groups[0])
        server.kill()
        started = time.monotonic()
        for group in groups:
            group.wait(timeout=180)
        errors = [(tmp_path / f"group-{g}.log").read_text() for g in (0, 1)]
    finally:
        for process in (server, *groups):
            process.kill()
    assert time.monotonic() - started < 120  # bounded by the quorum patience (3 timeouts), not a hang
    assert all(group.returncode != 0 for group in groups)
    assert any("no quorum from the quorum service" in text for text in errors), errors[0][-2000:]
    state, meta = load_full_state(replica_dir(tmp_path, 0) / "ckpt")  # the last checkpoint is intact
    assert meta["step"] >= 10 and meta["step"] % 5 == 0


def test_a_group_that_comes_back_with_another_model_is_refused(tmp_path):
    server, address = ft.start_lighthouse()
    env = {**ft.FT_ENV, "PLAIT_FT_STEP_DELAY_S": "0.3"}

    def group(g, extra=(), log="group"):  # stderr to a file: a pipe nobody reads fills and blocks the rank
        command = [sys.executable, "-m", *ft.group_command(tmp_path, g, 2, address, 150, list(extra)), "--nproc", "2"]
        with open(tmp_path / f"{log}-{g}.log", "w") as err:
            return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)

    live, lost = group(0), group(1)
    try:
        ft.wait_for_step(tmp_path, 1, 3, lost)
        os.killpg(lost.pid, signal.SIGKILL)  # the node of group 1 is lost; it comes back with another model
        lost.wait()
        other = group(1, ["model.n_layer=3"], log="other")
        other.wait(timeout=300)
        refused = (tmp_path / "other-1.log").read_text()
        assert other.returncode != 0 and "trains another job" in refused and "model" in refused, refused[-2000:]
        assert live.wait(timeout=600) == 0  # the live group finished the run
    finally:
        for process in (server, live, lost):
            process.kill()


def test_two_torchrun_agents_as_two_nodes_one_killed(tmp_path):
    server, address = ft.start_lighthouse()
    env = {**ft.FT_ENV, "PLAIT_FT_STEP_DELAY_S": "0.3"}

    def node(g):  # stderr to a file: a pipe nobody reads fills and blocks the rank
        command = ft.torchrun_group(tmp_path, g, 2, address, 150, port=29600 + g + os.getpid() % 200 * 2)
        with open(tmp_path / f"node-{g}.log", "a") as err:
            return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=err)

    nodes = [node(0), node(1)]
    try:
        ft.wait_for_step(tmp_path, 1, 5, nodes[1])
        nodes[1].send_signal(signal.SIGKILL)  # node 1's agent; its workers die with it
        nodes[1].wait()
        ft.wait_for_step(tmp_path, 0, 20, nodes[0])  # node 0 goes on alone
        nodes[1] = node(1)  # the node comes back: a new agent, healed from node 0
        assert [p.wait(timeout=600) for p in nodes] == [0, 0], (tmp_path / "node-1.log").read_text()[-2000:]
    finally:
        for process in (server, *nodes):
            process.kill()
    assert [s["attempt"] for s in ft.starts(tmp_path, 0)] == [0, 0]
    healed = ft.step_records(tmp_path, 1)
    assert any("ft_healed_from_step" in r for r in healed.values()) and healed[150]["ft_groups"] == [0, 1]
    assert _equal_replicas(tmp_path, (0, 1))
