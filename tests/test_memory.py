"""The memory estimator reproduces the ZeRO paper's model-state figures and equals the bytes a run holds."""

import pytest
import torch

import plait
from plait import Layout, estimate_memory, measure_held
from plait.data import ShardedBatches
from plait.memory import activation_bytes, zero_paper_bytes
from test_engine import OPTIMIZERS, make_model


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
    estimate = estimate_memory(100, Layout(dp=1, recompute="full"),
                               activations={"seq": 8, "batch": 2, "hidden": 16, "heads": 2, "layers": 2})
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
