"""What a training step really holds, next to ``estimate_memory``: the activations it keeps for backward
(``Activations``, parameters and ZeRO-3's gathered units left out) and the model states at the optimizer step
(``measure_held``), for tests/test_memory.py and tests/test_planner_moe.py."""

from __future__ import annotations

from typing import Any

import torch
from helpers.gpt import OPTIMIZERS

import plait
from plait import Layout, estimate_memory, measure_held
from plait.models import GPT, GPTConfig, lm_loss
from plait.observe.memory import SavedActivations


def _zero3_gathered(engine: plait.Engine) -> set[int]:
    """Storages of ZeRO-3's gathered units now: a Linear saves its (gathered) weight by reference; that storage is
    the unit's, freed after its use and gathered again in backward, so it is not an activation."""
    units = getattr(engine.strategy, "units", [])
    full = [getattr(unit, "full", None) for unit in units]
    return {t.untyped_storage().data_ptr() for t in full if isinstance(t, torch.Tensor) and t.numel()}


class Activations(SavedActivations):
    """SavedActivations of a training step, leaving out the parameters and ZeRO-3's gathered units."""

    def __init__(self, engine: plait.Engine) -> None:
        super().__init__(exclude=engine.model.parameters())
        self.engine = engine

    def add(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.untyped_storage().data_ptr() in _zero3_gathered(self.engine):
            return tensor
        return super().add(tensor)


def measured_step(config: GPTConfig, layout: Layout, batch: Any, rows: int) -> tuple[int, dict[str, int], Any]:
    """plait's GPT of ``config`` under ``layout``, AdamW: (the activations its second step keeps, the model states
    held when the optimizer steps, ``estimate_memory`` of ``rows`` samples per micro-batch on CPU)."""
    torch.manual_seed(0)
    engine = plait.parallelize(GPT(config), layout, optimizer=OPTIMIZERS["adamw"], loss_fn=lm_loss)
    held: dict[str, int] = {}
    engine.before_optimizer_step.append(lambda e: held.update(measure_held(e)))
    engine.train_step(batch)  # optimizer states exist from the first step on
    with Activations(engine) as saved:
        engine.train_step(batch)
    estimate = estimate_memory(config, engine.layout, engine.optimizer, activations={"batch": rows}, device="cpu")
    getattr(engine.strategy, "close", lambda: None)()
    return saved.bytes, held, estimate
