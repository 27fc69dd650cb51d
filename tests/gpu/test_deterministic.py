"""Deterministic mode on CUDA (``plait.determinism``, ``--deterministic``): two runs bitwise equal, and what it
costs in step time (docs/certify.md, "Deterministic mode": the figure is this test's, measured on a GPU).

Each run is a fresh process (``plait.launch.run_local``) so that the environment (CUBLAS_WORKSPACE_CONFIG,
NCCL_ALGO, NCCL_PROTO) is in place before CUDA starts, as ``plait train`` and ``plait certify`` do it. The model
is a small GPT-2-shaped one (8 layers, d_model 512, 256 tokens, 16 rows a step, bf16 autocast; a tiny one when
``PLAIT_GPU_TEST_DEVICE=cpu`` dry-runs the code), whose embedding backward is one of the kernels deterministic
mode replaces (index accumulation by sorting instead of atomics). The step time is measured, not asserted (no wall-clock asserts); the test prints it and records it
as the properties ``deterministic_ms``, ``default_ms`` and ``cost`` (deterministic / default - 1).
"""

from __future__ import annotations

import os
import time

import torch
from helpers.harness import run_distributed

import plait
from plait import Layout
from plait.determinism import DETERMINISTIC_ENV, make_deterministic, state
from plait.models import GPT, GPTConfig, lm_loss

DEVICE = os.environ.get("PLAIT_GPU_TEST_DEVICE", "cuda")
WARMUP, TIMED = 3, 10
SHAPE = {"vocab_size": 8192, "seq_len": 256, "n_layer": 8, "n_head": 8, "d_model": 512}
if DEVICE == "cpu":  # the dry run checks the code, not the GPU
    SHAPE = {"vocab_size": 64, "seq_len": 16, "n_layer": 1, "n_head": 2, "d_model": 16}
ROWS = 16


def _run(deterministic: bool, device: str) -> dict:
    """``WARMUP + TIMED`` steps of the GPT on fixed random batches under one process (dp over this run's ranks);
    losses, final parameters and the mean time of the timed steps."""
    if deterministic:
        make_deterministic()
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SHAPE))
    engine = plait.parallelize(
        model,
        Layout(precision="bf16"),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
        loss_fn=lm_loss,
        max_grad_norm=1.0,
        device=device,
    )
    generator = torch.Generator().manual_seed(1)
    batches = [
        torch.randint(0, SHAPE["vocab_size"], (ROWS, SHAPE["seq_len"] + 1), generator=generator)
        for _ in range(WARMUP + TIMED)
    ]
    rows = ROWS // engine.mesh.size("dp")
    start = engine.mesh.index("dp") * rows
    losses, seconds = [], 0.0
    for step, batch in enumerate(batches):
        mine = batch[start : start + rows].to(device)
        if device == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        losses.append(engine.train_step((mine[:, :-1], mine[:, 1:])).loss)
        if device == "cuda":
            torch.cuda.synchronize()
        if step >= WARMUP:
            seconds += time.perf_counter() - began
    params = {name: p.detach().float().cpu() for name, p in engine.strategy.full_parameters().items()}
    return {"losses": losses, "params": params, "ms": 1e3 * seconds / TIMED, "state": state()}


def _bitwise(a: dict, b: dict) -> bool:
    return a["losses"] == b["losses"] and all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])


def test_deterministic_reruns_are_bitwise_equal_and_the_cost_is_measured(record_property):
    env = dict(DETERMINISTIC_ENV)
    default = run_distributed(_run, 1, False, DEVICE, timeout=600)[0]
    first, second = (run_distributed(_run, 1, True, DEVICE, timeout=600, env=env)[0] for _ in range(2))
    assert first["state"]["deterministic_algorithms"] and first["state"]["env"] == DETERMINISTIC_ENV
    assert _bitwise(first, second), "two deterministic runs on one GPU differ"
    cost = first["ms"] / default["ms"] - 1
    record_property("deterministic_ms", first["ms"])
    record_property("default_ms", default["ms"])
    record_property("cost", cost)
    print(f"deterministic mode: {first['ms']:.2f} ms/step against {default['ms']:.2f} ({100 * cost:+.1f} %)")


def test_two_ranks_on_one_gpu_rerun_bitwise():
    """dp=2 (gloo, two ranks sharing the GPU): the gradient all-reduce and every kernel repeat their order."""
    env = dict(DETERMINISTIC_ENV)
    a, b = (run_distributed(_run, 2, True, DEVICE, timeout=600, env=env) for _ in range(2))
    assert all(_bitwise(x, y) for x, y in zip(a, b)), "two deterministic dp=2 runs differ"
