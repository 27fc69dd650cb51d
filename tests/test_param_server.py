"""Parameter server (plait.param_server): sharding, the BSP/ASP/SSP rules and at-most-once pushes on the
server state machine; BSP parity with synchronous data-parallel training (SGD and AdamW, fp32, step by step);
ASP/SSP convergence; a worker killed with SIGKILL mid-run; a worker joining mid-run; checkpoint/resume; bad input.
Multi-process tests use 1-2 servers + 2-4 workers (at most 5 processes) and every wait has a timeout."""

import random
import threading
import time

import pytest
import torch

from plait.errors import ConfigError
from plait.param_server import (
    AdditionGPT,
    Consistency,
    JobConfig,
    LocalCluster,
    OptimizerSpec,
    PSWorker,
    ServerSettings,
    ShardServer,
    assign_shards,
    model_spec,
    run_local,
)
from plait.param_server.service import Service

TASK = AdditionGPT()  # GPT d_model=32, 2 layers, 4 heads, seq 7, vocab 12; 8 samples per worker and step
SGD = OptimizerSpec("SGD", {"lr": 0.5})
ADAMW = OptimizerSpec("AdamW", {"lr": 3e-3, "weight_decay": 0.01})


def _sync_training(optimizer: OptimizerSpec, workers: int, steps: int) -> list[dict[str, torch.Tensor]]:
    """Synchronous data parallelism in one process: one step per global batch (all workers' batches), params after
    each step."""
    model = TASK.build_model()
    opt = optimizer.build(list(model.parameters()))
    history = []
    for step in range(steps):
        opt.zero_grad()
        TASK.loss(model, TASK.global_batch(workers, step)).backward()
        opt.step()
        history.append({name: p.detach().clone() for name, p in model.named_parameters()})
    return history


def _eval_loss(params: dict[str, torch.Tensor] | None) -> float:
    model = TASK.build_model()
    if params is not None:
        model.load_state_dict(params)
    with torch.no_grad():
        return float(TASK.loss(model, TASK.eval_batch()))


def _push_grads(server: ShardServer, value: float) -> dict[str, torch.Tensor]:
    return {name: torch.full_like(p, value) for name, p in server.params.items()}


# ----------------------------------------------------------------- sharding and settings
def test_shards_are_size_balanced_and_cover_every_parameter_once():
    spec = model_spec(TASK.build_model())
    for servers in (1, 2, 3, 5):
        shards = assign_shards(spec, servers)
        names = [name for shard in shards for name in shard]
        assert sorted(names) == sorted(p.name for p in spec) and all(shards)
        sizes = {p.name: p.numel for p in spec}
        loads = [sum(sizes[n] for n in shard) for shard in shards]
        # greedy LPT: no server exceeds the mean load by more than the largest tensor
        assert max(loads) <= sum(loads) / servers + max(sizes.values())


def test_bad_input_is_a_clear_error():
    spec = model_spec(TASK.build_model())
    with pytest.raises(ConfigError, match="at least one server"):
        assign_shards(spec, 0)
    with pytest.raises(ConfigError, match=f"only {len(spec)} parameter tensors.*at most {len(spec)} servers"):
        JobConfig(servers=len(spec) + 1, workers=1).validate()
    with pytest.raises(ConfigError, match="unknown"):
        Consistency("bulk")
    with pytest.raises(ConfigError, match="only applies to mode 'ssp'"):
        Consistency("asp", staleness=2)
    with pytest.raises(ConfigError, match="not a torch.optim optimizer"):
        OptimizerSpec("Adamm").build([torch.nn.Parameter(torch.zeros(1))])
    with pytest.raises(ConfigError, match="workers=0"):
        JobConfig(workers=0).validate()


@pytest.mark.timeout(30)
def test_a_worker_with_a_different_model_is_refused():
    server = ShardServer(TASK.build_model(), ServerSettings())
    service = Service(server, log_every_s=0)
    thread = threading.Thread(target=service.serve_forever, daemon=True)
    thread.start()
    foreign = AdditionGPT(width_override=16).build_model()
    with pytest.raises(ConfigError, match="different model.*'tok_embed.weight' is \\(12, 16\\).*Fix"):
        PSWorker([service.address], foreign, "odd", timeout_s=10)
    worker = PSWorker([service.address], TASK.build_model(), "good", timeout_s=10)  # the right model is admitted
    assert worker.pull() == [0]
    worker.close()


# ----------------------------------------------------------------- the server's rules, in process
def test_a_retried_push_is_applied_once():
    server = ShardServer(TASK.build_model(), ServerSettings(consistency=Consistency("asp")))
    server.join("w", "w", server.spec)
    first = server.push("w", 0, 0, _push_grads(server, 1.0), 5)
    after_first = {n: p.detach().clone() for n, p in server.params.items()}
    retry = server.push("w", 0, 0, _push_grads(server, 1.0), 5)
    assert first == {"applied": True, "duplicate": False, "version": 1, "tau": 0}
    assert retry["applied"] and retry["duplicate"] and server.version == 1 and server.pushes_applied == 1
    assert all(torch.equal(after_first[n], p) for n, p in server.params.items())


def test_bsp_round_closes_without_a_worker_that_died():
    server = ShardServer(TASK.build_model(), ServerSettings(consistency=Consistency("bsp")))
    for wid in ("a", "b", "c"):
        server.join(wid, wid, server.spec)
    replies = {}

    def push(wid: str) -> None:
        replies[wid] = server.push(wid, 0, 0, _push_grads(server, 1.0), 10)

    threads = [threading.Thread(target=push, args=(wid,)) for wid in ("a", "b")]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    assert server.version == 0, "the round must wait for the live worker c"
    server.lost("c", "test")
    for thread in threads:
        thread.join(timeout=10)
    assert server.version == 1 and server.pushes_applied == 2 and all(r["applied"] for r in replies.values())
    assert server.push("a", 1, 0, _push_grads(server, 1.0), 5)["applied"] is False  # computed on an old version


def test_ssp_blocks_a_worker_more_than_s_clocks_ahead():
    server = ShardServer(TASK.build_model(), ServerSettings(consistency=Consistency("ssp", staleness=1)))
    server.join("fast", "fast", server.spec)
    server.join("slow", "slow", server.spec)
    for seq in range(2):  # fast reaches clock 2 while slow is at 0: 2 - 0 > s = 1
        server.push("fast", seq, server.version, _push_grads(server, 0.0), 5)
    with pytest.raises(TimeoutError, match="slowest worker"):
        server.pull("fast", timeout_s=0.3)
    server.push("slow", 0, 0, _push_grads(server, 0.0), 5)
    assert server.pull("fast", timeout_s=1)["version"] == 3
    assert server.staleness.counts == {0: 2, 2: 1}  # slow's gradient was computed on version 0, applied at 2


def test_checkpoint_is_atomic_and_a_restarted_server_resumes(tmp_path):
    settings = ServerSettings(
        consistency=Consistency("asp"), optimizer=ADAMW, checkpoint_dir=str(tmp_path), checkpoint_every=2
    )
    server = ShardServer(TASK.build_model(), settings)
    server.join("w", "w", server.spec)
    for seq in range(3):
        server.push("w", seq, seq, _push_grads(server, 0.1 * (seq + 1)), 5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["server-0.pt"]  # no .tmp left behind
    restarted = ShardServer(TASK.build_model(), settings)
    assert restarted.version == 2 and restarted.pushes_applied == 2  # the state of the last checkpoint (version 2)
    expected = ShardServer(TASK.build_model(), ServerSettings(consistency=Consistency("asp"), optimizer=ADAMW))
    expected.join("w", "w", expected.spec)
    for seq in range(2):
        expected.push("w", seq, seq, _push_grads(expected, 0.1 * (seq + 1)), 5)
    assert all(torch.equal(expected.params[n], p) for n, p in restarted.params.items())
    restarted.join("w", "w", restarted.spec)  # the worker reconnects and retries its pushes 1 and 2
    assert restarted.push("w", 1, 1, _push_grads(restarted, 0.2), 5)["duplicate"]
    assert not restarted.push("w", 2, 2, _push_grads(restarted, 0.3), 5)["duplicate"]
    assert restarted.version == 3


def test_a_restarted_bsp_server_waits_for_the_workers_live_at_its_checkpoint(tmp_path):
    settings = ServerSettings(
        consistency=Consistency("bsp"),
        checkpoint_dir=str(tmp_path),
        checkpoint_every=1,
        min_workers=2,
        dead_after_s=0.5,
    )
    server = ShardServer(TASK.build_model(), settings)
    for wid in ("a", "b", "gone"):
        server.join(wid, wid, server.spec)
    server.leave("gone")
    pushes = [threading.Thread(target=server.push, args=(wid, 0, 0, _push_grads(server, 1.0), 10)) for wid in "ab"]
    for thread in pushes:
        thread.start()
    for thread in pushes:
        thread.join(timeout=10)
    assert server.version == 1  # round 0 closed and was checkpointed with a and b live, "gone" gone
    restarted = ShardServer(TASK.build_model(), settings)
    assert restarted.version == 1 and restarted.live_count() == 2  # a and b presumed alive, "gone" is not
    restarted.join("a", "a", restarted.spec)  # a reconnects first
    first = threading.Thread(target=restarted.push, args=("a", 1, 1, _push_grads(restarted, 1.0), 10))
    first.start()
    time.sleep(0.2)
    assert restarted.version == 1, "the round must wait for b, live at the checkpoint, not close on a alone"
    restarted.sweep()  # b's heartbeat has been silent for less than dead_after_s: still waited for
    assert restarted.version == 1
    time.sleep(0.5)
    restarted.beat("a")  # a's heartbeat thread keeps it alive while it waits in the round
    restarted.sweep()  # b stayed silent past dead_after_s: declared dead, and the round closes without it
    first.join(timeout=10)
    assert restarted.version == 2 and restarted.workers["a"].last_seq == 1 and not restarted.workers["b"].alive


# ----------------------------------------------------------------- multi-process runs
@pytest.mark.distributed
@pytest.mark.timeout(90)
@pytest.mark.parametrize("optimizer", [SGD, ADAMW], ids=["sgd", "adamw"])
def test_bsp_matches_synchronous_data_parallel_step_by_step(optimizer):
    steps, workers = 4, 2
    result = run_local(
        JobConfig(
            servers=2,
            workers=workers,
            steps=steps,
            consistency=Consistency("bsp"),
            optimizer=optimizer,
            record_history=True,
            log_every_s=0,
        )
    )
    expected = _sync_training(optimizer, workers, steps)
    for report in result.reports:
        assert report["version"] == steps and report["pushes_applied"] == steps * workers
        assert report["staleness"]["max"] == 0
        for step, shard in enumerate(report["history"]):
            for name, value in shard.items():
                # fp32: the mean of 2 per-worker mean gradients vs the gradient of the 16-sample mean differ only in
                # summation order (~1e-7 relative); AdamW divides by sqrt(v) ~ |g|, so params agree to ~1e-6
                torch.testing.assert_close(
                    value,
                    expected[step][name],
                    rtol=1e-5,
                    atol=1e-5,
                    msg=f"server {report['index']} step {step} {name}",
                )


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_asp_and_ssp_converge_close_to_synchronous_training():
    steps, workers = 40, 3
    initial = _eval_loss(None)
    sync = _eval_loss(_sync_training(ADAMW, workers, steps)[-1])
    for consistency in (Consistency("asp"), Consistency("ssp", staleness=2)):
        result = run_local(
            JobConfig(servers=1, workers=workers, steps=steps, consistency=consistency, optimizer=ADAMW, log_every_s=0)
        )
        loss = _eval_loss(result.params)
        staleness = result.reports[0]["staleness"]
        # same samples seen (steps x workers x 8); asynchronous runs take 3x more, smaller, stale steps. Measured
        # (idle and loaded machine): sync 2.48 -> ~1.6-1.8, ASP/SSP within ~0.2 nats of it. Margin: they must keep
        # at least 70% of sync's loss reduction; much more staleness noise (or a lost/duplicated update) breaks it.
        assert loss <= initial - 0.7 * (initial - sync), f"{consistency.mode}: {loss:.3f} vs sync {sync:.3f}"
        assert result.reports[0]["pushes_applied"] == steps * workers
        if consistency.mode == "ssp":
            # a worker at clock c pulls when slowest >= c - s; until it pushes, another worker j can push from clock
            # c - s (at least the slowest) up to c + s + 1 (it may not pull beyond slowest + s <= c + s): 2s + 1 pushes
            assert staleness["max"] <= (workers - 1) * (2 * consistency.staleness + 1), staleness


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_killing_a_worker_mid_run_does_not_stop_training():
    config = JobConfig(servers=1, workers=4, steps=30, consistency=Consistency("bsp"), optimizer=ADAMW, log_every_s=0)
    victim, kill_at = 2, random.randint(3, 20)
    with LocalCluster(config) as cluster:
        cluster.start_servers()
        for index in range(config.workers):
            cluster.start_worker(index)
        deadline = time.monotonic() + 60
        while cluster.report()["version"] < kill_at:
            assert time.monotonic() < deadline, "training did not reach the kill step"
            time.sleep(0.02)
        cluster.kill_worker(victim)
        finished = cluster.wait_workers()
        report = cluster.stop()[0]
    assert sorted(finished) == [0, 1, 3]
    applied = report["applied_by_worker"]
    for index, outcome in finished.items():
        assert applied[f"worker{index}"] == outcome["acked"] == config.steps
    # the victim's last push may have been applied with its acknowledgement still on the wire when it died
    assert cluster.acked[victim] <= applied[f"worker{victim}"] <= cluster.acked[victim] + 1
    assert report["pushes_applied"] == sum(applied.values())
    assert report["version"] >= config.steps and report["live_workers"] == 0
    assert all(torch.isfinite(p).all() for p in report["params"].values())
    # BSP over the survivors is synchronous training on 3/4 of the global batch after the kill: it must keep at
    # least 80% of the loss reduction of uninterrupted synchronous training with 4 workers (measured: 1.00-1.02 of
    # it over 3 runs killed at rounds 8-14; a lost or doubly applied round of a 30-round run costs several %)
    initial, sync, loss = (
        _eval_loss(None),
        _eval_loss(_sync_training(ADAMW, 4, config.steps)[-1]),
        _eval_loss(report["params"]),
    )
    assert loss <= initial - 0.8 * (initial - sync), f"killed at {kill_at}: {loss:.3f}, sync {sync:.3f}"


def _wait_for_version(cluster: LocalCluster, server: int, version: int, what: str) -> None:
    deadline = time.monotonic() + 60
    while cluster.report(server)["version"] < version:
        assert time.monotonic() < deadline, f"training did not reach {what}"
        time.sleep(0.02)


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_a_killed_server_restarts_from_its_checkpoint_and_training_completes(tmp_path):
    # BSP with two shards is the hard case: after the restart, shard 1's rounds restart from an older version while
    # shard 0's go on, so the workers' in-flight shard-1 pushes are stale (dropped) and their rounds fall out of step
    config = JobConfig(
        servers=2,
        workers=3,
        steps=30,
        consistency=Consistency("bsp"),
        optimizer=ADAMW,
        checkpoint_dir=str(tmp_path),
        checkpoint_every=4,
        log_every_s=0,
    )
    with LocalCluster(config) as cluster:
        cluster.start_servers()
        for index in range(config.workers):
            cluster.start_worker(index)
        _wait_for_version(cluster, 1, random.randint(9, 15), "the kill step")
        cluster.kill_server(1)
        cluster.restart_server(1)
        finished = cluster.wait_workers()
        reports = cluster.stop()
    survivor, restarted = reports
    # every step of every worker was applied by both shards: a push the restarted shard refused as stale (computed
    # on a version it no longer has) was recomputed and pushed again, so the shards' BSP rounds stayed in step
    assert sorted(finished) == [0, 1, 2] and all(out["acked"] == config.steps for out in finished.values())
    assert survivor["resumed_from"] is None and survivor["version"] == config.steps
    assert survivor["applied_by_worker"] == {f"worker{i}": config.steps for i in range(3)}
    # resumed at its last checkpoint (a multiple of 4, at least 8), then kept training
    assert restarted["resumed_from"] % 4 == 0 and restarted["resumed_from"] >= 8
    assert restarted["version"] > restarted["resumed_from"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["server-0.pt", "server-1.pt"]  # no temporary files
    params = {**survivor["params"], **restarted["params"]}
    assert all(torch.isfinite(p).all() for p in params.values())
    # the restart loses shard 1's updates since its checkpoint (<= 3 rounds) and the rounds whose pushes were then
    # dropped as stale: training keeps 80% of synchronous training's loss reduction (measured: 0.985-1.02 of it,
    # 3 runs restarted at rounds 9-15, 0-3 rounds lost)
    initial, sync, loss = _eval_loss(None), _eval_loss(_sync_training(ADAMW, 3, config.steps)[-1]), _eval_loss(params)
    assert loss <= initial - 0.8 * (initial - sync), f"{loss:.3f} vs sync {sync:.3f} (initial {initial:.3f})"


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_worker_joining_mid_run_gets_the_current_parameters():
    config = JobConfig(
        servers=1, workers=2, steps=25, consistency=Consistency("ssp", staleness=2), optimizer=ADAMW, log_every_s=0
    )
    with LocalCluster(config) as cluster:
        cluster.start_servers()
        for index in range(2):
            cluster.start_worker(index, step_delay_s=0.05)
        deadline = time.monotonic() + 60
        while cluster.report()["version"] < 10:
            assert time.monotonic() < deadline, "training did not reach the join step"
            time.sleep(0.02)
        cluster.start_worker(2)
        finished = cluster.wait_workers()
        report = cluster.stop()[0]
    assert finished[2]["first_versions"][0] >= 10, "the new worker must start from the current parameters"
    assert report["applied_by_worker"] == {f"worker{i}": config.steps for i in range(3)}
    assert report["pushes_applied"] == report["version"] == 3 * config.steps
