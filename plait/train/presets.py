"""Run presets: whole run configurations by name (``plait train --preset NAME``; ``--config`` and ``--set`` apply
on top, in that order).

``stdlib-lm``: a small GPT language model on the Python standard library's own source (``data.name = "stdlib"``:
prepared on first use with a byte-level BPE of 4,096 tokens and cached, docs/data.md). Its held-out perplexity
falls visibly within a few minutes on 2 CPU cores; the measured curve is in docs/data.md. It checkpoints at steps
300 and 600, so ``plait generate <out>`` prints what the trained model writes.

``stdlib-moe``: the same run with the ``small-moe`` model (plait/models/presets.py): every block's feed-forward
becomes 8 experts of width 256, top-2, the dense model's active parameters (4 x its feed-forward parameters in all).
Its held-out curve against ``stdlib-lm``'s over the same steps is in docs/expert_parallel.md; ``--set layout.ep=2``
splits the experts over 2 of the data-parallel ranks.
"""

from __future__ import annotations

import copy
from typing import Any

from plait.errors import ConfigError

PRESETS: dict[str, dict[str, Any]] = {
    "stdlib-lm": {
        "layout": {"dp": -1},
        "model": {"n_layer": 4, "n_head": 4, "d_model": 128},
        "data": {"name": "stdlib", "vocab": 4096, "seq_len": 128},
        "train": {
            "steps": 600,
            "global_batch": 32,
            "lr": 3e-3,
            "warmup_steps": 30,
            "eval_every": 100,
            "eval_batches": 8,
            "log_every": 10,
            "save_every": 300,  # <out>/ckpt at steps 300 and 600: what plait generate reads
        },
    },
}
PRESETS["stdlib-moe"] = {**copy.deepcopy(PRESETS["stdlib-lm"]), "model": {"preset": "small-moe"}}
"""Each preset is the sections of a RunConfig (what a ``--config`` TOML file would hold)."""
DESCRIPTIONS: dict[str, str] = {
    "stdlib-lm": "a small GPT on the Python standard library's source (BPE 4,096, 600 steps)",
    "stdlib-moe": "the same run with 8 experts per block, top-2 (--set layout.ep=2 splits them)",
}
"""One line per preset, for ``plait train --help`` (a test checks every preset has one)."""


def preset(name: str) -> dict[str, dict[str, Any]]:
    """A copy of preset ``name``'s sections; ``ConfigError`` naming the presets for an unknown name."""
    if name not in PRESETS:
        raise ConfigError(f"--preset {name!r} is unknown. Fix: use one of {sorted(PRESETS)}.")
    return copy.deepcopy(PRESETS[name])


__all__ = ["DESCRIPTIONS", "PRESETS", "preset"]
