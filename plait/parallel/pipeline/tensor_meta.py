"""What a pipeline stage tells its neighbour before the first message of a shape: ``TensorMeta``, the shape and
dtype of a tensor crossing a stage boundary, encoded as one small int64 tensor (its rank, its dtype's index in
``DTYPES``, its dimensions padded to ``MAX_DIMS``), so that the receiver can allocate the buffer it receives into.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_DIMS = 8
DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
"""Dtypes a stage may pass on (index = their code in metadata messages)."""


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of a tensor crossing a stage boundary."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorMeta:
        if tensor.dim() > MAX_DIMS or tensor.dtype not in DTYPES:
            raise TypeError(
                f"a pipeline stage output of shape {tuple(tensor.shape)} and dtype {tensor.dtype} cannot be passed on: "
                f"at most {MAX_DIMS} dims and one of {', '.join(str(d) for d in DTYPES)}. Fix: reshape or cast it."
            )
        return cls(tuple(tensor.shape), tensor.dtype)

    def encode(self, device: torch.device) -> torch.Tensor:
        dims = list(self.shape) + [0] * (MAX_DIMS - len(self.shape))
        return torch.tensor([len(self.shape), DTYPES.index(self.dtype), *dims], dtype=torch.int64, device=device)

    @staticmethod
    def message(device: torch.device) -> torch.Tensor:
        """A buffer to receive an encoded ``TensorMeta`` into."""
        return torch.empty(2 + MAX_DIMS, dtype=torch.int64, device=device)

    @classmethod
    def decode(cls, message: torch.Tensor) -> TensorMeta:
        values = message.tolist()
        return cls(tuple(values[2 : 2 + values[0]]), DTYPES[values[1]])

    def empty(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device)


__all__ = ["DTYPES", "MAX_DIMS", "TensorMeta"]
