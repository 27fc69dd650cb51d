"""Semi-synchronous data parallelism across HSDP replica groups: LocalSGD and DiLoCo (docs/zero.md, HSDP).

With ``Layout(dp_replicate=R)`` the data ranks form R replica groups (mesh axes ``replicate`` x ``shard``,
``plait.mesh``). ``SemiSync(mode, every=H)`` lets each group g train on its own batches for H *inner* steps,
gradients reduced inside the group only (over ``shard``: no traffic on ``replicate``), with the run's optimizer
as its own inner optimizer (its state stays per group, as in the paper). The inner step of group g at step t:

    theta_g <- InnerOpt(theta_g, grad L_g(theta_g))       L_g = S_g / N_g: the token mean over the group's tokens

Every H steps (after steps H, 2H, ...) an *outer* step, one all-reduce of every rank's parameters (its shards under
ZeRO: the ranks of one ``replicate`` group hold the same place of the same flat buffers) over ``replicate``:

- LocalSGD (Lin et al. 2018, "Don't use large mini-batches, use local SGD"): theta_g <- avg_g theta_g;
- DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training"): with theta the outer
  parameters (every group's parameters at the start of the window), the pseudo-gradient
  Delta = theta - avg_g theta_g, and SGD with Nesterov momentum mu and learning rate eta (0.9 and 0.7 by default,
  as the paper), in torch.optim.SGD's form::

      b <- Delta (first outer step), else mu b + Delta;    theta <- theta - eta (Delta + mu b)

  then every group restarts from the new theta. LocalSGD is DiLoCo with eta = 1, mu = 0.

What crosses the replica groups: at each outer step 2(R-1)/R x P_rank x 4 bytes (ring terms; P_rank the elements this
rank holds: every parameter with zero=0, its master shards under ZeRO): 1/H of synchronous HSDP's per-step gradient
all-reduce of the same shards. The step's token counts are all-reduced inside a group (``shard``); the loss each
step reports is the token mean over every group's tokens (one all-reduce of two numbers over ``dp_cp``, the same
on every rank; ``plait.parallel.loss_normalization``): the only per-step collective that spans the groups.

Only what the optimizer steps is averaged: buffers (running statistics, if a model has any) stay each group's own,
and frozen parameters never change. DiLoCo holds theta and b (fp32, the size of this rank's parameters or shards)
beside the model.

Checkpoints are written at outer-step boundaries only, where every group holds theta (``check_save``). They hold
the model once, each group's inner optimizer state (group 0's under the canonical ``optim/`` keys, group g's under
``group<g>/optim/``) and b under ``outer/<param>/momentum``. Resumed under the same R, every group gets its own
state back (bitwise); a group the checkpoint has no state of (another R, a synchronous or one-process checkpoint)
starts from the canonical one; synchronous training and one process read group 0's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from plait.errors import LayoutError
from plait.layout import Layout, PipelineSchedule, Precision
from plait.logging import get_logger

if TYPE_CHECKING:
    from plait.comm import Comm
    from plait.parallel.strategy import DataParallelStrategy

log = get_logger(__name__)

GROUP_PREFIX = "group{}/"
"""Checkpoint key prefix of replica group g's inner optimizer state for g > 0 (group 0's is the canonical one)."""


class SyncMode(str, enum.Enum):
    """How the replica groups of HSDP are kept together: every step, or every H inner steps."""

    SYNC = "sync"
    LOCALSGD = "localsgd"
    DILOCO = "diloco"


@dataclass(frozen=True)
class SemiSync:
    """Semi-synchronous training over ``Layout.dp_replicate`` replica groups (module docstring)."""

    mode: SyncMode | str = SyncMode.LOCALSGD
    every: int = 4
    """H: inner steps per outer step."""
    outer_lr: float = 0.7
    """DiLoCo's outer learning rate eta (ignored by LocalSGD)."""
    outer_momentum: float = 0.9
    """DiLoCo's outer Nesterov momentum mu (ignored by LocalSGD)."""

    def __post_init__(self) -> None:
        modes = [m.value for m in SyncMode if m != SyncMode.SYNC]
        if str(getattr(self.mode, "value", self.mode)) not in modes:
            raise LayoutError(
                f"sync={self.mode!r} is not a semi-synchronous mode. Fix: use one of {modes} (or no SemiSync for "
                f"synchronous training)."
            )
        object.__setattr__(self, "mode", SyncMode(str(getattr(self.mode, "value", self.mode))))
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise LayoutError(f"sync_every={self.every!r} must be an integer >= 1 (H inner steps). Fix: e.g. 4.")
        if not (isinstance(self.outer_lr, (int, float)) and self.outer_lr > 0):
            raise LayoutError(f"outer_lr={self.outer_lr!r} must be a positive number. Fix: 0.7 (the paper's).")
        if not (isinstance(self.outer_momentum, (int, float)) and 0 <= self.outer_momentum < 1):
            raise LayoutError(f"outer_momentum={self.outer_momentum!r} must be in [0, 1). Fix: 0.9 (the paper's).")

    @property
    def kind(self) -> SyncMode:
        """``mode`` as a ``SyncMode``."""
        return SyncMode(self.mode)

    def check(self, layout: Layout) -> None:
        """LayoutError (one line, with the fix) for a layout the algorithm cannot run on; pure, before any work."""
        name = f"sync={self.kind.value!r}"
        if layout.dp_replicate < 2:
            raise LayoutError(
                f"{name} averages R >= 2 replica groups every {self.every} steps, but the layout has "
                f"dp_replicate={layout.dp_replicate}. Fix: dp_replicate=R >= 2 dividing dp (Layout(dp=2, "
                f"dp_replicate=2); plait train: --set layout.dp_replicate=2), or synchronous training (sync='sync')."
            )
        if layout.schedule == PipelineSchedule.PIPEDREAM:
            raise LayoutError(
                f"{name} with schedule='pipedream': PipeDream updates per micro-batch with stashed weight versions, "
                f"so there is no step boundary at which the groups' parameters are one version. Fix: use a "
                f"synchronous pipeline schedule (1f1b, gpipe, interleaved, ...)."
            )
        if layout.precision == Precision.FP16:
            raise LayoutError(
                f"{name} with precision='fp16': dynamic loss scaling skips steps per replica group, so the groups' "
                f"step counts and lr schedules would drift apart. Fix: precision='bf16' (no loss scaling) or 'fp32'."
            )


def held_tensors(strategy: DataParallelStrategy) -> list[torch.Tensor]:
    """What this rank holds of the parameters that the optimizer steps: its master shards under ZeRO (the same
    place of the same flat buffers in every replica group), every trainable parameter otherwise."""
    if strategy.sharded:
        return list(strategy._masters())  # type: ignore[attr-defined]
    return list(strategy.params)


def _by_dtype(tensors: list[torch.Tensor]) -> dict[torch.dtype, list[int]]:
    groups: dict[torch.dtype, list[int]] = {}
    for index, tensor in enumerate(tensors):
        groups.setdefault(tensor.dtype, []).append(index)
    return groups


@torch.no_grad()
def nesterov(
    theta: list[torch.Tensor], averages: list[torch.Tensor], momentum: list[torch.Tensor] | None, mu: float, eta: float
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """DiLoCo's outer step, out of place (the arguments are left as they are): with Delta = theta - average,
    b' = Delta (no b yet) or mu b + Delta, and theta' = theta - eta (Delta + mu b') (torch.optim.SGD's Nesterov
    form). Returns (theta', b')."""
    deltas = [outer - average for outer, average in zip(theta, averages)]
    if momentum is None:
        stepped = [delta.clone() for delta in deltas]
    else:
        stepped = [buf.mul(mu).add_(delta) for buf, delta in zip(momentum, deltas)]
    return [
        outer.add(delta.add(buf, alpha=mu), alpha=-eta) for outer, delta, buf in zip(theta, deltas, stepped)
    ], stepped


class OuterLoop:
    """The outer steps of one engine: called by ``Engine.train_step`` after every inner step."""

    def __init__(self, config: SemiSync, strategy: DataParallelStrategy, comm: Comm) -> None:
        self.config, self.strategy, self.comm = config, strategy, comm
        self.axis = "replicate"
        self.outer: list[torch.Tensor] | None = None
        """DiLoCo's theta: a copy of this rank's held tensors at the start of the window (None: not taken yet)."""
        self.momentum: list[torch.Tensor] | None = None
        """DiLoCo's b, one tensor per held tensor (None before the first outer step)."""
        self.group = comm.mesh.index(self.axis)

    # ----------------------------------------------------------------- per step
    def begin_step(self, step: int) -> None:
        """Before inner step ``step`` + 1: at a window's start DiLoCo keeps theta (every group holds it now)."""
        if self.config.mode == SyncMode.DILOCO and step % self.config.every == 0:
            self.outer = [tensor.detach().clone() for tensor in held_tensors(self.strategy)]

    def end_step(self, step: int) -> bool:
        """After inner step ``step`` (counted from 1): the outer step when ``step`` ends a window. Returns whether
        one ran."""
        if step % self.config.every:
            return False
        self.outer_step()
        return True

    @torch.no_grad()
    def outer_step(self) -> None:
        """Average every held tensor over ``replicate`` (one all-reduce per dtype), then LocalSGD keeps the
        average and DiLoCo steps theta with Nesterov SGD on Delta = theta - average (module docstring); every
        group then holds the result, and ZeRO publishes its masters to the parameters the model reads."""
        held = held_tensors(self.strategy)
        averages: list[torch.Tensor] = [torch.empty(0)] * len(held)
        for _dtype, indices in _by_dtype(held).items():
            flat = torch.cat([held[i].detach().reshape(-1).to(self.comm.device) for i in indices])
            self.comm.all_reduce(flat, self.axis, op="avg")
            offset = 0
            for i in indices:
                averages[i] = flat[offset : offset + held[i].numel()].view_as(held[i]).to(held[i].device)
                offset += held[i].numel()
        if self.config.mode == SyncMode.DILOCO:
            averages = self._nesterov(averages)
        for tensor, value in zip(held, averages):
            tensor.copy_(value)
        publish = getattr(self.strategy, "_publish", None)
        if publish is not None:  # ZeRO: the stepped masters into the parameters forward reads
            publish()

    def _nesterov(self, averages: list[torch.Tensor]) -> list[torch.Tensor]:
        """theta <- theta - eta (Delta + mu b), b <- mu b + Delta (b = Delta at the first outer step)."""
        if self.outer is None:
            raise RuntimeError("DiLoCo's outer step ran without theta: begin_step was not called at the window start")
        self.outer, self.momentum = nesterov(
            self.outer, averages, self.momentum, self.config.outer_momentum, self.config.outer_lr
        )
        return self.outer

    # ----------------------------------------------------------------- checkpoints
    def check_save(self, step: int) -> None:
        """Saves happen at outer-step boundaries only: there every group holds the same parameters."""
        if step % self.config.every:
            raise LayoutError(
                f"a checkpoint at step {step} under sync={self.config.kind.value!r}: mid-window (sync_every="
                f"{self.config.every}) the replica groups hold different parameters. Fix: save at a multiple of "
                f"{self.config.every} (train.save_every a multiple of train.sync_every)."
            )

    def optim_prefix(self) -> str:
        """The key prefix of this rank's inner optimizer state in a checkpoint ("" for replica group 0)."""
        return GROUP_PREFIX.format(self.group) if self.group else ""

    def momentum_pieces(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """DiLoCo: (held tensor, its momentum b) pairs for a checkpoint, b made zeros where none exists yet (a load
        fills it; zeros then step as the first outer step's b = Delta, bitwise: 0 x mu + Delta). LocalSGD: none."""
        if self.config.mode != SyncMode.DILOCO:
            return []
        held = held_tensors(self.strategy)
        if self.momentum is None:
            self.momentum = [torch.zeros_like(tensor, requires_grad=False) for tensor in held]
        return list(zip(held, self.momentum))

    def momentum_of(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The part of b that belongs to ``tensor``: a held tensor or a view of one (a ZeRO parameter group's run of
        a flat master), found by storage; None when ``tensor`` is no part of what this rank holds."""
        ptr = tensor.untyped_storage().data_ptr()
        for held, momentum in self.momentum_pieces():
            if held.untyped_storage().data_ptr() == ptr:
                start = tensor.storage_offset() - held.storage_offset()
                return momentum.reshape(-1)[start : start + tensor.numel()].view(tensor.shape)
        return None


def attach(engine: Any, config: SemiSync | None) -> None:
    """Give ``engine`` its outer loop (``engine.outer``), or leave it synchronous (None)."""
    engine.outer = OuterLoop(config, engine.strategy, engine.comm) if config is not None else None
    if config is not None:
        log.info(
            "semi-synchronous training: %s over %d replica groups, an outer step every %d inner steps%s",
            config.kind.value,
            engine.comm.size("replicate"),
            config.every,
            f" (outer lr {config.outer_lr}, Nesterov momentum {config.outer_momentum})"
            if config.mode == SyncMode.DILOCO
            else "",
        )


__all__ = ["GROUP_PREFIX", "OuterLoop", "SemiSync", "SyncMode", "attach", "held_tensors", "nesterov"]
