"""A real ``plait train`` run in this process, straight and resumed through its checkpoint (token-stream tests)."""

from __future__ import annotations

import json
from pathlib import Path

SMALL_RUN = ["data.seq_len=16", "model.n_layer=1", "model.d_model=32", "train.global_batch=8"]
"""A tiny reference GPT on 16-token windows, 8 per step."""


def train_records(overrides: list[str], out: Path, steps: int) -> list[dict]:
    """Run ``plait train``'s loop (one process) with ``overrides`` for ``steps`` steps into ``out`` (a checkpoint and
    an evaluation every 3 steps); the records of its metrics.jsonl."""
    from plait.train.config import load_config
    from plait.train.loop import run

    cadence = [f"train.steps={steps}", "train.save_every=3", "train.eval_every=3", f"train.out={json.dumps(str(out))}"]
    run(load_config(None, [*SMALL_RUN, *overrides, *cadence]))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def straight_and_resumed(overrides: list[str], root: Path) -> tuple[list[dict], list[dict]]:
    """6 steps straight, and 3 steps, a checkpoint, then 3 more in a new run on the same folder: both records."""
    straight = train_records(overrides, root / "a", 6)
    train_records(overrides, root / "b", 3)
    return straight, train_records(overrides, root / "b", 6)


def recorded_train_steps(run_dir: Path) -> list[dict]:
    """The training records (kind "train") of a run folder's metrics.jsonl."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


def final_state(run_dir: Path) -> dict:
    """The run's last checkpoint loaded into a one-process engine: model parameters and optimizer state by name."""
    import torch

    from plait.distributed import World
    from plait.train.config import load_config
    from plait.train.loop import build

    config = load_config(run_dir / "config.toml")
    engine, _, _ = build(config, World(0, 1, 0, torch.device("cpu"), None))
    engine.load(run_dir / "ckpt")
    state = {f"model.{k}": v for k, v in engine.model.state_dict().items()}
    for name, param in engine.model.named_parameters():
        for key, value in engine.optimizer.state[param].items():
            state[f"optimizer.{name}.{key}"] = torch.as_tensor(value)
    return state
