"""Tokenizers for ``plait data prepare`` and the token datasets: one small interface over three kinds.

``--tokenizer`` (a *spec*) takes

* ``bytes``: the 256 byte values of the UTF-8 text, plus an end-of-document id 256 (vocabulary 257);
* ``bpe:VOCAB``: a byte-level BPE (GPT-2's scheme: bytes mapped to printable symbols, merges learned greedily by
  pair frequency, Sennrich et al. 2016) trained by the Hugging Face ``tokenizers`` library on the data itself, with
  ``<|endoftext|>`` as its end-of-document token. GPT-2's pre-tokenizer keeps a run of letters as one piece; its
  pieces are then cut to at most ``MAX_PIECE`` byte symbols (``train_bpe`` says why);
* a local Hugging Face tokenizer: a ``tokenizer.json`` file, or a folder saved by ``save_pretrained`` (read by
  ``transformers.AutoTokenizer`` with ``local_files_only=True`` and ``trust_remote_code=False``: nothing is ever
  downloaded, and no code from the folder ever runs; a folder whose ``tokenizer_config.json`` or ``config.json``
  asks for its own Python classes (``auto_map``) is refused before transformers reads it, so nothing prompts).

Every kind but ``bytes`` is a ``tokenizers.Tokenizer`` in the end, saved as ``tokenizer.json`` in the prepared
folder, so a later program (``plait generate``) decodes exactly what was trained on. Documents are encoded without
the tokenizer's own special tokens (no BOS/CLS added by a post-processor); the data pipeline appends one end-of-
document id after each document, as nanoGPT and Megatron-LM do.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from plait import hf_folders
from plait.errors import DataError

TOKENIZER_FILE = "tokenizer.json"
FOLDER_CONFIGS = ("tokenizer_config.json", "config.json")
"""The files of a ``save_pretrained`` folder in which transformers looks for ``auto_map`` (the folder's own code)."""
BPE_EOS = "<|endoftext|>"
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]", "<|im_end|>")
"""End-of-document tokens recognised in a bare ``tokenizer.json`` (first found wins; ``--eos`` overrides)."""
MIN_BPE_VOCAB = 257
"""A byte-level BPE starts from the 256 byte symbols plus its end-of-document token."""
MAX_PIECE = 64
"""The longest pre-tokenized piece (byte symbols) a trained BPE sees, and so its longest token (``train_bpe``)."""


def _tokenizers() -> Any:
    """The ``tokenizers`` package, or a ``DataError`` naming the extra that installs it."""
    try:
        import tokenizers
    except ImportError as error:  # pragma: no cover - tokenizers ships with the data and test extras
        raise DataError(
            "this tokenizer needs the Hugging Face tokenizers package. Fix: pip install 'plait[data]' (or use "
            "--tokenizer bytes)."
        ) from error
    return tokenizers


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 and ``eos_id`` = 256."""

    kind = "bytes"
    vocab_size = 257
    eos_id = 256
    eos_token = "<eos>"

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint32) for text in texts]

    def decode_ids(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def save(self, folder: Path) -> str | None:
        return None


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` (from a ``tokenizer.json``, a ``save_pretrained`` folder, or trained here)."""

    def __init__(self, backend: Any, eos_token: str, kind: str) -> None:
        eos_id = backend.token_to_id(eos_token)
        if eos_id is None:
            raise DataError(
                f"the tokenizer has no token {eos_token!r} to end documents with. Fix: pass --eos with one of its "
                f"special tokens (e.g. {_special_tokens(backend)[:5]})."
            )
        self.backend, self.kind, self.eos_token, self.eos_id = backend, kind, eos_token, int(eos_id)
        self.vocab_size = int(backend.get_vocab_size(with_added_tokens=True))

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        # one document at a time: single-threaded, so --workers alone sets the parallelism
        return [np.asarray(self.backend.encode(text, add_special_tokens=False).ids, dtype=np.uint32) for text in texts]

    def decode_ids(self, ids: Sequence[int]) -> str:
        return str(self.backend.decode([int(i) for i in ids], skip_special_tokens=False))

    def save(self, folder: Path) -> str:
        self.backend.save(str(folder / TOKENIZER_FILE))
        return TOKENIZER_FILE


AnyTokenizer = ByteTokenizer | HFTokenizer


def _special_tokens(backend: Any) -> list[str]:
    return [token.content for token in backend.get_added_tokens_decoder().values() if token.special]


def _find_eos(backend: Any, eos: str | None, source: str) -> str:
    if eos:
        return eos
    vocab = backend.get_vocab(with_added_tokens=True)
    for name in EOS_NAMES:
        if name in vocab:
            return name
    raise DataError(
        f"cannot tell which token of {source} ends a document (none of {list(EOS_NAMES)}). Fix: pass --eos TOKEN "
        f"(its special tokens: {_special_tokens(backend)[:8]})."
    )


def parse_bpe_vocab(spec: str) -> int | None:
    """``bpe:8000`` -> 8000; any other spec -> None. A malformed size raises ``DataError``."""
    if not spec.startswith("bpe:"):
        return None
    text = spec.removeprefix("bpe:")
    if not text.isdigit() or int(text) < MIN_BPE_VOCAB or int(text) > 1 << 20:
        raise DataError(
            f"--tokenizer {spec!r}: the BPE vocabulary must be an integer in [{MIN_BPE_VOCAB}, {1 << 20}]. "
            f"Fix: e.g. --tokenizer bpe:8000."
        )
    return int(text)


def load_tokenizer(spec: str, eos: str | None = None) -> AnyTokenizer:
    """The tokenizer a ``bytes`` or local Hugging Face spec names (``bpe:V`` is trained by ``train_bpe``)."""
    if spec == "bytes":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if path.is_file():
        try:
            backend = _tokenizers().Tokenizer.from_file(str(path))
        except Exception as error:  # the Rust side raises its own Exception type
            raise DataError(
                f"{path} is not a Hugging Face tokenizer.json ({error}). Fix: give a tokenizer.json, a folder "
                f"saved by save_pretrained, 'bytes' or 'bpe:VOCAB'."
            ) from error
        return HFTokenizer(backend, _find_eos(backend, eos, str(path)), "hf")
    if path.is_dir():
        return _load_pretrained_folder(path, eos)
    raise DataError(
        f"--tokenizer {spec!r} is neither 'bytes', 'bpe:VOCAB', nor an existing tokenizer.json or tokenizer "
        f"folder. Fix: give one of those (a Hugging Face folder must be local: plait never downloads)."
    )


def refuse_remote_code(path: Path) -> None:
    """``DataError`` when a file of the tokenizer folder ``path`` names classes of the folder's own Python files
    (``auto_map``, in any form: ``plait.hf_folders.refuse_auto_map``): transformers would import them (after a
    prompt, or silently with ``trust_remote_code``), and plait never runs code from a folder; or when a link in the
    folder leads outside it (``plait.hf_folders.check_links``). Checked before transformers opens the folder."""
    hf_folders.check_links(path, DataError)
    for name in FOLDER_CONFIGS:
        file = hf_folders.resolve(path, name)
        if not file.is_file():
            continue
        try:
            fields = json.loads(file.read_bytes())
        except (OSError, ValueError, RecursionError) as error:
            raise DataError(
                f"{file} is not a JSON file ({error}). Fix: a folder written by save_pretrained, or pass its "
                f"tokenizer.json file."
            ) from error
        hf_folders.refuse_auto_map(
            fields,
            path / name,
            f"Fix: use a tokenizer class transformers has built in (drop auto_map and tokenizer_class there, or pass "
            f"the folder's {TOKENIZER_FILE} file).",
            DataError,
        )


def _load_pretrained_folder(path: Path, eos: str | None) -> HFTokenizer:
    """A ``save_pretrained`` folder through ``transformers.AutoTokenizer``: local files only, no code from the folder
    (``refuse_remote_code`` first, then ``trust_remote_code=False``, which also answers transformers' prompt)."""
    refuse_remote_code(path)
    try:
        from transformers import AutoTokenizer
    except ImportError as error:  # pragma: no cover - transformers ships with the test extra
        raise DataError(
            f"reading the tokenizer folder {path} needs transformers. Fix: pip install 'plait[hf]', or pass "
            f"its tokenizer.json file instead."
        ) from error
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except Exception as error:  # transformers raises many types for a folder it cannot read
        raise DataError(
            f"{path} is not a Hugging Face tokenizer folder ({type(error).__name__}: {error}). Fix: a folder "
            f"written by save_pretrained (with tokenizer.json), or its tokenizer.json file."
        ) from error
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise DataError(
            f"the tokenizer in {path} has no fast (tokenizers) form. Fix: save it with a tokenizer.json "
            f"(AutoTokenizer.from_pretrained(..., use_fast=True).save_pretrained(...))."
        )
    eos_token = eos or tokenizer.eos_token or _find_eos(backend, None, str(path))
    return HFTokenizer(backend, str(eos_token), "hf")


def bpe_pre_tokenizer(tk: Any) -> Any:
    """GPT-2's byte-level pre-tokenizer, then every piece cut into runs of at most ``MAX_PIECE`` byte symbols."""
    return tk.pre_tokenizers.Sequence(
        [
            tk.pre_tokenizers.ByteLevel(add_prefix_space=False),
            tk.pre_tokenizers.Split(tk.Regex(f".{{1,{MAX_PIECE}}}"), behavior="isolated"),
        ]
    )


def train_bpe(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    """Train a byte-level BPE of ``vocab_size`` tokens (incl. ``<|endoftext|>``) on ``texts`` with ``tokenizers``.

    The trainer counts the distinct pre-tokenized pieces in one pass over the iterator (memory grows with their
    number, not with the corpus), then learns merges: each merge rewrites every distinct piece holding the pair, at
    a cost proportional to the piece's length. GPT-2's pre-tokenizer alone keeps a run of letters whole, so text
    without whitespace (a 1 MiB document of one line) is one piece of a million symbols holding nearly every pair,
    and training costs (merges x corpus bytes): a 1 MB line of random letters took 463 s for ``bpe:2000``. Cut to
    ``MAX_PIECE`` symbols, pieces stay short and repeat as in ordinary text; words of ordinary text are shorter and
    unchanged (the same cut applies when the tokenizer later encodes, as it is part of its ``tokenizer.json``)."""
    tk = _tokenizers()
    backend = tk.Tokenizer(tk.models.BPE())
    backend.pre_tokenizer = bpe_pre_tokenizer(tk)
    backend.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BPE_EOS],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(backend, BPE_EOS, "bpe")


def load_saved(folder: Path, record: dict[str, Any]) -> AnyTokenizer:
    """The tokenizer ``meta.json``'s ``tokenizer`` record describes, read from ``folder`` (never downloads)."""
    if record.get("kind") == "bytes":
        return ByteTokenizer()
    name = record.get("file") or TOKENIZER_FILE
    path = folder / Path(str(name)).name  # a file in the folder, whatever meta.json says
    redo = f"Fix: prepare {folder} again with plait data prepare."
    if not path.is_file():
        raise DataError(f"{path} is missing (meta.json names it). {redo}")
    try:
        backend = _tokenizers().Tokenizer.from_file(str(path))
    except Exception as error:  # the Rust side raises its own Exception type
        raise DataError(f"{path} is not a tokenizer.json that can be read ({error}). {redo}") from error
    tokenizer = HFTokenizer(backend, str(record.get("eos_token")), str(record.get("kind", "hf")))
    if tokenizer.vocab_size != record.get("vocab_size", tokenizer.vocab_size):
        raise DataError(
            f"{path} has {tokenizer.vocab_size} tokens but meta.json says {record.get('vocab_size')}. {redo}"
        )
    return tokenizer


class TextCodec:
    """What a token dataset exposes for generation: ``encode`` text -> ids, ``decode`` ids -> text."""

    def __init__(self, tokenizer: AnyTokenizer) -> None:
        self.tokenizer = tokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    def encode(self, text: str) -> Tensor:
        """Text -> long tensor of ids (no end-of-document id appended)."""
        return torch.from_numpy(self.tokenizer.encode_batch([text])[0].astype(np.int64))

    def decode(self, tokens: Tensor | Sequence[int]) -> str:
        values = tokens.tolist() if isinstance(tokens, Tensor) else list(tokens)
        return self.tokenizer.decode_ids(values)


def describe(tokenizer: AnyTokenizer, spec: str, file: str | None) -> dict[str, Any]:
    """The ``tokenizer`` record of ``meta.json``."""
    return {
        "kind": tokenizer.kind,
        "spec": spec,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "eos_token": tokenizer.eos_token,
        "file": file,
    }


# ----------------------------------------------------------------------------------------- worker processes
_WORKER_TOKENIZER: tuple[str, AnyTokenizer] | None = None


def worker_tokenizer(folder: str, record: dict[str, Any]) -> AnyTokenizer:
    """In a worker process: the tokenizer ``record`` of ``folder``, loaded on the first batch and kept (one per
    process, single-threaded: the parallelism comes from the processes)."""
    global _WORKER_TOKENIZER
    key = f"{folder}\0{sorted(record.items())}"
    if _WORKER_TOKENIZER is None or _WORKER_TOKENIZER[0] != key:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        _WORKER_TOKENIZER = (key, load_saved(Path(folder), record))
    return _WORKER_TOKENIZER[1]


def encode_documents(folder: str, record: dict[str, Any], texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """In a worker process: (token ids of ``texts`` concatenated, uint32; per-document lengths, int64), no eos."""
    return concatenate(worker_tokenizer(folder, record).encode_batch(texts))


def concatenate(pieces: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter((len(piece) for piece in pieces), dtype=np.int64, count=len(pieces))
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint32)
    return tokens.astype(np.uint32, copy=False), lengths
