"""What ``plait train`` evaluates on, and how an evaluation is recorded and shown.

A dataset with a validation split (``validation_split()``: a token folder prepared with ``--val-fraction`` > 0, the
stdlib corpus) is evaluated on held-out documents: loss and perplexity exp(loss) (the per-token cross-entropy is a
mean over every scored token, so exp of it is the usual perplexity) go to ``metrics.jsonl`` and the progress line.
A synthetic task keeps its accuracy, measured on fresh samples from ``EVAL_OFFSET`` on. A mixture of token folders
(``plait.data.mixture``) is evaluated on its sources' held-out splits mixed by weight, and on each one alone: the
record's ``sources`` holds every source's loss and perplexity.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from plait.data import ShardedBatches
from plait.logging import get_logger, job_warning
from plait.train.metrics import eval_record

log = get_logger(__name__)
EVAL_OFFSET = 10**9
"""Without a validation split, evaluation reads samples from index 1e9 on: fresh samples of a synthetic task."""


def evaluation_batches(
    dataset: Any, global_batch: int, count: int, dp_rank: int, dp_size: int
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], bool]:
    """This dp rank's share of the evaluation batches, and whether they are held-out data.

    A dataset with a validation split (``validation_split()``, e.g. a prepared token folder) is evaluated on its
    first ``count`` global batches (a token folder's: a fixed uniform sample of its held-out windows), capped at the windows it holds (at least one batch: a split smaller than one
    batch repeats windows, with a warning). Otherwise the samples from ``EVAL_OFFSET`` on: fresh samples of a
    synthetic task, but training windows (in-sample) for a token folder prepared without a validation split."""
    split = dataset.validation_split() if callable(getattr(dataset, "validation_split", None)) else None
    if split is None:
        if hasattr(dataset, "validation_split"):
            job_warning(log, "the data has no validation split: evaluation reads training windows (in-sample).")
        loader = ShardedBatches(dataset, global_batch, dp_rank, dp_size, offset=EVAL_OFFSET)
        return [loader.batch_at(i) for i in range(count)], False
    return held_out_batches(split, global_batch, count, dp_rank, dp_size), True


def held_out_batches(split: Any, global_batch: int, count: int, dp_rank: int, dp_size: int) -> list[Any]:
    """This dp rank's share of the first ``count`` global batches of a held-out split (at least one; a split
    smaller than one batch repeats windows, with a warning)."""
    windows = int(getattr(split, "num_windows", count * global_batch))
    if windows < global_batch:
        job_warning(
            log,
            "the validation split holds %d windows, fewer than one global batch (%d): evaluation repeats some. "
            "Fix: prepare with a larger --val-fraction, or lower train.global_batch or data.seq_len.",
            windows,
            global_batch,
        )
    loader = ShardedBatches(split, global_batch, dp_rank, dp_size)
    return [loader.batch_at(i) for i in range(max(1, min(count, windows // global_batch)))]


def source_batches(dataset: Any, global_batch: int, count: int, dp_rank: int, dp_size: int) -> dict[str, list[Any]]:
    """A mixture's held-out batches per source (``validation_sources``), by name; {} for any other dataset."""
    sources = dataset.validation_sources() if callable(getattr(dataset, "validation_sources", None)) else {}
    return {name: held_out_batches(split, global_batch, count, dp_rank, dp_size) for name, split in sources.items()}


def evaluate_sources(engine: Any, batches: dict[str, list[Any]]) -> dict[str, dict[str, float]]:
    """Every source's held-out loss and perplexity (a collective: every rank calls it)."""
    out = {}
    for name, source in batches.items():
        loss = engine.evaluate(source).loss
        out[name] = {"loss": loss, "perplexity": math.exp(loss) if loss < 700 else float("inf")}
    return out


def evaluation_record(
    step: int, result: Any, held_out: bool, sources: dict[str, dict[str, float]] | None = None
) -> dict[str, Any]:
    """``metrics.jsonl``'s evaluation record, with perplexity = exp(loss), where the data came from and, for a
    mixture, each source's loss and perplexity (``sources``)."""
    perplexity = math.exp(result.loss) if result.loss < 700 else float("inf")
    record = {**eval_record(step, result), "perplexity": perplexity, "split": "val" if held_out else "train-stream"}
    return record | ({"sources": sources} if sources else {})


def eval_text(result: Any, held_out: bool, final: bool = False) -> str:
    """An evaluation in words: validation loss and perplexity, or a synthetic task's accuracy."""
    if held_out:
        return f"val loss {result.loss:.3f} ppl {math.exp(min(result.loss, 700)):,.1f}"
    if final:
        return f"eval accuracy {100 * result.accuracy:.1f}% ({result.total} samples)"
    return f"eval acc {100 * result.accuracy:.1f}%"


__all__ = [
    "EVAL_OFFSET",
    "eval_text",
    "evaluate_sources",
    "evaluation_batches",
    "evaluation_record",
    "held_out_batches",
    "source_batches",
]
