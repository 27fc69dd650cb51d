"""Observability (issue 8): the merged trace of every rank (dp2 through the API, pp2 x dp2 through
``plait train --trace``), idle shares recomputed from the JSON, per-step metrics (tokens/s, MFU, peak memory and
bytes per axis per rank), model FLOPs against an independent count, and the interval arithmetic."""

import json
from pathlib import Path

import pytest
import torch
from helpers.harness import run_distributed

import plait
from plait.models import GPT, GPTConfig, lm_loss
from plait.observe.trace import Tracer
from plait.observe.trace_summary import split_step, union
from plait.train.metrics import catalogue_gpu, model_flops_per_token, peak_flops

CONFIG = GPTConfig(vocab_size=16, seq_len=8, n_layer=2, n_head=2, d_model=16)
WORK = ("forward", "backward", "comm")


def recompute_idle(events: list[dict]) -> dict[int, float]:
    """Idle share per pid from the trace alone: step time not covered by any work span (any thread)."""
    shares = {}
    for pid in {e["pid"] for e in events}:
        mine = [e for e in events if e["pid"] == pid and e["ph"] == "X"]
        work = union((e["ts"], e["ts"] + e["dur"]) for e in mine if e["cat"] not in ("step", "idle"))
        total = idle = 0.0
        for step in (e for e in mine if e["cat"] == "step"):
            start, end = step["ts"], step["ts"] + step["dur"]
            covered = sum(min(b, end) - max(a, start) for a, b in work if b > start and a < end)
            total, idle = total + (end - start), idle + (end - start - covered)
        shares[pid] = idle / total
    return shares


def check_trace(trace_path: Path, ranks: int, steps: int) -> dict:
    """Every rank has a process with forward, backward and comm spans; idle shares agree with the spans."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    summary = json.loads(trace_path.with_name(trace_path.stem + ".summary.json").read_text())
    assert trace_path.with_suffix(".png").stat().st_size > 10_000
    assert sorted({e["pid"] for e in events}) == list(range(ranks))
    for pid in range(ranks):
        cats = {e.get("cat") for e in events if e["pid"] == pid}
        assert set(WORK) <= cats, (pid, cats)
        assert sum(e.get("cat") == "step" for e in events if e["pid"] == pid) == steps
    recomputed = recompute_idle(events)
    for row in summary["ranks"]:
        assert 0.0 <= row["idle_share"] <= 1.0
        # float microseconds vs integer nanoseconds: agreement to 1e-6 of the step time
        assert row["idle_share"] == pytest.approx(recomputed[row["rank"]], abs=1e-6)
        assert row["compute_s"] + row["comm_s"] + row["idle_s"] == pytest.approx(row["seconds"], rel=1e-9)
    idle_spans = sum(e["dur"] for e in events if e.get("cat") == "idle" and e["pid"] == 0) / 1e6
    assert idle_spans == pytest.approx(summary["ranks"][0]["idle_s"], rel=1e-6, abs=1e-9)
    return summary


def _dp2_traced(out: str) -> dict:
    torch.manual_seed(0)
    engine = plait.parallelize(
        GPT(CONFIG),
        plait.Layout(dp=2, microbatches=2),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
        loss_fn=lm_loss,
    )
    got = engine.comm.all_gather_bytes(b"x" * (3 * engine.mesh.rank), "world")  # unequal lengths, one empty
    assert got == [b"", b"xxx"]
    x = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(engine.mesh.rank))
    engine.train_step((x, x))  # untraced warm-up
    tracer = Tracer(engine)
    payload = 0
    with tracer:
        for _ in range(3):
            payload += sum(count.payload_bytes for count in engine.train_step((x, x)).comm.counts.values())
    assert engine.comm.tracer is None
    traced = sum(s[5]["bytes"] for s in tracer.spans if s[1] == "comm")  # one span per collective
    summary = tracer.save(Path(out) / "trace.json")
    return {"payload": payload, "traced": traced, "summary": summary}


@pytest.mark.distributed
def test_dp2_trace_every_rank_spans_and_bytes(tmp_path):
    results = run_distributed(_dp2_traced, 2, str(tmp_path), timeout=120)
    for result in results:  # every collective (DDP buckets, the loss) is one traced span with its bytes
        assert result["traced"] == result["payload"] > 0
    assert results[1]["summary"] is None
    summary = check_trace(tmp_path / "trace.json", ranks=2, steps=3)
    assert summary["ranks"] == results[0]["summary"]["ranks"]  # what save() returned is what it wrote


def _train_pp2_dp2(out: str, calibration: str) -> list[str]:
    """``plait train``'s per-rank program (the worker behind ``plait train --trace``), pp=2 x dp=2."""
    import logging
    import os

    from plait.train.config import load_config
    from plait.train.loop import run

    os.environ["PLAIT_CALIBRATION"] = calibration  # absent: MFU must be null, with a line naming plait calibrate
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    for name in ("plait.observe.trace", "plait.train.metrics"):
        logging.getLogger(name).addHandler(handler)
    config = load_config(
        None,
        [
            "layout.pp=2",
            "layout.dp=2",
            "layout.microbatches=2",
            "train.steps=3",
            "train.global_batch=8",
            "train.eval_every=0",
            "train.eval_batches=1",
            "model.d_model=16",
            f"train.out={json.dumps(out)}",
        ],
    )
    run(config, trace="", trace_steps=2)
    return messages


@pytest.mark.distributed
def test_plait_train_trace_pp2_dp2_and_metrics(tmp_path):
    out = tmp_path / "run"
    messages = run_distributed(_train_pp2_dp2, 4, str(out), str(tmp_path / "none.json"), timeout=180)[0]
    assert any("idle share per rank: rank 0" in m for m in messages), messages
    assert any("MFU unknown" in m and "plait calibrate" in m for m in messages), messages
    summary = check_trace(out / "trace.json", ranks=4, steps=2)
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    for pid in range(4):  # the pipeline runtime's actions and its sends/receives are on every rank
        names = {e["name"] for e in events if e["pid"] == pid and e["ph"] == "X"}
        assert any(n.endswith(("F0", "F1")) for n in names) and any("send_recv pp" in n for n in names), names
    assert {r["coords"]["pp"] for r in summary["ranks"]} == {0, 1}
    train = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    assert len(train) == 3
    for record in train:
        assert record["tokens_per_s"] > 0 and record["mfu"] is None  # no calibration file: unknown, not a guess
        assert len(record["max_rss_bytes"]) == 4 and min(record["max_rss_bytes"]) > 10 * 2**20
        per_rank = record["comm_bytes_per_rank"]
        assert set(per_rank) >= {"pp", "dp_cp"} and all(len(v) == 4 for v in per_rank.values())
        assert min(per_rank["pp"]) > 0 and min(per_rank["dp_cp"]) > 0  # every rank sends on both axes
        assert per_rank["dp_cp"][0] == record["comm_bytes"]["dp_cp"]  # rank 0's, as comm_bytes always was


def test_cli_forwards_trace_to_the_workers(tmp_path, monkeypatch):
    import torch.distributed.run as torchrun

    from plait.cli.main import main

    launched = []
    monkeypatch.setattr(torchrun, "run", launched.append)
    assert main(["train", "--nproc", "2", "--out", str(tmp_path), "--trace", "--trace-steps", "3"]) == 0
    worker_args = launched[0].training_script_args
    assert "--trace=" in worker_args and "--trace-steps=3" in worker_args
    assert main(["train", "--nproc", "2", "--out", str(tmp_path), "--trace", "t.json"]) == 0
    assert "--trace=t.json" in launched[1].training_script_args


def test_model_flops_per_token_match_an_independent_count():
    """3 x forward: 2 x (every block matmul weight, counted on the module) + 4 s h per block + 2 h V."""
    config = GPTConfig(vocab_size=50, seq_len=12, n_layer=3, n_head=4, d_model=32)
    model = GPT(config)
    matmul = sum(
        m.weight.numel()
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and ".blocks." in f".{name}."
    )
    s, h = config.seq_len, config.d_model
    expected = 3 * (2 * matmul + config.n_layer * 4 * s * h + 2 * h * config.vocab_size)
    assert matmul > 0 and model_flops_per_token(model, s) == pytest.approx(expected, rel=1e-12)


def test_peak_flops_catalogue_and_calibration(tmp_path, monkeypatch):
    assert catalogue_gpu("NVIDIA H100 80GB HBM3") == "h100" and catalogue_gpu("NVIDIA H100 PCIe") is None
    assert catalogue_gpu("NVIDIA A100-SXM4-80GB") == "a100-80gb" and catalogue_gpu("NVIDIA H200") == "h200"
    assert catalogue_gpu("Tesla T4") is None
    monkeypatch.setenv("PLAIT_CALIBRATION", str(tmp_path / "missing.json"))
    peak, why = peak_flops(torch.device("cpu"), "fp32", 4)
    assert peak is None and "missing.json" in why
    from plait.planner.hardware import CATALOGUE

    hardware = {**CATALOGUE["h100"].to_dict(), "name": "this-machine", "peak_flops": {"fp32": 5e10}}
    (tmp_path / "cal.json").write_text(json.dumps({"hardware": hardware}))
    monkeypatch.setenv("PLAIT_CALIBRATION", str(tmp_path / "cal.json"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert peak_flops(torch.device("cpu"), "fp32", 4)[0] == 2 * 5e10  # the machine's figure x 2 hosts


def test_split_step_counts_overlap_once():
    spans = [
        [0, "forward", "f", 0, 40, {}],
        [1, "comm", "c", 30, 60, {}],
        [0, "step", "s", 0, 100, {}],
        [0, "backward", "b", 70, 80, {}],
        [1, "comm", "late", 95, 130, {}],
    ]
    split = split_step(spans, 0, 100)
    assert split["comm_s"] * 1e9 == pytest.approx(35)  # 30..60 and 95..100
    assert split["compute_s"] * 1e9 == pytest.approx(40 + 10 - 10)  # 0..40, 70..80 minus the 30..40 overlap
    assert split["idle_s"] * 1e9 == pytest.approx(100 - 75) and split["gaps"] == [(60, 70), (80, 95)]


def test_tracer_refuses_what_is_not_an_engine_and_bad_trace_steps(tmp_path, capsys):
    with pytest.raises(TypeError, match="Engine or Comm"):
        Tracer(torch.nn.Linear(2, 2))
    from plait.cli.main import main

    assert main(["train", "--nproc", "2", "--out", str(tmp_path), "--trace", "--trace-steps", "0"]) == 2
    assert "--trace-steps 0 must be at least 1" in capsys.readouterr().err


def test_step_meter_mfu_with_a_calibrated_peak(tmp_path, monkeypatch):
    """One process: MFU = tokens x FLOPs per token / seconds / peak, with the peak from `plait calibrate`'s file."""
    from plait.planner.hardware import CATALOGUE
    from plait.train.metrics import StepMeter

    hardware = {**CATALOGUE["h100"].to_dict(), "name": "this-machine", "peak_flops": {"fp32": 1e9}}
    (tmp_path / "cal.json").write_text(json.dumps({"hardware": hardware}))
    monkeypatch.setenv("PLAIT_CALIBRATION", str(tmp_path / "cal.json"))
    engine = plait.parallelize(
        GPT(CONFIG), plait.Layout(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=lm_loss
    )
    meter = StepMeter(engine, CONFIG, CONFIG.seq_len)
    x = torch.randint(0, 16, (4, 8))
    meter.before_step()
    stats = engine.train_step((x, x))
    record = meter.measure(stats)
    expected = 32 * model_flops_per_token(CONFIG, 8) / stats.seconds / 1e9
    assert record["mfu"] == pytest.approx(expected, rel=1e-12) and 0 < record["mfu"]
    assert record["max_rss_bytes"][0] > 0 and record["comm_bytes_per_rank"] == {}  # one rank: no traffic


def test_the_trace_picture_labels_whole_ranks(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """trace.png's memory panel labelled 2 ranks 0.0/0.5/1.0 (issue 37): its ticks are the ranks."""
    from matplotlib.figure import Figure

    from plait.observe.trace_summary import draw

    saved: list[Figure] = []
    original = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (saved.append(fig), original(fig, *a, **k))[1])
    row = {"compute_s": 0.01, "comm_s": 0.002, "idle_s": 0.001}
    summary = {
        "ranks": [
            {"rank": r, "memory_kind": "rss", "peak_memory_bytes": 2**20 * (r + 1), "idle_share": 0.1} for r in (0, 1)
        ],
        "steps": [{"step": 3, "ranks": [{"rank": r, **row} for r in (0, 1)]}],
    }
    draw(summary, tmp_path / "trace.png")
    assert list(saved[0].axes[0].get_xticks()) == [0, 1]
