"""What a model is called with: token ids, or token ids and the positions of packed documents.

One convention, carried by the batch (docs/data.md, "Packed documents"). A batch is ``(inputs, targets)``;
``inputs`` is either the token ids [B, T] (plain causal language modelling: attention sees every earlier token of
the window) or the pair ``(tokens, positions)``, where ``positions`` [B, T] (int64) counts each token's place in
its own document: 0 at every document's first token (and at the window's first token, whose document may have
begun in an earlier window), then 1, 2, ... — the ``position_ids`` that Hugging Face's packing collator builds.
Attention then derives its block-diagonal causal mask from them (``plait.models.layers.document_mask``): token i
sees token j iff 0 <= i - j <= positions[i], so no token attends across a document boundary, and position
embeddings and RoPE restart at each document. A document run on its own gives the same outputs.

plait calls ``model(tokens)`` or ``model(tokens, positions=positions)`` (``call``): plait's GPT takes
``positions`` as it is; a Hugging Face model gets them as ``position_ids`` (``plait.models.hf``). Every rank of a
data-parallel replica holds the same batch, so the paradigms never send positions: each pipeline stage, tensor-
and context-parallel rank reads them from its micro-batch (context parallelism slices them with the tokens).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

Inputs = Tensor | tuple[Tensor, Tensor]
"""Token ids [B, T], or (token ids [B, T], document positions [B, T])."""


def split(inputs: Any) -> tuple[Tensor, Tensor | None]:
    """(tokens, positions or None) of ``inputs``; TypeError naming the convention for anything else."""
    if isinstance(inputs, Tensor):
        return inputs, None
    if isinstance(inputs, (tuple, list)) and len(inputs) == 2 and all(isinstance(t, Tensor) for t in inputs):
        tokens, positions = inputs
        if positions.dim() != 2 or tuple(positions.shape) != tuple(tokens.shape[:2]):
            raise TypeError(
                f"packed inputs are (tokens [B, T], positions [B, T]); got positions of shape {tuple(positions.shape)} "
                f"next to tokens of shape {tuple(tokens.shape)}. Fix: one position per token, restarting at 0 at "
                f"each document."
            )
        return tokens, positions
    raise TypeError(
        f"model inputs are token ids [B, T] or (token ids, positions), got {type(inputs).__name__}. Fix: a batch is "
        f"(inputs, targets) with inputs one of those."
    )


def tokens_of(inputs: Any) -> Tensor:
    """The token ids (or the first stage's input) of ``inputs``."""
    return split(inputs)[0]


def call(model: nn.Module, inputs: Any) -> Any:
    """``model(tokens)``, or ``model(tokens, positions=positions)`` for packed documents."""
    tokens, positions = split(inputs)
    return model(tokens) if positions is None else model(tokens, positions=positions)


def to_device(inputs: Any, device: torch.device | str, non_blocking: bool = False) -> Inputs:
    """``inputs`` on ``device`` (both tensors of a pair)."""
    tokens, positions = split(inputs)
    tokens = tokens.to(device, non_blocking=non_blocking)
    return tokens if positions is None else (tokens, positions.to(device, non_blocking=non_blocking))


def chunk(inputs: Any, parts: int) -> list[Inputs]:
    """``inputs`` cut into ``parts`` micro-batches along the batch dimension (as ``Tensor.chunk``)."""
    tokens, positions = split(inputs)
    if positions is None:
        return list(tokens.chunk(parts))
    return list(zip(tokens.chunk(parts), positions.chunk(parts)))


def rows(inputs: Any, index: Tensor | slice) -> Inputs:
    """The rows ``index`` of ``inputs`` (both tensors of a pair)."""
    tokens, positions = split(inputs)
    return tokens[index] if positions is None else (tokens[index], positions[index])


__all__ = ["Inputs", "call", "chunk", "rows", "split", "to_device", "tokens_of"]
