"""Untrusted chat templates and records under budgets (issue 39, N1 N4 N6 N7; docs/security.md, docs/data.md).

A tokenizer folder's chat template and the records of ``plait data prepare`` come from third parties: a template
that loops without end or doubles a string, a conversation of thousands of exchanges, a 50 MB message, a lone
surrogate in a JSON string. Each case asserts the bound (work and memory counted, never wall time) and a one-line
``DataError`` naming the record, the budget and the fix — or, for lone surrogates, the replacement by U+FFFD.
"""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import plait.data.instruct as instruct
from plait.cli.main import main
from plait.data import TokenFolder, prepare
from plait.data.instruct import ChatTemplate
from plait.data.tokenizer import ByteTokenizer
from plait.errors import DataError, PlaitError

pytestmark = [pytest.mark.adversarial]
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
EXCHANGE = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def one_line(error: pytest.ExceptionInfo, *words: str) -> str:
    message = str(error.value)
    assert isinstance(error.value, PlaitError) and "\n" not in message and "Fix" in message, message
    assert all(word in message for word in words), (words, message)
    return message


def refused_render(source: str, *words: str) -> str:
    """The one-line refusal of ``source`` rendering a conversation of one exchange (record "chats.jsonl line 7")."""
    with pytest.raises(DataError) as error:
        ChatTemplate(source, where="evil-folder").conversation(EXCHANGE, "chats.jsonl line 7")
    return one_line(error, "evil-folder", "chats.jsonl line 7", *words)


# ----------------------------------------------------------------------------------------- N1: the time budget
def test_a_template_looping_without_output_stops_at_the_time_budget(monkeypatch):
    monkeypatch.setenv("PLAIT_MAX_RENDER_SECONDS", "0.2")
    nested = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"  # 10^10 steps
    refused_render(nested, "ran out of time", "render time budget (0.2 seconds, PLAIT_MAX_RENDER_SECONDS)")
    iterating = "{% set s = messages[0]['content'] * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}"
    refused_render(iterating, "ran out of time")  # a string's characters: no range involved


# ----------------------------------------------------------------------------------------- N1: the size budget
DOUBLINGS = {
    "concat": "{% set ns = namespace(s='x') %}{% for i in range(26) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
    "{{ ns.s|length }}",
    "plus": "{% set ns = namespace(s='x') %}{% for i in range(26) %}{% set ns.s = ns.s + ns.s %}{% endfor %}"
    "{{ ns.s|length }}",
    "times": "{% set ns = namespace(s='x') %}{% for i in range(26) %}{% set ns.s = ns.s * 2 %}{% endfor %}"
    "{{ ns.s|length }}",
    "repeat": "{{ ('x' * 100000000)|length }}",
    "center": "{{ ('x'|center(100000000))|length }}",
    "percent": "{{ ('%100000000s' % 'x')|length }}",
    "format": "{{ ('{:>100000000}'.format('x'))|length }}",
    "replace": "{{ (('x' * 1000).replace('x', 'y' * 100000))|length }}",
    "captured": "{% set s = 'x' * 1000 %}{% set big %}{% for i in range(100000) %}{{ s }}{% endfor %}{% endset %}"
    "{{ big|length }}",
    "literal": "{% for i in range(100000) %}{% for j in range(100) %}0123456789{% endfor %}{% endfor %}",
    "slices": "{% set ns = namespace(l=[]) %}{% set s = 'x' * 100000 %}{% for i in range(1000) %}"
    "{% set ns.l = ns.l + [s[i:]] %}{% endfor %}{{ ns.l|length }}",
}


@pytest.mark.parametrize("name", sorted(DOUBLINGS))
def test_a_growing_template_stops_at_the_size_budget_without_large_memory(monkeypatch, name):
    """Each template makes about 10^8 characters (67 MB to 1 GB of memory) unbounded; under a budget of 10^6 it
    stops before allocating much more than that: the peak of traced memory is asserted, not the time."""
    monkeypatch.setenv("PLAIT_MAX_RENDER_CHARACTERS", "1000000")
    tracemalloc.start()
    try:
        refused_render(DOUBLINGS[name], "render size budget (1,000,000 characters, PLAIT_MAX_RENDER_CHARACTERS)")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak:,} bytes"


# -------------------------------------------------------------------- N6: failures other than Jinja's own
@pytest.mark.parametrize(
    ("source", "words"),
    [
        ("{% for i in range(1000000) %}{% endfor %}", "OverflowError: Range too big"),
        ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
        ("{{ 7 ** 300000000 }}", "render size budget"),
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
        ("{{ messages[0].content.nope() }}", "UndefinedError"),
        ("{{ ''.__class__.__mro__ }}", "SecurityError"),
    ],
    ids=["range-limit", "recursion", "huge-power", "division", "undefined", "sandbox"],
)
def test_any_template_failure_is_one_line_naming_the_folder_and_record(source, words):
    refused_render(source, words)


def test_a_memory_error_in_the_template_is_one_line(monkeypatch):
    monkeypatch.setenv("PLAIT_MAX_RENDER_CHARACTERS", "1e30")  # the size check out of the way: Python's own limit
    refused_render("{{ 'x' * 2 ** 62 }}", "MemoryError")


def test_raise_exception_names_the_record_and_the_fix():
    refused_render("{{ raise_exception('no\nsystem role') }}", "refused a conversation: no system role")


# ---------------------------------------------------------------------------------- N4: turns, record size
def test_a_conversation_of_3000_exchanges_is_refused_before_any_render(monkeypatch):
    template = ChatTemplate(CHATML, where="folder")
    renders = []
    spy = template.render
    monkeypatch.setattr(template, "render", lambda *args, **kwargs: renders.append(1) or spy(*args, **kwargs))
    messages = EXCHANGE * 3000
    with pytest.raises(DataError) as error:
        template.conversation(messages, "chats.jsonl line 2")
    one_line(error, "chats.jsonl line 2", "6,000 messages", "turns budget (1,024 messages, PLAIT_MAX_TURNS)")
    assert renders == []  # before: 6,002 renders of up to 6,000 messages (1.7 G characters)
    spans = template.conversation(EXCHANGE * 100, "chats.jsonl line 3").spans  # within it: one render per prefix
    assert len(spans) == 100 and len(renders) == 2 * 100 + 1  # the spans need, and the whole


def test_a_huge_record_is_refused_before_it_is_read_whole_or_tokenized(tmp_path, monkeypatch):
    tokenized: list[int] = []
    encode = ByteTokenizer.encode_batch
    monkeypatch.setattr(ByteTokenizer, "encode_batch", lambda self, texts: tokenized.append(1) or encode(self, texts))
    scored = instruct.scored_tokens
    monkeypatch.setattr(instruct, "scored_tokens", lambda tok, texts: tokenized.append(1) or scored(tok, texts))
    first = json.dumps({"prompt": "a", "response": "b", "text": "c"}).encode() + b"\n"
    path = tmp_path / "big.jsonl"  # a 50 MB message: it aborted the Rust tokenizer with signal 6
    path.write_bytes(first + b'{"prompt": "p", "response": "' + b"x" * (50 << 20) + b'"}\n')
    with pytest.raises(DataError) as error:
        prepare([path], tmp_path / "out", val_fraction=0.0, progress=False, instruct=True)
    one_line(error, f"{path} line 2", "record size budget (8,388,608 bytes, PLAIT_MAX_RECORD_BYTES)")
    monkeypatch.setenv("PLAIT_MAX_RECORD_BYTES", "1000")  # plain documents, under a budget the test sets
    path = tmp_path / "docs.jsonl"
    path.write_bytes(first + json.dumps({"text": "y" * 2000}).encode() + b"\n")
    with pytest.raises(DataError) as error:
        prepare([path], tmp_path / "out", val_fraction=0.0, progress=False)
    one_line(error, f"{path} line 2", "record size budget (1,000 bytes, PLAIT_MAX_RECORD_BYTES)")
    assert not (tmp_path / "out").exists()
    assert tokenized == []
    monkeypatch.setenv("PLAIT_MAX_RECORD_BYTES", "lots")
    with pytest.raises(DataError) as error:
        prepare([path], tmp_path / "out", val_fraction=0.0, progress=False)
    one_line(error, "PLAIT_MAX_RECORD_BYTES='lots'", "positive number")


# ------------------------------------------------------------------------------------ N7: lone surrogates
@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory) -> Path:  # noqa: ANN001
    """A save_pretrained tokenizer folder (a small byte-level BPE) with a ChatML template."""
    from transformers import PreTrainedTokenizerFast

    from plait.data.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("chat")
    backend = train_bpe(iter(["user assistant system hello there"] * 20), 300).backend
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(root / "tok")
    return root / "tok"


@pytest.mark.parametrize(
    ("kind", "record", "tokenizer"),
    [
        ("text", {"text": "a\ud800b"}, "bytes"),
        ("text", {"text": "a\udfffb"}, "bpe:300"),
        ("instruct", {"prompt": "a\ud800b", "response": "fine"}, "bytes"),
        ("chat", {"messages": [{"role": "user", "content": "a\ud800b"}, {"role": "assistant", "content": "ok"}]}, ""),
    ],
)
def test_a_lone_surrogate_becomes_u_fffd_through_the_cli(tmp_path, capsys, chat_folder, kind, record, tokenizer):
    path = tmp_path / "in.jsonl"
    other = {"messages": EXCHANGE} if kind == "chat" else {"prompt": "p", "response": "r", "text": "other doc"}
    path.write_text(json.dumps(record) + "\n" + json.dumps(other) + "\n")  # json.dumps writes "\ud800" as such
    assert "\\ud" in path.read_text()
    args = ["data", "prepare", str(path), "--out", str(tmp_path / "out"), "--val-fraction", "0"]
    args += ["--tokenizer", tokenizer or str(chat_folder)] + (["--instruct"] if kind != "text" else [])
    assert main(args) == 0, capsys.readouterr().err
    folder = TokenFolder(tmp_path / "out")
    tokens, offsets = np.asarray(folder.tokens("train")), np.asarray(folder.offsets("train"))
    first = folder.codec.decode(tokens[offsets[0] : offsets[1] - 1].tolist())
    assert "a\ufffdb" in first, first


def test_a_template_writing_a_lone_surrogate_gives_u_fffd():
    rendered = ChatTemplate("{{ '\\ud800' }}{% for m in messages %}{{ m.content }}{% endfor %}").conversation(
        EXCHANGE, "chats.jsonl line 1"
    )
    assert str(rendered) == "\ufffdhihello" and rendered.spans == ((3, 8),)
    rendered.encode("utf-8")
