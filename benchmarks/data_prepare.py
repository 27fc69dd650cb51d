"""``python -m benchmarks.data_prepare [--corpus-mb M] [--vocab V] [--workers 1 2] [--train-nproc N] [--out F.json]``

Two questions about plait's token data, on the Python standard library's source (the ``stdlib`` corpus, written
once as a JSON Lines file so that both contenders read the same bytes):

1. **Prepare throughput.** ``plait data prepare`` (text -> ``train.bin``/``val.bin``) with the same byte-level BPE
   tokenizer (``bpe:V`` trained once by ``plait data prepare``, whose run shows the progress bar), per worker count,
   next to the field's usual pipeline, nanoGPT's ``prepare.py`` recipe: Hugging Face ``datasets``
   ``load_dataset("json")`` + ``Dataset.map(num_proc=N)`` with the same ``tokenizers`` tokenizer, then the ids
   concatenated into a ``np.memmap``. Both are timed from the jsonl file to the token file on disk; tokens/s per
   worker = tokens / seconds / workers. Both tokenizers run single-threaded per process
   (``TOKENIZERS_PARALLELISM=false``), so the worker count is the parallelism.
2. **Loader vs training.** The ``TokenDataset`` + ``ShardedBatches`` batches of the ``stdlib-lm`` preset (its
   seq_len and global batch, one process building whole global batches) in tokens/s, next to the tokens/s that
   ``plait train --preset stdlib-lm`` trains at (``summary.json``); the target is a ratio >= 50.

``datasets`` is needed for the baseline only (``pip install 'plait[bench]'``); ``--no-baseline`` skips it. Timings on
a shared machine are noisy: ``--repeat`` runs each measurement several times and reports the median and the range.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks.report import machine

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def write_corpus_jsonl(path: Path, corpus_mb: float) -> dict[str, Any]:
    """The stdlib corpus (see plait.data.stdlib_corpus) as one JSON object per file: {"text": source}."""
    from plait.data.stdlib_corpus import stdlib_files

    files = stdlib_files(max_bytes=int(corpus_mb * 1e6))
    with open(path, "w") as stream:
        for file in files:
            stream.write(json.dumps({"text": file.read_text(encoding="utf-8", errors="replace")}) + "\n")
    return {"files": len(files), "bytes": path.stat().st_size}


def time_plait(jsonl: Path, tokenizer: str, out: Path, workers: int) -> tuple[float, int]:
    """Seconds and tokens of ``plait data prepare`` (through its Python entry point: same code as the CLI)."""
    from plait.data.prepare import prepare

    start = time.perf_counter()
    meta = prepare([jsonl], out, tokenizer=tokenizer, val_fraction=0.0, workers=workers, progress=False, overwrite=True)
    return time.perf_counter() - start, int(meta["tokens"])


def time_hf_datasets(jsonl: Path, tokenizer_json: Path, eos_id: int, out: Path, workers: int) -> tuple[float, int]:
    """Seconds and tokens of nanoGPT's recipe: datasets.load_dataset + map(num_proc) + concatenation into a memmap."""
    import datasets
    from tokenizers import Tokenizer

    datasets.disable_progress_bars()
    out.mkdir(parents=True, exist_ok=True)
    cache = out / f"hf-cache-{workers}"  # a fresh cache per run: datasets would otherwise reuse the last map
    start = time.perf_counter()
    dataset = datasets.load_dataset("json", data_files=str(jsonl), split="train", cache_dir=str(cache))
    tokenizer = Tokenizer.from_file(str(tokenizer_json))

    def process(batch: dict[str, list[str]]) -> dict[str, list[Any]]:
        ids = [e.ids + [eos_id] for e in tokenizer.encode_batch(batch["text"], add_special_tokens=False)]
        return {"ids": ids, "len": [len(i) for i in ids]}

    tokenized = dataset.map(process, batched=True, remove_columns=["text"], num_proc=workers if workers > 1 else None)
    total = int(np.sum(tokenized["len"], dtype=np.int64))
    array = np.memmap(out / f"hf-{workers}.bin", dtype=np.uint16, mode="w+", shape=(total,))
    position = 0
    shards = max(1, min(64, len(tokenized)))
    for index in range(shards):
        shard = tokenized.shard(num_shards=shards, index=index, contiguous=True).with_format("numpy")
        ids = np.concatenate(list(shard["ids"])) if len(shard) else np.zeros(0, dtype=np.uint16)
        array[position : position + len(ids)] = ids
        position += len(ids)
    array.flush()
    return time.perf_counter() - start, total


def loader_tokens_per_s(folder: Path, seq_len: int, global_batch: int, steps: int) -> float:
    """Tokens/s of whole global batches (inputs) from ``TokenDataset`` through ``ShardedBatches`` in one process."""
    from plait.data import ShardedBatches, TokenDataset

    loader = ShardedBatches(TokenDataset(folder, seq_len), global_batch)
    loader.batch_at(0)  # first touch of the memory map and the epoch's permutation
    start = time.perf_counter()
    for step in range(1, steps + 1):
        loader.batch_at(step)
    return steps * global_batch * seq_len / (time.perf_counter() - start)


def training_tokens_per_s(nproc: int, steps: int, cache: Path, work: Path) -> float:
    """``plait train --preset stdlib-lm``'s tokens/s (summary.json: the loop's tokens over its seconds)."""
    out = work / f"train-{nproc}"
    env = {**os.environ, "PLAIT_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "plait", "train", "--preset", "stdlib-lm", "--nproc", str(nproc), "--out",
               str(out), "--set", f"train.steps={steps}", "--set", "train.eval_every=0"]  # fmt: skip
    subprocess.run(command, check=True, env=env, capture_output=True, text=True)
    return float(json.loads((out / "summary.json").read_text())["tokens_per_s"])


def _median_range(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus-mb", type=float, default=0.0, help="MB of the stdlib corpus (0: all of it)")
    parser.add_argument("--vocab", type=int, default=8000, help="BPE vocabulary (default 8000)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts (default 1 2)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of each measurement (median and range)")
    parser.add_argument("--loader-steps", type=int, default=500, help="global batches the loader builds")
    parser.add_argument("--train-steps", type=int, default=30, help="training steps of the stdlib-lm preset")
    parser.add_argument("--train-nproc", type=int, default=2, help="processes plait train uses (default 2)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the Hugging Face datasets baseline")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    results: dict[str, Any] = {"machine": machine(), "args": vars(args)}
    with tempfile.TemporaryDirectory(prefix="plait-data-bench-") as temp:
        work = Path(temp)
        jsonl = work / "stdlib.jsonl"
        results["corpus"] = write_corpus_jsonl(jsonl, args.corpus_mb)
        console.print(f"corpus: {results['corpus']['files']} stdlib files, {results['corpus']['bytes'] / 1e6:.1f} MB")
        from plait.data.prepare import prepare

        start = time.perf_counter()  # the run a user sees: BPE training included, with the progress bar
        meta = prepare([jsonl], work / "bpe", tokenizer=f"bpe:{args.vocab}", workers=max(args.workers), console=console)
        results["bpe_prepare_s"] = time.perf_counter() - start
        tokenizer_json, eos_id = work / "bpe" / "tokenizer.json", int(meta["eos_id"])
        contenders = ("plait data prepare",) if args.no_baseline else ("plait data prepare", "HF datasets.map")
        runs: dict[tuple[str, int], list[float]] = {(c, w): [] for w in args.workers for c in contenders}
        counts: dict[tuple[str, int], int] = {}
        for round_ in range(args.repeat):  # rounds alternate the contenders: machine noise hits both alike
            for workers in args.workers:
                for contender in contenders if round_ % 2 == 0 else contenders[::-1]:
                    if contender.startswith("plait"):
                        seconds, tokens = time_plait(jsonl, str(tokenizer_json), work / f"p{workers}", workers)
                    else:
                        seconds, tokens = time_hf_datasets(jsonl, tokenizer_json, eos_id, work / f"r{round_}", workers)
                    runs[contender, workers].append(tokens / seconds / workers)
                    counts[contender, workers] = tokens
        rows = [
            {"contender": c, "workers": w, "tokens": counts[c, w], "tokens_per_s_per_worker": _median_range(r)}
            for (c, w), r in runs.items()
        ]
        results["prepare"] = rows
        from plait.train.presets import PRESETS

        data, train = PRESETS["stdlib-lm"]["data"], PRESETS["stdlib-lm"]["train"]
        cache = work / "cache"
        loader = [
            loader_tokens_per_s(_stdlib_folder(cache), data["seq_len"], train["global_batch"], args.loader_steps)
            for _ in range(args.repeat)
        ]
        training = [training_tokens_per_s(args.train_nproc, args.train_steps, cache, work) for _ in range(args.repeat)]
        results["loader_tokens_per_s"] = _median_range(loader)
        results["training_tokens_per_s"] = _median_range(training)
        results["loader_vs_training"] = statistics.median(loader) / statistics.median(training)
    _print(console, results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


def _stdlib_folder(cache: Path) -> Path:
    """The stdlib-lm preset's prepared folder (prepared here, in a temporary cache, on first use)."""
    os.environ["PLAIT_CACHE_DIR"] = str(cache)
    from plait.data.stdlib_corpus import ensure_stdlib_tokens
    from plait.train.presets import PRESETS

    return ensure_stdlib_tokens(PRESETS["stdlib-lm"]["data"]["vocab"])


def _print(console: Console, results: dict[str, Any]) -> None:
    table = Table(title=f"plait data prepare vs datasets.map (bpe:{results['args']['vocab']}, stdlib corpus)")
    for column in ("contender", "workers", "tokens", "tokens/s per worker (median)", "range"):
        table.add_column(column)
    for row in results["prepare"]:
        figure = row["tokens_per_s_per_worker"]
        table.add_row(row["contender"], str(row["workers"]), f"{row['tokens']:,}", f"{figure['median']:,.0f}",
                      f"{figure['min']:,.0f}-{figure['max']:,.0f}")  # fmt: skip
    Console().print(table)
    loader, training = results["loader_tokens_per_s"]["median"], results["training_tokens_per_s"]["median"]
    Console().print(
        f"loader {loader:,.0f} tokens/s vs training {training:,.0f} tokens/s (stdlib-lm, "
        f"{results['args']['train_nproc']} processes): x{results['loader_vs_training']:,.0f} (target >= 50); "
        f"BPE prepare with training: {results['bpe_prepare_s']:.1f} s; load average {results['machine']['load_1m']:.1f}"
    )


if __name__ == "__main__":
    sys.exit(main())
