"""Instruction data for ``plait data prepare --instruct``: prompt / response pairs and chat conversations, with the
prompt tokens masked from the loss.

Each ``.jsonl`` line is one document, either

* ``{"prompt": "...", "response": "..."}``: the text prompt + response (as given: put any separator or template in
  the strings), the response scored; or
* ``{"messages": [{"role": "system"|"user"|"assistant"|..., "content": "..."}, ...]}``: a conversation rendered
  by the chat template of the tokenizer folder (``--tokenizer path/folder`` whose ``chat_template.jinja`` or
  ``tokenizer_config.json`` holds one), every assistant turn scored — its text and the end-of-turn marker the
  template writes after it — and everything else (system, user, the template's prompts) not.

A document is a ``Rendered`` string: its text, plus the character spans that are scored. Chat templates are Jinja
(transformers' format); plait renders them in Jinja's immutable sandbox, as transformers does, so a template can
format but never run code, and renders nothing that depends on the clock (no ``strftime_now``: a template falls
back to its fixed date), so the output is the same bytes on every run. An assistant turn's span is found by
rendering the conversation up to it with the generation prompt, then with it: the difference is the turn. A
template that rewrites earlier turns when later ones come (not prefix-stable) is refused.

Tokenization (``scored_tokens``) maps the spans to tokens through the tokenizer's character offsets: a token is
scored when its first character is; the end-of-document token after a document is scored when the document ends
scored (a response), so the model learns to stop. The folder then holds ``<split>.mask.bin``: one byte per token,
1 where the token is a scored *target* (``TokenDataset`` sets the other targets to -100).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from plait.data.tokenizer import concatenate, worker_tokenizer
from plait.errors import DataError
from plait.files import read_text

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
_GENERATION_TAGS = re.compile(r"{%-?\s*(end)?generation\s*-?%}")
"""transformers' ``{% generation %}`` markers (its assistant masks): plait finds the turns itself, so they go."""


class Rendered(str):
    """A document's text with the character spans [start, end) whose tokens the loss scores."""

    spans: tuple[tuple[int, int], ...]

    def __new__(cls, text: str, spans: Sequence[tuple[int, int]] = ()) -> Rendered:
        made = super().__new__(cls, text)
        made.spans = tuple(spans)
        return made

    def __reduce__(self) -> tuple[Any, ...]:  # to the tokenizer worker processes, spans included
        return Rendered, (str(self), self.spans)


def _special(value: Any) -> str:
    """A special token from tokenizer_config.json: a string, or an AddedToken's ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


class ChatTemplate:
    """A tokenizer folder's chat template, compiled in Jinja's immutable sandbox (module docstring)."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", where: str = "") -> None:
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.where = where
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        environment.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        environment.globals["raise_exception"] = self._raise
        try:
            self.template = environment.from_string(_GENERATION_TAGS.sub("", source))
        except TemplateError as error:
            raise DataError(f"the chat template of {where} is not valid Jinja ({error}). Fix: correct it.") from error
        self.tokens = {"bos_token": bos_token, "eos_token": eos_token}

    def _raise(self, message: str) -> None:
        raise DataError(f"the chat template of {self.where} refused a conversation: {message}")

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        from jinja2 import TemplateError

        try:
            return str(self.template.render(messages=messages, add_generation_prompt=generation_prompt, **self.tokens))
        except TemplateError as error:  # includes the sandbox's SecurityError
            raise DataError(f"the chat template of {self.where} failed ({type(error).__name__}: {error}).") from error

    def conversation(self, messages: list[dict[str, Any]], where: str) -> Rendered:
        """The whole conversation, with every assistant turn's span."""
        spans = []
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.render(messages[:index], generation_prompt=True)
            turn = self.render(messages[: index + 1], generation_prompt=False)
            if not turn.startswith(prompt):
                raise DataError(
                    f"{where}: the chat template of {self.where} renders the turns before assistant message {index} "
                    f"differently once it answers (not prefix-stable), so its tokens cannot be told apart. Fix: one "
                    f"exchange per record, or prompt/response records."
                )
            spans.append((len(prompt), len(turn)))
        text = self.render(messages, generation_prompt=False)
        if spans and not text.startswith(self.render(messages[: _last_assistant(messages) + 1], False)):
            raise DataError(
                f"{where}: the chat template of {self.where} renders earlier turns differently as the conversation "
                f"goes on. Fix: one exchange per record, or prompt/response records."
            )
        return Rendered(text, spans)


def _last_assistant(messages: list[dict[str, Any]]) -> int:
    return max(index for index, message in enumerate(messages) if message["role"] == "assistant")


def chat_template(spec: str) -> ChatTemplate | None:
    """The chat template of the tokenizer ``spec`` when it is a folder holding one (``chat_template.jinja``, or the
    ``chat_template`` of ``tokenizer_config.json``: a string, or a list of named templates, "default" used), else
    None. Only regular files inside the folder are read; nothing from it runs."""
    folder = Path(spec).expanduser()
    if not folder.is_dir():
        return None
    config: dict[str, Any] = {}
    if (folder / CONFIG_FILE).is_file():
        try:
            loaded = json.loads(read_text(folder / CONFIG_FILE, "tokenizer config", DataError))
        except (ValueError, RecursionError) as error:
            raise DataError(f"{folder / CONFIG_FILE} is not valid JSON ({error}). Fix: restore it.") from error
        config = loaded if isinstance(loaded, dict) else {}
    source: Any = None
    if (folder / TEMPLATE_FILE).is_file():
        source = read_text(folder / TEMPLATE_FILE, "chat template", DataError)
    else:
        source = config.get("chat_template")
        if isinstance(source, list):
            named = {entry.get("name"): entry.get("template") for entry in source if isinstance(entry, dict)}
            source = named.get("default")
    if not isinstance(source, str) or not source.strip():
        return None
    where = str(folder)
    return ChatTemplate(source, _special(config.get("bos_token")), _special(config.get("eos_token")), where)


def _messages(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}}. Fix: correct the line.")
    for message in value:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)):
            raise DataError(f"{where}: every message needs a string 'role' (and 'content'). Fix: correct the line.")
        if not isinstance(message.get("content"), str):
            raise DataError(f"{where}: a message's 'content' must be text. Fix: correct the line.")
    if not any(message["role"] == "assistant" for message in value):
        raise DataError(f"{where}: the conversation has no assistant turn: nothing to learn. Fix: drop the line.")
    return value


def render_record(record: Any, template: ChatTemplate | None, where: str) -> Rendered:
    """One jsonl record as a ``Rendered`` document (module docstring)."""
    if isinstance(record, dict) and isinstance(record.get("prompt"), str) and isinstance(record.get("response"), str):
        prompt, response = record["prompt"], record["response"]
        return Rendered(prompt + response, [(len(prompt), len(prompt) + len(response))])
    if isinstance(record, dict) and "messages" in record:
        messages = _messages(record["messages"], where)
        if template is None:
            raise DataError(
                f"{where} holds chat messages, but the tokenizer has no chat template. Fix: --tokenizer a tokenizer "
                f"folder with one (chat_template in tokenizer_config.json, or chat_template.jinja), or write "
                f"prompt/response records."
            )
        return template.conversation(messages, where)
    keys = sorted(record)[:8] if isinstance(record, dict) else type(record).__name__
    raise DataError(
        f'{where} is not an instruction record (it has: {keys}). Fix: {{"prompt": ..., "response": ...}} or '
        f'{{"messages": [{{"role": "user", "content": ...}}, {{"role": "assistant", "content": ...}}]}}.'
    )


def instruct_documents(path: Path, template: ChatTemplate | None) -> Iterator[Rendered]:
    """The instruction documents of a ``.jsonl`` file, streamed (one per non-blank line)."""
    with open(path, "rb") as stream:
        for number, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            where = f"{path} line {number}"
            try:
                record = json.loads(line)
            except ValueError as error:
                raise DataError(
                    f"{where} is not JSON ({error}). Fix: one JSON object per line (JSON Lines)."
                ) from error
            except RecursionError as error:
                raise DataError(f"{where} nests JSON deeper than Python can parse. Fix: flatten it.") from error
            yield render_record(record, template, where)


def scored_tokens(tokenizer: Any, texts: Sequence[str]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each document's token ids (uint32) and whether each token is scored (bool): a ``Rendered`` document's spans
    mapped through the tokenizer's character offsets; a plain string is all scored."""
    out = []
    for text in texts:
        spans = getattr(text, "spans", None)
        if tokenizer.kind == "bytes":
            raw = str(text).encode("utf-8")
            ids = np.frombuffer(raw, dtype=np.uint8).astype(np.uint32)
            starts = _byte_starts(str(text), len(raw))
        else:
            encoding = tokenizer.backend.encode(str(text), add_special_tokens=False)
            ids = np.asarray(encoding.ids, dtype=np.uint32)
            starts = np.asarray([start for start, _ in encoding.offsets], dtype=np.int64)
        scored = np.ones(len(ids), dtype=bool) if spans is None else np.zeros(len(ids), dtype=bool)
        for start, end in spans or ():
            scored |= (starts >= start) & (starts < end)
        out.append((ids, scored))
    return out


def encode_scored(tokenizer: Any, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids concatenated, uint32; lengths, int64; scored concatenated, bool) of ``texts`` (no eos)."""
    pieces = scored_tokens(tokenizer, texts)
    ids, lengths = concatenate([piece for piece, _ in pieces])
    scored = np.concatenate([mask for _, mask in pieces]) if pieces else np.zeros(0, dtype=bool)
    return ids, lengths, scored


def encode_scored_documents(
    folder: str, record: dict[str, Any], texts: Sequence[str]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``encode_scored`` in a tokenizer worker process (``tokenizer.worker_tokenizer``)."""
    return encode_scored(worker_tokenizer(folder, record), texts)


def _byte_starts(text: str, size: int) -> np.ndarray:
    """The character index of each UTF-8 byte of ``text``."""
    widths = np.fromiter((len(char.encode("utf-8")) for char in text), dtype=np.int64, count=len(text))
    return np.repeat(np.arange(len(text), dtype=np.int64), widths)[:size]


__all__ = [
    "ChatTemplate",
    "Rendered",
    "chat_template",
    "encode_scored",
    "encode_scored_documents",
    "instruct_documents",
    "render_record",
    "scored_tokens",
]
