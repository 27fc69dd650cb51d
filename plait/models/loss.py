"""Losses: the language-model cross-entropy and ``apply_loss``, which shapes a model's output for any loss.

A causal LM's logits are [B, T, V] and its targets [B, T]; a classifier's are [B, C] and [B]. ``apply_loss``
flattens the first to [B*T, V] against [B*T], so every ``loss_fn(output, target)`` written for the second works
for the first. ``lm_loss`` computes the cross-entropy in fp32 (the logits may be bf16/fp16 under autocast) and
averages over the tokens whose target is not ``ignore_index``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

LossFn = Callable[[Tensor, Tensor], Tensor]


def lm_loss(logits: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """Cross-entropy of logits [B, T, V] against targets [B, T], averaged over the tokens not equal to ignore_index."""
    vocab = logits.shape[-1]
    return F.cross_entropy(logits.reshape(-1, vocab).float(), targets.reshape(-1), ignore_index=ignore_index)


def apply_loss(loss_fn: LossFn, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Call ``loss_fn``, flattening a sequence model's [B, T, C] output and [B, T] target to [B*T, C] and [B*T]."""
    if output.dim() > 2 and output.dim() == target.dim() + 1:
        output, target = output.flatten(0, -2), target.flatten()
    return loss_fn(output, target)


__all__ = ["LossFn", "apply_loss", "lm_loss"]
