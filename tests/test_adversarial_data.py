"""Hostile and careless inputs on the data, tokenizer and configuration surface (issue 30; docs/security.md).

Each case asserts what docs/security.md promises: nothing of the user's is lost (their files byte-identical after),
nothing from a folder runs (the sentinel a payload would create never appears), and the refusal is one line (a
``plait.errors`` exception, or one ``plait: error:`` line on stderr with a non-zero exit) naming the problem and
the fix. Programs run as subprocesses where stdin, the exit code or a memory limit matter; in process elsewhere.
"""

from __future__ import annotations

import errno
import importlib
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.full_disk import failing_open

import plait
from plait.cli.main import main
from plait.data import ByteTextDataset, TokenDataset, prepare
from plait.errors import ConfigError, DataError, PlaitError
from plait.train.config import load_config

pytestmark = [pytest.mark.adversarial]
ROOT = Path(plait.__file__).resolve().parent.parent
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    "CUDA_VISIBLE_DEVICES": "",  # CPU ranks: the cases are about the host (and a memory limit breaks CUDA's start)
}
TINY_RUN = ["--nproc", "1", "--set", "train.steps=2", "--set", "train.samples=0", "--set", "train.eval_every=0"]


def run_plait(*args: str, stdin: str | None = None, memory_gib: int | None = None) -> subprocess.CompletedProcess:
    """``python -m plait ARGS`` with ``stdin`` (None: closed) and, optionally, an address-space limit (a run
    that allocates past it fails there instead of exhausting the machine)."""

    def limit() -> None:
        if memory_gib:
            resource.setrlimit(resource.RLIMIT_AS, (memory_gib << 30, memory_gib << 30))

    return subprocess.run(
        [sys.executable, "-m", "plait", *args],
        input=stdin if stdin is not None else None,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=240,
        preexec_fn=limit,
    )


def refused(result: subprocess.CompletedProcess, *words: str) -> str:
    """The one ``plait: error:`` line of a refused command (exit 2, no traceback), checked for ``words`` and a fix."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and lines, (result.returncode, result.stderr[-3000:])
    assert lines[-1].startswith("plait: error:") and "Traceback" not in result.stderr, result.stderr[-3000:]
    error_lines = [line for line in lines if line.startswith("plait: error:")]
    assert len(error_lines) == 1 and "Fix" in lines[-1], result.stderr[-3000:]
    assert all(word in lines[-1] for word in words), (words, lines[-1])
    return lines[-1]


def one_line(error: pytest.ExceptionInfo, *words: str) -> None:
    message = str(error.value)
    assert isinstance(error.value, PlaitError) and "\n" not in message and "Fix" in message, message
    assert all(word in message for word in words), (words, message)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def write_docs(folder: Path, count: int = 12) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps({"text": f"document {i}: the quick brown fox jumps over the lazy dog {i}."}) for i in range(count)
    ]
    (folder / "docs.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "docs.jsonl"


# ------------------------------------------------------------------------------------ 2: no code from a folder
def hostile_folder(root: Path, sentinel: Path, config_file: str) -> Path:
    """A tokenizer folder whose ``config_file`` maps AutoTokenizer to its own evil.py (which creates ``sentinel``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = root / "hostile-tokenizer"
    folder.mkdir()
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel()
    backend.add_special_tokens(["<|endoftext|>"])
    backend.save(str(folder / "tokenizer.json"))
    (folder / "evil.py").write_text(
        f"import pathlib\npathlib.Path({str(sentinel)!r}).write_text('ran')\n"
        "from transformers import PreTrainedTokenizerFast\nclass EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    auto_map = {"AutoTokenizer": [None, "evil.EvilTokenizer"], "AutoConfig": "evil.EvilConfig"}
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    fields = {"auto_map": auto_map, "tokenizer_class": "EvilTokenizer"}
    if config_file == "config.json":
        fields["model_type"] = "evil"
    (folder / config_file).write_text(json.dumps({"eos_token": "<|endoftext|>", **fields}))
    return folder


@pytest.mark.parametrize(("config_file", "stdin"), [("tokenizer_config.json", "y\n"), ("config.json", None)])
def test_a_tokenizer_folder_asking_for_its_own_code_runs_nothing(tmp_path, config_file, stdin):
    sentinel = tmp_path / "sentinel"
    folder = hostile_folder(tmp_path, sentinel, config_file)
    before = snapshot(folder)
    docs = write_docs(tmp_path / "in")
    result = run_plait(
        "data", "prepare", str(docs), "--out", str(tmp_path / "out"), "--tokenizer", str(folder), stdin=stdin
    )
    refused(result, config_file, "auto_map", "never runs code")
    assert not sentinel.exists() and not (tmp_path / "out").exists() and snapshot(folder) == before


def test_tokenizer_folders_are_read_without_remote_code_or_downloads(tmp_path, monkeypatch):
    import transformers

    seen: dict = {}

    def spy(path, **options):
        seen.update(options)
        raise OSError("stop here")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    (tmp_path / "tok").mkdir()
    with pytest.raises(DataError):
        prepare([write_docs(tmp_path / "in")], tmp_path / "out", tokenizer=str(tmp_path / "tok"), progress=False)
    assert seen.get("trust_remote_code") is False and seen.get("local_files_only") is True


@pytest.mark.parametrize("key", ["hf_config", "hf"])
def test_a_model_config_asking_for_its_own_code_is_refused(tmp_path, key):
    from plait.models.build import build_model, check_model_section

    folder = tmp_path / "model"
    folder.mkdir()
    config = {"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2, "vocab_size": 12, "n_positions": 16}
    config["auto_map"] = {"AutoModelForCausalLM": "evil.EvilModel"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"")  # never read: the config is refused first
    for call in (check_model_section, build_model):
        with pytest.raises(ConfigError) as error:
            call({key: str(folder)}, 12, 8)
        one_line(error, "config.json", "auto_map", "never runs code")


# ------------------------------------------------------------------------------- 4 and 15: prepare loses nothing
def test_prepare_never_overwrites_a_folder_plait_did_not_write(tmp_path):
    docs = write_docs(tmp_path / "in")
    out = tmp_path / "mine"
    out.mkdir()
    for name, data in {
        "tokenizer.json": b"{my tokenizer}",
        "inputs.jsonl": b"my inputs\n",
        "train.bin": b"\x01\x02",
    }.items():
        (out / name).write_bytes(data)
    before = snapshot(out)
    for extra in ([], ["--overwrite"]):
        result = run_plait("data", "prepare", str(docs), "--out", str(out), *extra)
        refused(result, "plait did not write", "new or empty folder")
        assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "mine"]  # no staging folder left either


def test_overwrite_replaces_only_plaits_own_files(tmp_path):
    docs = write_docs(tmp_path / "in")
    out = tmp_path / "out"
    out.mkdir()  # an empty folder is taken as it is, through a link too
    (tmp_path / "link").symlink_to(out)
    prepare([docs], tmp_path / "link", val_fraction=0.2, progress=False)
    assert (tmp_path / "link").is_symlink() and (out / "meta.json").is_file()
    (out / "notes.txt").write_text("the user's notes")
    with pytest.raises(DataError) as error:
        prepare([docs], out, progress=False)
    one_line(error, "already holds prepared data", "--overwrite")
    meta = prepare([docs], out, val_fraction=0.5, overwrite=True, progress=False)
    assert (out / "notes.txt").read_text() == "the user's notes" and meta["val_fraction"] == 0.5
    assert TokenDataset(out, seq_len=8).folder.meta["val_fraction"] == 0.5
    (out / "tokenizer.json").write_text("the user's own tokenizer")  # a plait name that meta.json does not list
    with pytest.raises(DataError) as error:
        prepare([docs], out, overwrite=True, progress=False)
    one_line(error, "tokenizer.json", "not plait's")
    assert (out / "tokenizer.json").read_text() == "the user's own tokenizer"


def test_an_interrupted_prepare_leaves_the_folder_as_it_was(tmp_path, monkeypatch):
    preparing = importlib.import_module("plait.data.prepare")  # the module: plait.data.prepare is also a function
    docs = write_docs(tmp_path / "in")
    out = tmp_path / "out"
    prepare([docs], out, val_fraction=0.2, progress=False)
    before = snapshot(out)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(preparing, "_tokenize", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare([docs], out, tokenizer="bpe:300", overwrite=True, progress=False)
    assert snapshot(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["in", "out"]
    TokenDataset(out, seq_len=8)  # still complete and intact


def test_out_must_not_be_or_hold_an_input(tmp_path):
    docs = write_docs(tmp_path / "corpus")
    first = run_plait("data", "prepare", str(tmp_path / "corpus"), "--out", str(tmp_path / "corpus" / "tokens"))
    refused(first, "inside the input folder", "outside")
    prepare([docs], tmp_path / "tokens", val_fraction=0.2, progress=False)
    before = snapshot(tmp_path / "tokens")
    with pytest.raises(DataError) as error:
        prepare([tmp_path / "tokens" / "inputs.jsonl"], tmp_path / "tokens", overwrite=True, progress=False)
    one_line(error, "lies inside --out")
    assert snapshot(tmp_path / "tokens") == before and not (tmp_path / "corpus" / "tokens").exists()


@pytest.mark.parametrize("where", ["file", "under a file"])
def test_out_naming_a_file_is_one_line(tmp_path, capsys, where):
    docs = write_docs(tmp_path / "in")
    target = docs if where == "file" else docs / "sub"
    assert main(["data", "prepare", str(docs), "--out", str(target)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is a file" in err and "Fix" in err, err
    assert docs.read_text().startswith('{"text"')


# -------------------------------------------------------------------------------------------- 10: BPE stall
def test_bpe_on_text_without_whitespace_trains_in_bounded_time_with_progress(tmp_path):
    """Bounded work, asserted as work (not seconds, which a busy machine stretches): the trainer's pieces of a 1 MB
    line are cut to 64 symbols, so it counts pairs in pieces of 64 (uncut: one piece of 10^6 symbols, 463 s)."""
    import io

    from rich.console import Console

    letters = np.random.default_rng(0).integers(ord("a"), ord("z") + 1, 1_000_000, dtype=np.uint8).tobytes()
    (tmp_path / "line.txt").write_bytes(letters)  # one line: one 1 MB "word" to GPT-2's pre-tokenizer alone
    screen = io.StringIO()
    prepare([tmp_path / "line.txt"], tmp_path / "out", tokenizer="bpe:1000", val_fraction=0.0,
            console=Console(file=screen, force_terminal=True, width=150))  # fmt: skip
    assert "train BPE 1000: read" in screen.getvalue() and "train BPE 1000: merges" in screen.getvalue()
    dataset = TokenDataset(tmp_path / "out", seq_len=16)
    pieces = dataset.tokenizer.tokenizer.backend.pre_tokenizer.pre_tokenize_str(letters.decode())
    assert max(len(piece) for piece, _ in pieces) == 64  # plait.data.tokenizer.MAX_PIECE
    assert len(pieces) == -(-len(letters) // 64)  # every piece but the last is full: the line was cut, not split
    assert dataset.decode(dataset.encode(letters[:5000].decode())) == letters[:5000].decode()


# ---------------------------------------------------------------------------- 12: non-finite hyper-parameters
@pytest.mark.parametrize(
    "override",
    ["train.lr=inf", "train.lr=nan", "train.weight_decay=inf", "train.betas=[0.9, nan]", "train.eps=inf",
     "train.max_grad_norm=-1", "train.max_grad_norm=inf", "train.min_lr=nan", "train.sample_temperature=inf",
     "train.momentum=nan", "data.corpus_mb=inf", "data.seq_len=0", "data.digits=0"],
)  # fmt: skip
def test_non_finite_and_out_of_range_settings_are_refused(override):
    with pytest.raises(ConfigError) as error:
        load_config(None, [override])
    one_line(error, override.split("=")[0])


def test_lr_inf_is_refused_by_plait_train(tmp_path):
    result = run_plait("train", *TINY_RUN, "--out", str(tmp_path / "run"), "--set", "train.lr=inf")
    refused(result, "train.lr=inf", "finite")
    assert not (tmp_path / "run").exists()


def strict_json(text: str):
    def refuse(constant: str):
        raise ValueError(f"bare {constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_a_diverging_run_stops_with_an_error_and_writes_strict_json(tmp_path):
    out = tmp_path / "run"
    result = run_plait("train", *TINY_RUN, "--out", str(out), "--set", "train.lr=1e6", "--set", "train.steps=20")
    refused(result, "training diverged", "train.lr")
    records = [strict_json(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) < 20 and None in (records[-1]["loss"], records[-1]["grad_norm"])


def test_summary_json_is_strict_json_when_no_step_ran(tmp_path):
    out = tmp_path / "run"
    first = run_plait("train", *TINY_RUN, "--out", str(out), "--set", "train.save_every=2")
    assert first.returncode == 0, first.stderr[-2000:]
    again = run_plait("train", *TINY_RUN, "--out", str(out), "--set", "train.save_every=2")  # resumes at the end
    assert again.returncode == 0, again.stderr[-2000:]
    summary = strict_json((out / "summary.json").read_text())
    assert summary["final_loss"] is None and summary["steps"] == 2
    for line in (out / "metrics.jsonl").read_text().splitlines():
        strict_json(line)


# ------------------------------------------------------------------------------------- 13: absurd sizes
def hf_config_file(tmp_path: Path, layers: int) -> str:
    fields = {"model_type": "gpt2", "n_layer": layers, "n_embd": 1024, "n_head": 16, "vocab_size": 50257}
    (tmp_path / "config.json").write_text(json.dumps({**fields, "n_positions": 1024}))
    return str(tmp_path / "config.json")


@pytest.mark.parametrize(
    ("nproc", "override", "words"),
    [
        ("1", "model.n_layer=100000", "M parameters"),
        ("1", "train.global_batch=100000000", "micro-batch 100000000"),
        ("2", "model.n_layer=100000", "for the 2 ranks"),
        ("1", "model.hf_config=CONFIG", "M parameters"),
    ],
)
def test_sizes_that_cannot_fit_are_refused_before_allocation(tmp_path, nproc, override, words):
    override = override.replace("CONFIG", hf_config_file(tmp_path, 20000))
    args = ["train", *TINY_RUN, "--nproc", nproc, "--out", str(tmp_path / "run"), "--set", override]
    result = run_plait(*args, memory_gib=8)  # before the check: a MemoryError traceback at 8 GiB, not a refusal
    refused(result, "GiB per rank", "host RAM is", words)


def test_on_a_gpu_the_estimate_is_compared_with_its_memory(monkeypatch):
    import torch

    from plait.train import fits

    config = load_config(None, ["model.n_layer=100000"])
    layout = config.layout.resolve(1)
    monkeypatch.setattr(fits, "available", lambda device, ranks: (80 * fits.GIB, 1, "NVIDIA H100's memory"))
    with pytest.raises(ConfigError) as error:
        fits.check_memory(config, layout, 12, 8, torch.device("cuda", 0), 1)
    one_line(error, "GiB per rank", "NVIDIA H100's memory is 80.0 GiB")
    fits.check_memory(load_config(None, []), layout, 12, 8, torch.device("cuda", 0), 1)  # the tiny default fits


def test_a_global_batch_larger_than_the_data_is_refused(tmp_path):
    out = tmp_path / "tokens"
    prepare([write_docs(tmp_path / "in")], out, val_fraction=0.2, progress=False)
    overrides = ["data.name=tokens", f"data.path={json.dumps(str(out))}", "data.seq_len=16", "train.global_batch=4096"]
    from plait.train.fits import check_batch_fits_data

    config = load_config(None, overrides)
    dataset = TokenDataset(out, seq_len=16)
    with pytest.raises(ConfigError) as error:
        check_batch_fits_data(config.train.global_batch, dataset, str(out))
    one_line(error, "train.global_batch=4096", f"{dataset.num_windows} samples")


# ---------------------------------------------------------------------------------- 14: one-line errors
def test_deeply_nested_jsonl_is_one_line(tmp_path):
    (tmp_path / "deep.jsonl").write_text('{"text": "fine"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(DataError) as error:
        prepare([tmp_path / "deep.jsonl"], tmp_path / "out", val_fraction=0.0, progress=False)
    one_line(error, "deep.jsonl line 2", "nests")
    assert not (tmp_path / "out").exists()


@pytest.fixture
def prepared(tmp_path) -> Path:
    out = tmp_path / "tokens"
    prepare([write_docs(tmp_path / "in", 30)], out, val_fraction=0.2, progress=False)
    return out


@pytest.mark.parametrize(
    ("lie", "words"),
    [
        ({"vocab_size": 100, "eos_id": 50}, "holds token id"),
        ({"eos_id": 4000}, "eos_id 4000"),
        ({"vocab_size": 70000, "eos_id": 256}, "vocab_size 70000"),
        ({"vocab_size": -3}, "vocab_size -3"),
    ],
)
def test_a_meta_json_lying_about_the_vocabulary_is_refused(prepared, lie, words):
    meta = json.loads((prepared / "meta.json").read_text())
    (prepared / "meta.json").write_text(json.dumps({**meta, **lie}))
    with pytest.raises(DataError) as error:
        TokenDataset(prepared, seq_len=8)
    one_line(error, words, "prepare it again")


def test_ids_beyond_the_vocabulary_are_refused_per_batch_in_large_folders(prepared, monkeypatch):
    import plait.data.tokens as tokens

    meta = json.loads((prepared / "meta.json").read_text())
    (prepared / "meta.json").write_text(json.dumps({**meta, "vocab_size": 100, "eos_id": 50}))
    monkeypatch.setattr(tokens, "CHEAP_VERIFY_BYTES", 0)  # a large folder: opened without reading every id
    dataset = TokenDataset(prepared, seq_len=8)
    with pytest.raises(DataError) as error:
        dataset.batch(range(dataset.num_windows))
    one_line(error, "holds token id", "100 ids")


def test_a_meta_json_lying_about_the_dtype_is_refused(prepared):
    """A consistent lie: uint16 files declared uint32 (padded to whole uint32 ids, sizes, counts and sha256
    rewritten to match), so only the ids betray it."""
    import hashlib

    meta = json.loads((prepared / "meta.json").read_text())
    for split in meta["splits"].values():
        path = prepared / split["bin"]
        data = path.read_bytes()
        data += b"\0" * (-len(data) % 4)
        path.write_bytes(data)
        split["tokens"] = len(data) // 4
        meta["files"][split["bin"]] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (prepared / "meta.json").write_text(json.dumps({**meta, "dtype": "uint32"}))
    with pytest.raises(DataError) as error:
        TokenDataset(prepared, seq_len=8)
    one_line(error, "holds token id", "prepare it again")


def test_a_binary_or_malformed_config_is_one_line(tmp_path):
    (tmp_path / "binary.toml").write_bytes(bytes(range(256)) * 8)
    result = run_plait("train", "--config", str(tmp_path / "binary.toml"), *TINY_RUN, "--out", str(tmp_path / "run"))
    refused(result, "binary.toml", "not a text file")
    (tmp_path / "flat.toml").write_text("layout = 5\n")
    with pytest.raises(ConfigError) as error:
        load_config(tmp_path / "flat.toml")
    one_line(error, "outside a section")
    (tmp_path / "deep.toml").write_text("a = " + "[" * 50_000 + "]" * 50_000 + "\n")
    with pytest.raises(ConfigError) as error:
        load_config(tmp_path / "deep.toml")
    one_line(error, "not valid TOML")


def test_seq_len_is_checked_for_the_addition_task_too():
    with pytest.raises(ConfigError) as error:
        load_config(None, ["data.name=addition", "data.seq_len=0"])
    one_line(error, "data.seq_len=0")


def test_the_planners_model_config_reader_is_one_line_on_hostile_files(tmp_path):
    """``plait plan --model config.json`` (``from_hf_config``): not UTF-8, nested past the recursion limit, a FIFO
    (which would block an open), missing: one ConfigError each, no traceback, no hang."""
    from plait.planner.hf_config import from_hf_config

    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe{}")
    nested = tmp_path / "nested.json"
    nested.write_text("[" * 100_000 + "]" * 100_000)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for path, reason in (
        (binary, "not UTF-8"),
        (nested, "nested too deeply"),
        (fifo, "FIFO"),
        (tmp_path / "no.json", "does not exist"),
    ):
        with pytest.raises(ConfigError, match="Fix") as caught:
            from_hf_config(path)
        assert reason.lower() in str(caught.value).lower() and "\n" not in str(caught.value), str(caught.value)


# ------------------------------------------------------------ issue 39 N8: a full disk during prepare
@pytest.mark.parametrize(
    ("code", "words"),
    [
        (errno.ENOSPC, "no space left on device at"),
        (errno.EDQUOT, "no space left on device at"),
        (errno.EROFS, "Read-only file system"),
        (errno.EACCES, "Permission denied"),
    ],
)
def test_a_full_disk_during_prepare_is_one_line_and_loses_nothing(tmp_path, monkeypatch, capsys, code, words):
    preparing = importlib.import_module("plait.data.prepare")
    docs = write_docs(tmp_path / "in")
    out = tmp_path / "out"
    prepare([docs], out, val_fraction=0.2, progress=False)
    before = snapshot(out)
    monkeypatch.setattr(preparing, "open", failing_open(code, room=100), raising=False)
    assert main(["data", "prepare", str(docs), "--out", str(out), "--overwrite"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("plait: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert words in lines[0] and str(tmp_path) in lines[0] and "Fix" in lines[0], lines
    assert snapshot(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["in", "out"]


# ------------------------------------------------------- issue 39 N11: a missing or short bytes file
@pytest.mark.parametrize(("content", "words"), [(None, "does not exist"), (b"too short", "has 9 bytes")])
def test_a_missing_or_short_bytes_file_is_one_line_before_any_work(tmp_path, capsys, content, words):
    text = tmp_path / "notes.txt"
    if content is not None:
        text.write_bytes(content)
    overrides = ["data.name=bytes", f'data.path="{text}"']
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    one_line(error, words, "data.path")
    with pytest.raises(DataError) as error:
        ByteTextDataset(text, seq_len=64)
    one_line(error, words)
    argv = ["train", "--nproc", "1", "--out", str(tmp_path / "run")]
    assert main([*argv, "--set", overrides[0], "--set", overrides[1]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0] and "Fix" in err[0], err
    assert not (tmp_path / "run").exists()
