"""``prepare``: text, JSON Lines and parquet in; a folder of memory-mappable token files out (``plait data prepare``).

The folder (docs/data.md explains the choices against nanoGPT's ``train.bin`` and Megatron-LM's ``.bin``/``.idx``):

    train.bin  val.bin    every document's token ids followed by the end-of-document id, back to back, as raw
                          little-endian uint16 (vocabulary <= 65,536) or uint32: ``np.memmap`` reads it in place
    train.idx  val.idx    int64 little-endian token offsets of the documents: n_documents + 1 entries, 0 first,
                          the split's token count last (document d is tokens [idx[d], idx[d+1]), its eos last)
    train.mask.bin ...    instruction data only (``--instruct``, format version 2): one byte per token, 1 where
                          the token is a target the loss scores (responses, assistant turns: ``plait.data.instruct``)
    tokenizer.json        the tokenizer (not for ``bytes``), so that later programs decode what was trained on
    inputs.jsonl          one record per input file: path, kind, bytes, sha256, documents, characters
    meta.json             tokenizer, vocabulary, eos id, dtype, counts, the sha256 of the inputs (all of them in one:
                          sha256 of their sha256 lines) and of every file written

The validation split holds whole documents: document i (numbered over all inputs in order) is held out when
``hash(i) < val_fraction * 2^64`` (plait's SplitMix64 index hash: deterministic, independent of worker count and
of the other documents), and at least one document is held out whenever ``val_fraction > 0``.

Work happens in passes that never hold the corpus in memory: ``scan`` (every input read once: sha256, counts,
every record checked, so bad input fails before any token is written), BPE training for ``bpe:V`` (on the training
documents only, streamed), then tokenization in ``workers`` processes fed batches of about 1 MiB of text (at most
two batches per worker in flight) and written in document order. Everything is written into a hidden temporary
sibling of ``--out`` and renamed into place when complete, ``meta.json`` last, so a folder with a ``meta.json`` is a
complete one and an interrupted prepare leaves ``--out`` as it was. An existing ``--out`` must be empty or a plait
token folder (replaced with ``--overwrite``, and then only plait's own files): ``plait.data.output``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from plait import files
from plait.data.discover import describe_skipped
from plait.data.instruct import chat_template, encode_scored, encode_scored_documents
from plait.data.loader import index_hash
from plait.data.output import FORMAT, INPUTS_FILE, META_FILE, OutFolder, check_out
from plait.data.sources import InputFile, InputStats, find_inputs, iter_all_documents, scan, sha256_of
from plait.data.tokenizer import (
    MIN_BPE_VOCAB,
    AnyTokenizer,
    concatenate,
    describe,
    encode_documents,
    load_tokenizer,
    parse_bpe_vocab,
    train_bpe,
)
from plait.errors import DataError
from plait.logging import get_logger

if TYPE_CHECKING:
    from concurrent.futures import Future

log = get_logger(__name__)

FORMAT_VERSION = 1
MASKED_VERSION = 2
"""A folder with loss masks (``<split>.mask.bin``): older readers, which would train on the prompts, refuse it."""
READABLE_VERSIONS = (FORMAT_VERSION, MASKED_VERSION)
SPLITS = ("train", "val")
SPLIT_STREAM = 0x5B17
"""The index-hash stream of the validation split (seed 0): fixed, so a folder's split never depends on a flag."""
SKIPPED_LISTED = 100
"""``meta.json`` lists at most this many skipped input files (with the total)."""
BATCH_CHARACTERS = 1 << 20
BATCH_DOCUMENTS = 4096


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocabulary <= 65,536), else uint32: half the bytes for most vocabularies."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def validation_mask(indices: np.ndarray, val_fraction: float) -> np.ndarray:
    """True for the documents ``indices`` that ``val_fraction`` holds out (hash below the fraction of 2^64)."""
    threshold = np.uint64(min(int(val_fraction * 2.0**64), 2**64 - 1))
    return index_hash(0, indices, SPLIT_STREAM) < threshold


def _first_by_hash(documents: int) -> int:
    """The document with the smallest split hash: held out when the fraction alone holds out none."""
    best, best_hash = 0, None
    for start in range(0, documents, 1 << 20):
        hashes = index_hash(0, np.arange(start, min(documents, start + (1 << 20))), SPLIT_STREAM)
        where = int(hashes.argmin())
        if best_hash is None or hashes[where] < best_hash:
            best, best_hash = start + where, hashes[where]
    return best


def _writing(staging: Path) -> AbstractContextManager[None]:
    """A failure of the disk while writing into the ``staging`` folder as one ``DataError`` line naming the folder
    and the fix (``plait.files.disk_errors``); ``prepare`` then removes the staging folder, so --out is unchanged."""
    return files.disk_errors(
        staging.parent,
        "plait data prepare",
        "--out is as it was, and the partial output is removed.",
        DataError,
    )


@dataclass
class _SplitWriter:
    """Appends documents (ids + eos) of one split to ``<name>.bin.partial`` and their offsets to ``.idx.partial``."""

    folder: Path
    name: str
    dtype: np.dtype
    eos_id: int
    masked: bool = False
    """Instruction data: also ``<name>.mask.bin``, one byte per token (1: a scored target)."""
    documents: int = 0
    tokens: int = 0
    hashes: dict[str, Any] = field(default_factory=dict)
    streams: dict[str, BinaryIO] = field(default_factory=dict)

    @property
    def suffixes(self) -> tuple[str, ...]:
        return ("bin", "idx", "mask.bin") if self.masked else ("bin", "idx")

    def __post_init__(self) -> None:
        with _writing(self.folder):
            for suffix in self.suffixes:
                self.streams[suffix] = open(self.folder / f"{self.name}.{suffix}.partial", "wb")
                self.hashes[suffix] = hashlib.sha256()
        self._write("idx", np.zeros(1, dtype="<i8").tobytes())

    def _write(self, suffix: str, data: bytes) -> None:
        with _writing(self.folder):
            self.streams[suffix].write(data)
        self.hashes[suffix].update(data)

    def append(self, tokens: np.ndarray, lengths: np.ndarray, scored: np.ndarray | None = None) -> np.ndarray:
        """Write documents given as concatenated ids and lengths (and, masked, whether each token is scored: a
        document's eos is scored when its last token is); returns what was written (ids with eos)."""
        if len(lengths) == 0:
            return np.zeros(0, dtype=self.dtype)
        with_eos = np.empty(len(tokens) + len(lengths), dtype=self.dtype)
        ends = np.cumsum(lengths + 1)
        eos_at = ends - 1
        keep = np.ones(len(with_eos), dtype=bool)
        keep[eos_at] = False
        with_eos[keep] = tokens
        with_eos[eos_at] = self.eos_id
        if self.masked:
            assert scored is not None
            mask = np.zeros(len(with_eos), dtype=np.uint8)
            mask[keep] = scored
            mask[eos_at] = np.where(lengths > 0, mask[np.maximum(eos_at - 1, 0)], 0)
            self._write("mask.bin", mask.tobytes())
        self._write("bin", with_eos.tobytes())
        self._write("idx", (self.tokens + ends).astype("<i8").tobytes())
        self.documents += len(lengths)
        self.tokens += len(with_eos)
        return with_eos

    def close(self) -> None:
        for stream in self.streams.values():
            stream.close()

    def finish(self) -> dict[str, dict[str, Any]]:
        """Rename the partial files into place; their records for ``meta.json``."""
        records = {}
        with _writing(self.folder):  # closing flushes the last bytes
            self.close()
            for suffix in self.suffixes:
                final = self.folder / f"{self.name}.{suffix}"
                os.replace(self.folder / f"{self.name}.{suffix}.partial", final)
                records[final.name] = {"bytes": final.stat().st_size, "sha256": self.hashes[suffix].hexdigest()}
        return records

    def discard(self) -> None:
        with contextlib.suppress(OSError):  # a full disk fails the flush of what is being thrown away
            self.close()
        for suffix in self.suffixes:
            (self.folder / f"{self.name}.{suffix}.partial").unlink(missing_ok=True)


class _Progress:
    """rich progress bars (scan, BPE training, tokenization) on ``console``; nothing when disabled."""

    def __init__(self, enabled: bool, console: Any) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TaskProgressColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        if console is None:
            from rich.console import Console

            console = Console(stderr=True)
        self.bar = Progress(
            SpinnerColumn(),
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=console,
            disable=not enabled,
        )

    def __enter__(self) -> _Progress:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()

    def add(self, description: str, total: float | None) -> Any:
        return self.bar.add_task(description, total=total, info="")

    def update(self, task: Any, **kwargs: Any) -> None:
        self.bar.update(task, **kwargs)


def _batches(documents: Iterator[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for text in documents:
        batch.append(text)
        size += len(text)
        if size >= BATCH_CHARACTERS or len(batch) >= BATCH_DOCUMENTS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def worker_pool(workers: int) -> Any:
    """``workers`` tokenizer processes, started now (``prepare`` starts them first, before its progress bar's thread
    and a BPE trainer's threads exist). On Linux they are forked, as torch's DataLoader forks its workers: nothing
    to import, so they start at once; the tokenizer is loaded by each worker on its first batch. Elsewhere they
    come from a fork server (macOS) or are spawned."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    methods = multiprocessing.get_all_start_methods()
    method = "fork" if sys.platform.startswith("linux") else "forkserver" if "forkserver" in methods else "spawn"
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method))
    pool.submit(os.getpid).result()  # the first task starts every worker process
    return pool


def _encoded_batches(
    batches: Iterator[list[str]],
    tokenizer: AnyTokenizer,
    pool: Any,
    workers: int,
    folder: Path,
    record: dict[str, Any],
    masked: bool,
) -> Iterator[tuple[np.ndarray, ...]]:
    """(ids, lengths) of each batch — (ids, lengths, scored) when ``masked`` — in order: in this process (no
    ``pool``), or in the pool's ``workers`` processes with at most two batches per worker in flight (so the reader
    never runs ahead of the tokenizers by more)."""
    if pool is None:
        for batch in batches:
            yield encode_scored(tokenizer, batch) if masked else concatenate(tokenizer.encode_batch(batch))
        return
    pending: deque[Future[tuple[np.ndarray, ...]]] = deque()
    encode = encode_scored_documents if masked else encode_documents
    for batch in batches:
        pending.append(pool.submit(encode, str(folder), record, batch))
        if len(pending) >= 2 * workers:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _check_arguments(val_fraction: float, workers: int) -> None:
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"--val-fraction {val_fraction} must be in [0, 1). Fix: e.g. --val-fraction 0.01.")
    if workers < 1:
        raise DataError(f"--workers {workers} must be at least 1. Fix: e.g. --workers {os.cpu_count() or 1}.")


def _entropy(counts: np.ndarray) -> float:
    """Unigram entropy H = -sum p log p (nats) of token counts: the loss of the best context-free model."""
    total = counts.sum()
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum()) if total else float("nan")


def prepare(
    inputs: Sequence[str | Path],
    out: str | Path,
    tokenizer: str = "bytes",
    val_fraction: float = 0.01,
    workers: int = 1,
    field: str = "text",
    eos: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    console: Any = None,
    extra_meta: dict[str, Any] | None = None,
    instruct: bool = False,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
) -> dict[str, Any]:
    """Tokenize ``inputs`` into the folder ``out`` (see the module doc); returns its ``meta.json`` as a dict.
    ``instruct``: the inputs are ``.jsonl`` instruction records, whose prompts the loss will not score
    (``plait.data.instruct``). ``include`` / ``exclude``: glob patterns choosing the files of input folders
    (``plait.data.discover``); the files skipped, with why, are logged and listed in ``meta.json``.

    Raises ``DataError`` naming the file (and line) and the fix for bad input, before anything is written."""
    _check_arguments(val_fraction, workers)
    target = check_out(Path(out).expanduser(), inputs, overwrite)
    bpe_vocab = parse_bpe_vocab(tokenizer)
    sources, skipped = find_inputs(inputs, include, exclude)
    if skipped:
        log.warning("%s", describe_skipped(skipped))
    if instruct:
        sources = _instruct_inputs(sources, tokenizer)
    chosen = None if bpe_vocab else load_tokenizer(tokenizer, eos)
    pool = worker_pool(workers) if workers > 1 else None
    staging: Path | None = None
    try:
        with _Progress(progress, console) as bars:
            scanning = bars.add("scan", len(sources))
            stats = scan(sources, field, on_file=lambda s: bars.update(scanning, advance=1, info=s.path[-40:]))
            is_val = _split_rule(sum(s.documents for s in stats), val_fraction)
            if bpe_vocab:
                chosen = _train_bpe(sources, stats, field, is_val, bpe_vocab, bars)
            assert chosen is not None
            staging = target.stage()
            with _writing(staging):
                tokenizer_file = chosen.save(staging)
            record = describe(chosen, tokenizer, tokenizer_file)
            work = (pool, workers, instruct)
            meta = _tokenize(sources, stats, chosen, record, staging, work, field, is_val, bars)
        meta.update(extra_meta or {})
        meta["val_fraction"] = val_fraction
        if skipped:  # the first SKIPPED_LISTED, and how many in all
            meta["skipped"] = {
                "files": len(skipped),
                "list": [{"path": entry.path, "reason": entry.reason} for entry in skipped[:SKIPPED_LISTED]],
            }
        with _writing(staging):
            _write_records(staging, meta, stats, tokenizer_file)
        target.install(staging)  # renames inside one file system
        staging = None
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
        if staging is not None:
            OutFolder.discard(staging)
    val = meta["splits"]["val"]
    log.info(
        "%s: %d documents, %s tokens (validation: %d documents, %s tokens), vocabulary %d, %s",
        target.path,
        meta["documents"],
        f"{meta['tokens']:,}",
        val["documents"],
        f"{val['tokens']:,}",
        meta["vocab_size"],
        meta["dtype"],
    )
    return meta


def _instruct_inputs(sources: list[InputFile], tokenizer: str) -> list[InputFile]:
    """``--instruct``: every input a ``.jsonl`` of instruction records, read with the tokenizer folder's chat
    template (if it has one)."""
    others = [str(source.path) for source in sources if source.kind != "jsonl"]
    if others:
        raise DataError(
            f"--instruct reads .jsonl files of prompt/response or chat records, but {others[:3]} are not .jsonl. "
            f"Fix: prepare plain text without --instruct (into another folder), or convert them to JSON Lines."
        )
    template = chat_template(tokenizer)
    return [InputFile(source.path, "instruct", source.size, template) for source in sources]


def _write_records(folder: Path, meta: dict[str, Any], stats: list[InputStats], tokenizer_file: str | None) -> None:
    """``inputs.jsonl`` (one line per input: meta.json stays small for many inputs), then ``meta.json``."""
    with open(folder / INPUTS_FILE, "w") as stream:
        stream.writelines(json.dumps(s.record()) + "\n" for s in stats)
    for name in (tokenizer_file, INPUTS_FILE):
        if name:
            path = folder / name
            meta["files"][name] = {"bytes": path.stat().st_size, "sha256": sha256_of(path)}
    (folder / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def _split_rule(documents: int, val_fraction: float) -> Any:
    """``is_val(indices) -> bool array``: the validation split's rule for a corpus of ``documents`` documents."""
    if val_fraction > 0 and documents < 2:
        raise DataError(
            f"the inputs hold {documents} document; a validation split by whole documents needs at least 2. "
            f"Fix: more documents (jsonl lines, files), or --val-fraction 0 (no validation split)."
        )
    always_val = _first_by_hash(documents) if val_fraction > 0 else -1

    def is_val(indices: np.ndarray) -> np.ndarray:
        return validation_mask(indices, val_fraction) | (indices == always_val)

    return is_val


def _training_documents(sources: Sequence[Any], field: str, is_val: Any, on_batch: Any) -> Iterator[str]:
    """The documents that the validation split does not hold, streamed (what the BPE is trained on);
    ``on_batch(characters)`` after each batch read (held-out documents included), and ``on_batch(None)`` at the end."""
    first = 0
    for batch in _batches(iter_all_documents(sources, field)):
        held = is_val(np.arange(first, first + len(batch)))
        yield from (text for text, out in zip(batch, held.tolist()) if not out)
        first += len(batch)
        on_batch(sum(map(len, batch)))
    on_batch(None)


def _train_bpe(
    sources: Sequence[Any], stats: list[InputStats], field: str, is_val: Any, vocab: int, bars: _Progress
) -> Any:
    """``train_bpe`` on the training documents, with progress: one bar counts the characters handed to the trainer,
    a second one shows it at work after that (counting the pieces it has buffered, then learning merges: the
    trainer reports nothing while it does, so the bar shows the elapsed time); log lines say the same for a program
    whose logger is configured (the ranks of plait train preparing the stdlib corpus)."""
    total, started = sum(s.characters for s in stats), time.perf_counter()
    reading = bars.add(f"train BPE {vocab}: read", total)
    merging: list[Any] = []
    log.info("training a byte-level BPE of %d tokens on %s characters", vocab, f"{total:,}")

    def on_batch(characters: int | None) -> None:
        if characters is not None:
            bars.update(reading, advance=characters)
            return
        bars.update(reading, completed=total)
        merging.append(bars.add(f"train BPE {vocab}: merges", None))
        bars.update(merging[0], info=f"counting pieces, learning {vocab - MIN_BPE_VOCAB} merges")
        log.info(
            "BPE: text read in %.1f s; counting pieces and learning %d merges",
            time.perf_counter() - started,
            vocab - MIN_BPE_VOCAB,
        )

    chosen = train_bpe(_training_documents(sources, field, is_val, on_batch), vocab)
    for task in merging:
        bars.update(task, total=1, completed=1, info="")
    log.info("BPE of %d tokens trained in %.1f s", vocab, time.perf_counter() - started)
    return chosen


def _tokenize(
    sources: Sequence[Any],
    stats: list[InputStats],
    chosen: AnyTokenizer,
    record: dict[str, Any],
    out: Path,
    work: tuple[Any, int, bool],
    field: str,
    is_val: Any,
    bars: _Progress,
) -> dict[str, Any]:
    """Tokenize every document (``work`` = (process pool or None, workers, instruction data)) and write both
    splits."""
    pool, workers, masked = work
    documents = sum(s.documents for s in stats)
    dtype = token_dtype(chosen.vocab_size)
    writers = {name: _SplitWriter(out, name, dtype, chosen.eos_id, masked) for name in SPLITS}
    counts = np.zeros(chosen.vocab_size, dtype=np.int64)
    task = bars.add("tokenize", documents)
    first, done = 0, False
    try:
        batches = _batches(iter_all_documents(sources, field))
        for tokens, lengths, *scored in _encoded_batches(batches, chosen, pool, workers, out, record, masked):
            if len(tokens) and int(tokens.max()) >= chosen.vocab_size:
                raise DataError(
                    f"the tokenizer produced id {int(tokens.max())} >= its vocabulary size {chosen.vocab_size}. "
                    f"Fix: use a tokenizer whose ids are below its vocabulary size."
                )
            held = is_val(np.arange(first, first + len(lengths)))
            per_token = np.repeat(held, lengths)
            mask = scored[0] if scored else None
            writers["val"].append(tokens[per_token], lengths[held], None if mask is None else mask[per_token])
            written = writers["train"].append(
                tokens[~per_token], lengths[~held], None if mask is None else mask[~per_token]
            )
            counts += np.bincount(written, minlength=chosen.vocab_size)[: chosen.vocab_size]
            first += len(lengths)
            total = writers["train"].tokens + writers["val"].tokens
            bars.update(task, completed=first, info=f"{total:,} tokens")
        files: dict[str, Any] = {}
        for writer in writers.values():
            files.update(writer.finish())
        done = True
    finally:
        if not done:
            for writer in writers.values():
                writer.discard()
    splits = {
        name: {"documents": w.documents, "tokens": w.tokens, "bin": f"{name}.bin", "idx": f"{name}.idx"}
        | ({"mask": f"{name}.mask.bin"} if masked else {})
        for name, w in writers.items()
    }
    return {
        "format": FORMAT,
        "version": MASKED_VERSION if masked else FORMAT_VERSION,
        **({"loss_mask": True} if masked else {}),
        "tokenizer": record,
        "vocab_size": chosen.vocab_size,
        "eos_id": chosen.eos_id,
        "dtype": dtype.name,
        "field": field,
        "documents": documents,
        "tokens": sum(w.tokens for w in writers.values()),
        "splits": splits,
        "unigram_entropy_nats": _entropy(counts),
        "inputs": {
            "files": len(stats),
            "bytes": sum(s.bytes for s in stats),
            "sha256": hashlib.sha256("".join(f"{s.sha256}\n" for s in stats).encode()).hexdigest(),
            "list": INPUTS_FILE,
        },
        "files": files,
        "split_rule": f"document i is held out when index_hash(0, i, stream={SPLIT_STREAM}) < val_fraction * 2^64",
    }


__all__ = ["META_FILE", "READABLE_VERSIONS", "prepare", "token_dtype", "validation_mask"]
