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

The template and the records are untrusted (docs/security.md): records are read under the record-size budget
(``plait.data.jsonl``), a conversation may hold at most ``budgets.TURNS`` messages, and the sandbox is metered
(``plait.data.sandbox``: a render-time budget per record, a size budget per render). Whatever stops a render —
a budget, the sandbox, ``raise_exception``, or any exception the template makes Python raise (an ``OverflowError``
from ``range``, a ``RecursionError``, a ``MemoryError``) — is one ``DataError`` naming the record, the template's
folder and the fix. A lone surrogate the template writes becomes U+FFFD, as in records.

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
from typing import TYPE_CHECKING, Any

import numpy as np

from plait.data.budgets import TURNS
from plait.data.jsonl import SURROGATES, records
from plait.data.tokenizer import concatenate, worker_tokenizer
from plait.errors import DataError
from plait.files import read_text

if TYPE_CHECKING:
    from plait.data.sandbox import Meter

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
    """A tokenizer folder's chat template, compiled in Jinja's immutable sandbox, metered (module docstring)."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", where: str = "") -> None:
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols

        from plait.data.sandbox import MeteredEnvironment  # Jinja: imported when a template is used

        self.where = where
        self.record = ""
        """The record being rendered ("FILE line N"), for the messages."""
        self.environment = MeteredEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        self.environment.globals["raise_exception"] = self._raise
        try:
            self.template = self.environment.from_string(_GENERATION_TAGS.sub("", source))
        except TemplateError as error:
            raise DataError(f"the chat template of {where} is not valid Jinja ({error}). Fix: correct it.") from error
        except Exception as error:  # nested past Python's limits (RecursionError, SyntaxError), ...
            raise DataError(
                f"the chat template of {where} cannot be compiled ({type(error).__name__}: {_one_line(error)}). "
                f"Fix: correct it (less deeply nested)."
            ) from error
        self.tokens = {"bos_token": bos_token, "eos_token": eos_token}
        self.meter: Meter | None = None
        """The budget of the record being rendered (``conversation``), else None."""
        self.work: Meter | None = None
        """The budget of the record last rendered: ``work.renders`` is how many renders it took."""

    def _about(self) -> str:
        return f"{self.record}: " if self.record else ""

    def _raise(self, message: Any) -> None:
        raise DataError(
            f"{self._about()}the chat template of {self.where} refused a conversation: {_one_line(message)}. Fix: "
            f"make the record fit the template, or use a tokenizer folder whose template takes it."
        )

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        """The template's text for ``messages``, under the budgets of ``self.meter`` (a fresh one when none is
        running): lone surrogates the template writes become U+FFFD, one character for one, as in records
        (``plait.data.jsonl``)."""
        from plait.data.sandbox import Meter, OverBudget

        own = self.meter is None
        meter = self.meter = self.meter or Meter()
        meter.start()
        self.environment.meter = meter
        try:
            context = {"messages": messages, "add_generation_prompt": generation_prompt, **self.tokens}
            text = meter.collect(self.template.generate(context))
            return text if text.isascii() else SURROGATES.sub("\ufffd", text)
        except DataError:  # raise_exception
            raise
        except OverBudget as error:
            raise DataError(
                f"{self._about()}the chat template of {self.where} stopped: {error}. Fix: a template that formats "
                f"the messages without such work, or a shorter record; {error.budget.fix(error.limit)}."
            ) from error
        except Exception as error:  # whatever the template makes Python raise: SecurityError, OverflowError, ...
            raise DataError(
                f"{self._about()}the chat template of {self.where} failed ({type(error).__name__}: "
                f"{_one_line(error)}). Fix: correct the template, or use a tokenizer folder whose template renders "
                f"this conversation."
            ) from error
        finally:
            self.environment.meter = None
            if own:
                self.meter = None

    def conversation(self, messages: list[dict[str, Any]], where: str) -> Rendered:
        """The whole conversation, with every assistant turn's span.

        An assistant turn i is found by two renders, of messages[:i] with the generation prompt and of
        messages[:i+1]; the second must start with the first, and the last with the whole conversation's render
        (prefix-stable). That is exact for any template but renders a prefix per turn: work grows with turns x
        length. A template is a black box, so knowing where a prefix's render ends takes rendering it; what bounds
        the work is the turns budget (``budgets.TURNS``, checked before any render), the render-time budget over
        the record's renders together, and the size budget of each render."""
        turns = TURNS.value()
        if len(messages) > turns:
            raise DataError(
                f"{where} holds a conversation of {len(messages):,} messages, more than {TURNS.describe(turns)}. "
                f"Fix: split it into records of fewer turns; {TURNS.fix(turns)}."
            )
        from plait.data.sandbox import Meter

        self.record, self.meter = where, Meter()
        self.work = self.meter
        try:
            return self._spans(messages, where)
        finally:
            self.record, self.meter = "", None

    def _spans(self, messages: list[dict[str, Any]], where: str) -> Rendered:
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
        if spans and not text.startswith(turn):
            raise DataError(
                f"{where}: the chat template of {self.where} renders earlier turns differently as the conversation "
                f"goes on. Fix: one exchange per record, or prompt/response records."
            )
        return Rendered(text, spans)


def _one_line(value: Any, limit: int = 300) -> str:
    """A message from a template or an exception on one line, at most ``limit`` characters."""
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
    """The instruction documents of a ``.jsonl`` file, streamed (one per non-blank line; ``plait.data.jsonl``)."""
    for where, record in records(path):
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
