"""``Engine.train_step``: micro-batching, loss, gradient synchronisation, clipping, optimizer step, stats.

One step on a data-parallel rank with m micro-batches of its share of the global batch::

    N = scored tokens of the whole global batch        (one all-reduce of m integers over dp)
    for each micro-batch k:  s_k = sum of loss_fn's per-token losses on (model(x_k), y_k);  backward(s_k G / N)
    sync gradients (average over the G ranks of dp_cp);  clip;  optimizer.step();  zero_grad

How the micro-batches run forward and backward is the engine's ``StepRunner``, chosen once by
``plait.parallelize`` (``plait.parallel.runner``: plain, pipeline schedule, or PipeDream, which also applies
the updates itself). The average over replicas of sum_k s_k G / N is the global batch's sum / N: the gradient
of the token mean one device computes on the global batch, whatever the loss masks
(``plait.parallel.loss_normalization``; a loss that is not a token mean is averaged per micro-batch instead).
The loss reported is the global sum / N, the same number on every rank.

A Mixture-of-Experts model (``plait.models.moe``) also trains on its balance loss, which each MoE layer hands its
own gradient: before the step the Engine sets that gradient's scale to G / B (B sequences in the global batch,
times the fp16 loss scale), after it the routing statistics are summed over every rank, the aux-free biases move,
and ``StepStats.moe`` reports them (``plait.parallel.expert.stats``; docs/expert_parallel.md).

The hot path never waits for the device: the loss and the gradient norm stay 0-dim tensors until read
(``StepStats.loss``), clipping scales by a tensor factor, and fp16 loss scaling checks every gradient for
inf/NaN in one fused pass and reads one flag per step (the only host sync of an fp16 step; none under bf16 /
fp32). So on a GPU the host queues step n+1 while step n runs, as a plain PyTorch loop does when it does not
print its loss every step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from plait import checkpoint
from plait.comm import Comm, CommStats
from plait.errors import LayoutError
from plait.layout import Layout
from plait.mesh import Mesh
from plait.models import inputs as model_inputs
from plait.models.loss import LossFn, MeanLoss, apply_loss, apply_total
from plait.observe.trace import no_span
from plait.parallel.loss_normalization import StepLoss, step_loss
from plait.parallel.precision import MixedPrecision
from plait.parallel.runner import StepRunner
from plait.parallel.strategy import DataParallelStrategy

if TYPE_CHECKING:
    from plait.parallel.expert.stats import MoEStepStats, RouterStats
    from plait.parallel.pipeline.runtime import PipelineRunner
    from plait.parallel.pipeline.simulate import SimResult
    from plait.parallel.semisync import OuterLoop

Metric = Callable[[torch.Tensor, torch.Tensor], tuple[int, int]]


Scalar = float | torch.Tensor
"""A number that may still be a 0-dim tensor on the device (read lazily)."""


def _host(value: Scalar | None) -> float | None:
    return float(value) if isinstance(value, torch.Tensor) else value


class StepStats:
    """What one ``train_step`` did. ``loss`` is identical on every rank; ``comm`` is this rank's traffic.

    ``loss`` and ``grad_norm`` are computed on the device and read lazily: the step itself never waits for the
    device, so the host can queue the next step while this one runs (Engine module docstring). Reading either
    waits for the step once (a host sync); the value is then cached. ``loss_tensor`` / ``grad_norm_tensor`` give
    the 0-dim tensors without waiting."""

    def __init__(
        self,
        step: int,
        loss: Scalar,
        tokens: int,
        seconds: float,
        grad_norm: Scalar | None = None,
        comm: CommStats | None = None,
        skipped: bool = False,
        loss_scale: float | None = None,
        staleness: dict[int, dict[str, float]] | None = None,
        moe: MoEStepStats | None = None,
        scored: Scalar | None = None,
    ) -> None:
        self.step = step
        self.tokens = tokens
        self.seconds = seconds
        """Host time of the call (on a GPU without syncs: the time to queue the step, not to run it)."""
        self.comm = comm if comm is not None else CommStats()
        self.skipped = skipped
        """True when fp16 loss scaling found inf/NaN gradients and skipped the optimizer step."""
        self.loss_scale = loss_scale
        self.staleness = staleness
        """PipeDream: per local stage, the step's mean/max staleness, its updates and most weight versions stashed."""
        self.moe = moe
        """Mixture-of-Experts models: per layer the tokens routed to each expert, the dropped ones, and the balance
        loss of the step (``plait.parallel.expert.stats``; the same on every rank, read lazily); else None."""
        self._loss: Scalar = loss
        self._grad_norm: Scalar | None = grad_norm
        self._scored: Scalar | None = scored

    @property
    def scored(self) -> float | None:
        """The scored tokens ``loss`` is a mean over (a token-mean loss; read lazily), None for any other loss. 0:
        no token was scored, the loss is 0/0 (NaN) and the gradient zero: not a divergence."""
        if isinstance(self._scored, torch.Tensor):
            self._scored = float(self._scored)
        return self._scored

    @property
    def loss(self) -> float:
        """The step's mean loss over the global batch (reading it waits for the step on the device, once)."""
        if isinstance(self._loss, torch.Tensor):
            self._loss = float(self._loss)
        return self._loss

    @property
    def loss_tensor(self) -> torch.Tensor:
        """The loss as a 0-dim tensor (no host sync)."""
        return self._loss if isinstance(self._loss, torch.Tensor) else torch.tensor(self._loss)

    @property
    def grad_norm(self) -> float | None:
        """The global gradient norm before clipping (None without clipping or for a skipped step)."""
        if isinstance(self._grad_norm, torch.Tensor):
            self._grad_norm = float(self._grad_norm)
        return self._grad_norm

    @property
    def grad_norm_tensor(self) -> torch.Tensor | None:
        """The norm as a 0-dim tensor (no host sync), or None."""
        norm = self._grad_norm
        return norm if isinstance(norm, torch.Tensor) or norm is None else torch.tensor(norm)

    @property
    def materialized(self) -> bool:
        """Whether reading ``loss`` and ``grad_norm`` no longer needs the device."""
        return not isinstance(self._loss, torch.Tensor) and not isinstance(self._grad_norm, torch.Tensor)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")

    def __repr__(self) -> str:
        loss = f"{_host(self._loss):.6g}" if self.materialized else "<on device>"
        return f"StepStats(step={self.step}, loss={loss}, tokens={self.tokens}, seconds={self.seconds:.4g})"


@dataclass
class EvalStats:
    """Mean loss over the evaluated tokens (a token-mean loss) or samples and, with a metric, the share it counts
    correct."""

    loss: float
    correct: int = 0
    total: int = 0

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else float("nan")


class Engine:
    """Trains one (possibly parallelised) model under a resolved Layout. Built by ``plait.parallelize``."""

    def __init__(
        self,
        model: nn.Module,
        layout: Layout,
        mesh: Mesh,
        comm: Comm,
        strategy: DataParallelStrategy,
        runner: StepRunner,
        loss_fn: LossFn,
        device: torch.device,
        precision: MixedPrecision,
        max_grad_norm: float | None = None,
        lr_scheduler: Any | None = None,
    ) -> None:
        self.model = model
        self.runner = runner
        """Runs each step's micro-batches forward and backward (``plait.parallel.runner``)."""
        self.layout = layout
        self.mesh = mesh
        self.comm = comm
        self.strategy = strategy
        self.loss_fn = loss_fn
        self.device = device
        self.max_grad_norm = max_grad_norm
        self.lr_scheduler = lr_scheduler
        self.precision = precision
        self.step = 0
        self.run_id: str | None = None
        """The run of the checkpoint this engine resumed from (``plait.checkpoint.catalog``: kept by the next save
        into a checkpoint folder that has no run id yet)."""
        self.before_optimizer_step: list[Callable[[Engine], None]] = []
        """Hooks called with the engine once gradients are synchronised (and clipped), before the step."""
        self.commit_gradients: Callable[[Engine], bool] | None = None
        """Per-step fault tolerance (``plait.ft``): called once the gradients are synchronised inside this
        layout, before unscaling and clipping; it combines them across replica groups and returns whether the
        update is committed. False skips the update as an fp16 overflow does (no optimizer or lr step)."""
        self.step_loss: StepLoss | None = None
        """The running step's loss normalisation (its token counts), for ``commit_gradients``."""
        self.step_total: torch.Tensor | None = None
        """The running step's accumulated loss (what ``StepLoss.report`` reads), for ``commit_gradients``."""
        self.experts: RouterStats | None = None
        """Mixture-of-Experts models (set by ``plait.parallelize``): the balance loss's weight set before each step,
        the routing statistics gathered after it (``plait.parallel.expert.stats``)."""
        self.outer: OuterLoop | None = None
        """Semi-synchronous training (set by ``plait.parallelize``): inner steps inside each HSDP replica group, an
        outer step across the groups every H steps (``plait.parallel.semisync``); None: every step synchronous."""

    @property
    def pipeline(self) -> PipelineRunner | None:
        """With pp > 1: the runner of this rank's pipeline stages (its schedule, timeline, stages); else None."""
        from plait.parallel.pipeline.runtime import PipelineRunner

        return self.runner if isinstance(self.runner, PipelineRunner) else None

    # ----------------------------------------------------------------- training
    def _split(self, batch: tuple[model_inputs.Inputs, torch.Tensor]) -> list[tuple[model_inputs.Inputs, torch.Tensor]]:
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise TypeError("a batch is (inputs, targets): the share of the global batch for this data-parallel rank")
        inputs, targets = batch
        rows = model_inputs.tokens_of(inputs).shape[0]  # inputs: token ids, or (token ids, document positions)
        m = self.layout.microbatches
        if rows % m or rows == 0:
            raise LayoutError(
                f"this rank's batch of {rows} samples does not split into microbatches={m}. "
                f"Fix: make the per-rank batch (global batch / dp={self.layout.dp}) a multiple of {m}."
            )
        inputs = model_inputs.to_device(inputs, self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        return list(zip(model_inputs.chunk(inputs, m), targets.chunk(m)))

    def train_step(self, batch: tuple[model_inputs.Inputs, torch.Tensor]) -> StepStats:
        """Forward and backward over the micro-batches, average gradients, clip, step the optimizer."""
        start = time.perf_counter()
        tracer = self.comm.tracer  # plait.observe.trace.Tracer while one records; None costs this one check
        traced_from = tracer.now() if tracer is not None else 0
        before = self.comm.stats.snapshot()
        micro = self._split(batch)
        self.model.train()
        window = self.runner.update_window(len(micro))
        if self.outer is not None:  # DiLoCo keeps theta at a window's start
            self.outer.begin_step(self.step)
        group = "shard" if self.outer is not None else None  # semi-synchronous: token means over one replica group
        loss = step_loss(self.loss_fn, self.comm, [targets for _, targets in micro], window, group)
        self.step_loss, self.step_total = loss, None  # before experts.begin: plait.ft weighs by its token counts
        sequences = batch[1].shape[0] * self.mesh.size("dp")  # the global batch's sequences (balance loss)
        if self.experts is not None:
            self.experts.begin(sequences, self.precision.loss_scale)
        total = self.runner.run(micro, self.apply_update, loss)
        self.step_total = total
        skipped, grad_norm = (False, None) if self.runner.owns_updates else self.apply_update()
        if self.outer is not None:  # after steps H, 2H, ...: the outer step across the replica groups
            self.outer.end_step(self.step + 1)
        staleness = self.runner.staleness()
        reported = loss.report(total)
        moe = self.experts.end(sequences, update_biases=not skipped) if self.experts is not None else None
        self.step += 1
        if tracer is not None:
            tracer.step(self.step, traced_from)
        tokens = batch[1].numel() * self.mesh.size("dp")
        return StepStats(
            step=self.step,
            loss=reported,
            tokens=tokens,
            seconds=time.perf_counter() - start,
            grad_norm=grad_norm,
            comm=self.comm.stats.since(before),
            skipped=skipped,
            loss_scale=self.precision.loss_scale,
            staleness=staleness,
            moe=moe,
            scored=loss.scored,
        )

    def apply_update(self) -> tuple[bool, torch.Tensor | None]:
        """One optimizer update from the accumulated gradients: sync them, unscale, clip, step, zero them, step
        the lr scheduler. Returns (skipped, grad norm). Once per train_step; PipeDream calls it per update."""
        span = self.comm.tracer.span if self.comm.tracer is not None else no_span
        with span("grad sync", "sync"):
            self.strategy.finish_backward()
            self.strategy.reduce_sequence_parallel_grads()  # Megatron-SP: sum tp-partial grads (no-op otherwise)
        with span("optimizer", "optimizer"):
            return self._update()

    def _update(self) -> tuple[bool, torch.Tensor | None]:
        """``apply_update`` once the gradients are synchronised: unscale, check, clip, step, zero, lr step."""
        committed = self.commit_gradients is None or self.commit_gradients(self)
        skipped = not committed or not self.precision.unscale_and_check(self.strategy)
        grad_norm = None
        if not skipped:
            grad_norm = self.strategy.clip_grad_norm(self.max_grad_norm) if self.max_grad_norm else None
            for hook in self.before_optimizer_step:
                hook(self)
            self.strategy.step()
        self.strategy.zero_grad()
        if self.lr_scheduler is not None and not skipped:
            self.lr_scheduler.step()
        return skipped, grad_norm

    @torch.no_grad()
    def evaluate(
        self, batches: Iterable[tuple[model_inputs.Inputs, torch.Tensor]], metric: Metric | None = None
    ) -> EvalStats:
        """Mean loss (and ``metric``'s correct/total counts) over ``batches``, summed over every dp rank: a token
        mean (``MeanLoss``) over every scored token of every batch, any other loss over samples."""
        was_training = self.model.training
        self.model.eval()
        totals = torch.zeros(4, dtype=torch.float64, device=self.device)  # loss sum, items, correct, total
        mean = self.loss_fn if isinstance(self.loss_fn, MeanLoss) else None
        for inputs, targets in batches:
            inputs, targets = model_inputs.to_device(inputs, self.device), targets.to(self.device)
            with self.precision.autocast():
                output = self.runner.forward(inputs)
                if output is None:  # pipeline: only the rank with the last stage has the output
                    continue
                if mean is not None:  # a token mean: sum and count, so batches weigh by their scored tokens
                    totals[0] += apply_total(mean, output, targets).detach().to(totals.dtype)
                    totals[1] += mean.count(targets).to(totals.dtype)
                else:  # any other loss: a mean per sample
                    loss = apply_loss(self.loss_fn, output, targets)
                    totals[0] += loss.detach().to(totals.dtype) * targets.shape[0]  # on the device: no sync
                    totals[1] += targets.shape[0]
            if metric is not None:
                correct, total = metric(output, targets)
                totals[2] += correct
                totals[3] += total
        self.model.train(was_training)
        if self.pipeline is not None:
            self.comm.broadcast(totals, "pp", src=self.pipeline.last_rank_index)
        # Over dp only: under context parallelism every cp rank evaluated the gathered, full outputs, so summing
        # over dp_cp would count each sample cp times.
        self.comm.all_reduce(totals, "dp")
        loss_value = float(totals[0] / totals[1]) if totals[1] else float("nan")
        return EvalStats(loss=loss_value, correct=int(totals[2]), total=int(totals[3]))

    # ----------------------------------------------------------------- pipeline pictures
    def pipeline_timeline(self) -> SimResult:
        """The last ``train_step`` as measured on every rank of this rank's pp group (ms; a collective over
        "pp"): a ``SimResult`` with real timelines, busy/idle times and bubble fraction."""
        if self.pipeline is None:
            raise LayoutError(
                "pipeline_timeline needs pipeline parallelism, but the layout has pp=1. Fix: train with Layout(pp > 1)."
            )
        from plait.parallel.pipeline.measured import gather_timeline

        return gather_timeline(self.pipeline)

    def save_pipeline_trace(self, path: str | Path | None, png: str | Path | None = None) -> SimResult:
        """Gather ``pipeline_timeline()`` (every rank must call) and, on global rank 0, write it as a
        Chrome/Perfetto trace to ``path`` (ui.perfetto.dev) and as a picture to ``png`` (ranks x time,
        measured bubble in the title). Returns the timeline."""
        from plait.observe.pipeline_picture import save_timeline

        result = self.pipeline_timeline()
        if self.mesh.rank == 0:
            save_timeline(result, path, png)
        return result

    # ----------------------------------------------------------------- checkpoints
    def save(self, directory: str | Path) -> Path:
        """Write model, optimizer, lr scheduler and random states under ``directory`` atomically, each rank its
        own pieces of the whole tensors with their SHA-256; returns the checkpoint's folder (docs/checkpoints.md;
        ``plait.checkpoint.Checkpointer`` adds asynchronous saves and retention)."""
        return checkpoint.save(self, directory)

    def load(self, directory: str | Path) -> int:
        """Load the newest intact checkpoint under ``directory`` (or the step folder ``directory``), saved under
        any layout, after checking its files' sizes and SHA-256; a damaged or incomplete newer one is skipped
        with one warning. Returns its step."""
        return checkpoint.load(self, directory)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer that steps (over the model's parameters, or over this rank's shards under ZeRO)."""
        return self.strategy.optimizer

    @property
    def module(self) -> nn.Module:
        """The model being trained (this rank's part of it)."""
        return self.model
