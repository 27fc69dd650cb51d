"""JSON Lines records of untrusted input files: read under the record-size budget, parsed into one-line errors,
lone surrogates replaced.

Every ``.jsonl`` reader of ``plait data prepare`` (documents and instruction records) reads through ``records``:

* a line longer than ``budgets.RECORD_BYTES`` is refused as it is read (at most that many bytes are ever held), so
  it never reaches memory whole nor the Rust tokenizer;
* a line that is not JSON, or nests deeper than Python's parser recurses, is one ``DataError`` naming file and line;
* a JSON string may escape a lone UTF-16 surrogate (``"\\ud800"`` without its pair: what a string cut inside an
  emoji serializes to). That is not a character: no UTF-8 encoder (Python's, the Rust tokenizers') accepts it. As
  undecodable bytes of a text file are, it is replaced by U+FFFD, one character for one, and a warning names the
  file's first such line once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from plait.data.budgets import RECORD_BYTES
from plait.errors import DataError
from plait.logging import get_logger

log = get_logger(__name__)

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
"""A ``\\uD800``-``\\uDFFF`` escape in a raw line: the only way a lone surrogate gets into a parsed record (it
may also be an escaped backslash followed by such text: then nothing is replaced)."""
SURROGATES = re.compile("[\ud800-\udfff]")
"""A code point that is half of a UTF-16 pair: never a character of text."""
_WARNED: set[str] = set()


def records(path: Path) -> Iterator[tuple[str, Any]]:
    """``(where, record)`` for each non-blank line of the ``.jsonl`` file ``path`` (``where``: "FILE line N")."""
    limit = int(RECORD_BYTES.value())
    with open(path, "rb") as stream:
        number = 0
        while line := stream.readline(limit + 2):  # the line, its newline (\r\n at most), and one byte more
            number += 1
            where = f"{path} line {number}"
            if len(line.rstrip(b"\r\n")) > limit:
                raise DataError(
                    f"{where} is longer than {RECORD_BYTES.describe(limit)}: it is not read further. Fix: split the "
                    f"record (or drop it); {RECORD_BYTES.fix(limit)}."
                )
            if line.strip():
                yield where, parse(line, where, path)


def parse(line: bytes, where: str, path: Path) -> Any:
    """One JSON line as Python values, lone surrogates replaced (module docstring)."""
    try:
        record = json.loads(line)
    except ValueError as error:
        raise DataError(f"{where} is not JSON ({error}). Fix: one JSON object per line (JSON Lines).") from error
    except RecursionError as error:  # json's parser recurses once per level of nesting
        raise DataError(
            f"{where} nests JSON deeper than Python can parse. Fix: one flat JSON object per line, its text in a "
            f"top-level field."
        ) from error
    if _SURROGATE_ESCAPE.search(line):
        record, replaced = _replace_surrogates(record)
        if replaced and str(path) not in _WARNED:
            _WARNED.add(str(path))
            log.warning(
                "%s holds a lone UTF-16 surrogate escape (half of an emoji's \\ud83d\\ude00 pair, not a character): "
                "replaced by U+FFFD, here and in any later line of %s",
                where,
                path.name,
            )
    return record


def _replace_surrogates(record: Any) -> tuple[Any, bool]:
    """``record`` with every lone surrogate of its strings (keys too) replaced by U+FFFD, and whether any was.
    Iterative: a record nests as deep as the JSON parser allowed."""
    replaced = False

    def clean(value: Any) -> Any:
        nonlocal replaced
        if isinstance(value, str) and SURROGATES.search(value):
            replaced = True
            return SURROGATES.sub("\ufffd", value)
        return value

    root = [record]
    stack: list[Any] = [root]
    while stack:
        container = stack.pop()
        if isinstance(container, list):
            for index, item in enumerate(container):
                container[index] = clean(item)
                if isinstance(item, (list, dict)):
                    stack.append(item)
        else:
            for key in list(container):
                item = container.pop(key)
                container[clean(key)] = clean(item)
                if isinstance(item, (list, dict)):
                    stack.append(item)
    return root[0], replaced


__all__ = ["SURROGATES", "parse", "records"]
