"""The checkpoint benchmark runs end to end (a tiny model, one round; the figures themselves are
``python -m benchmarks.run --suite checkpoint``'s): plait and plain DCP save and load the same state at dp=2,
and the stall block runs with no saves, synchronous and asynchronous ones."""

import pytest

pytestmark = pytest.mark.distributed


def test_checkpoint_benchmark_runs_and_both_contenders_write_the_same_state():
    from benchmarks.checkpoint import markdown, run_checkpoint_suite
    from benchmarks.workload import Workload
    from plait.models import GPTConfig

    tiny = Workload(model=GPTConfig(vocab_size=256, seq_len=16, n_layer=1, n_head=2, d_model=32), global_batch=4)
    rows = run_checkpoint_suite(rounds=1, stall_steps=2, stall_every=1, cases=("dp2",), stall_case="dp2", workload=tiny)
    saves = {row["contender"]: row for row in rows if row["kind"] == "save/load"}
    assert set(saves) == {"plait", "DCP get_state_dict"}
    for row in saves.values():
        assert row["save_s"]["median"] > 0 and row["load_s"]["median"] > 0, row
    # the same tensors (parameters + AdamW states): plait adds its JSON, RNG files and per-entry headers
    assert saves["DCP get_state_dict"]["bytes"] < saves["plait"]["bytes"] < 2 * saves["DCP get_state_dict"]["bytes"]
    assert saves["plait"]["sha256_s"] > 0 and saves["plait"]["files"] > saves["DCP get_state_dict"]["files"]
    stall = {row["contender"]: row for row in rows if row["kind"] == "stall"}
    assert set(stall) == {"none", "sync", "async"} and stall["sync"]["saves"] == 2
    assert stall["sync"]["blocking_s"] > 0 and stall["async"]["blocking_s"] > 0
    text = markdown(rows, "python -m benchmarks.run --suite checkpoint", "test")
    assert "| dp2 | 2 | plait |" in text and "| async |" in text
