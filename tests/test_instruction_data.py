"""Instruction data (issue 27, ``plait data prepare --instruct``, ``plait.data.instruct``): prompt / response
records and chat conversations through a tokenizer folder's chat template, rendered in Jinja's sandbox; only the
responses and assistant turns (with their end-of-turn marker and the document's eos) are scored; packed with
document masking; the same bytes with any worker count; bad records, missing templates, templates that try to
reach Python, and templates that are not prefix-stable are refused with the fix.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from plait.cli.main import main
from plait.data import TokenDataset, TokenFolder, prepare
from plait.data.instruct import ChatTemplate, Rendered
from plait.errors import DataError

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PAIRS = [
    {"prompt": "Q: two plus two?\nA: ", "response": "four"},
    {"prompt": "Say hi. ", "response": "hi there, friend"},
    {"prompt": "Translate 'chat': ", "response": "cat (in French: chat)"},
] * 6
CHATS = [
    {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": f"count to {n}"},
            {"role": "assistant", "content": " ".join(str(i) for i in range(1, n + 1))},
            {"role": "user", "content": "thanks"},
            {"role": "assistant", "content": "you are welcome"},
        ]
    }
    for n in range(2, 12)
]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def documents(folder: Path, split: str = "train") -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, mask) of every document of a split."""
    meta = TokenFolder(folder)
    tokens, mask, offsets = meta.tokens(split), meta.loss_mask(split), np.asarray(meta.offsets(split))
    assert mask is not None
    return [(np.asarray(tokens[a:b]), np.asarray(mask[a:b])) for a, b in zip(offsets[:-1], offsets[1:])]


def test_prompt_response_records_score_the_response_and_the_eos(tmp_path) -> None:  # noqa: ANN001
    source = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    meta = prepare([source], tmp_path / "out", val_fraction=0.0, progress=False, instruct=True)
    assert meta["version"] == 2 and meta["loss_mask"] and meta["splits"]["train"]["mask"] == "train.mask.bin"
    for (ids, mask), record in zip(documents(tmp_path / "out"), PAIRS):
        prompt, response = record["prompt"].encode(), record["response"].encode()
        assert bytes(ids[:-1].astype(np.uint8)) == prompt + response and ids[-1] == 256
        assert mask.tolist() == [0] * len(prompt) + [1] * (len(response) + 1)
    dataset = TokenDataset(tmp_path / "out", seq_len=32, attention="document")
    (tokens, positions), targets = dataset.batch(range(dataset.num_windows))
    index = dataset.windows(range(dataset.num_windows))[:, None] * 32 + np.arange(1, 33)
    scored = np.asarray(TokenFolder(tmp_path / "out").loss_mask("train"))[index] == 1
    assert torch.equal(targets != -100, torch.from_numpy(scored)) and 0 < scored.mean() < 1
    assert (positions == 0).sum() > len(positions)  # packed documents restart inside the windows
    assert main(["data", "info", str(tmp_path / "out")]) == 0


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory) -> Path:  # noqa: ANN001
    """A save_pretrained tokenizer folder (a small byte-level BPE) with ChatML special tokens and template."""
    from transformers import PreTrainedTokenizerFast

    from plait.data.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("chat")
    texts = [json.dumps(record) for record in CHATS + PAIRS] * 3
    backend = train_bpe(iter(texts), 300).backend
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(root / "tok")
    return root / "tok"


def test_chat_turns_through_the_template_score_the_assistant_turns(chat_folder, tmp_path) -> None:  # noqa: ANN001
    source = write_jsonl(tmp_path / "chats.jsonl", CHATS)
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        prepare([source], out, str(chat_folder), val_fraction=0.2, workers=workers, progress=False, instruct=True)
    for name in ("train.bin", "train.mask.bin", "val.mask.bin"):  # the same bytes with 1 and 2 tokenizer processes
        assert (tmp_path / "out1" / name).read_bytes() == (out / name).read_bytes()
    codec = TokenFolder(out).codec
    split = documents(out) + documents(out, "val")
    assert len(split) == len(CHATS)
    for ids, mask in split:
        text = codec.decode(ids[:-1].tolist())
        scored = codec.decode(ids[mask == 1][:-1].tolist())  # the eos, scored, decodes as itself: left out
        n = text.count(" ") and int(text.split("count to ")[1].split("<|im_end|>")[0])
        counted = " ".join(str(i) for i in range(1, n + 1))
        assert scored == f"{counted}<|im_end|>\nyou are welcome<|im_end|>\n", scored
        assert mask[-1] == 1 and "be brief" in text and "thanks" in text


def test_the_template_runs_in_the_sandbox() -> None:
    hostile = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(DataError, match="SecurityError: access to attribute .__class__. of .str. object is unsafe"):
        ChatTemplate(hostile, where="evil").render([{"role": "user", "content": "x"}], False)
    refusing = ChatTemplate("{{ raise_exception('no system role') }}", where="strict")
    with pytest.raises(DataError, match="refused a conversation: no system role"):
        refusing.render([], False)
    with pytest.raises(DataError, match="not valid Jinja"):
        ChatTemplate("{% for %}", where="broken")
    clock = ChatTemplate("{% if strftime_now is defined %}{{ strftime_now('%Y') }}{% else %}fixed{% endif %}")
    assert clock.render([], False) == "fixed"  # nothing depends on the clock: the same bytes every run
    assert Rendered("ab", [(1, 2)]).spans == ((1, 2),) and isinstance(Rendered("ab"), str)


def test_bad_instruction_input_names_the_fix(chat_folder, tmp_path) -> None:  # noqa: ANN001
    def refused(records: list, match: str, tokenizer: str = "bytes", name: str = "in.jsonl") -> None:
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in records) if records else "x\n")
        with pytest.raises(DataError, match=match):
            prepare([path], tmp_path / "never", tokenizer=tokenizer, val_fraction=0.0, progress=False, instruct=True)
        assert not (tmp_path / "never").exists()

    refused([{"text": "plain"}], r"line 1 is not an instruction record .*Fix: \{\"prompt\"")
    refused(CHATS[:1], "holds chat messages, but the tokenizer has no chat template. Fix")
    refused([{"messages": [{"role": "user", "content": "hi"}]}], "no assistant turn", str(chat_folder))
    refused([{"messages": [{"role": "user", "content": 3}]}], "'content' must be text", str(chat_folder))
    refused([{"messages": []}], "non-empty list", str(chat_folder))
    refused([], r"not \.jsonl", name="notes.txt")
    unstable = tmp_path / "unstable"
    unstable.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (chat_folder / name).is_file():
            (unstable / name).write_bytes((chat_folder / name).read_bytes())
    config = json.loads((unstable / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (unstable / "tokenizer_config.json").write_text(json.dumps(config))
    (unstable / "chat_template.jinja").unlink(missing_ok=True)
    refused(CHATS[:1], "not prefix-stable", str(unstable))
