"""`AdditionTask`: multi-digit addition as text, small enough for a tiny GPT to learn on one CPU core in seconds.

A sample reads "aa+bb=sss" with a and b zero-padded to `digits` digits and the sum zero-padded to digits+1 digits and
written least-significant digit first (so each answer digit depends only on digits already seen and a carry). Every
sample has the same length and the same number of scored answer tokens, so a mean of per-micro-batch mean losses
equals the global mean loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from plait.data.loader import IGNORE_INDEX, index_uniform

ALPHABET = "0123456789+="
_TOKEN_OF = {char: token for token, char in enumerate(ALPHABET)}
_PLUS, _EQUALS = _TOKEN_OF["+"], _TOKEN_OF["="]
_MAX_DIGITS = 18  # 10**digits must fit the 64-bit sample hash


@dataclass
class AdditionTask:
    """Random a + b with `digits`-digit operands; sample i is a pure function of (seed, i)."""

    digits: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.digits, bool) or not isinstance(self.digits, int) or not 1 <= self.digits <= _MAX_DIGITS:
            raise ValueError(f"digits={self.digits!r} must be an integer in [1, {_MAX_DIGITS}] (e.g. 2 or 3).")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} must be an integer.")

    @property
    def vocab_size(self) -> int:
        """Ten digits plus '+' and '='."""
        return len(ALPHABET)

    @property
    def answer_digits(self) -> int:
        """Width of the zero-padded sum: digits + 1 (room for the final carry)."""
        return self.digits + 1

    @property
    def prompt_len(self) -> int:
        """Tokens of "a+b=": 2*digits + 2; greedy decoding continues from here."""
        return 2 * self.digits + 2

    @property
    def seq_len(self) -> int:
        """Model input length: the full text (prompt + answer) minus its last token."""
        return self.prompt_len + self.answer_digits - 1

    def operands(self, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The (a, b) pairs of samples `indices`, each uniform in [0, 10**digits)."""
        high = 10**self.digits
        return index_uniform(self.seed, indices, 0, high), index_uniform(self.seed, indices, 1, high)

    def texts(self, indices: Sequence[int]) -> np.ndarray:
        """Full token rows [N, seq_len + 1]: a (most significant first), '+', b, '=', reversed zero-padded sum."""
        a, b = self.operands(indices)
        count = len(a)
        most_first = 10 ** np.arange(self.digits - 1, -1, -1, dtype=np.int64)
        least_first = 10 ** np.arange(self.answer_digits, dtype=np.int64)
        return np.concatenate(
            [
                (a[:, None] // most_first) % 10,
                np.full((count, 1), _PLUS, dtype=np.int64),
                (b[:, None] // most_first) % 10,
                np.full((count, 1), _EQUALS, dtype=np.int64),
                ((a + b)[:, None] // least_first) % 10,
            ],
            axis=1,
        )

    def batch(self, indices: Sequence[int]) -> tuple[Tensor, Tensor]:
        """Inputs x [N, seq_len] and next-token targets y [N, seq_len]: y[t] = text[t+1] where that is an answer
        digit, IGNORE_INDEX (-100) elsewhere."""
        text = torch.from_numpy(self.texts(indices))
        inputs = text[:, :-1].clone()
        targets = text[:, 1:].clone()
        targets[:, : self.prompt_len - 1] = IGNORE_INDEX
        return inputs, targets

    def sample(self, index: int) -> tuple[Tensor, Tensor]:
        """One sample (x [seq_len], y [seq_len]), deterministic in (seed, index)."""
        inputs, targets = self.batch([index])
        return inputs[0], targets[0]

    def accuracy_counts(self, logits: Tensor, targets: Tensor) -> tuple[int, int]:
        """(exactly right samples, samples): a sample counts iff argmax(logits) == target at every scored position.

        The input already holds the true answer prefix (teacher forcing), but a sample whose teacher-forced argmax is
        right at every answer position is exactly one that greedy decoding answers right: by induction, greedy's
        prefix equals the true prefix at each step. So this is greedy exact-match accuracy.
        """
        predictions = logits.argmax(dim=-1)
        scored = targets != IGNORE_INDEX
        right = ((predictions == targets) | ~scored).all(dim=-1)
        return int(right.sum().item()), int(targets.shape[0])

    def decode(self, tokens: Tensor | Sequence[int]) -> str:
        """Token ids -> text, e.g. [0, 7, 10, 4, 5, 11, 2, 5, 0] -> "07+45=250" (7 + 45 = 52, reversed and padded)."""
        values = tokens.tolist() if isinstance(tokens, Tensor) else list(tokens)
        return "".join(ALPHABET[int(value)] for value in values)

    def encode(self, text: str) -> Tensor:
        """Text over "0123456789+=" -> long tensor of token ids."""
        unknown = sorted(set(text) - set(ALPHABET))
        if unknown:
            raise ValueError(f"cannot encode {text!r}: characters {unknown} are not in the alphabet {ALPHABET!r}.")
        return torch.tensor([_TOKEN_OF[char] for char in text], dtype=torch.long)
