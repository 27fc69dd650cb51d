"""Run records: one JSON object per line in ``metrics.jsonl`` (train steps and evaluations), and a PNG of the
loss and accuracy curves. Written by rank 0 only.

``StepMeter`` adds, per step, what every rank saw (one small all-gather over "world"): peak memory per rank
and bytes sent per mesh axis per rank, plus the model FLOPs utilisation

    MFU = tokens x model FLOPs per token / step seconds / peak FLOP/s of all devices

Model FLOPs per token are the model description's (``plait.models.spec.ModelSpec.flops_per_token``, the
count ``GPT.flops_per_token`` and the planner use too: Narayanan et al. 2021, eq. 3, forward 2 b s [matmul
parameters] + 4 b s^2 h per block plus 2 b s h V for the logits; backward twice the forward; recomputation
excluded, as in Chowdhery et al. 2022, app. B). The peak is the hardware catalogue's dense figure
for the GPU named by ``torch.cuda.get_device_name`` at the layout's precision (fp32: TF32), times the world
size; on CPU it is ``plait calibrate``'s measured matmul FLOP/s of the whole machine, times the number of
hosts; otherwise MFU is null and one log line names ``plait calibrate``. A model the planner cannot describe
(a ``ConfigError`` from its description, e.g. a Hugging Face config it does not know) trains with MFU null.

Every file is strict JSON (RFC 8259, which has no NaN or Infinity): a non-finite number (a NaN loss, an undefined
entropy) is written as ``null`` (``json_safe``). A training step whose loss or gradient norm is not finite, and
whose update the optimizer applied, stops the run (``check_step``): its record is written first, then every rank
raises the same ``PlaitError`` (the loss is the same on every rank), so ``plait train`` exits non-zero. A step that
scored no token at all (``StepStats.scored`` 0: every target masked) has the loss 0/0, NaN, and a zero gradient: it
is recorded as null and the run goes on.

A Mixture-of-Experts model adds a ``moe`` object to each train record (``moe_record``): per MoE layer (``layers``:
block indices) the tokens routed to each expert in the step (``load``, summed over every rank), the imbalance
(most-loaded expert over the mean), the choices dropped by a capacity cap, and the step's balance loss.

With ``train.straggler_every`` N, every N-th train record also names the slowest rank (``straggler_rank``,
``straggler_host``, ``straggler_lag``) and per rank the window's compute, comm and wait seconds per step
(``rank_seconds``): ``plait.observe.stragglers``, whose two numbers per rank ride the same all-gather.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from plait.engine import Engine, EvalStats, StepStats
from plait.errors import ConfigError, PlaitError
from plait.logging import get_logger
from plait.observe.stragglers import StragglerMeter
from plait.parallel.expert.stats import MoEStepStats

log = get_logger(__name__)


def step_record(stats: StepStats, lr: float) -> dict[str, Any]:
    """The JSON record of one training step (bytes per mesh axis on rank 0, ring model). ``skipped``: fp16 loss
    scaling found inf/NaN gradients and the optimizer did not step; ``loss_scale``: the scale after this step's
    update (halved after a skip; null without fp16)."""
    return {
        "kind": "train",
        "step": stats.step,
        "loss": stats.loss,
        "tokens_per_s": stats.tokens_per_s,
        "seconds": stats.seconds,
        "grad_norm": stats.grad_norm,
        "lr": lr,
        "skipped": stats.skipped,
        "loss_scale": stats.loss_scale,
        "comm_bytes": {axis: int(b) for axis, b in stats.comm.wire_by_axis().items()},
    } | ({"moe": moe_record(stats.moe)} if stats.moe is not None else {})


def moe_record(moe: MoEStepStats) -> dict[str, Any]:
    """The ``moe`` object of a train record (module docstring)."""
    return {
        "layers": list(moe.layers),
        "aux_loss": moe.aux_loss,
        "load": moe.load,
        "imbalance": moe.imbalance,
        "dropped": moe.dropped,
        "dropped_fraction": moe.dropped_fraction,
    }


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, +-inf) replaced by None, in nested dicts, lists and tuples."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def dumps(value: Any, **options: Any) -> str:
    """Strict JSON of ``value``: non-finite floats as null (``json_safe``), never a bare NaN."""
    return json.dumps(json_safe(value), allow_nan=False, **options)


def check_step(stats: StepStats) -> None:
    """``PlaitError`` when a step's loss or gradient norm is NaN or infinite and the optimizer stepped anyway (a
    step that fp16 loss scaling skipped left the weights alone: the scaler's own remedy, not an error)."""
    if stats.skipped:
        return
    values = {"loss": stats.loss, "gradient norm": stats.grad_norm}
    if stats.scored == 0:  # no token scored: the loss is 0/0, the weights had a zero gradient
        del values["loss"]
    bad = {name: value for name, value in values.items() if value is not None and not math.isfinite(value)}
    if bad:
        what = ", ".join(f"{name} {value}" for name, value in bad.items())
        raise PlaitError(
            f"step {stats.step}: {what}: training diverged and the weights are no longer finite. Fix: a smaller "
            f"train.lr or a longer train.warmup_steps, gradient clipping on (train.max_grad_norm, e.g. 1.0), bf16 "
            f"rather than fp16, and check the data; resume from a checkpoint before step {stats.step}."
        )


def model_flops_per_token(model: Any, seq: int) -> float:
    """Model FLOPs of one trained token (forward + backward) for sequences of ``seq`` tokens:
    ``ModelSpec.flops_per_token`` of the model's description. ``model``: a ``ModelSpec`` or anything
    ``plait.planner.models.resolve_model`` takes (a GPT, GPTConfig, Hugging Face model or config, a name)."""
    from plait.models.spec import ModelSpec

    if not isinstance(model, ModelSpec):
        from plait.planner.models import resolve_model

        model = resolve_model(model, seq)
    if isinstance(model, list):
        raise TypeError("model FLOPs need a transformer spec, not a list of measured layer profiles.")
    return float(model.flops_per_token(seq))


def catalogue_gpu(device_name: str) -> str | None:
    """The hardware catalogue key of a ``torch.cuda.get_device_name`` (SXM parts only), or None."""
    name = device_name.lower().replace(" ", "").replace("-", "")
    if "b200" in name:
        return "b200"
    for key in ("h200", "h100"):  # PCIe / NVL variants have lower peaks than the SXM entries
        if key in name:
            return None if "pcie" in name or "nvl" in name else key
    if "a100" in name:
        return "a100-80gb" if "80g" in name else "a100-40gb"
    return None


def peak_flops(device: torch.device, precision: str, world_size: int) -> tuple[float | None, str]:
    """Peak dense FLOP/s of all ``world_size`` ranks together and where it comes from (None: unknown)."""
    from plait.planner.hardware import THIS_MACHINE, calibration_path, get_hardware

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        key = catalogue_gpu(name)
        if key is None:
            return None, f"GPU {name!r} is not in the hardware catalogue (plait/planner/hardware.py)"
        return get_hardware(key).flops(precision) * world_size, f"catalogue {key} x {world_size}"
    if not calibration_path().is_file():
        return None, f"no calibration of this machine at {calibration_path()}"
    hosts = max(1, world_size // int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    return get_hardware(THIS_MACHINE).flops(precision) * hosts, f"plait calibrate ({calibration_path()}) x {hosts}"


class StepMeter:
    """Per-step tokens/s, MFU, peak memory per rank and bytes per axis per rank (``measure`` is a collective)."""

    def __init__(self, engine: Engine, model: Any, seq: int, stragglers: StragglerMeter | None = None) -> None:
        self.engine, self.device = engine, engine.comm.device
        self.stragglers = stragglers
        """Straggler detection (``plait.observe.stragglers``): its window sums ride this all-gather."""
        self.axes = [a for a in engine.mesh.grid.axes if engine.mesh.size(a) > 1]
        self.flops_per_token: float | None = None
        try:
            self.flops_per_token = model_flops_per_token(model, seq)
        except ConfigError as error:  # a model the planner cannot describe (yet) trains all the same
            log.info("model FLOPs unknown, so MFU is null in metrics.jsonl: %s", error)
        self.peak, source = peak_flops(self.device, engine.layout.precision, engine.mesh.world_size)
        self.memory_field = "max_allocated_bytes" if self.device.type == "cuda" else "max_rss_bytes"
        self.stop_signal = 0
        """After ``measure``: the signal some rank was asked to stop by (0: none), agreed by every rank."""
        if self.flops_per_token is None:
            pass
        elif self.peak is None:
            log.info(
                "MFU unknown (null in metrics.jsonl): %s. Fix: run `plait calibrate` to measure this machine.", source
            )
        else:
            log.info(
                "MFU against %.4g TFLOP/s peak (%s); %.4g model FLOPs per token",
                self.peak / 1e12,
                source,
                self.flops_per_token,
            )

    def before_step(self) -> None:
        """Start a step's memory peak (CUDA: reset the allocator's peak; CPU RSS peaks are process-lifetime)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def measure(self, stats: StepStats, stop_signal: int = 0) -> dict[str, Any]:
        """The fields this adds to the step's record. Every rank must call it (an all-gather over "world").

        The same all-gather carries each rank's ``stop_signal`` (the signal it was asked to stop by, 0 for none:
        ``plait.train.stop``); afterwards ``self.stop_signal`` is the largest of them, the same on every rank, so
        the ranks agree to stop after the same step at the cost of one more number per rank. With ``stragglers``
        it also carries that meter's two window sums per rank, and a window's end adds its fields."""
        from plait.observe.trace import max_rss_bytes

        memory = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else max_rss_bytes()
        wire = stats.comm.wire_by_axis()
        extra = self.stragglers.columns(stats) if self.stragglers is not None else []
        mine = torch.tensor(
            [float(stop_signal), float(memory)] + [wire.get(a, 0.0) for a in self.axes] + extra, dtype=torch.float64
        )
        width = 2 + len(self.axes)
        gathered = self.engine.comm.all_gather(mine.to(self.device), "world").cpu().view(-1, width + len(extra))
        self.stop_signal = int(gathered[:, 0].max().item())
        rows = gathered[:, 1:width]
        window = self.stragglers.gathered(stats.step, gathered[:, width:]) if self.stragglers is not None else {}
        flops, seconds = self.flops_per_token, stats.seconds
        mfu = stats.tokens * flops / seconds / self.peak if self.peak and flops and seconds else None
        return {
            "mfu": mfu,
            "model_flops_per_token": self.flops_per_token,
            self.memory_field: [int(v) for v in rows[:, 0].tolist()],
            "comm_bytes_per_rank": {
                a: [int(v) for v in rows[:, 1 + i].tolist()] for i, a in enumerate(self.axes) if rows[:, 1 + i].any()
            },
        } | window


def eval_record(step: int, stats: EvalStats) -> dict[str, Any]:
    return {"kind": "eval", "step": step, "loss": stats.loss, "accuracy": stats.accuracy, "samples": stats.total}


class MetricsWriter:
    """Appends records to ``<folder>/metrics.jsonl`` (line-buffered, so a crash loses at most one line), and
    hands each to ``also`` (e.g. ``plait.train.tensorboard.TensorBoardLog``) when given."""

    def __init__(self, folder: Path, also: Any = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / "metrics.jsonl"
        self._file = open(self.path, "a", buffering=1)
        self.also = also

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(dumps(record) + "\n")
        if self.also is not None:
            self.also.write(record)

    def close(self) -> None:
        self._file.close()
        if self.also is not None:
            self.also.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _number(value: float | None) -> float:
    """A plotted value: null (a non-finite number, ``json_safe``) as NaN, which matplotlib leaves out."""
    return float("nan") if value is None else float(value)


def plot_metrics(metrics_path: Path, out_path: Path, title: str = "") -> Path:
    """Draw training loss (and evaluation loss/accuracy when present) against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot([r["step"] for r in train], [_number(r["loss"]) for r in train], label="train loss", color="tab:blue", lw=1)
    if evals:
        losses = [_number(r["loss"]) for r in evals]
        ax.plot([r["step"] for r in evals], losses, "o-", label="eval loss", color="tab:orange")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    if evals:
        acc = ax.twinx()
        acc.plot(
            [r["step"] for r in evals],
            [100 * _number(r["accuracy"]) for r in evals],
            "s--",
            color="tab:green",
            label="eval accuracy",
        )
        acc.set_ylabel("accuracy (%)")
        acc.set_ylim(0, 100)
        acc.legend(loc="center right")
    ax.legend(loc="upper right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out_path)
    plt.close(fig)
    return out_path
