"""What a model's *blocks* are, defined once for every paradigm that works block by block.

Transformers keep their repeated layers in one ``nn.ModuleList`` / ``nn.ModuleDict``: plait's GPT in ``blocks``,
Hugging Face GPT-2 in ``transformer.h``, Llama in ``model.layers``, BERT-style encoders in ``encoder.layer``,
some seq2seq models in ``decoder_layers``. The block container is the shallowest such container whose name is one
of ``BLOCK_CONTAINER_NAMES`` (the first registered among equally shallow ones), and the blocks are its children,
in order. Recomputation checkpoints per block, ZeRO-3 makes each block one unit (plus a root unit for everything
else), and the pipeline cuts between blocks: all three read this, so a model is split the same way by each.
"""

from __future__ import annotations

from torch import nn

BLOCK_CONTAINER_NAMES = ("blocks", "layers", "h", "layer", "decoder_layers")
"""Names under which models keep their repeated blocks (plait GPT, Llama, GPT-2, BERT-style encoders, ...)."""


def find_block_container(model: nn.Module) -> tuple[str, nn.ModuleList | nn.ModuleDict] | None:
    """``(path, container)`` of the model's block container (module docstring), or None when it has none."""
    found: tuple[str, nn.ModuleList | nn.ModuleDict] | None = None
    for path, module in model.named_modules():
        if not path or path.rsplit(".", 1)[-1] not in BLOCK_CONTAINER_NAMES:
            continue
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and (
            found is None or path.count(".") < found[0].count(".")
        ):
            found = (path, module)
    return found


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's blocks as (path, module), in order; [] when it has no block container."""
    found = find_block_container(model)
    if found is None:
        return []
    path, container = found
    return [(f"{path}.{name}", child) for name, child in container.named_children()]


__all__ = ["BLOCK_CONTAINER_NAMES", "find_block_container", "find_blocks"]
