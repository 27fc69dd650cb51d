"""``plait.param_server.train``: any model, data and loss trained by parameter servers on this machine.

    from plait.data import make_dataset
    from plait.param_server import train

    def my_model():                                   # module level: every server and worker process builds it
        return MyTransformer(vocab=256, seq=64)

    result = train(my_model, make_dataset("bytes", path="notes.txt", seq_len=64), servers=2, workers=4,
                   consistency="ssp", staleness=2, optimizer="AdamW", lr=3e-3, steps=200, out="runs/ps")
    result.model, result.held_out_loss, result.summary   # runs/ps/{ckpt,summary.json,ps.png}

Worker w trains on its own share of the data (``task.py``: step t's samples of all workers form the global batch of
a synchronous run); every process seeds the model with ``seed``, so servers and workers start equal. The trained
model is written as a plait model-only checkpoint (``plait.checkpoint.save_model_state``: ``plait convert`` and
``Engine.load`` read it, like ``plait train``'s), with ``summary.json`` and ``ps.png`` beside it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from plait.checkpoint import save_model_state
from plait.data import Dataset
from plait.errors import ConfigError
from plait.logging import get_logger
from plait.models.loss import LossFn, lm_loss
from plait.param_server.consistency import Consistency
from plait.param_server.launch import JobConfig, run_local
from plait.param_server.server import OptimizerSpec
from plait.param_server.summary import job_summary, plot_job
from plait.param_server.task import ModelTask, Task

log = get_logger(__name__)


@dataclass
class TrainResult:
    """The trained model (all shards merged), its held-out loss, each worker's losses and the job's summary."""

    model: nn.Module
    params: dict[str, Tensor]
    held_out_loss: float
    losses: dict[int, list[float]]
    reports: list[dict[str, Any]]
    summary: dict[str, Any]


def held_out_loss(task: Task, model: nn.Module, samples: int = 256) -> float:
    with torch.no_grad():
        return float(task.loss(model, task.eval_batch(samples)))


def model_meta(model: nn.Module) -> dict[str, Any] | None:
    """What ``plait convert`` needs to know of the model: an HF config, or a dataclass config's fields."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_string") and hasattr(config, "model_type"):
        return {"hf": json.loads(config.to_json_string(use_diff=False))}
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        try:
            fields = dataclasses.asdict(config)
            json.dumps(fields)
            return {"config": fields}
        except TypeError:
            return None
    return None


def run_job(
    config: JobConfig, out: str | Path | None = None, on_reports: Callable[[list[dict[str, Any]]], None] | None = None
) -> TrainResult:
    """Run ``config`` on this machine; write the checkpoint, summary and plot under ``out`` when given."""
    config.validate()
    task = config.task
    initial = held_out_loss(task, task.build_model())
    result = run_local(config, on_reports)
    model = task.build_model()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in result.params:
                param.copy_(result.params[name])
    final = held_out_loss(task, model)
    setup = {
        "mode": config.consistency.mode,
        "staleness_bound": config.consistency.staleness,
        "servers": config.servers,
        "workers": config.workers,
        "steps": config.steps,
        "batch_per_worker": task.batch,
        "optimizer": {"name": config.optimizer.name, **config.optimizer.kwargs},
        "push_dtype": config.push_dtype,
    }
    summary = job_summary(setup, result.reports, result.losses, initial, final)
    if out is not None:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        state = {name: value.detach().clone() for name, value in model.state_dict().items()}
        checkpoint = save_model_state(
            folder / "ckpt", state, {"step": config.steps, "model": model_meta(model), "trained_by": "plait ps"}
        )
        summary["checkpoint"] = str(checkpoint)
        summary["plot"] = str(plot_job(summary, result.losses, folder / "ps.png"))
        (folder / "summary.json").write_text(json.dumps(summary, indent=2))
        log.info("wrote %s, %s and %s", checkpoint, summary["plot"], folder / "summary.json")
    return TrainResult(model, result.params, final, result.losses, result.reports, summary)


def train(
    model_fn: Callable[[], nn.Module],
    data: Dataset,
    loss_fn: LossFn = lm_loss,
    *,
    servers: int = 2,
    workers: int = 2,
    steps: int = 100,
    batch: int = 8,
    consistency: str | Consistency = "bsp",
    staleness: int | None = None,
    optimizer: str | OptimizerSpec = "AdamW",
    lr: float = 3e-3,
    seed: int = 0,
    push_dtype: str = "float32",
    checkpoint_dir: str | None = None,
    checkpoint_every: int = 0,
    out: str | Path | None = None,
    timeout_s: float = 120.0,
    on_reports: Callable[[list[dict[str, Any]]], None] | None = None,
) -> TrainResult:
    """Train ``model_fn()`` on ``data`` with ``loss_fn(output, target)`` by ``servers`` parameter servers and
    ``workers`` workers, all on this machine, ``steps`` steps of ``batch`` samples per worker.

    ``consistency``: "bsp" (synchronous: equals data-parallel training on the union of the workers' batches),
    "asp", or "ssp" with ``staleness`` s (default 2); ``optimizer``: any ``torch.optim`` class name (with ``lr``)
    or an ``OptimizerSpec``, applied by the servers. ``model_fn``, ``loss_fn`` and the dataset's class must be
    importable by the job's processes (defined at module level)."""
    if isinstance(consistency, str):
        consistency = Consistency(
            consistency, staleness if staleness is not None else (2 if consistency == "ssp" else 0)
        )
    elif staleness is not None:
        raise ConfigError("staleness is given twice (in consistency and as staleness=). Fix: pass one of them.")
    if isinstance(optimizer, str):
        optimizer = OptimizerSpec(optimizer, {"lr": lr})
    if not isinstance(data, Dataset):
        raise ConfigError(
            f"data is a {type(data).__name__}, not a plait Dataset (vocab_size, seq_len, batch(indices)). "
            f"Fix: e.g. plait.data.make_dataset('bytes', path=..., seq_len=...)."
        )
    task = ModelTask(model_fn, data, loss_fn, batch, seed)
    config = JobConfig(
        servers=servers,
        workers=workers,
        steps=steps,
        consistency=consistency,
        optimizer=optimizer,
        task=task,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        timeout_s=timeout_s,
        push_dtype=push_dtype,
    )
    optimizer.build(list(task.build_model().parameters()))  # an unknown optimizer or bad kwargs fail here
    return run_job(config, out, on_reports)


__all__ = ["TrainResult", "held_out_loss", "model_meta", "run_job", "train"]
