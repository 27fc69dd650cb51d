"""The parameter server's interface: ``train(model_fn, data, loss_fn, ...)`` on a user's own model (tied weights)
writes a checkpoint ``plait convert`` reads; settings that differ between a worker and the servers are an error on
both sides within 5 s naming each difference; a BSP server says whom it waits for within 5 s; pushes overlapped
with backward equal pushes after it (tied weights included); bf16 pushes apply exactly the rounded gradient.
Servers run in threads of this process except in the ``train`` test."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from torch import nn

from plait.checkpoint import load_full_state
from plait.cli.main import main
from plait.data import make_dataset
from plait.errors import ConfigError
from plait.param_server import AdditionGPT, Consistency, OptimizerSpec, PSWorker, ServerSettings, ShardServer, train
from plait.param_server.agreement import JobSettings
from plait.param_server.service import Service

TASK = AdditionGPT()
KEY = b"interface-test-key-0123"


class TiedLM(nn.Module):
    """A user's model: embedding, one hidden layer, and an output layer tied to the embedding."""

    def __init__(self, vocab: int = 12, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.hidden = nn.Linear(width, width)
        self.out = nn.Linear(width, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.embed(tokens))))


def tied_lm() -> nn.Module:
    return TiedLM()


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def server_log():
    logger = logging.getLogger("plait.param_server")
    handler, level = _Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def _serve(model: nn.Module, settings: ServerSettings) -> Service:
    service = Service(ShardServer(model, settings), log_every_s=0, key=KEY)
    threading.Thread(target=service.serve_forever, daemon=True).start()
    return service


def _wait_for(lines: list[str], text: str, within_s: float) -> float:
    started = time.monotonic()
    while not any(text in line for line in lines):
        assert time.monotonic() - started < within_s, f"no log line with {text!r} within {within_s} s: {lines}"
        time.sleep(0.05)
    return time.monotonic() - started


@pytest.mark.timeout(30)
def test_mismatched_settings_are_an_error_on_both_sides_within_5_s(server_log):
    settings = ServerSettings(consistency=Consistency("bsp"), min_workers=2, steps=10)
    service = _serve(TASK.build_model(), settings)
    try:
        started = time.monotonic()
        with pytest.raises(ConfigError) as caught:
            PSWorker(
                [service.address],
                TASK.build_model(),
                "stray",
                key=KEY,
                settings=JobSettings("asp", 0, 20, 4, 1),
                timeout_s=10,
            )
        assert time.monotonic() - started < 5
        message = str(caught.value)
        for phrase in (
            "mode: server 'bsp', worker 'asp'",
            "steps: server 10, worker 20",
            "workers: server 2, worker 4",
        ):
            assert phrase in message
        assert "Fix: start every server and worker of the job with the same --mode, --steps, --workers" in message
        assert any("refused worker stray" in line and "mode: server 'bsp'" in line for line in server_log)
        assert service.server.joined == 0  # nothing was admitted
    finally:
        service.stopped.set()


@pytest.mark.timeout(30)
def test_a_bsp_server_says_whom_it_waits_for_within_5_s(server_log):
    service = _serve(TASK.build_model(), ServerSettings(consistency=Consistency("bsp"), min_workers=3))
    server = service.server
    try:
        server.join("a", "a", server.spec)
        assert _wait_for(server_log, "waiting for workers: 1 of 3 have joined", 5) < 5
        for wid in "bc":
            server.join(wid, wid, server.spec)
        grads = {name: torch.zeros_like(p) for name, p in server.params.items()}
        pushes = [threading.Thread(target=server.push, args=(w, 0, 0, grads, 20), daemon=True) for w in "ab"]
        for thread in pushes:
            thread.start()
        assert _wait_for(server_log, "for workers ['c'] (2 of 3 live workers have pushed)", 5) < 5
        server.lost("c", "test")
        for thread in pushes:
            thread.join(timeout=10)
        assert server.version == 1
    finally:
        service.stopped.set()


def _three_steps(overlap: bool, push_dtype: str = "float32") -> tuple[dict[str, torch.Tensor], PSWorker]:
    torch.manual_seed(0)
    model = TiedLM()
    sgd = OptimizerSpec("SGD", {"lr": 0.5})
    services = [
        _serve(model, ServerSettings(index, 2, Consistency("asp"), sgd)) for index in range(2)
    ]  # two shards: the tied embedding on one, the rest on the other
    worker_model = TiedLM()
    worker = PSWorker([s.address for s in services], worker_model, "w", key=KEY, overlap=overlap, push_dtype=push_dtype)
    data = make_dataset("addition")
    for step in range(3):
        worker.step(
            step,
            lambda m: nn.functional.cross_entropy(
                m(data.batch(range(8))[0]).flatten(0, 1), data.batch(range(8))[1].flatten()
            ),
        )  # noqa: B023,E501
    params = {n: p.detach().clone() for s in services for n, p in s.server.params.items()}
    worker.close()
    for service in services:
        service.stopped.set()
    return params, worker


@pytest.mark.timeout(60)
def test_pushes_overlapped_with_backward_equal_pushes_after_it_with_tied_weights():
    overlapped, worker = _three_steps(overlap=True)
    # counted in the first step: autograd sums a tied weight's two uses before its one accumulation
    assert worker._uses == {"embed.weight": 1, "hidden.weight": 1, "hidden.bias": 1}
    after, _ = _three_steps(overlap=False)
    for name, value in after.items():
        assert torch.equal(overlapped[name], value), name  # same gradients, same order: bitwise equal


@pytest.mark.timeout(30)
def test_bf16_pushes_apply_exactly_the_rounded_gradient():
    torch.manual_seed(0)
    model = TiedLM()
    service = _serve(model, ServerSettings(consistency=Consistency("asp"), optimizer=OptimizerSpec("SGD", {"lr": 1.0})))
    try:
        initial = {n: p.detach().clone() for n, p in service.server.params.items()}
        worker = PSWorker([service.address], TiedLM(), "w", key=KEY, push_dtype="bfloat16")
        data = make_dataset("addition")
        inputs, targets = data.batch(range(8))
        worker.step(0, lambda m: nn.functional.cross_entropy(m(inputs).flatten(0, 1), targets.flatten()))
        for name, param in service.server.params.items():
            rounded = worker.params[name].grad.to(torch.bfloat16).float()
            assert not torch.equal(rounded, worker.params[name].grad)  # bf16 did round
            assert torch.equal(param.detach(), initial[name] - rounded), name  # SGD lr 1: w - bf16(g), exactly
        worker.close()
    finally:
        service.stopped.set()


def test_bad_push_dtype_is_a_clear_error():
    with pytest.raises(ConfigError, match="push_dtype='int8'"):
        PSWorker([], TASK.build_model(), "w", push_dtype="int8")


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_train_any_model_writes_a_checkpoint_plait_convert_reads(tmp_path):
    data = make_dataset("addition", digits=2)
    result = train(
        tied_lm, data, servers=2, workers=2, steps=6, consistency="bsp", optimizer="SGD", lr=0.5, out=tmp_path
    )
    summary = result.summary
    # BSP: 6 synchronous rounds, the same updates whatever order the workers' pushes arrive in (ASP's order, and so
    # its loss, varies from run to run); 6 SGD steps at lr 0.5 on the batch mean must lower the held-out loss
    assert result.held_out_loss < summary["initial_loss"], summary
    assert summary["updates"] == {"0": 6, "1": 6} and sum(summary["pushes_applied"].values()) == 24
    assert sum(summary["staleness"]["histogram"].values()) == 24 and summary["mode"] == "bsp"
    assert (tmp_path / "ps.png").stat().st_size > 10_000 and (tmp_path / "summary.json").is_file()
    state, meta = load_full_state(tmp_path / "ckpt")
    assert meta["step"] == 6
    for name, value in result.model.state_dict().items():
        assert torch.equal(state[name], value), name  # tied aliases each under their own name
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "model.safetensors")]) == 0
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "model.safetensors")["hidden.weight"], result.model.hidden.weight)


@pytest.mark.timeout(30)
def test_servers_given_in_the_wrong_order_are_named():
    services = [_serve(TASK.build_model(), ServerSettings(index, 2)) for index in range(2)]
    try:
        with pytest.raises(ConfigError, match="is server 1 of 2, but this worker was given it as server 0.*--connect"):
            PSWorker([services[1].address, services[0].address], TASK.build_model(), "w", key=KEY, timeout_s=10)
    finally:
        for service in services:
            service.stopped.set()
