"""``TokenDataset``: packed fixed-length windows over a folder written by ``plait data prepare``.

A split's token file is one stream: every document's ids followed by the end-of-document id. Cut into windows of
``T + 1`` tokens that overlap by one (window w holds tokens [w T, w T + T + 1)), it gives
``W = (n_tokens - 1) // T`` training samples x = window[:-1], y = window[1:]; documents run across window edges with
the eos between them, as in GPT-2/3 pre-training and nanoGPT (no padding, every position scored).

Sample i of the training split reads window ``perm_e[i mod W]`` of epoch ``e = i // W``, where ``perm_e`` is the
argsort of plait's counter-based hash of (seed, window) in stream e + 1: a permutation that is a pure function of
(seed, epoch). So ``ShardedBatches`` over this dataset is deterministic in (seed, step, dp rank), resumes exactly at
any step, and over one epoch serves every window once across all dp ranks. The validation split is read the same
way with seed 0 whatever the run's seed: its first n samples are a uniform sample of n held-out windows from all
over the split (not just its first documents), and every run evaluates on the same windows.

**Packed documents** (``attention="document"``, docs/data.md): each sample's inputs are ``(tokens, positions)``
(``plait.models.inputs``): positions count each token's place in its document, from the folder's document offsets
(``.idx``), restarting at 0 at every document and at the window's first token, so attention stays inside each
document. ``eod_mask_loss`` ignores the target at each end-of-document token (the next document's first token,
which the finished document cannot predict), as Megatron-LM's ``--eod-mask-loss``.

The files are opened with ``np.memmap``: nothing is read until a batch touches it, and every rank of a node shares
the page cache. Opening checks the files against ``meta.json``: sizes always, sha256 when asked (``verify``) or
when cheap (all files together under ``CHEAP_VERIFY_BYTES``). ``meta.json`` itself is checked for consistency (a
vocabulary its dtype can hold, an eos id inside it), and token ids against the vocabulary: the whole split when the
sha256 is checked, and every batch as it is read (a model sized by a lying ``meta.json`` would otherwise index past
its embedding table).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from plait.data.loader import IGNORE_INDEX, index_hash
from plait.data.prepare import FORMAT, META_FILE, READABLE_VERSIONS, SPLITS
from plait.data.sources import sha256_of
from plait.data.tokenizer import TextCodec, load_saved
from plait.errors import DataError

ATTENTION_KINDS = ("causal", "document")
"""``data.attention``: "causal" (documents run into each other across the eos, GPT-2 style) or "document"."""
CHEAP_VERIFY_BYTES = 64 << 20
"""Folders whose files add up to at most this (64 MiB) are checked by sha256 on every open, not only by size."""
_DTYPES: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def _redo(path: Path) -> str:
    return f"Fix: prepare it again (plait data prepare INPUT... --out {path} --overwrite)."


class TokenFolder:
    """A prepared folder: ``meta.json`` read and checked against the files on disk, token files memory-mapped."""

    def __init__(self, path: str | Path, verify: bool = False) -> None:
        self.path = Path(path).expanduser()
        meta_path = self.path / META_FILE
        if not meta_path.is_file():
            raise DataError(
                f"{self.path} holds no {META_FILE}: it is not a folder written by plait data prepare (or the "
                f"preparation did not finish). Fix: plait data prepare INPUT... --out {self.path}."
            )
        try:
            meta = json.loads(meta_path.read_bytes())
            if not isinstance(meta, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError, RecursionError) as error:
            raise DataError(f"{meta_path} is not valid JSON ({error}). {_redo(self.path)}") from error
        if meta.get("format") != FORMAT or meta.get("version") not in READABLE_VERSIONS:
            raise DataError(
                f"{meta_path} is format {meta.get('format')!r} version {meta.get('version')!r}; this plait reads "
                f"{FORMAT!r} versions {list(READABLE_VERSIONS)}. {_redo(self.path)}"
            )
        try:
            self.dtype = _DTYPES[meta["dtype"]]
            self.vocab_size, self.eos_id = int(meta["vocab_size"]), int(meta["eos_id"])
            self.splits = {name: meta["splits"][name] for name in SPLITS}
            files: dict[str, Any] = dict(meta["files"])
        except (KeyError, TypeError, ValueError) as error:
            raise DataError(f"{meta_path} lacks or mangles {error}. {_redo(self.path)}") from error
        self.meta = meta
        self._check_vocabulary(meta_path)
        try:
            self._check_files(files, verify)
        except (KeyError, TypeError, ValueError) as error:
            if isinstance(error, DataError):
                raise
            raise DataError(f"{meta_path} lacks or mangles {error}. {_redo(self.path)}") from error
        self._codec: TextCodec | None = None

    def _check_vocabulary(self, meta_path: Path) -> None:
        """DataError when ``meta.json``'s vocabulary, eos id and dtype contradict each other."""
        limit = 1 << (8 * self.dtype.itemsize)
        if not 1 <= self.vocab_size <= limit or not 0 <= self.eos_id < self.vocab_size:
            raise DataError(
                f"{meta_path} says vocab_size {self.vocab_size} and eos_id {self.eos_id} in {self.dtype.name} files, "
                f"which cannot be (ids are < vocab_size <= {limit:,}). {_redo(self.path)}"
            )

    def check_ids(self, ids: np.ndarray, where: str) -> None:
        """DataError when a token id of ``ids`` is not below the vocabulary of ``meta.json``."""
        if ids.size and int(ids.max()) >= self.vocab_size:
            raise DataError(
                f"{where} of {self.path} holds token id {int(ids.max())}, but {META_FILE} says the vocabulary has "
                f"{self.vocab_size} ids: the folder is corrupt or its {META_FILE} wrong. {_redo(self.path)}"
            )

    def _check_files(self, files: dict[str, Any], verify: bool) -> None:
        total = 0
        for name, record in files.items():
            path = self._file(name)
            if not path.is_file():
                raise DataError(f"{path} is missing ({META_FILE} lists it). {_redo(self.path)}")
            size = path.stat().st_size
            if size != int(record["bytes"]):
                raise DataError(
                    f"{path} has {size:,} bytes but {META_FILE} says {int(record['bytes']):,}: the file is "
                    f"truncated or corrupt. {_redo(self.path)}"
                )
            total += size
        for name, split in self.splits.items():
            expected = {
                split["bin"]: int(split["tokens"]) * self.dtype.itemsize,
                split["idx"]: 8 * (int(split["documents"]) + 1),
            }
            if "mask" in split:  # instruction data: one byte per token
                expected[split["mask"]] = int(split["tokens"])
            for file, size in expected.items():
                if file not in files or int(files[file]["bytes"]) != size:
                    raise DataError(
                        f"{META_FILE} of {self.path}: the {name} split's counts do not match {file}. {_redo(self.path)}"
                    )
        if verify or total <= CHEAP_VERIFY_BYTES:
            for name, record in files.items():
                if sha256_of(self._file(name)) != record["sha256"]:
                    raise DataError(
                        f"{self._file(name)} does not match the sha256 in {META_FILE}: the file is corrupt. "
                        f"{_redo(self.path)}"
                    )
            for split in SPLITS:  # read in full anyway: the ids too
                self.check_ids(self.tokens(split), f"the {split} split")

    def _file(self, name: str) -> Path:
        """A file of the folder by its name in meta.json (a bare name: a hostile meta.json cannot point outside)."""
        if Path(name).name != name or name in ("", ".", ".."):
            raise DataError(
                f"{META_FILE} of {self.path} names the file {name!r}, not a plain file name. {_redo(self.path)}"
            )
        return self.path / name

    def tokens(self, split: str) -> np.ndarray:
        """The split's token stream (read-only memory map; an empty array for an empty split)."""
        record = self.splits[split]
        if int(record["tokens"]) == 0:
            return np.zeros(0, dtype=self.dtype)
        return np.memmap(self._file(record["bin"]), dtype=self.dtype, mode="r")

    def loss_mask(self, split: str) -> np.ndarray | None:
        """Instruction data: the split's per-token loss mask (uint8, nonzero where the token is a scored target;
        read-only memory map), else None."""
        record = self.splits[split]
        if "mask" not in record:
            return None
        if int(record["tokens"]) == 0:
            return np.zeros(0, dtype=np.uint8)
        return np.memmap(self._file(record["mask"]), dtype=np.uint8, mode="r")

    def offsets(self, split: str) -> np.ndarray:
        """The split's document offsets: n_documents + 1 int64 token positions."""
        return np.memmap(self._file(self.splits[split]["idx"]), dtype="<i8", mode="r")

    def document_starts(self, split: str) -> np.ndarray:
        """The split's document offsets, checked once (0 first, never decreasing, the token count last): a lying
        ``.idx`` would give negative positions, which no attention can use."""
        offsets = np.asarray(self.offsets(split))
        if (
            len(offsets) < 2
            or offsets[0] != 0
            or offsets[-1] != len(self.tokens(split))
            or (np.diff(offsets) < 0).any()
        ):
            raise DataError(
                f"the {split} split's document offsets ({self.splits[split]['idx']}) of {self.path} do not start at 0, "
                f"rise to the token count, or fall somewhere: the folder is corrupt. {_redo(self.path)}"
            )
        return offsets

    @property
    def codec(self) -> TextCodec:
        """The folder's tokenizer (``encode`` / ``decode``), loaded on first use."""
        if self._codec is None:
            record = self.meta.get("tokenizer")
            if not isinstance(record, dict):
                raise DataError(f"{META_FILE} of {self.path} has no tokenizer record. {_redo(self.path)}")
            codec = TextCodec(load_saved(self.path, record))
            if codec.vocab_size != self.vocab_size:
                raise DataError(
                    f"the tokenizer of {self.path} has {codec.vocab_size} tokens but {META_FILE} says vocab_size "
                    f"{self.vocab_size}. {_redo(self.path)}"
                )
            self._codec = codec
        return self._codec


class TokenDataset:
    """Packed windows of ``seq_len`` + 1 tokens of one split of a prepared folder (see the module doc)."""

    def __init__(
        self,
        path: str | Path,
        seq_len: int,
        seed: int = 0,
        split: str = "train",
        verify: bool = False,
        folder: TokenFolder | None = None,
        attention: str = "causal",
        eod_mask_loss: bool = False,
    ) -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise DataError(f"data.seq_len={seq_len!r} must be a positive integer. Fix: e.g. data.seq_len=256.")
        if split not in SPLITS:
            raise DataError(f"split {split!r} is unknown. Fix: one of {list(SPLITS)}.")
        check_attention(attention, eod_mask_loss)
        self.folder = folder or TokenFolder(path, verify=verify)
        self.split, self.seed, self._seq_len = split, seed, seq_len
        self.attention, self.eod_mask_loss = attention, eod_mask_loss
        self._starts = self.folder.document_starts(split) if attention == "document" or eod_mask_loss else None
        self.loss_mask = self.folder.loss_mask(split)
        """Instruction data: which tokens are scored targets (prompts are not), else None."""
        self.data = self.folder.tokens(split)
        self.num_windows = (len(self.data) - 1) // seq_len
        if self.num_windows < 1:
            raise DataError(
                f"the {split} split of {self.folder.path} has {len(self.data)} tokens, fewer than data.seq_len + 1 = "
                f"{seq_len + 1}. Fix: a smaller data.seq_len, or prepare more text"
                + (" (or a larger --val-fraction)." if split == "val" else ".")
            )
        self._permutations: dict[int, np.ndarray] = {}

    @property
    def vocab_size(self) -> int:
        return self.folder.vocab_size

    @property
    def seq_len(self) -> int:
        return self._seq_len

    @property
    def eos_id(self) -> int:
        return self.folder.eos_id

    @property
    def tokenizer(self) -> TextCodec:
        """``encode(text) -> ids`` and ``decode(ids) -> text`` with the tokenizer the folder was prepared with."""
        return self.folder.codec

    def encode(self, text: str) -> Tensor:
        return self.tokenizer.encode(text)

    def decode(self, tokens: Tensor | Sequence[int]) -> str:
        return self.tokenizer.decode(tokens)

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of the windows in ``epoch``: argsort of hash(seed, window) in stream epoch + 1."""
        if epoch not in self._permutations:
            if len(self._permutations) >= 2:
                self._permutations.pop(min(self._permutations))
            keys = index_hash(self.seed, np.arange(self.num_windows), stream=epoch + 1)
            self._permutations[epoch] = np.argsort(keys, kind="stable")
        return self._permutations[epoch]

    def windows(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """The window number of each sample index."""
        indices = np.asarray(indices, dtype=np.int64)
        positions = indices % self.num_windows
        epochs = indices // self.num_windows
        result = np.empty_like(positions)
        for epoch in np.unique(epochs).tolist():
            where = epochs == epoch
            result[where] = self.permutation(int(epoch))[positions[where]]
        return result

    def batch(self, indices: Sequence[int]) -> tuple[Any, Tensor]:
        """Inputs [N, T] and next-token targets [N, T] (int64) of the samples ``indices``; with document attention
        the inputs are (tokens, positions) (module doc)."""
        starts = self.windows(indices) * self._seq_len
        index = starts[:, None] + np.arange(self._seq_len + 1)
        rows = self.data[index].astype(np.int64)
        self.folder.check_ids(rows, f"the {self.split} split")
        windows = torch.from_numpy(rows)
        inputs, targets = windows[:, :-1].clone(), windows[:, 1:].clone()
        if self.loss_mask is not None:  # instruction data: prompt tokens score nothing
            targets[torch.from_numpy(self.loss_mask[index[:, 1:]] == 0)] = IGNORE_INDEX
        if self._starts is None:
            return inputs, targets
        document = np.searchsorted(self._starts, index, side="right") - 1
        begins = self._starts[document]  # the first token of each token's document
        if self.eod_mask_loss:  # a target that begins a document follows an end-of-document token
            targets[torch.from_numpy(begins[:, 1:] == index[:, 1:])] = IGNORE_INDEX
        if self.attention == "causal":
            return inputs, targets
        positions = index[:, :-1] - np.maximum(begins[:, :-1], starts[:, None])
        return (inputs, torch.from_numpy(positions)), targets

    def validation_split(self) -> TokenDataset | None:
        """The held-out documents as a dataset of windows of the same length, shuffled with seed 0 (the same
        evaluation windows for every run), or None when nothing is held out."""
        if self.split != "train" or int(self.folder.splits["val"]["tokens"]) == 0:
            return None
        return TokenDataset(
            self.folder.path,
            self._seq_len,
            seed=0,
            split="val",
            folder=self.folder,
            attention=self.attention,
            eod_mask_loss=self.eod_mask_loss,
        )

    def accuracy_counts(self, logits: Tensor, targets: Tensor) -> tuple[int, int]:
        """(correctly predicted next tokens, scored tokens): per-token argmax accuracy."""
        scored = targets != IGNORE_INDEX
        correct = (logits.argmax(dim=-1) == targets) & scored
        return int(correct.sum().item()), int(scored.sum().item())


def check_attention(attention: str, eod_mask_loss: bool) -> None:
    """DataError unless ``attention`` is one of ``ATTENTION_KINDS`` and ``eod_mask_loss`` a bool."""
    if attention not in ATTENTION_KINDS:
        raise DataError(
            f"data.attention={attention!r} is unknown. Fix: 'causal' (documents run into each other) or 'document' "
            f"(attention stays inside each document)."
        )
    if not isinstance(eod_mask_loss, bool):
        raise DataError(f"data.eod_mask_loss={eod_mask_loss!r} must be true or false. Fix: data.eod_mask_loss=true.")


__all__ = ["ATTENTION_KINDS", "CHEAP_VERIFY_BYTES", "TokenDataset", "TokenFolder", "check_attention"]
