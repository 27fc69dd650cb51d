"""Weighted mixtures of token folders (issue 27, ``plait.data.mixture``): per-source token shares follow the
weights over every stretch of the stream (far inside sampling error), the stream is deterministic in (seed, step,
rank), resumes exactly at any step (also through a real run's checkpoint, with ``tokens_by_source`` in
metrics.jsonl), reshards to another dp size, keeps each source's epochs, evaluates each source's held-out split,
and refuses folders with different tokenizers or a malformed ``[data] sources`` with the fix.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.runs import straight_and_resumed

from plait.data import MixtureDataset, ShardedBatches, make_dataset, prepare
from plait.errors import ConfigError, DataError
from plait.train.config import DataConfig, load_config

LETTERS = {"web": "w", "code": "c", "books": "b"}


def make_folder(root: Path, name: str, documents: int, tokenizer: str = "bytes", letter: str = "") -> Path:
    """A folder whose text is one letter (so a token tells its source), documents of uneven lengths."""
    letter = letter or LETTERS.get(name, "x")
    lines = [json.dumps({"text": letter * (5 + (7 * i) % 23)}) for i in range(documents)]
    (root / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    prepare([root / f"{name}.jsonl"], root / name, tokenizer=tokenizer, val_fraction=0.2, progress=False)
    return root / name


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:  # noqa: ANN001
    root = tmp_path_factory.mktemp("mixture")
    return {name: make_folder(root, name, count) for name, count in (("web", 120), ("code", 40), ("books", 30))}


def sources(folders: dict[str, Path], weights: dict[str, float]) -> list[dict]:
    return [{"path": str(folders[name]), "weight": weight} for name, weight in weights.items()]


def source_of(row: torch.Tensor) -> str:
    """The source of a window of tokens: its letter (eos, 256, aside)."""
    letters = {chr(int(t)) for t in row.tolist() if t < 256}
    assert len(letters) == 1, letters
    return {letter: name for name, letter in LETTERS.items()}[letters.pop()]


WEIGHTS = {"web": 0.5, "code": 0.3, "books": 0.2}


def test_token_shares_follow_the_weights_over_every_stretch(folders) -> None:  # noqa: ANN001
    """By the content of the batches: each source's share of the tokens of the first n samples is within K/n of
    its weight (sampling independently would miss by ~sqrt(w (1-w) / n)), and ``tokens_seen`` counts the same."""
    mixture = MixtureDataset(sources(folders, WEIGHTS), seq_len=8, seed=3)
    assert mixture.vocab_size == 257 and [s["name"] for s in mixture.sources] == ["web", "code", "books"]
    loader = ShardedBatches(mixture, global_batch=16)
    seen = {name: 0 for name in WEIGHTS}
    for step in range(40):
        inputs, targets = loader.batch_at(step)
        for row in inputs:
            seen[source_of(row)] += row.numel()
        samples = (step + 1) * 16
        assert seen == mixture.tokens_seen(samples), step
        for name, weight in WEIGHTS.items():
            assert abs(seen[name] / (samples * 8) - weight) <= len(WEIGHTS) / samples, (step, name)
    counts = mixture.counts(10**12 + 7)  # exact integer arithmetic far along the stream
    assert sum(counts) == 10**12 + 7 and all(abs(c - 1e12 * w) <= 3 for c, w in zip(counts, WEIGHTS.values()))


def test_each_source_keeps_its_own_epochs(folders) -> None:  # noqa: ANN001
    """Source k's j-th sample is its TokenDataset's sample j: over the source's epoch, every window once."""
    mixture = MixtureDataset(sources(folders, WEIGHTS), seq_len=8, seed=3)
    picks = [mixture.assign(i) for i in range(2000)]
    for number, dataset in enumerate(mixture.datasets):
        own = [j for source, j in picks if source == number]
        assert own == list(range(len(own)))  # the source's own samples, in order
        epoch = min(len(own), dataset.num_windows)
        windows = dataset.windows(own[:epoch]).tolist()
        assert len(set(windows)) == epoch
    seeds = {dataset.seed for dataset in mixture.datasets}
    assert len(seeds) == 3  # sources shuffle independently


def test_deterministic_resumable_and_reshardable(folders) -> None:  # noqa: ANN001
    weights = {"web": 2.0, "code": 1.0}  # weights are normalised
    opened = lambda: MixtureDataset(sources(folders, weights), seq_len=8, seed=11)  # noqa: E731
    whole = ShardedBatches(opened(), global_batch=8)
    uninterrupted = [whole.batch_at(step) for step in range(30)]
    for dp in (2, 4):  # another dp size: the ranks' rows are the global batch's, in order
        for step in (0, 13, 29):
            pieces = [ShardedBatches(opened(), 8, rank, dp).batch_at(step) for rank in range(dp)]
            assert torch.equal(torch.cat([p[0] for p in pieces]), uninterrupted[step][0])
            assert torch.equal(torch.cat([p[1] for p in pieces]), uninterrupted[step][1])
    for start in (0, 7, 22):  # a fresh process resuming at step `start`
        resumed = ShardedBatches(opened(), 8, dp_rank=0, dp_size=1, start_step=start)
        for expected, got in zip(uninterrupted[start:], resumed):
            assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])
    other = MixtureDataset(sources(folders, weights), seq_len=8, seed=12)
    assert not torch.equal(ShardedBatches(other, 8).batch_at(0)[0], uninterrupted[0][0])  # the seed matters


def test_documents_and_validation_per_source(folders) -> None:  # noqa: ANN001
    mixture = MixtureDataset(sources(folders, WEIGHTS), seq_len=8, seed=1, attention="document", eod_mask_loss=True)
    (tokens, positions), targets = mixture.batch(range(12))
    assert tokens.shape == positions.shape == targets.shape == (12, 8)
    for row in range(12):  # each row as its own source's TokenDataset gives it
        source, j = mixture.assign(row)
        (own_tokens, own_positions), own_targets = mixture.datasets[source].batch([j])
        assert torch.equal(tokens[row], own_tokens[0]) and torch.equal(positions[row], own_positions[0])
        assert torch.equal(targets[row], own_targets[0])
    per_source = mixture.validation_sources()
    assert sorted(per_source) == sorted(WEIGHTS) and all(s.split == "val" for s in per_source.values())
    held_out = mixture.validation_split()
    assert held_out is not None and held_out.weights == pytest.approx(list(WEIGHTS.values()))
    val_tokens = held_out.batch(range(6))[0][0]
    assert {source_of(row) for row in val_tokens} <= set(WEIGHTS)
    assert held_out.validation_split() is None


def test_folders_with_different_tokenizers_are_refused(folders, tmp_path) -> None:  # noqa: ANN001
    bpe = make_folder(tmp_path, "bpe", 60, tokenizer="bpe:280")
    with pytest.raises(DataError, match=r"hold different tokenizers .*Fix: prepare every source with one tokenizer"):
        MixtureDataset([{"path": str(folders["web"])}, {"path": str(bpe)}], seq_len=8)
    other_bpe = make_folder(tmp_path, "other", 60, tokenizer="bpe:280", letter="y")  # the same spec, other text
    with pytest.raises(DataError, match="different tokenizers"):
        MixtureDataset([{"path": str(bpe)}, {"path": str(other_bpe)}], seq_len=8)
    (tmp_path / "again.jsonl").write_text(json.dumps({"text": "other text entirely"}) + "\n")
    shared = tmp_path / "shared"
    prepare([tmp_path / "again.jsonl"], shared, tokenizer=str(bpe / "tokenizer.json"), val_fraction=0, progress=False)
    assert MixtureDataset([{"path": str(bpe)}, {"path": str(shared), "name": "b2"}], seq_len=4).vocab_size == 280


def test_bad_sources_name_the_fix(folders) -> None:  # noqa: ANN001
    good = sources(folders, {"web": 1.0, "code": 1.0})
    config = DataConfig(name="tokens", sources=good)
    assert config.dataset_name == "mixture" and config.sources[0]["name"] == "web"
    assert isinstance(make_dataset(config.dataset_name, **config.dataset_kwargs()), MixtureDataset)
    cases = [
        (dict(name="tokens", path="x", sources=good), "data.path=''"),
        (dict(name="bytes", sources=good), "data.name='tokens'"),
        (dict(name="tokens", sources=[{"path": "a", "weight": 0}]), "positive finite"),
        (dict(name="tokens", sources=[{"path": "a", "weight": float("nan")}]), "positive finite"),
        (dict(name="tokens", sources=[{"path": "a", "weigth": 1}]), "path, weight and optionally name"),
        (dict(name="tokens", sources=[{"path": "a/x"}, {"path": "b/x"}]), "the same name"),
        (dict(name="tokens", sources="a,b"), "must be a list"),
    ]
    for fields, message in cases:
        with pytest.raises(ConfigError, match=message):
            DataConfig(**fields)
    toml = load_config(None, ["data.name=tokens", f"data.sources=[{{path={json.dumps(str(folders['web']))}}}]"])
    assert toml.data.sources[0]["weight"] == 1.0


def test_a_real_run_records_tokens_per_source_and_resumes(folders, tmp_path) -> None:  # noqa: ANN001
    """One process: 6 steps straight vs 3 steps, a checkpoint, then 3 more; the losses bitwise, the per-source
    token counts those of the stream, the evaluations per source."""
    mix = json.dumps([{"path": str(folders["web"]), "weight": 0.7}, {"path": str(folders["code"]), "weight": 0.3}])
    toml_mix = mix.replace('"path"', "path").replace('"weight"', "weight").replace(":", "=")
    data = ["data.name=tokens", f"data.sources={toml_mix}", "data.attention='document'", "train.eval_batches=1"]
    straight, resumed = straight_and_resumed([*data, "train.samples=0"], tmp_path)
    steps = [r for r in straight if r["kind"] == "train"]
    assert [r["loss"] for r in resumed if r["kind"] == "train"] == [r["loss"] for r in steps]  # bitwise
    mixture = MixtureDataset(json.loads(mix), seq_len=16)
    for record in steps:
        assert record["tokens_by_source"] == mixture.tokens_seen(8 * record["step"]), record["step"]
    assert steps[-1]["tokens_by_source"]["web"] > 2 * steps[-1]["tokens_by_source"]["code"]
    evals = [r for r in resumed if r["kind"] == "eval"]
    assert evals and all(sorted(r["sources"]) == ["code", "web"] for r in evals)
    assert all(np.isfinite(r["sources"]["web"]["loss"]) for r in evals)
    from plait.cli.main import main  # the launcher builds the data too, before any worker starts

    cli = ["train", "--nproc", "1", "--out", str(tmp_path / "c"), "--set", "data.name=tokens"]
    cli += ["--set", f"data.sources={toml_mix}", "--set", "data.seq_len=16", "--set", "train.steps=1"]
    cli += ["--set", "model.n_layer=1", "--set", "train.global_batch=8", "--set", "train.samples=0"]
    assert main(cli) == 0
