"""`ByteTextDataset`: next-byte prediction on any file the user points at (vocabulary: the 256 byte values)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from plait.data.loader import IGNORE_INDEX, index_uniform
from plait.errors import DataError


def check_text_file(path: str | Path, seq_len: int) -> int:
    """The size of the text file ``path`` of ``data.name = "bytes"``; DataError (one line with the fix) when it
    is missing, not a regular file, or shorter than one window of ``seq_len`` + 1 bytes."""
    path = Path(path)
    if not path.is_file():
        what = "does not exist" if not path.exists() else "is not a regular file"
        raise DataError(
            f"the text file data.path={str(path)!r} {what}. Fix: --set data.path=FILE naming an existing text file."
        )
    size = path.stat().st_size
    if size < seq_len + 1:
        raise DataError(
            f"the text file data.path={str(path)!r} has {size} bytes, fewer than seq_len + 1 = {seq_len + 1} (one "
            f"sample and its next byte). Fix: use a longer file, or --set data.seq_len={max(1, size - 1)} or less."
        )
    return size


class ByteTextDataset:
    """Windows of a file's bytes: sample i starts at a pseudo-random offset o = hash(seed, i) mod (len - T), with
    x = bytes[o : o+T] and y = bytes[o+1 : o+T+1]. The whole file is read into memory once."""

    vocab_size: int = 256

    def __init__(self, path: str | Path, seq_len: int, seed: int = 0) -> None:
        self.path = Path(path)
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise DataError(f"seq_len={seq_len!r} must be a positive integer. Fix: e.g. data.seq_len=64.")
        check_text_file(self.path, seq_len)
        self.data = np.frombuffer(self.path.read_bytes(), dtype=np.uint8)
        if len(self.data) < seq_len + 1:  # shrunk since it was checked
            check_text_file(self.path, seq_len)
        self._seq_len = seq_len
        self.seed = seed

    @property
    def seq_len(self) -> int:
        """Window length T."""
        return self._seq_len

    @property
    def num_offsets(self) -> int:
        """How many distinct windows the file holds: len(bytes) - T."""
        return len(self.data) - self._seq_len

    def offsets(self, indices: Sequence[int]) -> np.ndarray:
        """Start offset of each sample's window, pure in (seed, index)."""
        return index_uniform(self.seed, indices, 0, self.num_offsets)

    def batch(self, indices: Sequence[int]) -> tuple[Tensor, Tensor]:
        """Inputs [N, T] and next-byte targets [N, T] as long tensors."""
        starts = self.offsets(indices)
        rows = starts[:, None] + np.arange(self._seq_len + 1, dtype=np.int64)
        windows = torch.from_numpy(self.data[rows].astype(np.int64))
        return windows[:, :-1].clone(), windows[:, 1:].clone()

    def sample(self, index: int) -> tuple[Tensor, Tensor]:
        """One window (x [T], y [T])."""
        inputs, targets = self.batch([index])
        return inputs[0], targets[0]

    def accuracy_counts(self, logits: Tensor, targets: Tensor) -> tuple[int, int]:
        """(correctly predicted bytes, scored bytes): per-token argmax accuracy, skipping IGNORE_INDEX targets."""
        scored = targets != IGNORE_INDEX
        correct = (logits.argmax(dim=-1) == targets) & scored
        return int(correct.sum().item()), int(scored.sum().item())

    def decode(self, tokens: Tensor | Sequence[int]) -> str:
        """Byte values -> text (UTF-8, undecodable bytes replaced)."""
        values = tokens.tolist() if isinstance(tokens, Tensor) else list(tokens)
        return bytes(int(value) for value in values).decode("utf-8", errors="replace")

    def encode(self, text: str) -> Tensor:
        """Text -> its UTF-8 bytes as a long tensor."""
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
