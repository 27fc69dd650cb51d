"""``TokenDataset`` in training: packed windows that cover each window once per epoch across dp ranks, a token
stream that resumes exactly at any step (also through a checkpoint of a real run), evaluation on the held-out
documents with perplexity, and the checks that refuse a model too small for the data before anything is launched.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.runs import straight_and_resumed

from plait.cli.main import main
from plait.data import ShardedBatches, TokenDataset, make_dataset, prepare
from plait.errors import ConfigError
from plait.train.config import DataConfig, check_model_fits_data, load_config
from plait.train.evaluation import evaluation_batches

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex".split()


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A prepared bytes folder of 60 short documents, 20% held out."""
    root = tmp_path_factory.mktemp("tokens")
    texts = [
        f"doc {i}: " + " ".join(WORDS[(i * k + 3) % len(WORDS)] for k in range(9)) + f" end {i}." for i in range(60)
    ]
    lines = [json.dumps({"text": text}) for text in texts]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    prepare([root / "docs.jsonl"], root / "out", val_fraction=0.2, progress=False)
    return root / "out"


def test_windows_are_packed_next_token_pairs_of_the_stream(folder):
    dataset = TokenDataset(folder, seq_len=16, seed=3)
    stream = np.asarray(dataset.data).astype(np.int64)
    assert dataset.num_windows == (len(stream) - 1) // 16 and dataset.vocab_size == 257
    inputs, targets = dataset.batch(range(5))
    assert inputs.shape == targets.shape == (5, 16) and inputs.dtype == torch.long
    for row, window in enumerate(dataset.windows(range(5)).tolist()):
        chunk = torch.from_numpy(stream[window * 16 : window * 16 + 17])
        assert torch.equal(inputs[row], chunk[:-1]) and torch.equal(targets[row], chunk[1:])
    assert (stream == dataset.eos_id).sum() == dataset.folder.splits["train"]["documents"] > 40  # an eos after each
    assert dataset.decode(dataset.encode("lazy dog")) == "lazy dog"
    assert dataset.tokenizer.eos_id == 256


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_one_epoch_over_all_dp_ranks_covers_each_window_once(folder, dp_size):
    dataset = TokenDataset(folder, seq_len=8, seed=1)
    windows = dataset.num_windows
    global_batch = 4
    seen: list[int] = []
    for step in range(windows // global_batch):
        for rank in range(dp_size):
            loader = ShardedBatches(dataset, global_batch, rank, dp_size)
            seen += dataset.windows(loader.local_indices_at(step)).tolist()
            inputs, _ = loader.batch_at(step)
            assert inputs.shape == (global_batch // dp_size, 8)
    assert len(seen) == len(set(seen)) == (windows // global_batch) * global_batch  # no window twice
    assert sorted(dataset.windows(range(windows)).tolist()) == list(range(windows))  # the epoch: every window
    second = dataset.windows(range(windows, 2 * windows)).tolist()
    assert sorted(second) == list(range(windows)) and second != dataset.windows(range(windows)).tolist()
    assert dataset.windows(range(windows)).tolist() != TokenDataset(folder, 8, seed=2).windows(range(windows)).tolist()


def test_the_token_stream_resumes_exactly_at_any_step(folder):
    loader = ShardedBatches(TokenDataset(folder, seq_len=8, seed=5), global_batch=6, dp_rank=1, dp_size=2)
    uninterrupted = [batch for _, batch in zip(range(40), loader)]  # crosses several epochs
    for start in (0, 7, 23, 39):
        reopened = TokenDataset(folder, seq_len=8, seed=5)  # a fresh process would open the files again
        resumed = ShardedBatches(reopened, global_batch=6, dp_rank=1, dp_size=2, start_step=start)
        for expected, got in zip(uninterrupted[start:], resumed):
            assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])


def test_evaluation_reads_a_fixed_sample_of_the_held_out_documents(folder):
    dataset = TokenDataset(folder, seq_len=8, seed=7)
    validation = dataset.validation_split()
    assert validation is not None and validation.split == "val"
    val_stream = np.asarray(validation.data).astype(np.int64)
    batches, held_out = evaluation_batches(dataset, global_batch=4, count=1000, dp_rank=0, dp_size=1)
    assert held_out and len(batches) == validation.num_windows // 4  # capped at what the split holds
    first = int(validation.windows([0])[0])
    assert torch.equal(batches[0][0][0], torch.from_numpy(val_stream[8 * first : 8 * first + 8]))
    used = validation.windows(range(len(batches) * 4)).tolist()
    assert len(set(used)) == len(used) and max(used) > validation.num_windows // 2  # spread over the split
    other_seed = TokenDataset(folder, seq_len=8, seed=8).validation_split()
    assert other_seed is not None and other_seed.windows(range(8)).tolist() == validation.windows(range(8)).tolist()
    train_text = dataset.decode(np.asarray(dataset.data).tolist())
    for document in dataset.decode(val_stream.tolist()).split("\ufffd")[:-1]:  # eos (256) decodes as U+FFFD
        assert document not in train_text  # whole documents: none of them leaks into training
    synthetic = make_dataset("addition", digits=2)
    batches, held_out = evaluation_batches(synthetic, global_batch=4, count=2, dp_rank=0, dp_size=1)
    assert not held_out and len(batches) == 2


def test_data_config_and_model_checks_name_the_fix(folder, capsys):
    config = load_config(None, ["data.name=tokens", f"data.path={json.dumps(str(folder))}", "data.seq_len=32"])
    dataset = make_dataset(config.data.name, **config.data.dataset_kwargs())
    assert isinstance(dataset, TokenDataset) and dataset.seq_len == 32
    with pytest.raises(ConfigError, match="needs a folder written by plait data prepare"):
        DataConfig(name="tokens").dataset_kwargs()
    with pytest.raises(ConfigError, match="has 257 tokens, but model.vocab_size=100.*Fix: drop model.vocab_size"):
        check_model_fits_data({"vocab_size": 100}, 257, 32, str(folder))
    with pytest.raises(ConfigError, match="data.seq_len=64 is above the model's context model.seq_len=32.*Fix"):
        check_model_fits_data({"seq_len": 32}, 257, 64)
    check_model_fits_data({"vocab_size": 300, "seq_len": 64}, 257, 64)
    base = ["train", "--nproc", "2", "--set", "data.name=tokens", "--set", f"data.path={json.dumps(str(folder))}"]
    for extra, message in (
        (["--set", "model.vocab_size=100"], "model.vocab_size=100"),
        (["--set", "model.seq_len=16", "--set", "data.seq_len=32"], "above the model's context"),
        (["--set", "data.seq_len=100000"], "fewer than data.seq_len + 1"),
    ):
        assert main([*base, *extra]) == 2  # refused before any process is launched
        assert message in capsys.readouterr().err


def test_a_real_run_resumes_the_token_stream_through_its_checkpoint(folder, tmp_path):
    """One process, the reference GPT: 6 steps straight vs 3 steps, a checkpoint, then 3 more (a new run)."""
    data = ["data.name=tokens", f"data.path={json.dumps(str(folder))}", "train.eval_batches=2"]
    straight, resumed = straight_and_resumed(data, tmp_path)
    losses = {r["step"]: r["loss"] for r in straight if r["kind"] == "train"}
    assert [r["loss"] for r in resumed if r["kind"] == "train"] == [losses[s] for s in range(1, 7)]  # bitwise
    evals = [r for r in straight if r["kind"] == "eval"]
    assert evals and all(r["split"] == "val" and r["perplexity"] == pytest.approx(math.exp(r["loss"])) for r in evals)
