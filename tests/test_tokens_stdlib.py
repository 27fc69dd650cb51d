"""The embedded real corpus: the Python standard library's source, prepared on first use and cached, and the
``stdlib-lm`` preset learning it: its held-out loss falls below the unigram entropy of the corpus (the loss of the
best model that ignores context), i.e. the model uses context within a minute on 2 cores. The run is the preset
made small (1 MB of the corpus, a 512-token BPE, a 2-layer d=64 GPT, 80 steps); the full preset's curve is in
docs/data.md."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from plait.cli.main import main
from plait.data.stdlib_corpus import EXCLUDED_DIRS, ensure_stdlib_tokens, stdlib_files, stdlib_root
from plait.data.tokens import TokenFolder
from plait.train.config import load_config
from plait.train.presets import PRESETS, preset


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """H = -sum_i p_i log p_i (nats) of the token frequencies: the cross-entropy of the best context-free model."""
    counts = np.bincount(tokens.astype(np.int64), minlength=vocab_size)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def test_the_corpus_is_the_stdlib_source_without_tests(tmp_path):
    files = stdlib_files()
    root = stdlib_root()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert not any(EXCLUDED_DIRS.intersection(f.relative_to(root).parts[:-1]) for f in files)
    assert (root / "json" / "decoder.py") in files and files == sorted(files)
    assert sum(f.stat().st_size for f in stdlib_files(max_bytes=200_000)) >= 200_000


def test_stdlib_preset_beats_the_unigram_entropy_and_caches_the_corpus(tmp_path, monkeypatch, capsys):
    from plait.train.loop import run

    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "cache"))
    small = [
        "data.corpus_mb=1",
        "data.vocab=512",
        "data.seq_len=64",
        "model.n_layer=2",
        "model.d_model=64",
        "train.steps=80",
        "train.global_batch=16",
        "train.eval_every=40",
        "train.eval_batches=4",
        "train.save_every=80",  # the preset saves at 300 and 600; here the last step
        f"train.out={json.dumps(str(tmp_path / 'run'))}",
    ]
    config = load_config(None, small, preset="stdlib-lm")
    assert (
        config.data.name == "stdlib"
        and config.layout.dp == -1
        and config.train.lr == PRESETS["stdlib-lm"]["train"]["lr"]
    )
    summary = run(config)
    folder = TokenFolder(tmp_path / "cache" / "data" / "stdlib-bpe512-1mb")
    entropy = unigram_entropy(np.asarray(folder.tokens("train")), folder.vocab_size)
    assert folder.meta["unigram_entropy_nats"] == pytest.approx(entropy)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["split"] for r in evals] == ["val", "val"] and evals[-1]["perplexity"] == pytest.approx(
        math.exp(summary.eval_loss)
    )
    assert evals[0]["loss"] > evals[-1]["loss"] == pytest.approx(summary.eval_loss)
    assert summary.eval_loss < entropy - 0.2, (summary.eval_loss, entropy)  # it uses context, on held-out files
    prompt = ["generate", str(tmp_path / "run"), "--prompt", "def parse(", "--max-new-tokens", "20", "--seed", "1"]
    assert main(prompt) == 0  # README's chain: the preset's run folder -> plait generate, with the corpus's tokenizer
    text = capsys.readouterr().out
    assert text.strip() and main(prompt) == 0 and capsys.readouterr().out == text  # the same seed, the same text
    corpus = folder.meta["corpus"]
    assert (
        corpus["python"] and corpus["files"] == len(stdlib_files(max_bytes=1_000_000)) and len(corpus["sha256"]) == 64
    )

    meta_file = folder.path / "meta.json"
    written = meta_file.stat().st_mtime_ns
    assert ensure_stdlib_tokens(512, 1.0) == folder.path and meta_file.stat().st_mtime_ns == written  # reused
    stale = json.loads(meta_file.read_text())
    stale["corpus"]["sha256"] = "another python"
    meta_file.write_text(json.dumps(stale))
    ensure_stdlib_tokens(512, 1.0)  # a different corpus (another Python): prepared again
    assert json.loads(meta_file.read_text())["corpus"]["sha256"] == corpus["sha256"]


def test_unknown_preset_names_the_presets():
    from plait.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--preset 'gpt5' is unknown. Fix: use one of \['stdlib-lm', 'stdlib-moe'\]"):
        preset("gpt5")
    assert load_config(None, ["train.steps=7"], preset="stdlib-lm").train.steps == 7  # --set applies on top
