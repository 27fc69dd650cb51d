"""``plait data prepare``: text, jsonl and parquet in; token files, document offsets, tokenizer and meta.json out.

The files hold exactly the documents' ids with an eos after each, in input order; the validation split holds whole
documents and does not depend on the worker count; every tokenizer kind (bytes, trained BPE, a tokenizer.json, a
save_pretrained folder) is recorded so that the folder decodes; bad input fails before anything is written, naming
the file (and line) and the fix; a corrupt or truncated folder is refused on open.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pytest

from plait.cli.main import main
from plait.data import prepare, sources
from plait.data.tokens import TokenDataset, TokenFolder
from plait.errors import DataError

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


def sentence(i: int, words: int = 12) -> str:
    return " ".join(WORDS[(i * 7 + k * k) % len(WORDS)] for k in range(words)) + f" {i}."


def write_corpus(folder: Path) -> list[str]:
    """A folder with a text file, a jsonl file (a blank line too) and a parquet file; returns the documents in the
    order prepare numbers them (files sorted by path)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    text = "\n".join(sentence(i) for i in range(5)) + "\nünïcödé ✓\n"
    (folder / "a.txt").write_text(text, encoding="utf-8")
    lines = [sentence(i) for i in range(10, 22)]
    (folder / "b.jsonl").write_text(
        "\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(lines[:6]))
        + "\n\n"
        + "\n".join(json.dumps({"text": t}) for t in lines[6:])
        + "\n"
    )
    rows = [sentence(i) for i in range(30, 40)]
    pq.write_table(pa.table({"text": rows, "n": list(range(10))}), folder / "c.parquet")
    (folder / "ignored.bin").write_bytes(b"\x00\x01")  # not an input suffix: a folder skips it
    return [text, *lines, *rows]


def read_split(folder: Path, split: str) -> list[list[int]]:
    """The documents of a split as id lists (eos included), read back through meta.json's dtype and offsets."""
    store = TokenFolder(folder)
    tokens, offsets = np.asarray(store.tokens(split)), np.asarray(store.offsets(split))
    return [tokens[offsets[d] : offsets[d + 1]].tolist() for d in range(len(offsets) - 1)]


def test_bytes_prepare_writes_every_document_once_with_eos_and_a_whole_document_split(tmp_path):
    documents = write_corpus(tmp_path / "in")
    meta = prepare([tmp_path / "in"], tmp_path / "out", tokenizer="bytes", val_fraction=0.3, progress=False)
    assert meta["documents"] == len(documents) == 1 + 12 + 10 and meta["dtype"] == "uint16"
    inputs = [json.loads(line) for line in (tmp_path / "out" / "inputs.jsonl").read_text().splitlines()]
    assert [entry["kind"] for entry in inputs] == ["text", "jsonl", "parquet"] and meta["inputs"]["files"] == 3
    assert [entry["documents"] for entry in inputs] == [1, 12, 10]
    expected = [list(doc.encode("utf-8")) + [256] for doc in documents]
    train, val = read_split(tmp_path / "out", "train"), read_split(tmp_path / "out", "val")
    assert 0 < len(val) < len(documents) and len(train) + len(val) == len(documents)
    assert sorted(train + val) == sorted(expected)  # every document once, whole, eos-terminated
    held = [doc in val for doc in expected]
    assert [d for d, h in zip(expected, held) if not h] == train  # input order kept within a split
    assert meta["splits"]["val"]["tokens"] == sum(map(len, val)) and meta["tokens"] == sum(map(len, expected))
    assert inputs[0]["sha256"] == sources.sha256_of(tmp_path / "in" / "a.txt")
    assert meta["inputs"]["sha256"] == hashlib.sha256("".join(e["sha256"] + "\n" for e in inputs).encode()).hexdigest()
    counts = np.bincount(np.concatenate([np.array(d) for d in train]), minlength=257)
    p = counts[counts > 0] / counts.sum()
    assert meta["unigram_entropy_nats"] == pytest.approx(float(-(p * np.log(p)).sum()))
    # the same split and bytes from two worker processes, and the val set does not depend on --val-fraction's
    # neighbours: a larger fraction holds out a superset
    meta2 = prepare([tmp_path / "in"], tmp_path / "out2", val_fraction=0.3, workers=2, progress=False)
    for name in ("train.bin", "train.idx", "val.bin", "val.idx"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "out2" / name).read_bytes(), name
    assert meta2["files"] == meta["files"]
    prepare([tmp_path / "in"], tmp_path / "out3", val_fraction=0.6, progress=False)
    assert all(doc in read_split(tmp_path / "out3", "val") for doc in val)


def test_bpe_is_trained_saved_and_decodes_with_a_progress_bar(tmp_path):
    from rich.console import Console

    write_corpus(tmp_path / "in")
    screen = io.StringIO()
    meta = prepare(
        [tmp_path / "in"],
        tmp_path / "out",
        tokenizer="bpe:300",
        val_fraction=0.2,
        console=Console(file=screen, force_terminal=True, width=120),
    )
    shown = screen.getvalue()
    assert "tokenize" in shown and "train BPE 300" in shown and "100%" in shown, shown[-500:]
    assert meta["tokenizer"]["kind"] == "bpe" and meta["tokenizer"]["file"] == "tokenizer.json"
    assert meta["vocab_size"] == 300 and meta["eos_id"] == 0 and "tokenizer.json" in meta["files"]
    dataset = TokenDataset(tmp_path / "out", seq_len=16)
    text = "gamma delta ünïcödé ✓ 42."
    assert dataset.decode(dataset.encode(text)) == text
    first_document = read_split(tmp_path / "out", "train")[0]
    assert first_document[-1] == dataset.eos_id and dataset.eos_id not in first_document[:-1]
    assert dataset.decode(first_document[:-1]).startswith(sentence(0))


def test_hugging_face_tokenizer_file_and_folder_are_used_offline(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "</s>": 1, **{word: i + 2 for i, word in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="[UNK]").save_pretrained(
        tmp_path / "hf"
    )
    (tmp_path / "in.jsonl").write_text(json.dumps({"body": "alpha beta"}) + "\n" + json.dumps({"body": "pi rho"}))
    for spec in (str(tmp_path / "tokenizer.json"), str(tmp_path / "hf")):
        out = tmp_path / ("out-" + Path(spec).name)
        meta = prepare([tmp_path / "in.jsonl"], out, tokenizer=spec, field="body", val_fraction=0.0, progress=False)
        assert meta["tokenizer"]["kind"] == "hf" and meta["eos_id"] == 1 and meta["vocab_size"] == len(vocab)
        assert read_split(out, "train") == [[2, 3, 1], [vocab["pi"], vocab["rho"], 1]]
        assert TokenFolder(out).codec.decode([2, 3]) == "alpha beta"


def test_a_vocabulary_above_65536_is_stored_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<eos>": 0, **{f"w{i}": i + 1 for i in range(70_000)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "big.json"))
    (tmp_path / "in.txt").write_text("w1 w65535 w65536 w69999")
    meta = prepare([tmp_path / "in.txt"], tmp_path / "out", tokenizer=str(tmp_path / "big.json"), eos="<eos>",
                   val_fraction=0.0, progress=False)  # fmt: skip
    assert meta["dtype"] == "uint32" and (tmp_path / "out" / "train.bin").stat().st_size == 5 * 4
    assert read_split(tmp_path / "out", "train") == [[2, 65536, 65537, 70000, 0]]


def test_a_big_text_file_is_cut_into_documents_at_line_ends(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "TEXT_DOCUMENT_BYTES", 100)
    text = "".join(sentence(i) + "\n" for i in range(20))
    (tmp_path / "big.txt").write_text(text)
    pieces = list(sources.iter_documents(sources.resolve_inputs([tmp_path / "big.txt"])[0]))
    assert "".join(pieces) == text and len(pieces) > 5
    assert all(piece.endswith("\n") and len(piece.encode()) < 100 + 120 for piece in pieces)
    (tmp_path / "one_line.txt").write_text("✓" * 1000)  # no line end at all; 3 bytes a character, cut mid-way
    pieces = list(sources.iter_documents(sources.resolve_inputs([tmp_path / "one_line.txt"])[0]))
    assert "".join(pieces) == "✓" * 1000 and len(pieces) == 30  # cut every 100 bytes, no character broken


# ------------------------------------------------------------------------------------------------ bad input
def _bad_inputs(tmp_path: Path) -> dict[str, tuple[list[str], dict, str]]:
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "ok.txt").write_text("one document\n")
    (tmp_path / "nofield.jsonl").write_text('{"text": "fine"}\n{"content": "no text field"}\n')
    (tmp_path / "notjson.jsonl").write_text('{"text": "fine"}\n\n{"text": oops}\n')
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["a", "b"]}), tmp_path / "other.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    ok, two = str(tmp_path / "ok.txt"), [str(tmp_path / "ok.txt"), str(tmp_path / "nofield.jsonl")]
    return {
        "missing": ([str(tmp_path / "nope.txt")], {}, r"nope.txt does not exist. Fix"),
        "empty file": ([str(tmp_path / "empty.txt")], {}, r"empty.txt'\] are empty. Fix"),
        "empty folder": ([str(tmp_path / "empty_dir")], {}, r"holds no input file.*Fix"),
        "no field": ([str(tmp_path / "nofield.jsonl")], {}, r"nofield.jsonl line 2 has no 'text' field.*Fix: --field"),
        "not json": ([str(tmp_path / "notjson.jsonl")], {}, r"notjson.jsonl line 3 is not JSON.*Fix"),
        "bad parquet": ([str(tmp_path / "broken.parquet")], {}, r"cannot read .*broken.parquet as parquet.*Fix"),
        "no column": ([str(tmp_path / "other.parquet")], {}, r"has no column 'text' \(columns: \['content'\]\)"),
        "not text": ([str(tmp_path / "ints.parquet")], {}, r"holds int64, not text. Fix"),
        "one document": ([ok], {"val_fraction": 0.1}, r"1 document; .*needs at least 2.*--val-fraction 0"),
        "bad tokenizer": ([ok], {"tokenizer": "gpt2"}, r"neither 'bytes', 'bpe:VOCAB'.*never downloads"),
        "tiny bpe": ([ok], {"tokenizer": "bpe:10"}, r"bpe:10.*\[257, .*Fix: e.g. --tokenizer bpe:8000"),
        "no eos": ([ok], {"tokenizer": str(tmp_path / "plain.json")}, r"cannot tell which token.*Fix: pass --eos"),
        "fraction": (two, {"val_fraction": 1.0}, r"--val-fraction 1.0 must be in \[0, 1\)"),
        "workers": (two, {"workers": 0}, r"--workers 0 must be at least 1"),
    }


def test_bad_input_is_refused_before_anything_is_written(tmp_path):
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tmp_path / "plain.json"))
    for name, (inputs, options, message) in _bad_inputs(tmp_path).items():
        out = tmp_path / f"out-{name.replace(' ', '-')}"
        with pytest.raises(DataError, match=message):
            prepare(inputs, out, progress=False, **{"val_fraction": 0.0, **options})
        assert not out.exists(), name  # nothing written: the checks come before any work


def test_prepared_folder_is_not_overwritten_by_accident(tmp_path):
    write_corpus(tmp_path / "in")
    prepare([tmp_path / "in"], tmp_path / "out", progress=False)
    with pytest.raises(DataError, match="already holds prepared data. Fix: --overwrite"):
        prepare([tmp_path / "in"], tmp_path / "out", progress=False)
    prepare([tmp_path / "in"], tmp_path / "out", progress=False, overwrite=True, val_fraction=0.5)
    assert TokenFolder(tmp_path / "out").meta["val_fraction"] == 0.5


def test_corrupt_or_truncated_folders_are_refused_on_open(tmp_path):
    write_corpus(tmp_path / "in")
    out = tmp_path / "out"
    prepare([tmp_path / "in"], out, val_fraction=0.3, progress=False)
    meta = json.loads((out / "meta.json").read_text())
    original = (out / "train.bin").read_bytes()

    (out / "train.bin").write_bytes(original[:-2])  # truncated: sizes are always checked
    with pytest.raises(
        DataError, match=r"train.bin has .* bytes but meta.json says .*truncated.*Fix: prepare it again"
    ):
        TokenDataset(out, seq_len=8)
    flipped = bytearray(original)
    flipped[10] ^= 1
    (out / "train.bin").write_bytes(bytes(flipped))  # same size, one bit: the sha256 catches it (cheap folder)
    with pytest.raises(DataError, match=r"does not match the sha256 in meta.json"):
        TokenDataset(out, seq_len=8)
    (out / "train.bin").write_bytes(original)
    TokenDataset(out, seq_len=8, verify=True)  # intact again

    hostile = {**meta, "files": {**meta["files"], "../../etc/passwd": {"bytes": 1, "sha256": "0"}}}
    (out / "meta.json").write_text(json.dumps(hostile))
    with pytest.raises(DataError, match="not a plain file name"):
        TokenFolder(out)
    (out / "meta.json").write_text(json.dumps({**meta, "version": 99}))
    with pytest.raises(DataError, match="version 99.*Fix: prepare it again"):
        TokenFolder(out)
    (out / "meta.json").write_text("{not json")
    with pytest.raises(DataError, match="is not valid JSON"):
        TokenFolder(out)
    (out / "meta.json").unlink()
    with pytest.raises(DataError, match="holds no meta.json.*Fix: plait data prepare"):
        TokenFolder(out)
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="fewer than data.seq_len \\+ 1.*larger --val-fraction"):
        TokenDataset(out, seq_len=10**6, split="val")


def test_cli_prepare_and_info(tmp_path, capsys):
    write_corpus(tmp_path / "in")
    args = ["data", "prepare", str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--val-fraction", "0.2"]
    assert main(args) == 0
    shown = capsys.readouterr().out
    assert "23 documents" in shown and "tokenizer bytes" in shown and "data.name=tokens" in shown
    assert main(["data", "info", str(tmp_path / "out"), "--verify"]) == 0
    assert main(args) == 2
    assert "DataError" in capsys.readouterr().err
    assert (
        main(["data", "prepare", str(tmp_path / "in" / "b.jsonl"), "--field", "body", "--out", str(tmp_path / "x")])
        == 2
    )
    assert "b.jsonl line 1 has no 'body' field" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
