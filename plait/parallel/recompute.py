"""Activation recomputation (gradient checkpointing) per block.

A recomputed block keeps only its input during forward; backward runs the block's forward again to rebuild
the activations it needs (Chen et al. 2016). Per transformer layer this trades ~34 s b h bytes of stored
activations for 2 s b h (the input) at the cost of one extra forward (Korthikanti et al. 2022, sec. 4).
``Layout.recompute`` picks the blocks: "none", "full" (every block) or a tuple of block indices.

The block's ``forward`` is replaced on the instance by one that calls torch.utils.checkpoint (non-reentrant,
RNG state preserved, so dropout masks replay exactly); module paths and parameter names do not change.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from plait.errors import LayoutError
from plait.parallel.blocks import BLOCK_CONTAINER_NAMES, find_blocks


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_recompute(model: nn.Module, recompute: str | tuple[int, ...]) -> list[str]:
    """Make the chosen blocks recompute their activations in backward; returns their module paths."""
    if recompute == "none":
        return []
    blocks = find_blocks(model)
    if not blocks:
        raise LayoutError(
            f"recompute={recompute!r} needs the model's blocks, but {type(model).__name__} has no ModuleList/ModuleDict "
            f"named one of {', '.join(BLOCK_CONTAINER_NAMES)}. Fix: set recompute='none', or keep the blocks in such a container."
        )
    if recompute == "full":
        chosen = blocks
    else:
        bad = [i for i in recompute if i >= len(blocks)]
        if bad:
            raise LayoutError(
                f"recompute lists block(s) {bad}, but the model has {len(blocks)} blocks (0..{len(blocks) - 1}). "
                f"Fix: choose indices below {len(blocks)}."
            )
        chosen = [blocks[i] for i in sorted(set(recompute))]
    for _path, block in chosen:
        if not getattr(block, "_plait_recompute", False):
            block.forward = functools.partial(_checkpointed, block.forward)  # type: ignore[method-assign]
            block._plait_recompute = True  # type: ignore[attr-defined]
    return [path for path, _ in chosen]
