"""What a parameter-server job trains: a picklable recipe for the model, each worker's batches and the loss.

`AdditionGPT` is the default: the reference GPT on the synthetic `AdditionTask`. Worker w's batch at step t is the
samples [(t * STRIDE + w) * b, ... + b), so the union of the workers' batches of step t is the global batch a
synchronous data-parallel run would use at that step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from plait.data import IGNORE_INDEX, AdditionTask
from plait.models import GPT, GPTConfig

STRIDE = 1024
"""Worker slots per step in the sample numbering (at most this many workers)."""


@dataclass(frozen=True)
class AdditionGPT:
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

    def batch_of(self, worker: int, step: int) -> tuple[Tensor, Tensor]:
        if not 0 <= worker < STRIDE:
            raise ValueError(f"worker index {worker} must be in [0, {STRIDE}).")
        start = (step * STRIDE + worker) * self.batch
        return self.data.batch(range(start, start + self.batch))

    def global_batch(self, workers: int, step: int) -> tuple[Tensor, Tensor]:
        """The concatenation of workers 0..workers-1's batches at `step` (what synchronous training sees)."""
        parts = [self.batch_of(worker, step) for worker in range(workers)]
        return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])

    @staticmethod
    def loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        inputs, targets = batch
        logits = model(inputs)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)

    def eval_batch(self, size: int = 256) -> tuple[Tensor, Tensor]:
        """Held-out samples (indices beyond any training step's) for comparing runs."""
        return self.data.batch(range(10**9, 10**9 + size))


__all__ = ["STRIDE", "AdditionGPT"]
