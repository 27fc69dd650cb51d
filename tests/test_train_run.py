"""``plait train``'s run folder and configuration: TensorBoard event files readable by tensorboard's own reader
(EventAccumulator) holding the scalars of metrics.jsonl; samples.jsonl at each evaluation; the optimizer and
learning-rate schedule of ``[train]`` (SGD with momentum, linear decay to ``min_lr``) under ZeRO-2; plan -> train:
the TOML ``plait plan --out`` writes runs unchanged with only ``--set data...`` added; bad ``[train]`` input.

One gloo job (2 ranks) runs both trainings through the worker's own entry point (``plait.train.loop.run`` on
``load_config(--config, --set)``, what ``plait train`` runs on every rank under torchrun).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from helpers.harness import run_distributed

from plait.cli.main import main
from plait.errors import ConfigError
from plait.train.config import RunConfig, load_config
from plait.train.optim import lr_factor

STEPS = 6
SCHEDULE = {  # the ZeRO-2 run's [train]
    "steps": STEPS,
    "global_batch": 8,
    "optimizer": "sgd",
    "momentum": 0.9,
    "lr": 0.05,
    "lr_schedule": "linear",
    "warmup_steps": 2,
    "min_lr": 0.005,
    "eval_every": 3,
    "eval_batches": 1,
    "samples": 1,
    "sample_tokens": 2,
    "tensorboard": True,
}


def _job(root: str) -> None:
    from plait.distributed import init
    from plait.train.config import load_config
    from plait.train.loop import run

    world = init()
    overrides = ["data.name=addition", "train.steps=3", "train.eval_every=0", f'train.out="{root}/planned"']
    run(load_config(f"{root}/run.toml", overrides), world)
    zero2 = {"layout": {"dp": 2, "zero": 2}, "train": {**SCHEDULE, "out": f"{root}/zero2"}}
    run(RunConfig.from_dict(zero2), world)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    hf = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 64, "n_positions": 16}
    (root / "config.json").write_text(json.dumps(hf))
    argv = ["plan", "--model", str(root / "config.json"), "--gpus", "2", "--precision", "fp32", "--global-batch", "8"]
    assert main([*argv, "--out", str(root / "run.toml")]) == 0
    run_distributed(_job, 2, str(root), timeout=240)
    return root


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.distributed
def test_plan_output_trains_unchanged(root: Path) -> None:
    planned = load_config(root / "run.toml")
    ran = load_config(root / "planned" / "config.toml")
    assert ran.layout == planned.layout and ran.model == planned.model  # the planner's layout and model, as written
    summary = json.loads((root / "planned" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["world_size"] == 2
    assert summary["layout"].startswith(planned.layout.short().split(" ")[0])


@pytest.mark.distributed
def test_tensorboard_events_hold_the_metrics(root: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(root / "zero2")).Reload()
    tags = set(events.Tags()["scalars"])
    wanted = {"train/loss", "train/perplexity", "train/lr", "train/grad_norm", "train/tokens_per_s"}
    assert wanted | {"train/memory_bytes", "eval/loss", "eval/perplexity", "eval/accuracy"} <= tags
    train = [r for r in records(root / "zero2") if r["kind"] == "train"]
    logged = {e.step: e.value for e in events.Scalars("train/loss")}
    assert logged == pytest.approx({r["step"]: r["loss"] for r in train}, rel=1e-6)  # float32 in the event file
    for event, record in zip(events.Scalars("train/perplexity"), train):
        assert event.value == pytest.approx(math.exp(record["loss"]), rel=1e-6)
    memory = [max(r["max_rss_bytes"]) for r in train]
    assert [e.value for e in events.Scalars("train/memory_bytes")] == pytest.approx(memory, rel=1e-6)
    evals = [r for r in records(root / "zero2") if r["kind"] == "eval"]
    assert [e.step for e in events.Scalars("eval/loss")] == [r["step"] for r in evals] == [3, STEPS]


@pytest.mark.distributed
def test_optimizer_and_linear_schedule_of_the_config(root: Path) -> None:
    train = [r for r in records(root / "zero2") if r["kind"] == "train"]
    factor = lr_factor("linear", 2, STEPS, 0.005 / 0.05)
    # the lr a step used: the scheduler has stepped once per finished step
    assert [r["lr"] for r in train] == pytest.approx([0.05 * factor(step) for step in range(1, STEPS + 1)])
    assert train[-1]["lr"] == pytest.approx(0.005)  # the floor at the last step
    ran = load_config(root / "zero2" / "config.toml")
    assert ran.train.optimizer == "sgd" and ran.train.min_lr == 0.005


@pytest.mark.distributed
def test_samples_at_each_evaluation(root: Path) -> None:
    samples = [json.loads(line) for line in (root / "zero2" / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [3, STEPS]
    assert all(set(s["prompt"]) <= set("0123456789+=") and len(s["completion"]) == 2 for s in samples)


def test_lr_schedules() -> None:
    cosine = lr_factor("cosine", 10, 110, 0.1)
    assert [cosine(0), cosine(9)] == pytest.approx([0.1, 1.0])  # warm-up
    assert [cosine(10), cosine(60), cosine(110), cosine(500)] == pytest.approx([1.0, 0.55, 0.1, 0.1])
    linear = lr_factor("linear", 0, 100, 0.0)
    assert [linear(0), linear(50), linear(100)] == pytest.approx([1.0, 0.5, 0.0])
    assert lr_factor("constant", 5, 100, 0.0)(99) == 1.0


@pytest.mark.parametrize(
    ("train", "message"),
    [
        ({"optimizer": "lion"}, "train.optimizer='lion' is unknown. Fix: use one of"),
        ({"lr_schedule": "step"}, "train.lr_schedule='step' is unknown"),
        ({"betas": [0.9]}, "train.betas=[0.9] must be two numbers in [0, 1)"),
        ({"min_lr": 1.0}, "train.min_lr=1.0 must lie in [0, lr=0.003]"),
        ({"weight_decay_skip": ["gains"]}, "train.weight_decay_skip names ['gains']"),
        ({"momentum": 1.5}, "train.momentum=1.5 must be in [0, 1)"),
        ({"sample_tokens": -1}, "train.sample_tokens=-1 must be an integer >= 0"),
    ],
)
def test_bad_train_settings_are_refused(train: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        RunConfig.from_dict({"train": train})


def test_tensorboard_true_without_the_package_names_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from plait.train import tensorboard

    monkeypatch.setattr(tensorboard, "tensorboard_available", lambda: False)
    assert tensorboard.open_tensorboard(tmp_path, None) is None  # the default: off when the package is missing
    with pytest.raises(ConfigError, match=r"pip install 'plait\[tensorboard\]'"):
        tensorboard.open_tensorboard(tmp_path, True)
    assert tensorboard.open_tensorboard(tmp_path, False) is None


def test_the_last_step_is_saved_when_steps_is_not_a_multiple_of_save_every(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """steps=7, save_every=3: step 7 is saved besides 3 and 6 (``latest``), so generate, convert and a resume start
    from it; resumed with steps=9 the run trains 8 and 9 only, records each step once, and saves its own last."""
    run = tmp_path / "run"
    job = ["train", "--nproc", "1", "--out", str(run)] + [
        arg
        for setting in ("train.save_every=3", "train.eval_every=0", "train.global_batch=4", "model.n_layer=1")
        for arg in ("--set", setting)
    ]
    assert main([*job, "--set", "train.steps=7"]) == 0
    assert sorted(p.name for p in (run / "ckpt").glob("step-*")) == [f"step-{n:08d}" for n in (3, 6, 7)]
    assert (run / "ckpt" / "latest").read_text().strip().endswith("step-00000007")
    assert "step 7: the last step, saved although train.save_every=3" in capsys.readouterr().err
    assert main([*job, "--set", "train.steps=9"]) == 0
    assert sorted(p.name for p in (run / "ckpt").glob("step-*"))[-2:] == ["step-00000007", "step-00000009"]
    assert [r["step"] for r in records(run) if r["kind"] == "train"] == list(range(1, 10))
