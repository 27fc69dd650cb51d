"""Tests of the datasets (addition, bytes) and of deterministic data-parallel batching."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from plait.data import (
    IGNORE_INDEX,
    AdditionTask,
    ByteTextDataset,
    Dataset,
    ShardedBatches,
    index_hash,
    make_dataset,
)
from plait.models import lm_loss

# ---------------------------------------------------------------- addition


def perfect_logits(targets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits whose argmax is the target wherever one is scored."""
    return F.one_hot(targets.clamp(min=0), vocab_size).float()


@pytest.mark.parametrize("digits", [1, 2, 3])
def test_addition_samples_are_fixed_width_and_correct_sums(digits: int) -> None:
    task = AdditionTask(digits=digits, seed=7)
    inputs, targets = task.batch(range(50))
    assert inputs.shape == targets.shape == (50, task.seq_len) == (50, 3 * digits + 2)
    assert inputs.dtype == targets.dtype == torch.long
    assert torch.all((targets != IGNORE_INDEX).sum(dim=1) == digits + 1)
    assert torch.all(targets[:, : 2 * digits + 1] == IGNORE_INDEX)
    for row_inputs, row_targets in zip(inputs, targets, strict=True):
        text = task.decode(row_inputs) + task.decode(row_targets[-1:])
        prompt, reversed_answer = text.split("=")
        a, b = prompt.split("+")
        assert len(a) == len(b) == digits and len(reversed_answer) == digits + 1
        assert int(reversed_answer[::-1]) == int(a) + int(b)
    scored = targets[:, :-1] != IGNORE_INDEX
    assert torch.equal(targets[:, :-1][scored], inputs[:, 1:][scored])  # next-token targets


def test_addition_is_deterministic_in_seed_and_index_only() -> None:
    task = AdditionTask(digits=2, seed=3)
    x, y = task.sample(12)
    batch_x, batch_y = task.batch([40, 12, 5])
    assert torch.equal(x, batch_x[1]) and torch.equal(y, batch_y[1])
    assert torch.equal(AdditionTask(digits=2, seed=3).batch(range(20))[0], task.batch(range(20))[0])
    assert not torch.equal(AdditionTask(digits=2, seed=4).batch(range(20))[0], task.batch(range(20))[0])
    a, b = task.operands(range(2000))
    assert 0 <= a.min() and a.max() < 100 and len(set(zip(a.tolist(), b.tolist(), strict=True))) > 1500


def test_addition_accuracy_counts_exact_match() -> None:
    task = AdditionTask(digits=2)
    _, targets = task.batch(range(8))
    logits = perfect_logits(targets, task.vocab_size)
    assert task.accuracy_counts(logits, targets) == (8, 8)
    wrong = logits.clone()
    wrong[3, -1] = wrong[3, -1].roll(1)  # one wrong answer digit in sample 3
    wrong[5, 0] = wrong[5, 0].roll(1)  # an unscored position: does not matter
    assert task.accuracy_counts(wrong, targets) == (7, 8)


def test_mean_of_micro_batch_losses_equals_global_loss() -> None:
    task = AdditionTask(digits=2)
    _, targets = task.batch(range(12))
    logits = torch.randn(12, task.seq_len, task.vocab_size, generator=torch.Generator().manual_seed(0))
    micro = torch.stack([lm_loss(logits[i : i + 3], targets[i : i + 3]) for i in range(0, 12, 3)]).mean()
    torch.testing.assert_close(micro, lm_loss(logits, targets))


def test_addition_encode_decode_and_validation() -> None:
    task = AdditionTask(digits=2)
    assert task.decode(task.encode("07+45=250")) == "07+45=250"
    assert task.vocab_size == 12
    with pytest.raises(ValueError, match="'x'"):
        task.encode("1x2")
    with pytest.raises(ValueError, match="digits=0"):
        AdditionTask(digits=0)


# ---------------------------------------------------------------- bytes


def write_text(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    return path


def test_byte_windows_are_shifted_slices_of_the_file(tmp_path: Path) -> None:
    text = "".join(chr(ord("a") + (i * 7) % 26) for i in range(300))
    dataset = ByteTextDataset(write_text(tmp_path, text), seq_len=16, seed=1)
    data = torch.tensor(list(text.encode()))
    inputs, targets = dataset.batch(range(40))
    assert inputs.shape == targets.shape == (40, 16) and dataset.vocab_size == 256
    for offset, row_inputs, row_targets in zip(dataset.offsets(range(40)), inputs, targets, strict=True):
        assert torch.equal(row_inputs, data[offset : offset + 16])
        assert torch.equal(row_targets, data[offset + 1 : offset + 17])
    assert len(set(dataset.offsets(range(40)).tolist())) > 20
    again = ByteTextDataset(write_text(tmp_path, text), seq_len=16, seed=1)
    assert torch.equal(again.sample(9)[0], inputs[9])
    assert dataset.decode(inputs[0]) == text[dataset.offsets([0])[0] :][:16]


def test_byte_dataset_errors_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(ValueError, match="nope.txt"):
        ByteTextDataset(missing, seq_len=8)
    with pytest.raises(ValueError, match="corpus.txt.*8 bytes"):
        ByteTextDataset(write_text(tmp_path, "12345678"), seq_len=8)
    ByteTextDataset(write_text(tmp_path, "123456789"), seq_len=8)  # exactly seq_len + 1 bytes is enough


def test_byte_accuracy_counts_tokens(tmp_path: Path) -> None:
    dataset = ByteTextDataset(write_text(tmp_path, "hello world, hello plait"), seq_len=5)
    _, targets = dataset.batch(range(4))
    logits = perfect_logits(targets, 256)
    logits[0, 2] = logits[0, 2].roll(1)
    assert dataset.accuracy_counts(logits, targets) == (19, 20)


# ---------------------------------------------------------------- loader


def test_shards_concatenate_to_the_global_batch() -> None:
    task = AdditionTask(digits=2, seed=1)
    for step in (0, 5):
        global_x, global_y = ShardedBatches(task, global_batch=12).global_batch_at(step)
        shards = [ShardedBatches(task, 12, dp_rank=rank, dp_size=4).batch_at(step) for rank in range(4)]
        assert all(x.shape == (3, task.seq_len) for x, _ in shards)
        assert torch.equal(torch.cat([x for x, _ in shards]), global_x)
        assert torch.equal(torch.cat([y for _, y in shards]), global_y)
    assert torch.equal(ShardedBatches(task, 12).global_batch_at(1)[0], task.batch(range(12, 24))[0])


def test_iteration_is_resumable_at_any_step() -> None:
    task = AdditionTask(digits=2)
    stream = iter(ShardedBatches(task, global_batch=8, dp_rank=1, dp_size=2))
    first_four = [next(stream) for _ in range(4)]
    resumed = iter(ShardedBatches(task, global_batch=8, dp_rank=1, dp_size=2, start_step=2))
    for expected in first_four[2:]:
        actual = next(resumed)
        assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])
    assert not torch.equal(first_four[0][0], first_four[1][0])


def test_offset_gives_a_disjoint_evaluation_stream() -> None:
    train = ShardedBatches(AdditionTask(), global_batch=8)
    evaluation = ShardedBatches(AdditionTask(), global_batch=8, offset=10**9)
    assert set(train.global_indices_at(0)).isdisjoint(evaluation.global_indices_at(0))
    assert not torch.equal(train.global_batch_at(0)[0], evaluation.global_batch_at(0)[0])


def test_loader_errors_say_how_to_fix() -> None:
    task = AdditionTask()
    with pytest.raises(ValueError, match="global_batch=10 is not divisible by dp_size=4.*8 or 12"):
        ShardedBatches(task, global_batch=10, dp_size=4)
    with pytest.raises(ValueError, match="dp_rank=2 .* dp_size=2"):
        ShardedBatches(task, global_batch=8, dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="global_batch=0"):
        ShardedBatches(task, global_batch=0)


# ---------------------------------------------------------------- factory, protocol, hashing


def test_make_dataset_and_protocol(tmp_path: Path) -> None:
    addition = make_dataset("addition", digits=3, seed=2)
    assert addition == AdditionTask(digits=3, seed=2)
    text = make_dataset("bytes", path=write_text(tmp_path, "abc" * 20), seq_len=4)
    assert isinstance(text, ByteTextDataset)
    assert isinstance(addition, Dataset) and isinstance(text, Dataset)
    with pytest.raises(ValueError, match="'images'.*addition"):
        make_dataset("images")
    with pytest.raises(ValueError, match="addition"):
        make_dataset("addition", digitz=2)


def test_index_hash_is_pure_per_index() -> None:
    together = index_hash(5, [0, 1, 2, 10**9], stream=1)
    alone = index_hash(5, [10**9], stream=1)
    assert together[3] == alone[0]
    assert len(set(together.tolist())) == 4
    assert index_hash(5, [3], stream=0)[0] != index_hash(5, [3], stream=1)[0]
    assert index_hash(5, [3])[0] != index_hash(6, [3])[0]
