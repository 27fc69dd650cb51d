"""``plait generate RUN_DIR_OR_CKPT --prompt TEXT``: print what a trained model writes after TEXT.

    plait generate runs/mine --prompt "def main(" --max-new-tokens 100 --temperature 0.8 --top-k 50 --seed 1

The checkpoint (saved under any layout) gives the model: built on the meta device and filled tensor by tensor in
this one process (``plait.train.weights.model_from_checkpoint``: the weights are never held twice); the run's ``config.toml`` gives the data, whose ``encode`` / ``decode`` turn text into the token ids the
model was trained on and back (bytes, the synthetic task's symbols, or a token folder's tokenizer). Decoding runs
on the CPU, or on the GPU when there is one, with the reference GPT's key/value cache or a Hugging Face model's
own cache (``plait.models.generate``). The same seed prints the same text.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from plait.errors import ConfigError


def add_generate_command(commands: Any) -> None:
    """Register ``plait generate`` on the ``plait`` parser's subcommands."""
    parser = commands.add_parser(
        "generate",
        help="print a trained model's continuation of a prompt",
        description="Continue --prompt with the model of a run folder or checkpoint (saved under any layout).",
    )
    parser.add_argument("run", help="a run folder (runs/<id>), its ckpt folder, or one ckpt/step-N folder")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to add (default 64)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 picks the likeliest token (default 0.8)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (default 0: all)")
    parser.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")


def run_generate(args: argparse.Namespace) -> int:
    import torch

    from plait.data import make_dataset
    from plait.models.generate import generate
    from plait.train.config import load_config
    from plait.train.weights import find_run, model_from_checkpoint

    if args.max_new_tokens < 0 or args.temperature < 0 or args.top_k < 0:
        raise ConfigError("--max-new-tokens, --temperature and --top-k must be >= 0. Fix: e.g. --temperature 0.8.")
    checkpoint, config_path = find_run(args.run)
    if config_path is None:
        raise ConfigError(
            f"no config.toml next to {checkpoint}: the run's data (its tokenizer) is unknown. Fix: give the run "
            f"folder that plait train wrote."
        )
    config = load_config(config_path)
    try:
        dataset = make_dataset(config.data.dataset_name, **config.data.dataset_kwargs())
    except ValueError as error:
        raise ConfigError(f"the run's [data] section: {error}") from error
    if not hasattr(dataset, "encode") or not hasattr(dataset, "decode"):
        raise ConfigError(f"the run's data ({config.data.name!r}) has no tokenizer (encode/decode).")
    try:
        prompt = torch.as_tensor(dataset.encode(args.prompt), dtype=torch.long)
    except ValueError as error:
        raise ConfigError(f"--prompt cannot be encoded for this run's data: {error}") from error
    if prompt.numel() == 0:
        raise ConfigError("--prompt is empty. Fix: give some text to continue.")
    model = model_from_checkpoint(checkpoint, config.model, dataset.vocab_size, dataset.seq_len)
    if torch.cuda.is_available():
        model = model.cuda()
    options = {"temperature": args.temperature, "top_k": args.top_k, "seed": args.seed, "vocab": dataset.vocab_size}
    tokens = generate(model, prompt, args.max_new_tokens, **options)
    print(dataset.decode(tokens[prompt.numel() :].cpu()))  # noqa: T201 - CLI output
    sys.stdout.flush()
    return 0


__all__ = ["add_generate_command", "run_generate"]
