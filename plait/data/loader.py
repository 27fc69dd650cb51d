"""Deterministic, resumable data-parallel batching over index-addressed datasets.

A dataset here is a pure function of (seed, sample index): there is no hidden iterator state, so any rank can compute
exactly its rows of any step's global batch, and resuming at step s needs nothing but s.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

import numpy as np
from torch import Tensor

IGNORE_INDEX = -100
"""Target value that losses and accuracy counts skip (PyTorch's cross_entropy default)."""

_GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)


@runtime_checkable
class Dataset(Protocol):
    """What the trainers need from a dataset: sizes, a batch by sample indices, and an accuracy count."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def seq_len(self) -> int: ...

    def batch(self, indices: Sequence[int]) -> tuple[Tensor, Tensor]:
        """Inputs [N, seq_len] and next-token targets [N, seq_len] (IGNORE_INDEX where not scored)."""
        ...

    def accuracy_counts(self, logits: Tensor, targets: Tensor) -> tuple[int, int]:
        """(correct, total) under the dataset's own notion of accuracy; summable across ranks and micro-batches."""
        ...


def _mix64(values: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser: a bijective avalanche on uint64 (wrapping arithmetic)."""
    values = (values ^ (values >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    values = (values ^ (values >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return values ^ (values >> np.uint64(31))


def index_hash(seed: int, indices: Sequence[int] | np.ndarray, stream: int = 0) -> np.ndarray:
    """Counter-based random uint64 per index: mix64(key(seed, stream) + (index+1) * golden_gamma), like SplitMix64.

    Pure in (seed, stream, index), vectorised, and independent across streams: the randomness of sample i never
    depends on which other samples are drawn, or in what order.
    """
    with np.errstate(over="ignore"):
        key = _mix64(np.array([seed], dtype=np.int64).astype(np.uint64) * _GOLDEN_GAMMA + np.uint64(stream))
        counters = np.asarray(indices, dtype=np.int64).astype(np.uint64) + np.uint64(1)
        return _mix64(key + counters * _GOLDEN_GAMMA)


def index_uniform(seed: int, indices: Sequence[int] | np.ndarray, stream: int, high: int) -> np.ndarray:
    """Pseudo-random int64 in [0, high) per index (hash modulo high; bias < high / 2^64, negligible)."""
    if high < 1:
        raise ValueError(f"high={high} must be >= 1.")
    return (index_hash(seed, indices, stream) % np.uint64(high)).astype(np.int64)


class ShardedBatches:
    """Step s's global batch is the samples [s*G, (s+1)*G) of the dataset (G = global_batch); data-parallel rank r of
    n takes the contiguous rows [r*G/n, (r+1)*G/n). Deterministic from (dataset seed, step): resumable at any step.

    `offset` shifts every sample index (e.g. offset=10**9 for an evaluation stream disjoint from training).
    """

    def __init__(
        self,
        dataset: Dataset,
        global_batch: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        start_step: int = 0,
        offset: int = 0,
    ) -> None:
        if global_batch < 1:
            raise ValueError(f"global_batch={global_batch} must be >= 1.")
        if dp_size < 1:
            raise ValueError(f"dp_size={dp_size} must be >= 1 (1 means no data parallelism).")
        if global_batch % dp_size != 0:
            lower = global_batch - global_batch % dp_size
            nearest = sorted({max(lower, dp_size), lower + dp_size})
            raise ValueError(
                f"global_batch={global_batch} is not divisible by dp_size={dp_size}: use a multiple of {dp_size} "
                f"(nearest: {' or '.join(map(str, nearest))}) or change the data-parallel size."
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is out of range for dp_size={dp_size}: use 0 .. {dp_size - 1}.")
        if start_step < 0:
            raise ValueError(f"start_step={start_step} must be >= 0.")
        if offset < 0:
            raise ValueError(f"offset={offset} must be >= 0.")
        self.dataset = dataset
        self.global_batch = global_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.start_step = start_step
        self.offset = offset

    @property
    def local_batch(self) -> int:
        """Rows per rank per step: global_batch / dp_size."""
        return self.global_batch // self.dp_size

    def global_indices_at(self, step: int) -> range:
        """Sample indices of step `step`'s whole global batch."""
        first = self.offset + step * self.global_batch
        return range(first, first + self.global_batch)

    def local_indices_at(self, step: int) -> range:
        """Sample indices of this rank's contiguous share of step `step`'s global batch."""
        first = self.offset + step * self.global_batch + self.dp_rank * self.local_batch
        return range(first, first + self.local_batch)

    def global_batch_at(self, step: int) -> tuple[Tensor, Tensor]:
        """The whole global batch of `step` (for single-device reference runs)."""
        return self.dataset.batch(self.global_indices_at(step))

    def batch_at(self, step: int) -> tuple[Tensor, Tensor]:
        """This rank's share of step `step`'s global batch."""
        return self.dataset.batch(self.local_indices_at(step))

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        """This rank's share for step = start_step, start_step + 1, ... (endless)."""
        for step in itertools.count(self.start_step):
            yield self.batch_at(step)
