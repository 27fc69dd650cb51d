"""The inputs of ``plait data prepare``: text, ``.jsonl`` and ``.parquet`` files (and folders of them), streamed.

A *document* is the unit the validation split and the end-of-document token work on:

* a ``.jsonl`` file: one document per non-blank line, the string in its ``field`` (default ``text``); lines are
  read under the record-size budget, lone surrogate escapes replaced (``plait.data.jsonl``);
* a ``.parquet`` file: one document per row of the string column ``field`` (a null is an empty document);
* any other file: its UTF-8 text (undecodable bytes replaced) is one document, or, above ``TEXT_DOCUMENT_BYTES``,
  pieces of about that size cut at line ends (so a single big file streams, tokenizes in parallel and still has
  documents to hold out; a single line longer than that is cut too);
* with ``--instruct`` (kind "instruct"), a ``.jsonl`` file of prompt / response or chat records, one document per
  line, with the spans the loss scores (``plait.data.instruct``).

Folders are searched recursively, in sorted order: files with a known suffix (``SUFFIXES``) and any other file
whose content is UTF-8 text, chosen by ``--include`` / ``--exclude`` patterns; the rest are skipped with a reason
(``plait.data.discover``). Named files are taken whatever their suffix.
Nothing reads a whole file into memory: every reader streams lines or parquet record batches. ``scan`` reads every
input once before any work (sha256, document counts, and every jsonl line and parquet column checked), so bad input
fails before a token is written, naming the file and line.
"""

from __future__ import annotations

import codecs
import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.data.discover import SUFFIXES, Skipped, check_patterns, describe_skipped, kind_of, walk
from plait.data.instruct import instruct_documents
from plait.data.jsonl import records
from plait.errors import DataError

TEXT_DOCUMENT_BYTES = 1 << 20
"""A plain text file longer than this (1 MiB) is cut into documents of about this size at line ends."""
_PARQUET_ROWS = 1024


@dataclass(frozen=True)
class InputFile:
    """One input file and how it is read (``kind``: "text", "jsonl", "parquet" or "instruct", whose records a chat
    ``template`` may render)."""

    path: Path
    kind: str
    size: int
    template: Any = None


@dataclass
class InputStats:
    """What ``scan`` found in one file."""

    path: str
    kind: str
    bytes: int
    sha256: str
    documents: int
    characters: int

    def record(self) -> dict[str, Any]:
        return dict(self.__dict__)


def resolve_inputs(paths: Sequence[str | Path]) -> list[InputFile]:
    """``find_inputs`` without patterns: the files to read."""
    return find_inputs(paths)[0]


def find_inputs(
    paths: Sequence[str | Path], include: Sequence[str] = (), exclude: Sequence[str] = ()
) -> tuple[list[InputFile], list[Skipped]]:
    """Expand folders (``plait.data.discover``: known suffixes, other files by content, the patterns), check every
    input exists and is not empty; the files to read and the skipped ones. ``DataError`` naming the fix."""
    if not paths:
        raise DataError("no input given. Fix: plait data prepare FILE_OR_FOLDER... --out DIR")
    check_patterns(include, exclude)
    files: list[InputFile] = []
    skipped: list[Skipped] = []
    for given in paths:
        path = Path(given).expanduser()
        if path.is_dir():
            found, left = walk(path, include, exclude)
            skipped += left
            if not found:
                why = f" ({describe_skipped(left, limit=3)})" if left else ""
                raise DataError(
                    f"folder {path} holds no input file{why}: plait reads {', '.join(SUFFIXES)} and any other "
                    f"UTF-8 text file. Fix: point at a folder with such files, change --include / --exclude, or "
                    f"name the files themselves."
                )
            files.extend(InputFile(p, kind_of(p), p.stat().st_size) for p in found)
        elif path.is_file():
            files.append(InputFile(path, kind_of(path), path.stat().st_size))
        else:
            raise DataError(f"input {path} does not exist. Fix: give existing files or folders.")
    empty = [str(f.path) for f in files if f.size == 0]
    if empty:
        raise DataError(f"input file(s) {empty[:5]} are empty. Fix: remove them from the inputs, or fill them.")
    return files, skipped


def sha256_of(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while block := stream.read(chunk):
            digest.update(block)
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------------ readers
def _text_documents(path: Path) -> Iterator[str]:
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pieces: list[str] = []
    size = 0
    with open(path, "rb") as stream:
        # a line longer than a document (minified text) is read in pieces too: memory stays bounded
        for line in iter(lambda: stream.readline(TEXT_DOCUMENT_BYTES), b""):
            pieces.append(decoder.decode(line))
            size += len(line)
            if size >= TEXT_DOCUMENT_BYTES:
                yield "".join(pieces)
                pieces, size = [], 0
    pieces.append(decoder.decode(b"", final=True))
    text = "".join(pieces)
    if text or size:
        yield text


def _jsonl_documents(path: Path, field: str) -> Iterator[str]:
    for where, record in records(path):
        value = record.get(field) if isinstance(record, dict) else None
        if not isinstance(value, str):
            keys = sorted(record)[:8] if isinstance(record, dict) else type(record).__name__
            what = "has no" if not isinstance(record, dict) or field not in record else "has a non-string"
            raise DataError(
                f"{where} {what} {field!r} field (it has: {keys}). Fix: --field NAME picks the field that holds the "
                f"text, or fix that line."
            )
        yield value


def _parquet_file(path: Path, field: str) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError as error:  # pragma: no cover - pyarrow ships with the data extra
        raise DataError(f"reading {path} needs pyarrow. Fix: pip install 'plait[data]'.") from error
    import pyarrow as pa

    try:
        parquet = pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises ArrowInvalid, OSError, ... for a file it cannot read
        raise DataError(
            f"cannot read {path} as parquet ({type(error).__name__}: {error}). Fix: give a valid .parquet file "
            f"(or rename a text file so that it does not end in .parquet)."
        ) from error
    schema = parquet.schema_arrow
    if field not in schema.names:
        raise DataError(f"{path} has no column {field!r} (columns: {schema.names[:10]}). Fix: --field NAME.")
    column_type = schema.field(field).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise DataError(f"{path} column {field!r} holds {column_type}, not text. Fix: --field NAME of a text column.")
    return parquet


def _parquet_documents(path: Path, field: str) -> Iterator[str]:
    parquet = _parquet_file(path, field)
    try:
        for batch in parquet.iter_batches(batch_size=_PARQUET_ROWS, columns=[field]):
            for value in batch.column(0).to_pylist():
                yield value or ""
    except DataError:
        raise
    except Exception as error:  # a corrupt page shows only when read
        raise DataError(
            f"cannot read {path} as parquet ({type(error).__name__}: {error}). Fix: give a valid .parquet file."
        ) from error


def iter_documents(source: InputFile, field: str = "text") -> Iterator[str]:
    """The documents of one input file, streamed."""
    if source.kind == "jsonl":
        return _jsonl_documents(source.path, field)
    if source.kind == "parquet":
        return _parquet_documents(source.path, field)
    if source.kind == "instruct":
        return instruct_documents(source.path, source.template)
    return _text_documents(source.path)


def iter_all_documents(sources: Sequence[InputFile], field: str = "text") -> Iterator[str]:
    """Every document of every input, in input order (the order that numbers documents)."""
    for source in sources:
        yield from iter_documents(source, field)


def scan(sources: Sequence[InputFile], field: str = "text", on_file: Any = None) -> list[InputStats]:
    """Read every input once before any work: its sha256, its documents and characters; every record checked.

    ``on_file(stats)`` is called after each file (progress)."""
    found = []
    for source in sources:
        documents = characters = 0
        for text in iter_documents(source, field):
            documents += 1
            characters += len(text)
        if documents == 0:
            raise DataError(f"{source.path} holds no document. Fix: remove it from the inputs, or fill it.")
        stats = InputStats(str(source.path), source.kind, source.size, sha256_of(source.path), documents, characters)
        found.append(stats)
        if on_file is not None:
            on_file(stats)
    return found


__all__ = [
    "InputFile",
    "InputStats",
    "SUFFIXES",
    "find_inputs",
    "TEXT_DOCUMENT_BYTES",
    "iter_all_documents",
    "iter_documents",
    "resolve_inputs",
    "scan",
    "sha256_of",
]
