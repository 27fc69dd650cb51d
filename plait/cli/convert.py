"""``plait convert SOURCE OUT``: checkpoints <-> safetensors (plait/checkpoint/convert.py).

    plait convert runs/demo/ckpt model.safetensors       # export: whole weights, one file
    plait convert runs/hf/ckpt hf-folder/                # export an HF model as a folder from_pretrained opens
    plait convert runs/demo/ckpt gpt-folder/             # plait's GPT as GPT-2 / Llama / Mixtral / ... (export_gpt)
    plait convert model.safetensors runs/ft/ckpt         # import: a model-only checkpoint (any layout loads it)
    plait convert hf-folder/ runs/ft/ckpt                # import a save_pretrained folder

An existing OUT is never replaced, unless ``--overwrite`` is given and OUT is an earlier output of plait (an
exported file or folder, an imported checkpoint); never the checkpoint being converted or a folder of the user's
(``plait.checkpoint.outputs``). Bad input is a ``ConfigError``: ``plait`` prints it and exits with 2.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_convert_command(commands: Any) -> None:
    """Register ``plait convert`` on the ``plait`` parser's subcommands."""
    parser = commands.add_parser(
        "convert",
        help="export a checkpoint as safetensors / an HF folder, or import one as a checkpoint",
        description="Convert between plait checkpoints (any layout) and safetensors files or Hugging Face folders. "
        "The direction follows from SOURCE: a checkpoint is exported, anything else imported.",
    )
    parser.add_argument("source", help="a checkpoint folder (with 'latest'), a .safetensors file or an HF folder")
    parser.add_argument("out", help="OUT.safetensors or an HF folder (export), or a checkpoint folder (import)")
    parser.add_argument(
        "--hf-config", help="exporting an HF folder: the model's config.json, when the checkpoint does not record it"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace OUT when it is an earlier output of plait convert (never anything else)",
    )


def run_convert(args: argparse.Namespace) -> int:
    from plait import logging as plait_logging
    from plait.checkpoint.convert import convert

    plait_logging.configure(0)  # the converter's one line says what it wrote (step, format, where)
    convert(args.source, args.out, args.hf_config, args.overwrite)
    return 0


__all__ = ["add_convert_command", "run_convert"]
