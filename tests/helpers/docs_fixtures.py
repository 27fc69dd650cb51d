"""The stand-ins of the docs test (``needs=`` in a page's marker, tests/helpers/docs.py): small versions of the
files a page says are the user's (a folder of text, a jsonl of documents or chats, a Hugging Face model folder
with its tokenizer and chat template, a run configuration), made from the Python standard library's own files
and transformers configs. Nothing is downloaded.
"""

from __future__ import annotations

import json
import shutil
import sysconfig
from collections.abc import Callable
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

STDLIB = Path(sysconfig.get_path("stdlib"))
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _texts(folder: Path, package: str) -> None:
    """A folder of text: one stdlib package's .py files (every machine with Python has them)."""
    shutil.copytree(STDLIB / package, folder, ignore=shutil.ignore_patterns("__pycache__", "test*"))


def _jsonl(path: Path, package: str) -> None:
    """A jsonl of ``{"text": ...}`` documents: one per .py file of a stdlib package."""
    files = sorted((STDLIB / package).glob("*.py"))
    path.write_text("".join(json.dumps({"text": file.read_text()}) + "\n" for file in files))


def _chats(path: Path) -> None:
    """A jsonl of chats (``{"messages": [...]}``): 100 conversations of about 100 tokens."""
    explain = "Adding counts one number on from the other: start at the first, step forward once per unit. "
    chats = [
        {
            "messages": [
                {"role": "system", "content": "You answer arithmetic questions and explain the answer."},
                {"role": "user", "content": f"What is {a} + {b}? Please explain how you got it."},
                {"role": "assistant", "content": f"{a} + {b} = {a + b}. {explain * 2}"},
            ]
        }
        for a in range(10)
        for b in range(10)
    ]
    path.write_text("".join(json.dumps(chat) + "\n" for chat in chats))


def _hf_model(folder: Path, kind: str) -> None:
    """A tiny save_pretrained causal LM (random weights) with a byte-level BPE tokenizer and a ChatML template."""
    import torch
    import transformers
    from transformers import PreTrainedTokenizerFast

    from plait.data.tokenizer import train_bpe

    texts = [file.read_text() for file in sorted((STDLIB / "json").glob("*.py"))]
    backend = train_bpe(iter(texts), 512).backend
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(folder)
    vocab = len(tokenizer)
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=vocab, n_positions=256)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=vocab,
            max_position_embeddings=256,
        )
        model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder)


def _hf_config(path: Path, family: str) -> None:
    """A published model's config.json as transformers' defaults give it (Mixtral-8x7B's), or BLOOM-176B's."""
    import transformers

    path.parent.mkdir(parents=True, exist_ok=True)
    if family == "mixtral":
        config = transformers.MixtralConfig()
    else:
        config = transformers.BloomConfig(hidden_size=14336, n_layer=70, n_head=112, vocab_size=250880)
    config.to_json_file(path)


FIXTURES: dict[str, Callable[[Path], None]] = {
    "notes.txt": lambda path: shutil.copy(STDLIB / "difflib.py", path),
    "notes/": lambda path: _texts(path, "email"),
    "my_texts/": lambda path: _texts(path, "email"),
    "my_code/": lambda path: _texts(path, "json"),
    "notes.jsonl": lambda path: _jsonl(path, "logging"),
    "web.jsonl": lambda path: _jsonl(path, "logging"),
    "books.jsonl": lambda path: _jsonl(path, "logging"),
    "chats.jsonl": _chats,
    "run.toml": lambda path: path.write_text(
        "[model]\nn_layer = 2\nn_head = 4\nd_model = 64\n\n[train]\nsteps = 100\n"
    ),
    "models/my-llama": lambda path: _hf_model(path, "llama"),
    "tests/helpers/certify_mutants.py": lambda path: shutil.copy(TESTS / "helpers" / "certify_mutants.py", path),
    "path/to/mixtral/config.json": lambda path: _hf_config(path, "mixtral"),
    "path/to/bloom/config.json": lambda path: _hf_config(path, "bloom"),
}
"""What ``needs=`` may name: files a page uses and says come from the user; small stand-ins made here."""
