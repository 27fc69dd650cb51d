"""What a parameter-server job trains: a recipe for the model, each worker's batches and the loss, which the
launcher hands to every process (so its parts must be importable: module-level functions and classes).

- ``ModelTask(model_fn, data, loss_fn)``: any ``nn.Module`` built by ``model_fn()``, any plait ``Dataset`` (e.g.
  ``plait.data.make_dataset(...)``), any ``loss_fn(output, target)`` (applied through ``apply_loss``, so a
  sequence model's [B, T, V] output meets [B, T] targets).
- ``SectionModel``: the model of a run configuration's ``[model]`` section (``plait.models.build.build_model``),
  what ``plait ps --config run.toml`` trains, as ``plait train`` would.
- ``AdditionGPT``: the default demo, the reference GPT on the synthetic ``AdditionTask``.

Worker w's batch at step t is the samples [(t * STRIDE + w) * b, ... + b), so the union of the workers' batches of
step t is the global batch a synchronous data-parallel run would use at that step (``global_batch``), and a worker
that joins late under a new index never reads another's samples. Held-out samples start at index 10**9.

A token-mean loss (``plait.models.loss.MeanLoss``: ``lm_loss``, the default) is handed to the workers as its two
terms (an optional ``loss_terms`` method: the batch's sum and its count of scored items; a task without it is pushed
as ``loss``, one item), so that BSP's round divides the sum of the
workers' summed gradients by the sum of their counts: the gradient of the token mean over the union of their
batches, whatever each batch's loss mask (docs/loss_normalization.md). Any other loss is one item per worker.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from plait.data import AdditionTask, Dataset
from plait.models import GPT, GPTConfig
from plait.models.build import build_model
from plait.models.loss import LossFn, MeanLoss, apply_loss, apply_total, lm_loss

STRIDE = 1024
"""Worker slots per step in the sample numbering (at most this many workers)."""
HELD_OUT = 10**9


class Task(Protocol):
    """What the launcher needs of a job's workload."""

    @property
    def batch(self) -> int: ...

    def build_model(self) -> nn.Module: ...

    def batch_of(self, worker: int, step: int) -> tuple[Tensor, Tensor]: ...

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor: ...

    def eval_batch(self, size: int = 256) -> tuple[Tensor, Tensor]: ...


LossTerms = tuple[Tensor, Tensor]
"""(the sum of a batch's per-item losses, the number of items): what a worker differentiates and pushes."""


def loss_terms(loss_fn: LossFn, output: Tensor, targets: Tensor) -> LossTerms:
    """A token-mean loss as (sum, count); any other loss as (its value, 1)."""
    if isinstance(loss_fn, MeanLoss):
        return apply_total(loss_fn, output, targets), loss_fn.count(targets)
    return apply_loss(loss_fn, output, targets), torch.ones((), dtype=torch.int64)


def _indices(worker: int, step: int, batch: int) -> range:
    if not 0 <= worker < STRIDE:
        raise ValueError(f"worker index {worker} must be in [0, {STRIDE}).")
    start = (step * STRIDE + worker) * batch
    return range(start, start + batch)


class _Batches:
    """The sample numbering shared by every task (module docstring)."""

    batch: int

    @property
    def dataset(self) -> Dataset:
        raise NotImplementedError

    def batch_of(self, worker: int, step: int) -> tuple[Tensor, Tensor]:
        return self.dataset.batch(_indices(worker, step, self.batch))

    def global_batch(self, workers: int, step: int) -> tuple[Tensor, Tensor]:
        """The concatenation of workers 0..workers-1's batches at `step` (what synchronous training sees)."""
        parts = [self.batch_of(worker, step) for worker in range(workers)]
        return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])

    def eval_batch(self, size: int = 256) -> tuple[Tensor, Tensor]:
        """Held-out samples (indices beyond any training step's) for comparing runs."""
        return self.dataset.batch(range(HELD_OUT, HELD_OUT + size))


@dataclass(frozen=True)
class ModelTask(_Batches):
    """Any model, dataset and loss: ``model_fn()`` builds the model (seeded with ``seed`` in every process, so
    servers and workers start from the same weights)."""

    model_fn: Callable[[], nn.Module]
    data: Dataset
    loss_fn: LossFn = lm_loss
    batch: int = 8
    seed: int = 0

    @property
    def dataset(self) -> Dataset:
        return self.data

    def build_model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return self.model_fn()

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        inputs, targets = batch
        return apply_loss(self.loss_fn, model(inputs), targets)

    def loss_terms(self, model: nn.Module, batch: tuple[Tensor, Tensor]) -> LossTerms:
        inputs, targets = batch
        return loss_terms(self.loss_fn, model(inputs), targets)


@dataclass(frozen=True)
class SectionModel:
    """``model_fn`` for a run configuration's ``[model]`` section, sized to the data (``build_model``)."""

    section: Mapping[str, Any] = field(default_factory=dict)
    vocab_size: int = 0
    seq_len: int = 0

    def __call__(self) -> nn.Module:
        return build_model(dict(self.section), self.vocab_size, self.seq_len)


@dataclass(frozen=True)
class AdditionGPT(_Batches):
    """A tiny GPT learning `digits`-digit addition; `batch` samples per worker and step."""

    digits: int = 2
    batch: int = 8
    d_model: int = 32
    n_layer: int = 2
    n_head: int = 4
    seed: int = 0
    width_override: int | None = None  # a different d_model, for testing that servers reject a foreign model

    @property
    def data(self) -> AdditionTask:
        return AdditionTask(digits=self.digits, seed=self.seed)

    @property
    def dataset(self) -> Dataset:
        return self.data

    def build_model(self) -> nn.Module:
        """The same initial weights in every process (seeded)."""
        torch.manual_seed(self.seed)
        data = self.data
        config = GPTConfig(
            vocab_size=data.vocab_size,
            seq_len=data.seq_len,
            n_layer=self.n_layer,
            n_head=self.n_head,
            d_model=self.width_override or self.d_model,
        )
        return GPT(config)

    @staticmethod
    def loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        inputs, targets = batch
        return lm_loss(model(inputs), targets)

    @staticmethod
    def loss_terms(model: nn.Module, batch: tuple[Tensor, Tensor]) -> LossTerms:
        inputs, targets = batch
        return loss_terms(lm_loss, model(inputs), targets)


__all__ = ["HELD_OUT", "STRIDE", "AdditionGPT", "LossTerms", "ModelTask", "SectionModel", "Task", "loss_terms"]
