"""``MixtureDataset``: several token folders sampled by weight, as a pure function of the sample index.

Real pre-training mixes sources (web, code, books, ...) in set proportions; Megatron-LM's ``BlendedDataset`` builds,
before training, an index saying which source each sample comes from (greedily, the source furthest below its
share) and the how-many-th sample of that source it is. plait computes the same kind of index in closed form, per
sample, with exact integer arithmetic, so nothing is built or cached and any rank computes any step's rows:

- the weights w_1..w_K (normalised) become a chain of fractions p_k = w_k / (w_k + ... + w_K);
- sample n of the stream goes to source 1 when floor((n+1) p_1) > floor(n p_1) (Bresenham's line: exactly
  floor(n p_1) of the first n samples are source 1's, and this is its floor(n p_1)-th); otherwise it is sample
  n - floor((n+1) p_1) of the stream of the other sources, which the same rule splits with p_2, and so on.

So among the first n samples source k has c_k(n) = floor(n_k p_k) of them (n_k the samples left to sources k..K),
within K of n w_k: the mixture holds its proportions over every stretch of the stream, not only on average. Source
k's j-th sample is its own ``TokenDataset``'s sample j (windows shuffled per epoch with a seed drawn from the run's
seed and k), so every source also keeps its epoch guarantees. Under ``ShardedBatches`` the mixture is therefore
deterministic in (seed, step, dp rank), resumes exactly at any step, and reshards to any dp size (a step's global
batch is the same samples whatever the dp size). ``tokens_seen(n)`` counts each source's tokens among the first n
samples without reading anything, for ``metrics.jsonl``.

Every folder must hold the same tokenizer (vocabulary, eos id and ``tokenizer.json`` bytes): a mixture of ids from
two vocabularies would train on nonsense, so it is refused with the fix (prepare the others with the first's
``tokenizer.json``). Validation: each source's held-out split on its own (``validation_sources``), and their
mixture with the same weights (``validation_split``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from plait.data.loader import index_hash
from plait.data.tokenizer import TextCodec
from plait.data.tokens import TokenDataset, TokenFolder
from plait.errors import DataError

SOURCE_STREAM = 7_919
"""The hash stream of the per-source seeds (independent of the window permutations' streams)."""


def check_sources(sources: Any) -> list[dict[str, Any]]:
    """The ``[data] sources`` list as dicts with ``path``, ``weight`` (> 0, finite) and a unique ``name`` (default:
    the folder's name); DataError naming the entry and the fix otherwise."""
    example = '[{path = "data/web", weight = 0.7}, {path = "data/code", weight = 0.3}]'
    if not isinstance(sources, (list, tuple)) or len(sources) < 1:
        raise DataError(f"data.sources={sources!r} must be a list of token folders with weights. Fix: {example}.")
    checked = []
    for number, source in enumerate(sources):
        if not isinstance(source, dict) or set(source) - {"path", "weight", "name"} or "path" not in source:
            raise DataError(
                f"data.sources[{number}]={source!r} must be a table with path, weight and optionally name. "
                f"Fix: {example}."
            )
        path, weight = source["path"], source.get("weight", 1.0)
        if not isinstance(path, str) or not path:
            raise DataError(f"data.sources[{number}].path={path!r} must be a folder. Fix: {example}.")
        if (
            isinstance(weight, bool)
            or not isinstance(weight, (int, float))
            or not (math.isfinite(weight) and weight > 0)
        ):
            raise DataError(
                f"data.sources[{number}].weight={weight!r} must be a positive finite number (weights are normalised "
                f"to sum to 1). Fix: e.g. weight = 0.5."
            )
        name = source.get("name", Path(path).name or path)
        if not isinstance(name, str) or not name:
            raise DataError(f"data.sources[{number}].name={name!r} must be a non-empty string.")
        checked.append({"path": path, "weight": float(weight), "name": name})
    names = [source["name"] for source in checked]
    if len(set(names)) != len(names):
        raise DataError(
            f"data.sources name the sources {names}: two have the same name (by default the folder's). "
            f'Fix: give each a name, e.g. {{path = "...", weight = 1, name = "web"}}.'
        )
    return checked


def tokenizer_identity(folder: TokenFolder) -> tuple[int, int, str]:
    """(vocabulary, eos id, sha256 of tokenizer.json or "bytes"): what two folders must share to be mixed."""
    record = folder.meta.get("tokenizer")
    file = record.get("file") if isinstance(record, dict) else None
    if not file:
        return folder.vocab_size, folder.eos_id, "bytes"
    entry = folder.meta.get("files", {}).get(file)
    digest = entry.get("sha256") if isinstance(entry, dict) else None
    return folder.vocab_size, folder.eos_id, str(digest)


class MixtureDataset:
    """Samples of several ``TokenDataset`` s by weight (module docstring). ``sources``: ``check_sources``'s dicts;
    the other arguments are ``TokenDataset``'s, for every source."""

    def __init__(
        self,
        sources: Any,
        seq_len: int,
        seed: int = 0,
        split: str = "train",
        verify: bool = False,
        attention: str = "causal",
        eod_mask_loss: bool = False,
        datasets: Sequence[TokenDataset] | None = None,
    ) -> None:
        self.sources = check_sources(sources)
        self.split, self.seed, self._seq_len = split, seed, seq_len
        self.attention, self.eod_mask_loss, self.verify = attention, eod_mask_loss, verify
        if datasets is None:
            datasets = [
                TokenDataset(
                    source["path"],
                    seq_len,
                    seed=self.source_seed(seed, number),
                    split=split,
                    verify=verify,
                    attention=attention,
                    eod_mask_loss=eod_mask_loss,
                )
                for number, source in enumerate(self.sources)
            ]
        self.datasets = list(datasets)
        self._check_tokenizers()
        total = sum(Fraction(source["weight"]) for source in self.sources)
        self.weights = [float(Fraction(source["weight"]) / total) for source in self.sources]
        remaining = total
        self._levels: list[Fraction] = []  # p_k = w_k / (w_k + ... + w_K)
        for source in self.sources[:-1]:
            self._levels.append(Fraction(source["weight"]) / remaining)
            remaining -= Fraction(source["weight"])

    @staticmethod
    def source_seed(seed: int, number: int) -> int:
        """Source ``number``'s window-order seed, drawn from the run's ``seed`` (so sources shuffle independently)."""
        return int(index_hash(seed, [number], stream=SOURCE_STREAM)[0] >> np.uint64(2))

    def _check_tokenizers(self) -> None:
        first = tokenizer_identity(self.datasets[0].folder)
        for source, dataset in zip(self.sources[1:], self.datasets[1:]):
            identity = tokenizer_identity(dataset.folder)
            if identity != first:
                raise DataError(
                    f"data.sources {self.sources[0]['path']} and {source['path']} hold different tokenizers "
                    f"(vocabulary {first[0]} / {identity[0]}, eos id {first[1]} / {identity[1]}, tokenizer.json "
                    f"{first[2][:12]} / {identity[2][:12]}): their ids mean different text. Fix: prepare every source "
                    f"with one tokenizer, e.g. plait data prepare INPUT... --out {source['path']} --overwrite "
                    f"--tokenizer {Path(self.sources[0]['path']) / 'tokenizer.json'} (or --tokenizer bytes for all)."
                )

    # ----------------------------------------------------------------- the index
    def assign(self, index: int) -> tuple[int, int]:
        """(source, its sample number) of mixture sample ``index``."""
        n = int(index)
        for number, p in enumerate(self._levels):
            before, through = (n * p.numerator) // p.denominator, ((n + 1) * p.numerator) // p.denominator
            if through > before:
                return number, before
            n -= through
        return len(self.sources) - 1, n

    def counts(self, samples: int) -> list[int]:
        """How many of the first ``samples`` samples each source gave (c_k(n) of the module docstring)."""
        n, out = int(samples), []
        for p in self._levels:
            taken = (n * p.numerator) // p.denominator
            out.append(taken)
            n -= taken
        return out + [n]

    def tokens_seen(self, samples: int) -> dict[str, int]:
        """Input tokens of each source (by name) among the first ``samples`` samples."""
        return {s["name"]: count * self._seq_len for s, count in zip(self.sources, self.counts(samples))}

    # ----------------------------------------------------------------- the Dataset protocol
    @property
    def vocab_size(self) -> int:
        return self.datasets[0].vocab_size

    @property
    def seq_len(self) -> int:
        return self._seq_len

    @property
    def eos_id(self) -> int:
        return self.datasets[0].eos_id

    @property
    def num_windows(self) -> int:
        """Distinct windows over every source (the most samples before any window repeats, at best)."""
        return sum(dataset.num_windows for dataset in self.datasets)

    @property
    def tokenizer(self) -> TextCodec:
        return self.datasets[0].tokenizer

    def encode(self, text: str) -> Tensor:
        return self.tokenizer.encode(text)

    def decode(self, tokens: Tensor | Sequence[int]) -> str:
        return self.tokenizer.decode(tokens)

    def batch(self, indices: Sequence[int]) -> tuple[Any, Tensor]:
        """The samples ``indices``, each from its source (inputs as that source gives them: tokens, or tokens and
        document positions), in the order asked."""
        picks = [self.assign(index) for index in indices]
        rows: list[Any] = [None] * len(picks)
        for number, dataset in enumerate(self.datasets):
            where = [row for row, (source, _) in enumerate(picks) if source == number]
            if where:
                inputs, targets = dataset.batch([picks[row][1] for row in where])
                for offset, row in enumerate(where):
                    rows[row] = (_row(inputs, offset), targets[offset])
        targets = torch.stack([target for _, target in rows])
        if isinstance(rows[0][0], tuple):
            tokens = torch.stack([inputs[0] for inputs, _ in rows])
            return (tokens, torch.stack([inputs[1] for inputs, _ in rows])), targets
        return torch.stack([inputs for inputs, _ in rows]), targets

    def accuracy_counts(self, logits: Tensor, targets: Tensor) -> tuple[int, int]:
        return self.datasets[0].accuracy_counts(logits, targets)

    # ----------------------------------------------------------------- validation
    def validation_sources(self) -> dict[str, TokenDataset]:
        """Each source's held-out split (those that have one), by name."""
        splits = {source["name"]: dataset.validation_split() for source, dataset in zip(self.sources, self.datasets)}
        return {name: split for name, split in splits.items() if split is not None}

    def validation_split(self) -> MixtureDataset | None:
        """The held-out splits mixed with the same weights (sources without one left out), seed 0; None when no
        source holds documents out."""
        if self.split != "train":
            return None
        kept = [
            (source, split)
            for source, dataset in zip(self.sources, self.datasets)
            if (split := dataset.validation_split()) is not None
        ]
        if not kept:
            return None
        return MixtureDataset(
            [source for source, _ in kept],
            self._seq_len,
            seed=0,
            split="val",
            attention=self.attention,
            eod_mask_loss=self.eod_mask_loss,
            datasets=[split for _, split in kept],
        )


def _row(inputs: Any, row: int) -> Any:
    """Row ``row`` of a batch's inputs (token ids, or token ids and positions)."""
    return (inputs[0][row], inputs[1][row]) if isinstance(inputs, tuple) else inputs[row]


__all__ = ["MixtureDataset", "check_sources", "tokenizer_identity"]
