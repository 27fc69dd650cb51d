"""The memory estimator reproduces the ZeRO paper's model-state figures and equals the bytes a run holds."""

import functools

import pytest
import torch
from helpers.gpt import OPTIMIZERS, make_model
from helpers.harness import run_distributed

import plait
from plait import Layout, estimate_memory, measure_held
from plait.data import ShardedBatches
from plait.planner.memory import activation_bytes, zero_paper_bytes


@pytest.mark.parametrize("stage, gigabytes", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_one(stage, gigabytes):
    """Rajbhandari et al. 2020, Figure 1: Psi = 7.5B parameters, N = 64, K = 12."""
    assert zero_paper_bytes(7.5e9, 64, stage) / 1e9 == pytest.approx(gigabytes, abs=0.05)


def test_estimates_fall_as_the_paper_says():
    psi, n = 1000, 4
    by_stage = [estimate_memory(psi, Layout(dp=n, zero=s)) for s in range(4)]
    assert by_stage[0].optimizer_states == 8 * psi and by_stage[1].optimizer_states == 8 * psi / n
    assert by_stage[2].gradients == 4 * psi / n and by_stage[3].parameters == 4 * psi / n
    assert [e.model_states for e in by_stage] == sorted((e.model_states for e in by_stage), reverse=True)
    offloaded = estimate_memory(psi, Layout(dp=n, zero=2, offload="cpu"))
    assert offloaded.host == offloaded.optimizer_states + offloaded.master_weights
    with pytest.raises(ValueError, match="lamb"):
        estimate_memory(psi, Layout(dp=1), optimizer="lamb")


def test_activation_formula_and_recompute():
    full = activation_bytes(seq=2048, batch=1, hidden=4096, heads=32, layers=1)
    assert full == 2048 * 4096 * (34 + 5 * 32 * 2048 / 4096)  # Korthikanti et al. 2022, eq. 2
    assert activation_bytes(2048, 1, 4096, 32, 1, recompute_layers=1) == 2 * 2048 * 4096
    estimate = estimate_memory(
        100, Layout(dp=1, recompute="full"), activations={"seq": 8, "batch": 2, "hidden": 16, "heads": 2, "layers": 2}
    )
    assert estimate.activations == 2 * (2 * 8 * 2 * 16) * 4 / 2


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_measured_model_states_equal_the_estimate_single_rank(optimizer):
    model, task = make_model()
    engine = plait.parallelize(model, Layout(), optimizer=OPTIMIZERS[optimizer])
    held = {}
    engine.before_optimizer_step.append(lambda e: held.update(measure_held(e)))
    loader = ShardedBatches(task, 8)
    engine.train_step(loader.batch_at(0))
    engine.train_step(loader.batch_at(1))  # optimizer states exist from the first step on
    estimate = estimate_memory(model, engine.layout, engine.optimizer)
    assert held["parameters"] == estimate.parameters
    assert held["gradients"] == estimate.gradients
    assert held["optimizer_states"] == estimate.optimizer_states


# ------------------------------------------------------------------------------------------ ZeRO 1-3, dp=2 and 4
MEMORY_CONFIGS = [(stage, "none", opt) for stage in (0, 1, 2, 3) for opt in ("adamw", "sgd")] + [
    (1, "cpu", "adamw"),
    (3, "cpu", "adamw"),
    (3, "cpu", "sgd"),
]
"""(zero stage, offload, optimizer): every stage with AdamW (8 B of state per element) and SGD with momentum
(4 B), and offloaded masters under ZeRO-1 and ZeRO-3."""
MEASURE_POINTS = ("backward", "step", "rest")
"""After the last backward returns (before finish_backward), when the optimizer steps, and between steps."""
WITHIN = 0.01
"""Padding: each flat buffer is padded to a multiple of N (at most N-1 elements per bucket / ZeRO-3 unit), a
fraction < 0.2 % of the tiny GPT's 6736 parameters at N <= 4; the issue asks for 1 %."""


def _held_over_steps(world: int) -> dict:
    """For each config, measure_held at the three points of the second step (optimizer state exists by then)."""
    out = {}
    for stage, offload, opt in MEMORY_CONFIGS:
        model, task = make_model()
        psi = sum(p.numel() for p in model.parameters())  # before parallelize: ZeRO-3 empties the model's parameters
        engine = plait.parallelize(model, Layout(dp=world, zero=stage, offload=offload), optimizer=OPTIMIZERS[opt])
        strategy = engine.strategy
        loader = ShardedBatches(task, 8, dp_rank=engine.mesh.index("dp"), dp_size=world)
        for step in range(2):
            inputs, targets = loader.batch_at(step)
            torch.nn.functional.cross_entropy(engine.model(inputs).flatten(0, 1), targets.flatten()).backward()
            held = {"backward": measure_held(engine)}
            strategy.finish_backward()
            held["step"] = measure_held(engine)
            strategy.step()
            strategy.zero_grad()
            held["rest"] = measure_held(engine)
        estimate = estimate_memory(psi, engine.layout, engine.optimizer)
        out[(stage, offload, opt)] = {"held": held, "estimate": estimate}
        getattr(strategy, "close", lambda: None)()
    return out


@functools.cache
def held_over_steps(world: int) -> list[dict]:
    return run_distributed(_held_over_steps, world, world)


def _close(measured: int, estimated: float, what: str) -> None:
    assert measured == pytest.approx(estimated, rel=WITHIN, abs=0), (
        f"{what}: measured {measured} B, estimate {estimated:.0f} B"
    )


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_estimate_equals_measured_under_zero(world):
    """estimate_memory's per-rank model states equal the bytes each rank's tensors hold, within 1 % (padding):
    parameters, master weights and optimizer states at every point; gradients at their peak (ZeRO-1: the full
    local gradient at the end of backward), ``gradients_at_step`` when the optimizer steps, none between steps."""
    for rank, run in enumerate(held_over_steps(world)):
        for (stage, offload, opt), result in run.items():
            held, estimate = result["held"], result["estimate"]
            tag = f"rank {rank} zero={stage} offload={offload} {opt}"
            for point in MEASURE_POINTS:
                for kind in ("parameters", "master_weights", "optimizer_states"):
                    _close(held[point][kind], getattr(estimate, kind), f"{tag} {kind} at {point}")
            peak = max(held[point]["gradients"] for point in MEASURE_POINTS)
            _close(peak, estimate.gradients, f"{tag} peak gradients")
            _close(held["step"]["gradients"], estimate.gradients_at_step, f"{tag} gradients at the step")
            assert held["rest"]["gradients"] == 0, f"{tag}: gradients held between steps"


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_each_stage_removes_what_the_paper_says(world):
    """Measured: stage 1 divides the optimizer states by N (its gradients peak at the full size during backward),
    stage 2 the gradients too, stage 3 the parameters too (ratios to DDP's figures, 1/N up to padding)."""
    run = held_over_steps(world)[0]
    for opt in ("adamw", "sgd"):
        ddp, *zero = (run[(stage, "none", opt)]["held"] for stage in (0, 1, 2, 3))
        peak = [max(h[p]["gradients"] for p in MEASURE_POINTS) for h in (ddp, *zero)]
        ratios = {  # what: (measured ratio to DDP, expected)
            "stage 1 optimizer states": (
                zero[0]["step"]["optimizer_states"] / ddp["step"]["optimizer_states"],
                1 / world,
            ),
            "stage 1 gradients (peak: full during backward)": (peak[1] / peak[0], 1.0),
            "stage 2 gradients": (peak[2] / peak[0], 1 / world),
            "stage 2 parameters (whole)": (zero[1]["rest"]["parameters"] / ddp["rest"]["parameters"], 1.0),
            "stage 3 parameters": (zero[2]["rest"]["parameters"] / ddp["rest"]["parameters"], 1 / world),
            "stage 3 optimizer states": (
                zero[2]["step"]["optimizer_states"] / ddp["step"]["optimizer_states"],
                1 / world,
            ),
        }
        for what, (ratio, want) in ratios.items():
            assert ratio == pytest.approx(want, rel=WITHIN), f"{opt} {what}: {ratio:.4f}, expected {want:.4f}"
