"""What a healing replica group receives from a live one, rank by rank: everything a checkpoint holds, in memory.

Replica groups have the same layout, so rank r of one group holds exactly the pieces that rank r of another holds.
A live rank sends the pieces of its canonical entries (``plait.checkpoint.canonical.save_state``: parameters, fp32
masters, optimizer states; views of its live buffers, in a fixed order), the optimizer's hyper-parameters and the
lr scheduler (as a checkpoint's plait.json has them), its step, its random generators and, under fp16, the loss
scaler's state (so every group scales by the same S from then on: ``plait.parallel.precision``); the healing rank
builds the same views for loading (``plait.checkpoint.restore.LoadPlan``) and copies the pieces in. Nothing is
read from disk, and a live rank's state is bitwise what the healed rank continues from.

The data position is the step: batches are pure in (seed, step, data rank) (``plait.data``), so a healed group
reads, at step s, exactly what it would have read had it never been lost.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from plait.checkpoint import canonical, extras
from plait.checkpoint.restore import LoadPlan
from plait.errors import CheckpointError

ENTRIES, EXTRAS, SCALER = "entries", "extras", "loss_scaler"


def rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"torch_cpu": torch.get_rng_state(), "python": list(internal), "version": version}
    state["gauss"] = gauss
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])
    random.setstate((int(state["version"]), tuple(int(v) for v in state["python"]), state["gauss"]))


def engine_state(engine: Any) -> dict[str, Any]:
    """This rank's whole training state, for ``plait.ft.wire.dumps`` (tensors are copied there, not here)."""
    entries = {key: [piece.view for piece in chunked.pieces] for key, chunked in canonical.save_state(engine).items()}
    extra = {
        "step": engine.step,
        "param_groups": extras.param_groups(engine.strategy.optimizer, canonical.group_names(engine)),
        "lr_scheduler": extras.scheduler_state(engine.lr_scheduler),
        "rng": rng_state(),
    }
    scaler = engine.precision.scaler
    if scaler is not None:
        extra[SCALER] = {"scale": scaler.scale, "good_steps": scaler.good_steps, "skipped_steps": scaler.skipped_steps}
    return {ENTRIES: entries, EXTRAS: extra}


def load_engine_state(engine: Any, state: dict[str, Any], source: str) -> None:
    """Make ``engine`` continue from ``state`` (``engine_state`` of the same rank of another replica group)."""
    entries: dict[str, list[torch.Tensor]] = state[ENTRIES]
    plan = LoadPlan.build(engine, set(entries), source)
    if plan.problem is not None:
        raise plan.problem
    with torch.no_grad():
        for key, target in plan.request.items():
            received = entries[key]
            views = [target] if isinstance(target, torch.Tensor) else [piece.view for piece in target.pieces]
            if len(views) != len(received) or any(v.shape != r.shape for v, r in zip(views, received)):
                raise CheckpointError(
                    f"rank {engine.mesh.rank}: {source} holds {key} in pieces {[tuple(r.shape) for r in received]}, "
                    f"this rank in {[tuple(v.shape) for v in views]}: the replica groups' layouts differ. Fix: run "
                    f"every replica group with the same configuration."
                )
            for view, value in zip(views, received):
                view.copy_(value)
    plan.finish()
    extra = state[EXTRAS]
    extras.load_param_groups(engine.strategy.optimizer, canonical.group_names(engine), extra["param_groups"])
    extras.load_scheduler(engine.lr_scheduler, extra["lr_scheduler"])
    set_rng_state(extra["rng"])
    scaler = engine.precision.scaler
    if (scaler is None) != (SCALER not in extra):
        raise CheckpointError(
            f"rank {engine.mesh.rank}: {source} {'has no' if SCALER not in extra else 'has a'} fp16 loss scaler and "
            f"this rank {'has' if scaler is not None else 'has none'}: the replica groups' precisions differ. Fix: "
            f"run every replica group with the same layout.precision."
        )
    if scaler is not None:
        scaler.scale = float(extra[SCALER]["scale"])
        scaler.good_steps = int(extra[SCALER]["good_steps"])
        scaler.skipped_steps = int(extra[SCALER]["skipped_steps"])
    engine.step = int(extra["step"])


__all__ = ["engine_state", "load_engine_state", "rng_state", "set_rng_state"]
