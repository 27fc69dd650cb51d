"""benchmarks/gpu.py without a GPU: its bookkeeping (alternating order, median round, ratios to the right peer,
MFU only where the peak is known) on made-up timings, and one real smoke run of two contenders on a tiny GPT on
the CPU that writes its block of a BENCHMARKS.md."""

from __future__ import annotations

import pytest
import torch

from benchmarks import gpu


def test_rounds_alternate_and_rows_report_the_median_against_the_right_peer(monkeypatch):
    order = []
    speeds = {"plain": [100.0, 300.0, 200.0], "plain compiled": [400.0] * 3, "plait": [210.0, 190.0, 250.0]}
    speeds["plait compiled"] = [440.0] * 3

    def fake(contender, case, steps, warmup):
        order.append(contender)
        return {"contender": contender, "tokens_per_s": speeds[contender][len([c for c in order if c == contender]) - 1],
                "seconds": 1.0, "final_loss": 1.0, "peak_bytes": None}  # fmt: skip

    monkeypatch.setattr(gpu, "measure", fake)
    rows = {r["contender"]: r for r in gpu.run_case(gpu.Case("tiny", 2, "cpu"), 3, 1, 3, gpu.CONTENDERS)}
    assert order[:4] == list(gpu.CONTENDERS) and order[4:8] == list(reversed(gpu.CONTENDERS))
    assert rows["plain"]["tokens_per_s"] == 200.0 and rows["plait"]["tokens_per_s"] == 210.0  # medians
    assert rows["plait"]["vs_peer"] == pytest.approx(210 / 200)
    assert rows["plait compiled"]["vs_peer"] == pytest.approx(440 / 400)
    assert rows["plain"]["spread"] == (100.0, 300.0)
    assert all(r["mfu"] is None or r["mfu"] > 0 for r in rows.values()), "None where the device's peak is unknown"


def test_a_tiny_cpu_run_writes_its_block(tmp_path):
    out = tmp_path / "BENCHMARKS.md"
    out.write_text("# Benchmarks\n")
    argv = ["--device", "cpu", "--tiny", "--steps", "1", "--warmup", "1", "--rounds", "1", "--micro", "2"]
    assert gpu.main([*argv, "--contenders", "plain,plait", "--out", str(out)]) == 0
    text = out.read_text()
    assert "<!-- bench:gpu -->" in text and "| tiny | 2 | plain |" in text and "| tiny | 2 | plait |" in text
    assert gpu.main(["--shapes", "huge", "--device", "cpu"]) == 2
    if not torch.cuda.is_available():
        assert gpu.main([]) == 2, "without CUDA the default run refuses with the fix"
