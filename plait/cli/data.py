"""``plait data prepare`` and ``plait data info``: token folders for ``data.name = "tokens"`` (docs/data.md).

    plait data prepare notes/ books.jsonl --out data/mine --tokenizer bpe:8000 --workers 2
    plait data prepare corpus.parquet --field content --out data/hf --tokenizer path/to/hf-tokenizer-folder
    plait data prepare chats.jsonl --instruct --out data/sft --tokenizer path/to/hf-tokenizer-folder
    plait data info data/mine --verify
    plait train --set data.name=tokens --set data.path=data/mine

Bad input is a ``DataError``: ``plait`` prints it (file, line and fix) and exits with 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def add_data_command(commands: Any) -> None:
    """Register ``plait data`` (``prepare``, ``info``) on the ``plait`` parser's subcommands."""
    data = commands.add_parser(
        "data",
        help="prepare token folders (plait data prepare) and inspect them (plait data info)",
        description="Tokenize text, JSON Lines and parquet into memory-mapped token files for plait train.",
    )
    actions = data.add_subparsers(dest="data_command", required=True)
    prepare = actions.add_parser(
        "prepare",
        help="tokenize inputs into a folder of token files",
        description="Read text files, .jsonl (one document per line) and .parquet (one per row), and folders of "
        "them; tokenize in parallel; write train/val token files, document offsets, the tokenizer and meta.json.",
    )
    prepare.add_argument("inputs", nargs="+", metavar="INPUT", help="files or folders (searched recursively)")
    prepare.add_argument(
        "--include",
        action="append",
        default=[],
        metavar="PATTERN",
        help="read only the files of input folders matching this glob (path relative to the folder, or name); "
        "repeatable",
    )
    prepare.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="PATTERN",
        help="leave out the files of input folders matching this glob; repeatable",
    )
    prepare.add_argument("--out", required=True, metavar="DIR", help="the folder to write (created)")
    prepare.add_argument(
        "--tokenizer",
        default="bytes",
        metavar="SPEC",
        help="'bytes' (256 byte values + eos, the default), 'bpe:VOCAB' (train a byte-level BPE on the inputs), "
        "a tokenizer.json, or a local Hugging Face tokenizer folder (never downloaded)",
    )
    prepare.add_argument(
        "--val-fraction",
        type=float,
        default=0.01,
        metavar="F",
        help="share of whole documents held out for validation (default 0.01; 0: none)",
    )
    prepare.add_argument(
        "--workers", type=int, default=1, metavar="N", help="tokenizer processes (default 1; e.g. the core count)"
    )
    prepare.add_argument("--field", default="text", metavar="NAME", help="the jsonl field / parquet column of the text")
    prepare.add_argument(
        "--eos",
        metavar="TOKEN",
        help="the token that ends documents (a tokenizer.json's default: <|endoftext|>, </s>, ... whichever it has)",
    )
    prepare.add_argument(
        "--instruct",
        action="store_true",
        help="the inputs are .jsonl instruction records ({prompt, response}, or {messages} rendered by the "
        "tokenizer folder's chat template): only responses / assistant turns are scored by the loss",
    )
    prepare.add_argument("--overwrite", action="store_true", help="replace the prepared data already in --out")
    info = actions.add_parser(
        "info",
        help="describe a prepared folder and check its files against meta.json",
        description="Describe a folder written by plait data prepare (documents, tokens, splits, tokenizer, "
        "skipped inputs, how to train on it) after checking every file's size against meta.json; --verify "
        "also checks every file's SHA-256. Exit 0 when the folder checks out, 2 with the problem and the fix.",
    )
    info.add_argument("folder", metavar="DIR")
    info.add_argument("--verify", action="store_true", help="check every file's sha256 (sizes are always checked)")


def run_data(args: argparse.Namespace) -> int:
    if args.data_command == "prepare":
        from plait.data.prepare import prepare

        meta = prepare(
            args.inputs,
            args.out,
            tokenizer=args.tokenizer,
            val_fraction=args.val_fraction,
            workers=args.workers,
            field=args.field,
            eos=args.eos,
            overwrite=args.overwrite,
            instruct=args.instruct,
            include=args.include,
            exclude=args.exclude,
        )
        _print_summary(args.out, meta, skipped_shown=True)  # prepare has just logged the skipped files
        return 0
    from plait.data.tokens import TokenFolder

    folder = TokenFolder(args.folder, verify=args.verify)
    checked = "size and SHA-256" if args.verify else "size (--verify: SHA-256 too)"
    _print_summary(args.folder, folder.meta, checked=f"every file's {checked} matches meta.json")
    return 0


def _print_summary(
    folder: str | os.PathLike[str], meta: dict[str, Any], skipped_shown: bool = False, checked: str = ""
) -> None:
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    tokenizer = meta["tokenizer"]
    lines = [
        f"{folder}: {meta['documents']:,} documents, {meta['tokens']:,} tokens ({meta['dtype']})",
        f"  train {train['documents']:,} documents, {train['tokens']:,} tokens; "
        f"val {val['documents']:,} documents, {val['tokens']:,} tokens",
        f"  tokenizer {tokenizer['spec']} ({tokenizer['kind']}): vocabulary {meta['vocab_size']:,}, "
        f"eos {tokenizer['eos_token']!r} = {meta['eos_id']}",
        f"  unigram entropy of train: {meta['unigram_entropy_nats']:.3f} nats/token "
        f"(a model beats unigram statistics below this loss)",
        *(
            ["  instruction data: a loss mask scores responses only (pack with data.attention='document')"]
            if meta.get("loss_mask")
            else []
        ),
        *_skipped_lines(meta.get("skipped"), skipped_shown),
        *([f"  checked: {checked}"] if checked else []),
        f"  train with: plait train --set data.name=tokens --set data.path={json.dumps(str(folder))}",
    ]
    print("\n".join(lines), file=sys.stdout)  # noqa: T201 - CLI output


def _skipped_lines(skipped: Any, shown: bool = False) -> list[str]:
    """The input files prepare left out, and why (at most the 100 meta.json lists); only their count when
    ``shown`` (prepare logged the list a moment ago)."""
    files = skipped.get("files") if isinstance(skipped, dict) else None
    if isinstance(files, bool) or not isinstance(files, int) or files < 1:  # a meta.json of another writer
        return []
    if shown:
        return [f"  skipped {files:,} input file(s), listed above (plait data info lists them again)"]
    listed = skipped.get("list") if isinstance(skipped.get("list"), list) else []
    lines = [f"  skipped {files:,} input file(s):"]
    lines += [f"    {entry.get('path')}: {entry.get('reason')}" for entry in listed if isinstance(entry, dict)]
    if files > len(listed):
        lines.append(f"    ... and {files - len(listed):,} more")
    return lines


__all__ = ["add_data_command", "run_data"]
