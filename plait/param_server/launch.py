"""Run a parameter-server job: server and worker process entry points, and `LocalCluster` for one machine.

Servers start first and report their addresses; workers connect to all of them. `LocalCluster` spawns them
(forkserver, torch preloaded), can kill a worker (SIGKILL) or start a new one mid-run, and at the end asks every
server for its final report and shard. On several machines the same entry points run as separate commands
(docs/param_server.md): `serve_shard` on each server host, `run_worker` on each worker host.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from plait.errors import ConfigError
from plait.logging import configure, get_logger
from plait.param_server.consistency import Consistency
from plait.param_server.server import OptimizerSpec, ServerSettings, ShardServer
from plait.param_server.service import Service, request
from plait.param_server.sharding import assign_shards, model_spec
from plait.param_server.task import AdditionGPT
from plait.param_server.transport import connect
from plait.param_server.worker import PSWorker

log = get_logger(__name__)
MAX_WORKERS = 64
REPORT_TIMEOUT_S = 2.0
"""How long a progress poll waits for a server's report: a server that is down (restarting) shows as 'no report'
at once instead of holding up the launcher."""


@dataclass(frozen=True)
class JobConfig:
    """A parameter-server job: how many servers and workers, the rules, the optimizer and what to train."""

    servers: int = 2
    workers: int = 4
    steps: int = 50
    consistency: Consistency = field(default_factory=Consistency)
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    task: AdditionGPT = field(default_factory=AdditionGPT)
    dead_after_s: float = 5.0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    record_history: bool = False
    timeout_s: float = 120.0
    log_every_s: float = 1.0

    def validate(self) -> None:
        """Raise ConfigError for a job that cannot run, before any process starts."""
        for name in ("workers", "steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer. Fix: e.g. --{name} 4.")
        if self.workers > MAX_WORKERS:
            raise ConfigError(f"workers={self.workers} exceeds {MAX_WORKERS} local workers. Fix: use fewer.")
        if self.checkpoint_every < 0:
            raise ConfigError(f"checkpoint_every={self.checkpoint_every} must be >= 0 (0: never).")
        assign_shards(model_spec(self.task.build_model()), self.servers)

    def server_settings(self, index: int) -> ServerSettings:
        return ServerSettings(
            index,
            self.servers,
            self.consistency,
            self.optimizer,
            self.dead_after_s,
            self.checkpoint_dir,
            self.checkpoint_every,
            self.record_history,
            self.workers,
        )


def serve_shard(
    config: JobConfig, index: int, host: str = "127.0.0.1", port: int = 0, addresses: Any = None
) -> dict[str, Any]:
    """Server process body: build the model, keep shard `index`, serve until stopped; returns the final report."""
    configure(rank=index)
    torch.set_num_threads(1)
    server = ShardServer(config.task.build_model(), config.server_settings(index))
    service = Service(server, host, port, log_every_s=config.log_every_s if index == 0 else 0.0)
    log.info(
        "server %d of %d listening on %s:%d, owning %d tensors",
        index,
        config.servers,
        *service.address,
        len(server.params),
    )
    if addresses is not None:
        addresses.put((index, service.address))
    return service.serve_forever()


def run_worker(
    config: JobConfig,
    index: int,
    addresses: list[tuple[str, int]],
    acked: Any = None,
    results: Any = None,
    step_delay_s: float = 0.0,
) -> list[float]:
    """Worker process body: `config.steps` pull/compute/push steps on worker `index`'s data; returns the losses."""
    configure(rank=config.servers + index)
    torch.set_num_threads(1)
    task = config.task
    worker = PSWorker(addresses, task.build_model(), f"worker{index}", timeout_s=config.timeout_s)
    losses, first_versions = [], None
    for step in range(config.steps):
        loss, _ = worker.step(step, lambda model: task.loss(model, task.batch_of(index, step)))  # noqa: B023 - called within this iteration
        losses.append(loss)
        first_versions = first_versions or list(worker.versions)
        if acked is not None:
            acked[index] = worker.acked
        if step_delay_s:
            time.sleep(step_delay_s)
    worker.close()
    if results is not None:
        results.put((index, {"losses": losses, "acked": worker.acked, "first_versions": first_versions}))
    return losses


def _worker_entry(
    config: JobConfig, index: int, addresses: list[tuple[str, int]], acked: Any, results: Any, step_delay_s: float
) -> None:
    try:
        run_worker(config, index, addresses, acked, results, step_delay_s)
    except BaseException as error:  # noqa: BLE001 - report to the launcher, then fail the process
        results.put((index, {"error": f"{type(error).__name__}: {error}"}))
        raise


class LocalCluster:
    """Servers and workers as local processes; use as a context manager (leftover processes are killed)."""

    def __init__(self, config: JobConfig) -> None:
        config.validate()
        self.config = config
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["torch", "plait"])
        self.acked = self.ctx.Array("i", MAX_WORKERS)
        self.results = self.ctx.Queue()
        self.servers: list[Any] = []
        """Server processes by index (a restarted server replaces its predecessor)."""
        self.workers: dict[int, Any] = {}
        self.addresses: list[tuple[str, int]] = []

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        for process in [*self.servers, *self.workers.values()]:
            if process is None:
                continue
            if process.is_alive():
                process.kill()
            process.join(timeout=5)

    def start_servers(self) -> list[tuple[str, int]]:
        """Start every server on a free port; returns their addresses in index order."""
        self.servers = [None] * self.config.servers
        self.addresses = self._start({index: 0 for index in range(self.config.servers)})
        return self.addresses

    def _start(self, ports: dict[int, int]) -> list[tuple[str, int]]:
        """Start server `index` on `port` (0: any free port) for each item; wait until every one listens."""
        found = self.ctx.Queue()
        for index, port in ports.items():
            process = self.ctx.Process(
                target=serve_shard,
                args=(self.config, index, "127.0.0.1", port, found),
                name=f"ps-server{index}",
                daemon=True,
            )
            process.start()
            self.servers[index] = process
        addresses: dict[int, tuple[str, int]] = {}
        deadline = time.monotonic() + self.config.timeout_s
        while len(addresses) < len(ports):
            try:
                index, address = found.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(
                    f"servers {sorted(set(ports) - set(addresses))} did not start within {self.config.timeout_s:g} s"
                ) from None
            addresses[index] = address
        return [addresses[index] for index in sorted(addresses)]

    def kill_server(self, index: int) -> None:
        """SIGKILL server `index`: its shard's updates since its last checkpoint are lost with it."""
        os.kill(self.servers[index].pid, signal.SIGKILL)
        self.servers[index].join(timeout=10)

    def restart_server(self, index: int) -> None:
        """Start server `index` again on its old address; it resumes from its checkpoint (if the job writes
        them) and the workers, retrying, reconnect to it."""
        self._start({index: self.addresses[index][1]})

    def start_worker(self, index: int, step_delay_s: float = 0.0) -> None:
        process = self.ctx.Process(
            target=_worker_entry,
            name=f"ps-worker{index}",
            daemon=True,
            args=(self.config, index, self.addresses, self.acked, self.results, step_delay_s),
        )
        process.start()
        self.workers[index] = process

    def kill_worker(self, index: int) -> None:
        """SIGKILL, as `kill -9` would: no goodbye, the socket just closes."""
        os.kill(self.workers[index].pid, signal.SIGKILL)
        self.workers[index].join(timeout=10)

    def report(self, server: int = 0, timeout_s: float | None = None) -> dict[str, Any]:
        """Server `server`'s counters (`ShardServer.report`), waiting up to `timeout_s` (default the job's)."""
        timeout_s = self.config.timeout_s if timeout_s is None else timeout_s
        conn = connect(self.addresses[server], timeout_s)
        try:
            return request(conn, "report", timeout_s)
        finally:
            conn.close()

    def reports(self) -> list[dict[str, Any] | str]:
        """Every server's report, or a sentence saying why it gave none (down, restarting)."""
        found: list[dict[str, Any] | str] = []
        for server in range(len(self.addresses)):
            try:
                found.append(self.report(server, timeout_s=REPORT_TIMEOUT_S))
            except Exception as error:  # noqa: BLE001 - a server being down is a state to show, not a failure here
                found.append(f"server {server}: no report ({error})")
        return found

    def wait_workers(
        self, on_reports: Callable[[list[dict[str, Any]]], None] | None = None, poll_s: float = 0.5
    ) -> dict[int, dict[str, Any]]:
        """Wait for every worker still alive: {index: {losses, acked, first_versions}}; raises on a worker's error.

        Every `poll_s` the servers' reports go to `on_reports` (a progress view). The job fails with the servers'
        states when it makes no progress (no server version moves, no worker finishes) for `config.timeout_s`."""
        expected = {index for index, process in self.workers.items() if process.exitcode is None}
        done: dict[int, dict[str, Any]] = {}
        last_progress, last_versions = time.monotonic(), None
        while expected - set(done):
            try:
                index, outcome = self.results.get(timeout=poll_s)
            except queue.Empty:
                reports = self.reports()
                versions = [r["version"] if isinstance(r, dict) else None for r in reports]
                if versions != last_versions:
                    last_versions, last_progress = versions, time.monotonic()
                if on_reports is not None:
                    on_reports([r for r in reports if isinstance(r, dict)])
                if time.monotonic() - last_progress > self.config.timeout_s:
                    states = [
                        r
                        if isinstance(r, str)
                        else f"server {r['index']}: version {r['version']}, {r['live_workers']} live"
                        for r in reports
                    ]
                    raise TimeoutError(
                        f"workers {sorted(expected - set(done))} made no progress for "
                        f"{self.config.timeout_s:g} s; {'; '.join(states)}"
                    ) from None
                continue
            if "error" in outcome:
                raise RuntimeError(f"worker {index} failed: {outcome['error']}")
            done[index], last_progress = outcome, time.monotonic()
        if on_reports is not None:  # the final state, however short the job was
            on_reports([r for r in self.reports() if isinstance(r, dict)])
        return done

    def stop(self) -> list[dict[str, Any]]:
        """Ask every server for its final report (shard included) and end it."""
        reports = []
        for address in self.addresses:
            conn = connect(address, self.config.timeout_s)
            reports.append(request(conn, "stop", self.config.timeout_s))
            conn.close()
        for process in self.servers:
            process.join(timeout=10)
        return reports


@dataclass
class JobResult:
    """The trained parameters (all shards merged), the servers' reports and each worker's losses."""

    params: dict[str, Tensor]
    reports: list[dict[str, Any]]
    losses: dict[int, list[float]]


def run_local(config: JobConfig, on_reports: Callable[[list[dict[str, Any]]], None] | None = None) -> JobResult:
    """Run a whole job on this machine: servers, then `config.workers` workers; returns when they finish.
    `on_reports` receives the servers' reports while it runs (e.g. `ProgressView.update`)."""
    with LocalCluster(config) as cluster:
        cluster.start_servers()
        for index in range(config.workers):
            cluster.start_worker(index)
        finished = cluster.wait_workers(on_reports)
        reports = cluster.stop()
    params = {name: value for report in reports for name, value in report["params"].items()}
    return JobResult(params, reports, {index: out["losses"] for index, out in finished.items()})


__all__ = ["JobConfig", "JobResult", "LocalCluster", "run_local", "run_worker", "serve_shard"]
