"""Datasets addressed by sample index (pure in seed and index) and deterministic data-parallel batching.

``make_dataset(name, ...)``: "addition" (synthetic), "bytes" (one text file), "tokens" (a folder written by
``plait data prepare``: ``TokenDataset``), "mixture" (several token folders by weight: ``MixtureDataset``), "stdlib"
(the Python standard library's source, prepared on first use).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from plait.data.loader import IGNORE_INDEX, Dataset, ShardedBatches, index_hash, index_uniform
from plait.data.mixture import MixtureDataset
from plait.data.prepare import prepare
from plait.data.stdlib_corpus import stdlib_dataset
from plait.data.synthetic import AdditionTask
from plait.data.text import ByteTextDataset
from plait.data.tokens import TokenDataset, TokenFolder

DATASETS: dict[str, Callable[..., Any]] = {
    "addition": AdditionTask,
    "bytes": ByteTextDataset,
    "tokens": TokenDataset,
    "mixture": MixtureDataset,
    "stdlib": stdlib_dataset,
}

__all__ = [
    "AdditionTask",
    "ByteTextDataset",
    "DATASETS",
    "Dataset",
    "IGNORE_INDEX",
    "MixtureDataset",
    "ShardedBatches",
    "TokenDataset",
    "TokenFolder",
    "index_hash",
    "index_uniform",
    "make_dataset",
    "prepare",
    "stdlib_dataset",
]


def make_dataset(name: str, **kwargs: Any) -> Dataset:
    """Build a dataset by name (see ``DATASETS``) from its keyword arguments."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}: use one of {sorted(DATASETS)}.")
    try:
        return DATASETS[name](**kwargs)
    except TypeError as error:
        raise ValueError(f"bad arguments for dataset {name!r}: {error}") from error
