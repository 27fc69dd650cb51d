"""PipeDream (Narayanan et al., SOSP 2019): asynchronous pipeline training with weight stashing.

Each stage runs the 1F1B order (``generators.pipedream``) and applies an optimizer update after every backward
(or every ``update_interval`` backwards), so micro-batches in flight see different weight versions. Version v of
a stage is its weights after v updates. With p stages, stage r (0-based) runs micro-batch j's forward after
max(0, j - (p - r - 1)) updates and its backward after j updates: in steady state the gradient applied at update
t was computed on version t - (p - r - 1), the paper's W_r^(t - p + r + 1).

- **Weight stashing**: the forward of micro-batch j runs on a stashed copy of the version current at that time
  (``torch.func.functional_call`` with leaf tensors cloned from the live weights, shared by every micro-batch of
  that version), and its backward differentiates that same graph, so forward and backward see one version. The
  gradient lands on the stash's leaves, is moved to the live parameters' ``.grad`` and applied to the *latest*
  weights, as the paper does. Stage r holds at most p - r versions (the micro-batches it has in flight).
- **Vertical sync** (``vertical_sync=True``): every stage runs micro-batch j on the version the first stage
  used for it; that version id travels with the activation (a one-element int64 tag after each activation in
  the same batched ``send_recv``). A stage keeps each new version from the update that makes it until no
  future micro-batch can ask for it; every stage's staleness is then the first stage's, min(j, p - 1).
- **Staleness** (``staleness()``, ``StepStats.staleness``): per micro-batch, the updates between the version
  its forward used and the update that applied its gradient; per stage the step's mean and max.
- **1F1B-RR** (replicated stages): with ``Layout.dp = r`` every stage has r replicas, the dp group of its pp
  index. Global micro-batch g goes to replica g mod r (``round_robin``, ``replica_batch``); at every update the
  replicas average their gradients over dp (the Engine's update: ``strategy.finish_backward``), so they apply
  the same update and stay identical. Unequal replication per stage would need groups plait's Mesh does not
  build; it is not supported.

The pipeline drains at the end of every ``train_step`` (the paper's never flushes): micro-batch j of a step
sees staleness min(j, p - r - 1), the paper's p - r - 1 from micro-batch p - r - 1 of every step on, and a
checkpoint between steps holds no in-flight state. ``stash_weights=False`` (for tests) emulates PipeDream
without stashing: the backward then runs with the latest weights (copied into the graph's weight tensors) on
the activations the older forward produced. See docs/pipeline.md, "PipeDream (asynchronous)".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from plait.comm import Comm
from plait.errors import LayoutError, ScheduleError
from plait.layout import Layout, PipelineSchedule, Precision
from plait.logging import get_logger
from plait.parallel.loss_normalization import StepLoss
from plait.parallel.pipeline.runtime import ParamScope, PipelineRunner
from plait.parallel.pipeline.schedule import Action, Kind, Schedule
from plait.parallel.pipeline.stage import PipelineStage
from plait.parallel.precision import MixedPrecision
from plait.parallel.runner import Micro, NoSync, UpdateFn

logger = get_logger(__name__)

Weights = dict[str, torch.Tensor]


@dataclass(frozen=True)
class PipeDreamOptions:
    """How the asynchronous pipeline updates (``plait.parallelize(..., pipedream=PipeDreamOptions(...))``)."""

    update_interval: int = 1
    """A stage updates after every this many backwards (the micro-batches must be a multiple of it)."""
    vertical_sync: bool = False
    """Every stage runs a micro-batch on the weight version the first stage used for it."""
    stash_weights: bool = True
    """False only to show what stashing prevents: the backward then uses the latest weights."""
    record_versions: bool = False
    """Keep a ``VersionRecord`` (with copies of the weights) per micro-batch and stage, for tests."""


@dataclass(frozen=True)
class VersionRecord:
    """What one micro-batch's forward and backward used on one stage (``record_versions=True``)."""

    stage: int
    microbatch: int
    """Index in the stream of micro-batches since training started (step x m + j)."""
    forward_version: int
    backward_version: int
    forward_weights: torch.Tensor
    """The stage's weights the forward ran with, flattened."""
    backward_weights: torch.Tensor
    """The weights held by the graph the backward differentiated, read just before it ran."""
    live_weights: torch.Tensor
    """The stage's latest weights when the backward ran."""


def check_pipedream(layout: Layout, options: PipeDreamOptions | None, max_grad_norm: float | None) -> None:
    """Refuse, before any communication, what the asynchronous pipeline cannot run (LayoutError, with a fix)."""
    if layout.schedule != PipelineSchedule.PIPEDREAM or layout.pp == 1:
        if options is not None:
            raise LayoutError(
                f"pipedream options were given, but the layout runs schedule={layout.schedule!r} with "
                f"pp={layout.pp}. Fix: set schedule='pipedream' and pp > 1, or leave the options out."
            )
        return
    options = options or PipeDreamOptions()
    if (
        isinstance(options.update_interval, bool)
        or not isinstance(options.update_interval, int)
        or options.update_interval < 1
        or layout.microbatches % options.update_interval
    ):
        raise LayoutError(
            f"pipedream update_interval={options.update_interval!r} must be a positive divisor of "
            f"microbatches={layout.microbatches}. Fix: use 1 or a divisor of {layout.microbatches}."
        )
    if options.vertical_sync and not options.stash_weights:
        raise LayoutError(
            "pipedream vertical_sync=True needs stash_weights=True (it runs older versions). "
            "Fix: keep stash_weights=True."
        )
    refusals = [
        (
            max_grad_norm is not None,
            f"max_grad_norm={max_grad_norm}: clipping by a global norm needs every stage "
            "at the same update, but PipeDream's stages update independently",
            "max_grad_norm=None (plait train: --set train.max_grad_norm=0)",
        ),
        (
            layout.precision == Precision.FP16,
            "precision='fp16': the loss-scaling overflow check is global over the stages, which update independently",
            "precision='bf16' or 'fp32'",
        ),
        (
            layout.tp > 1 or layout.cp > 1,
            f"tp={layout.tp} cp={layout.cp}: tensor and context parallelism are not combined with the pipeline",
            "tp=1 and cp=1",
        ),
        (
            layout.zero != 0,
            f"zero={layout.zero}: a per-micro-batch update of a sharded optimizer is not implemented for PipeDream",
            "zero=0 (replicated stages over dp use DDP's all-reduce)",
        ),
    ]
    for refused, what, fix in refusals:
        if refused:
            raise LayoutError(f"schedule='pipedream' with {what}. Fix: use {fix}.")


def round_robin(microbatches: int, replicas: int) -> list[list[int]]:
    """1F1B-RR routing: global micro-batch g goes to replica g mod r; each replica's micro-batches in order."""
    if microbatches < 1 or replicas < 1 or microbatches % replicas:
        raise ValueError(
            f"{microbatches} micro-batches cannot be dealt evenly to {replicas} replicas. Fix: use a "
            f"multiple of {replicas}."
        )
    return [list(range(d, microbatches, replicas)) for d in range(replicas)]


def replica_batch(
    global_batch: tuple[torch.Tensor, torch.Tensor], microbatches: int, replicas: int, index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica ``index``'s rows of a global batch under 1F1B-RR: the batch is cut into ``microbatches`` x
    ``replicas`` micro-batches in order and replica d trains on d, d + r, d + 2r, ... (concatenated, so the
    Engine's split into ``microbatches`` yields them in stream order; update j then averages the stream's
    micro-batches j r .. j r + r - 1 over the replicas)."""
    inputs, targets = global_batch
    total = microbatches * replicas
    if inputs.shape[0] % total:
        raise ValueError(
            f"a global batch of {inputs.shape[0]} rows does not cut into {total} micro-batches "
            f"(microbatches={microbatches} x replicas={replicas}). Fix: use a multiple of {total} rows."
        )
    picks = round_robin(total, replicas)[index]
    pieces_in, pieces_target = inputs.chunk(total), targets.chunk(total)
    return torch.cat([pieces_in[g] for g in picks]), torch.cat([pieces_target[g] for g in picks])


class VersionedModule(nn.Module):
    """Runs ``inner`` on the weights in ``self.weights`` ({name: tensor}, one stashed version) when set, and on its
    own parameters otherwise (evaluation, the shape pass)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.weights: Weights | None = None

    def forward(self, inputs: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if self.weights is None:
            return self.inner(inputs, **kwargs)
        return functional_call(self.inner, self.weights, (inputs,), kwargs)


class WeightVersions:
    """The versions of one stage's weights: ``current`` updates applied; stashed copies by version id."""

    def __init__(self, module: nn.Module, keep_new: bool) -> None:
        self.live = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self.keep_new = keep_new
        """Vertical sync: stash each new version at once (a later micro-batch may ask for it)."""
        self.current = 0
        self.stash: dict[int, Weights] = {}
        self.peak = 0

    def copy(self) -> Weights:
        """Leaf copies of the live weights (they collect the gradient of the graphs built on them)."""
        return {name: p.detach().clone().requires_grad_(True) for name, p in self.live}

    def get(self, version: int) -> Weights:
        if version not in self.stash:
            if version != self.current:
                raise ScheduleError(
                    f"weight version {version} was asked for but is not stashed (current "
                    f"{self.current}, stashed {sorted(self.stash)}): the schedule feeds this stage "
                    f"micro-batches out of the first stage's order. Fix: use vertical_sync=False."
                )
            self.stash[version] = self.copy()
            self.peak = max(self.peak, len(self.stash))
        return self.stash[version]

    def advance(self) -> None:
        self.current += 1
        if self.keep_new:
            self.get(self.current)

    def prune(self, in_use: set[int], floor: int) -> None:
        """Drop versions below ``floor`` that no micro-batch in flight uses."""
        for version in [v for v in self.stash if v < floor and v not in in_use]:
            del self.stash[version]

    def flat_live(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for _, p in self.live]).clone()


def _flat(weights: Weights) -> torch.Tensor:
    return torch.cat([w.detach().reshape(-1) for w in weights.values()]).clone()


class PipeDreamRunner(PipelineRunner):
    """Runs the 1F1B order of ``schedule`` with an optimizer update per micro-batch and weight stashing."""

    owns_updates = True

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        schedule: Schedule,
        comm: Comm,
        precision: MixedPrecision,
        options: PipeDreamOptions | None = None,
        *,
        no_sync: NoSync = contextlib.nullcontext,
        param_scope: ParamScope | None = None,
        input_checks: Sequence[Callable[[torch.Tensor], None]] = (),
    ) -> None:
        if len(stages) != 1:
            raise ScheduleError(f"PipeDream runs one stage per rank, got {len(stages)}. Fix: virtual_stages=1.")
        kinds = {a.kind for actions in schedule.actions for a in actions if not a.is_comm}
        if not kinds <= {Kind.FORWARD, Kind.BACKWARD}:
            raise ScheduleError(
                f"PipeDream runs F and B actions only; the schedule has {sorted(kinds - {'F', 'B'})}. "
                f"Fix: use the 'pipedream' generator's 1F1B order."
            )
        self.options = options or PipeDreamOptions()
        if schedule.m % self.options.update_interval:
            raise ScheduleError(f"update_interval={self.options.update_interval} does not divide m={schedule.m}.")
        stage = stages[0]
        self.versioned = VersionedModule(stage.module)
        self.stage = PipelineStage(self.versioned, stage.index, stage.num_stages)
        super().__init__(
            [self.stage],
            schedule,
            comm,
            precision,
            no_sync=no_sync,
            param_scope=param_scope,
            input_checks=input_checks,
        )
        self.tags_activations = self.options.vertical_sync
        self.versions = WeightVersions(stage.module, keep_new=self.options.vertical_sync)
        self.steps = 0
        self.records: list[VersionRecord] = []
        self._update: UpdateFn = lambda: None
        self._in_flight: dict[int, tuple[int, Weights]] = {}  # micro-batch -> (forward version, its weights)
        self._forward_copies: dict[int, torch.Tensor] = {}
        self._floor = 0  # vertical sync: the last version the first stage asked for (never decreases)
        self._backwards = 0
        self._contributors: list[int] = []  # forward versions of the micro-batches in the next update
        self._update_due = False
        self._staleness: list[int] = []

    # ----------------------------------------------------------------- step
    def run(self, micro: Sequence[Micro], update: UpdateFn, loss: StepLoss) -> torch.Tensor:
        """Run the step's micro-batches; ``update()`` (the Engine's: sync over dp, step, zero_grad) is called after
        every ``update_interval`` backwards on this stage. Returns the sum of the micro-batches' loss values (every
        rank); each update's gradients are those of its window's loss (``update_window``)."""
        self.loss = loss
        self._update = update
        self._staleness = []
        self.versions.peak = len(self.versions.stash)
        with self.no_sync():
            total = self.train_step(micro)
        self.steps += 1
        self.versions.prune(set(), self.versions.current)  # drained: nothing in flight
        self._trace()
        return total

    def update_window(self, microbatches: int) -> int:
        return self.options.update_interval  # each update follows the loss of its own micro-batches

    def _before_compute(self, action: Action) -> None:
        if self._update_due:  # deferred until the sends after the backward were posted
            self._apply_update()

    def _after_actions(self) -> None:
        if self._update_due:
            self._apply_update()

    def _apply_update(self) -> None:
        self._update_due = False
        self._staleness += [self.versions.current - v for v in self._contributors]
        self._contributors = []
        self._update()
        self.versions.advance()
        self._prune()

    def _prune(self) -> None:
        floor = self._floor if self.options.vertical_sync and not self.stage.is_first else self.versions.current
        self.versions.prune({v for v, _ in self._in_flight.values()}, floor)

    # ----------------------------------------------------------------- compute
    def _compute(
        self, action: Action, micro: Sequence[Micro], inbox: dict, outbox: dict, loss_sum: torch.Tensor
    ) -> None:
        s, j = action.stage, action.microbatch
        if action.kind == Kind.FORWARD:
            version = self.versions.current
            if self.options.vertical_sync and not self.stage.is_first:
                version = int(self._take(inbox, ("V", s, j)).item())
                self._floor = max(self._floor, version)
            weights = self.versions.get(version) if self.options.stash_weights else self.versions.copy()
            self._in_flight[j] = (version, weights)
            if self.options.record_versions:
                self._forward_copies[j] = _flat(weights)
            self.versioned.weights = weights
            try:
                super()._compute(action, micro, inbox, outbox, loss_sum)
            finally:
                self.versioned.weights = None
            if self.options.vertical_sync and not self.stage.is_last:
                outbox[("V", s, j)] = torch.tensor([version], dtype=torch.int64, device=self.device)
            return
        if action.kind != Kind.BACKWARD:  # pragma: no cover - refused in __init__
            raise ScheduleError(f"PipeDream cannot run {action}")
        version, weights = self._in_flight.pop(j)
        backward_version = version
        if not self.options.stash_weights:  # what stashing prevents: the backward sees the latest weights
            backward_version = self.versions.current
            with torch.no_grad():
                for name, live in self.versions.live:
                    weights[name].data.copy_(live)  # .data: bypasses autograd's in-place check on purpose
        if self.options.record_versions:
            self.records.append(
                VersionRecord(
                    s,
                    self.steps * self.schedule.m + j,
                    version,
                    backward_version,
                    self._forward_copies.pop(j),
                    _flat(weights),
                    self.versions.flat_live(),
                )
            )
        super()._compute(action, micro, inbox, outbox, loss_sum)
        self._move_grads(weights)
        self._contributors.append(version)
        self._backwards += 1
        if self._backwards % self.options.update_interval == 0:
            self._update_due = True
        self._prune()

    def _move_grads(self, weights: Weights) -> None:
        """The gradient computed on the stashed version goes to the live parameters (applied to the latest)."""
        for name, live in self.versions.live:
            leaf = weights[name]
            grad, leaf.grad = leaf.grad, None
            if grad is not None:
                live.grad = grad if live.grad is None else live.grad.add_(grad)

    # ----------------------------------------------------------------- stats
    def staleness(self) -> dict[int, dict[str, float]] | None:
        """This rank's stage in the last step: mean and max staleness (updates between a micro-batch's forward
        version and the update applying its gradient), the updates made and the most versions stashed at once."""
        values = self._staleness or [0]
        return {
            self.stage.index: {
                "mean": sum(values) / len(values),
                "max": float(max(values)),
                "updates": float(len(self._staleness) // self.options.update_interval),
                "versions_peak": float(self.versions.peak),
            }
        }


__all__ = [
    "PipeDreamOptions",
    "PipeDreamRunner",
    "VersionRecord",
    "VersionedModule",
    "WeightVersions",
    "check_pipedream",
    "replica_batch",
    "round_robin",
]
