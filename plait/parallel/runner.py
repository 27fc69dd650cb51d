"""How one training step's micro-batches run forward and backward on this rank: the ``StepRunner`` contract and
the plain runner. ``plait.parallelize`` picks one runner per engine, once: ``PlainRunner`` without pipeline
parallelism, ``PipelineRunner`` (a schedule over stages, ``plait.parallel.pipeline.runtime``) with it, and
``PipeDreamRunner`` for the asynchronous schedule. The Engine drives any of them the same way::

    loss = step_loss(loss_fn, comm, targets, runner.update_window(m))   # counts the global batch's tokens
    total = runner.run(micro_batches, update, loss)  # forward + backward of every micro-batch
    if not runner.owns_updates: update()             # sync gradients, clip, optimizer step
    reported = loss.report(total)

A runner that owns its updates (PipeDream) calls ``update`` itself during the step, once per update window.

Plain step with m micro-batches of this rank's share of the global batch::

    for each micro-batch k:  v_k = loss.value(model(x_k), y_k);  backward(scale(loss.to_backward(k, v_k)))

(for a token-mean loss v_k is the micro-batch's sum and ``to_backward`` divides by the global batch's token count,
``plait.parallel.loss_normalization``), with the data-parallel gradient synchronisation held back (``no_sync``)
until the last micro-batch's backward, so that it overlaps only that backward and runs once per step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn

from plait.comm import Comm
from plait.models import inputs as model_inputs
from plait.observe.trace import no_span
from plait.parallel.loss_normalization import StepLoss
from plait.parallel.precision import MixedPrecision

Micro = tuple[model_inputs.Inputs, torch.Tensor]
"""A micro-batch: (inputs, targets); inputs are token ids, or (token ids, document positions): ``models.inputs``."""
UpdateFn = Callable[[], object]
NoSync = Callable[[], contextlib.AbstractContextManager[None]]


class StepRunner(Protocol):
    """Runs a step's micro-batches on this rank (module docstring)."""

    owns_updates: bool
    """True when ``run`` applies the optimizer updates itself (PipeDream)."""

    def run(self, micro: Sequence[Micro], update: UpdateFn, loss: StepLoss) -> torch.Tensor:
        """Forward and backward of every micro-batch; returns the sum of ``loss.value`` over them (a 0-dim tensor,
        the same on every rank of a pipeline; ``loss.report`` turns it into the step's loss)."""
        ...

    def update_window(self, microbatches: int) -> int:
        """How many micro-batches each optimizer update follows: all of the step's, or fewer (PipeDream)."""
        ...

    def forward(self, inputs: model_inputs.Inputs) -> torch.Tensor | None:
        """No-grad forward of a whole batch in eval mode: the model's output, or None on a rank without it."""
        ...

    def staleness(self) -> dict[int, dict[str, float]] | None:
        """Per local stage, how stale the last step's weights were (asynchronous runners), else None."""
        ...


class PlainRunner:
    """Every micro-batch through the whole (local) model; gradients synchronised once, in the last backward."""

    owns_updates = False

    def __init__(self, model: nn.Module, comm: Comm, precision: MixedPrecision, no_sync: NoSync):
        self.model = model
        self.comm = comm
        self.precision = precision
        self.no_sync = no_sync

    def run(self, micro: Sequence[Micro], update: UpdateFn, loss: StepLoss) -> torch.Tensor:
        tracer = self.comm.tracer
        span = tracer.span if tracer is not None else no_span
        loss_sum = torch.zeros((), device=micro[0][1].device)
        for index, (inputs, targets) in enumerate(micro):
            last = index == len(micro) - 1
            with contextlib.nullcontext() if last else self.no_sync():
                with span(f"forward {index}", "forward", microbatch=index), self.precision.autocast():
                    value = loss.value(model_inputs.call(self.model, inputs), targets)
                with span(f"backward {index}", "backward", microbatch=index):
                    self.precision.scale(loss.to_backward(index, value)).backward()
            loss_sum += value.detach().float()
        return loss_sum

    def update_window(self, microbatches: int) -> int:
        return microbatches

    def forward(self, inputs: model_inputs.Inputs) -> torch.Tensor | None:
        return model_inputs.call(self.model, inputs)

    def staleness(self) -> dict[int, dict[str, float]] | None:
        return None


__all__ = ["Micro", "NoSync", "PlainRunner", "StepRunner", "UpdateFn"]
