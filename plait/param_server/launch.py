"""Run a parameter-server job: server and worker process entry points, and `LocalCluster` for one machine.

Servers start first and report their addresses; workers connect to all of them. `LocalCluster` spawns them
(forkserver, torch preloaded), can kill a worker (SIGKILL) or start a new one mid-run, and at the end asks every
server for its final report and shard. Its processes die with it (``plait.launch.die_with_process``): a launcher
killed with SIGKILL leaves no server serving and no worker training. On several machines the same entry points run as separate commands
(docs/param_server.md): `serve_shard` on each server host, `run_worker` on each worker host.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import secrets
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from plait.errors import ConfigError
from plait.launch import die_with_process
from plait.logging import configure, get_logger
from plait.param_server.agreement import JobSettings
from plait.param_server.consistency import Consistency
from plait.param_server.server import OptimizerSpec, ServerSettings, ShardServer
from plait.param_server.service import Service
from plait.param_server.sharding import assign_shards, model_spec
from plait.param_server.task import AdditionGPT, Task
from plait.param_server.transport import call, connect, request
from plait.param_server.wire import DTYPES, Channel, ProtocolError, shard_bytes
from plait.param_server.worker import PUSH_DTYPES, PSWorker

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
    task: Task = field(default_factory=AdditionGPT)
    dead_after_s: float = 5.0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    record_history: bool = False
    timeout_s: float = 120.0
    log_every_s: float = 1.0
    """Servers log their progress this often (0: never; ``plait ps`` shows them in its live view instead)."""
    worker_log_every_s: float = 5.0
    """Each worker logs its step, loss, staleness and exchange times this often (0: never)."""
    push_dtype: str = "float32"
    """Gradients travel in this dtype: "bfloat16" or "float16" halve the push bytes (applied in fp32)."""
    overlap: bool = True
    """Push each shard as soon as backward has its gradients (worker.py)."""
    shm: bool = True
    """Same-host tensors through shared memory (wire.py)."""

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
        if self.push_dtype not in PUSH_DTYPES:
            raise ConfigError(f"push_dtype={self.push_dtype!r} is unknown. Fix: use one of {sorted(PUSH_DTYPES)}.")
        assign_shards(model_spec(self.task.build_model()), self.servers)

    @property
    def job(self) -> JobSettings:
        """What servers and workers compare when a worker joins."""
        return JobSettings(self.consistency.mode, self.consistency.staleness, self.steps, self.workers, self.servers)

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
            self.steps,
        )


def _log_progress() -> None:
    """Every server and worker process logs its own progress (plait's logger keeps ranks > 0 at WARNING)."""
    logging.getLogger("plait.param_server").setLevel(logging.INFO)


def serve_shard(
    config: JobConfig,
    index: int,
    host: str = "127.0.0.1",
    port: int = 0,
    addresses: Any = None,
    key: bytes | None = None,
) -> dict[str, Any]:
    """Server process body: build the model, keep shard `index`, serve until stopped; returns the final report."""
    configure(rank=index)
    _log_progress()
    torch.set_num_threads(1)
    server = ShardServer(config.task.build_model(), config.server_settings(index))
    service = Service(server, host, port, log_every_s=config.log_every_s, key=key)
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
    key: bytes | None = None,
) -> list[float]:
    """Worker process body: `config.steps` pull/compute/push steps on worker `index`'s data; returns the losses."""
    configure(rank=config.servers + index)
    _log_progress()
    torch.set_num_threads(1)
    task = config.task
    worker = PSWorker(
        addresses,
        task.build_model(),
        f"worker{index}",
        key=key,
        settings=config.job,
        timeout_s=config.timeout_s,
        shm=config.shm,
        push_dtype=config.push_dtype,
        overlap=config.overlap,
    )
    losses: list[float] = []
    first_versions = None
    loss_of = getattr(task, "loss_terms", task.loss)  # (sum, count) of a token mean; else the loss, one item
    progress = WorkerProgress(worker, config.steps, config.worker_log_every_s)
    for step in range(config.steps):
        started = time.perf_counter()
        loss, _ = worker.step(step, lambda model: loss_of(model, task.batch_of(index, step)))  # noqa: B023 - called within this iteration
        losses.append(loss)
        progress.record(step, loss, time.perf_counter() - started)
        first_versions = first_versions or list(worker.versions)
        if acked is not None:
            acked[index] = worker.acked
        if step_delay_s:
            time.sleep(step_delay_s)
    progress.finish()
    worker.close()
    if results is not None:
        results.put((index, {"losses": losses, "acked": worker.acked, "first_versions": first_versions}))
    return losses


class WorkerProgress:
    """A worker's own log line every ``every_s``: step, mean loss, staleness its pushes had, time per step and
    the share of it spent waiting for the servers' replies (after backward: what overlap did not hide)."""

    def __init__(self, worker: PSWorker, steps: int, every_s: float) -> None:
        self.worker, self.steps, self.every_s = worker, steps, every_s
        self.losses: list[float] = []
        self.step_s = 0.0
        self.last = time.monotonic()
        self.exchange_at_last = 0.0

    def record(self, step: int, loss: float, seconds: float) -> None:
        self.losses.append(loss)
        self.step_s += seconds
        if self.every_s and time.monotonic() - self.last >= self.every_s:
            self._log(step)

    def _log(self, step: int) -> None:
        worker, count = self.worker, max(1, len(self.losses))
        taus = worker.last_tau or [0]
        log.info(
            "%s: step %d/%d, loss %.4f, staleness mean %.2f max %d, %.1f ms per step of which %.1f ms waiting "
            "for the servers",
            worker.name,
            step + 1,
            self.steps,
            sum(self.losses) / count,
            sum(taus) / len(taus),
            max(taus),
            1000 * self.step_s / count,
            1000 * (worker.exchange_s - self.exchange_at_last) / count,
        )
        self.losses, self.step_s, worker.last_tau = [], 0.0, []
        self.last, self.exchange_at_last = time.monotonic(), worker.exchange_s

    def finish(self) -> None:
        if self.every_s and self.losses:
            self._log(self.steps - 1)


def _server_entry(
    config: JobConfig, index: int, host: str, port: int, addresses: Any, key: bytes | None, owner: int
) -> None:
    """A `LocalCluster` server: `serve_shard`, ending with the launcher (`owner`) if it dies first."""
    die_with_process(f"server {index}", owner)
    serve_shard(config, index, host, port, addresses, key)


def _worker_entry(
    config: JobConfig,
    index: int,
    addresses: list[tuple[str, int]],
    acked: Any,
    results: Any,
    step_delay_s: float,
    key: bytes | None,
    owner: int,
) -> None:
    die_with_process(f"worker {index}", owner)
    try:
        run_worker(config, index, addresses, acked, results, step_delay_s, key)
    except BaseException as error:  # noqa: BLE001 - report to the launcher, then fail the process
        results.put((index, {"error": f"{type(error).__name__}: {error}"}))
        raise


class LocalCluster:
    """Servers and workers as local processes; use as a context manager (leftover processes are killed)."""

    def __init__(self, config: JobConfig, key: bytes | None = None) -> None:
        config.validate()
        self.config = config
        self.key = key or secrets.token_hex(32).encode()
        """The job's key: the caller's, else a fresh random one that only this launcher's processes receive."""
        spec = model_spec(config.task.build_model())
        self.spec = {p.name: p for p in spec}
        self.model_bytes = shard_bytes((p.shape, DTYPES[p.dtype]) for p in spec)
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["torch", "plait"])
        self.acked = self.ctx.Array("i", MAX_WORKERS)
        self.results = self.ctx.Queue()
        self.servers: list[Any] = []
        """Server processes by index (a restarted server replaces its predecessor)."""
        self.workers: dict[int, Any] = {}
        self.addresses: list[tuple[str, int]] = []
        self._report_channels: dict[int, Channel] = {}

    def _close_reports(self) -> None:
        for channel in self._report_channels.values():
            channel.close()
        self._report_channels.clear()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self._close_reports()
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
                target=_server_entry,
                args=(self.config, index, "127.0.0.1", port, found, self.key, os.getpid()),
                name=f"ps-server{index}",
                daemon=True,
            )
            start_process(process, f"server {index}")
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
            args=(self.config, index, self.addresses, self.acked, self.results, step_delay_s, self.key, os.getpid()),
        )
        start_process(process, "the worker")
        self.workers[index] = process

    def kill_worker(self, index: int) -> None:
        """SIGKILL, as `kill -9` would: no goodbye, the socket just closes."""
        os.kill(self.workers[index].pid, signal.SIGKILL)
        self.workers[index].join(timeout=10)

    def report(self, server: int = 0, timeout_s: float | None = None) -> dict[str, Any]:
        """Server `server`'s counters (`ShardServer.report`), waiting up to `timeout_s` (default the job's)."""
        timeout_s = self.config.timeout_s if timeout_s is None else timeout_s
        cached = self._report_channels.pop(server, None)
        if cached is not None:  # one connection per server for all polls (a handshake per poll costs the server)
            try:
                report = _fix_report(request(cached, "report", timeout_s))
                self._report_channels[server] = cached
                return report
            except (OSError, EOFError, TimeoutError, ProtocolError):
                cached.close()  # e.g. the server restarted: connect again
        channel = connect(self.addresses[server], self.key, timeout_s, 0)
        try:
            report = _fix_report(request(channel, "report", timeout_s))
        except BaseException:
            channel.close()
            raise
        self._report_channels[server] = channel
        return report

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
        self._close_reports()
        reports = []
        versions = self.config.steps * (self.config.workers + 8) + 1 if self.config.record_history else 0
        expected = {f"p/{name}": (p.shape, (p.dtype,)) for name, p in self.spec.items()}
        for step in range(versions):
            expected.update({f"h/{step}/{name}": (p.shape, (p.dtype,)) for name, p in self.spec.items()})
        for address in self.addresses:
            channel = connect(address, self.key, self.config.timeout_s, self.model_bytes * (versions + 1))
            try:
                value, reply = call(channel, "stop", self.config.timeout_s)
                tensors = {name: t.clone() for name, t in channel.tensors(reply, expected, exact=False).items()}
            finally:
                channel.close()
            report = _fix_report(value)
            report["params"] = {name[2:]: t for name, t in tensors.items() if name.startswith("p/")}
            history: dict[int, dict[str, Tensor]] = {}
            for name, tensor in tensors.items():
                if name.startswith("h/"):
                    _, version, param = name.split("/", 2)
                    history.setdefault(int(version), {})[param] = tensor
            report["history"] = [history[version] for version in sorted(history)]
            reports.append(report)
        for process in self.servers:
            process.join(timeout=10)
        return reports


def _fix_report(report: Any) -> dict[str, Any]:
    """A report as received (JSON): the staleness histogram's keys back to integers."""
    if not isinstance(report, dict):
        raise ConfigError(f"a server sent a malformed report: {str(report)[:200]}")
    staleness = report.get("staleness", {})
    staleness["histogram"] = {int(tau): count for tau, count in staleness.get("histogram", {}).items()}
    return report


def start_process(process: Any, what: str) -> None:
    """Start a job process; a model_fn, data or loss_fn the launcher cannot hand over is a ConfigError."""
    try:
        process.start()
    except (AttributeError, TypeError) as error:
        raise ConfigError(
            f"cannot start {what}: {error}. Fix: define model_fn, loss_fn and the dataset's class at module "
            f"level (not as a lambda or a nested function), so that other processes can import them."
        ) from error


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
