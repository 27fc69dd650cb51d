"""Datasets addressed by sample index (pure in seed and index) and deterministic data-parallel batching."""

from __future__ import annotations

from typing import Any

from plait.data.loader import IGNORE_INDEX, Dataset, ShardedBatches, index_hash, index_uniform
from plait.data.synthetic import AdditionTask
from plait.data.text import ByteTextDataset

DATASETS: dict[str, type] = {"addition": AdditionTask, "bytes": ByteTextDataset}

__all__ = [
    "AdditionTask",
    "ByteTextDataset",
    "DATASETS",
    "Dataset",
    "IGNORE_INDEX",
    "ShardedBatches",
    "index_hash",
    "index_uniform",
    "make_dataset",
]


def make_dataset(name: str, **kwargs: Any) -> Dataset:
    """Build a dataset by name: "addition" -> AdditionTask(**kwargs), "bytes" -> ByteTextDataset(**kwargs)."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}: use one of {sorted(DATASETS)}.")
    try:
        return DATASETS[name](**kwargs)
    except TypeError as error:
        raise ValueError(f"bad arguments for dataset {name!r}: {error}") from error
