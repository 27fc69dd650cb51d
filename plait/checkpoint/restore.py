"""Load a checkpoint's canonical tensors into an engine of any layout: build this rank's views (as for a save),
read what overlaps them, then finish what the checkpoint leaves open (masters, ZeRO scalars, missing states).

Before reading, every rank checks that the checkpoint has the entries it needs; the verdict is agreed over the
world (one all-reduce), so a missing entry raises a clear error on every rank instead of a hang in DCP.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from plait.checkpoint import storage
from plait.checkpoint.canonical import MASTER, MODEL, OPTIM, EngineState, Flat, check_layout, optim_key
from plait.checkpoint.storage import CheckpointError
from plait.logging import get_logger

log = get_logger(__name__)


def init_optimizer_state(strategy: Any) -> None:
    """Create the optimizer's lazily built state where it has none (as torch's get_state_dict does): one step
    at lr 0 on zero gradients of exactly those parameters, which leaves every parameter unchanged."""
    optimizer = strategy.optimizer
    fresh = [p for group in optimizer.param_groups for p in group["params"] if not optimizer.state.get(p)]
    if not fresh:
        return
    lrs = [group["lr"] for group in optimizer.param_groups]
    grads = [p.grad for p in fresh]
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    for param in fresh:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    for param, grad in zip(fresh, grads):
        param.grad = grad
    placement = getattr(strategy, "placement", None)
    if placement is not None:
        placement.adopt_states(optimizer)


def _agree(
    engine: Any, problem: Exception | None, others: str | None = None, cleanup: Callable[[], None] | None = None
) -> None:
    """Raise on every rank when any rank found a problem: its own error, or one saying another rank has one
    (``others``, by default about the checkpoint's entries). ``cleanup`` runs first, on every rank, when one
    did (once every rank got here: nothing is still writing)."""
    flag = torch.tensor([0.0 if problem is None else 1.0], device=engine.comm.device)
    engine.comm.all_reduce(flag, "world", op="max")
    if flag.item() and cleanup is not None:
        cleanup()
        engine.comm.barrier()  # no rank goes on (or looks) before the cleanup is done
    if problem is not None:
        raise problem
    if flag.item():
        raise CheckpointError(
            others
            or "another rank found this checkpoint unusable for its part of the model (its error names the entries)."
        )


@torch.no_grad()
def _master_from_params(flat: Flat) -> None:
    """ZeRO-1/2: this rank's master shard = its slice of the (loaded) parameters, in the master's dtype."""
    for piece in flat.layout.slices(flat.rank):
        values = flat.params[piece.index].detach().reshape(-1)[piece.start : piece.end]
        flat.master.data[piece.at : piece.at + piece.end - piece.start].copy_(values)


def _alias_missing(state: EngineState, stored: Collection[str]) -> list[str]:
    """Model entries the checkpoint lacks, after reading a missing tied name from the name it is tied to (an
    imported HF model has ``lm_head.weight`` only as ``transformer.wte.weight``). Returns what stays missing."""
    missing = []
    for fqn in [k for k in state.entries if k.startswith(MODEL) and k not in stored]:
        key = fqn[len(MODEL) :]
        source = state.aliases.get(key, key)
        source = source if source != key else state.tied_copies.get(key, key)
        entry = state.entries.pop(fqn)
        if MODEL + source in stored and MODEL + source not in state.entries:
            state.entries[MODEL + source] = entry
        elif MODEL + source not in stored:
            missing.append(fqn)
    return sorted(missing)


@dataclass
class LoadPlan:
    """What this rank reads to load canonical entries ``stored`` into an engine: ``request`` (key -> its views,
    or a 0-dim tensor for a ZeRO scalar) filled by a reader, then ``finish``; ``problem`` when entries are missing.
    Checkpoints read it from DCP files (``load_engine``); healing from a live replica's message (``plait.ft``)."""

    state: EngineState
    request: dict[str, Any]
    scalars: list[tuple[str, torch.Tensor]]
    masters_saved: list[Flat]
    problem: CheckpointError | None

    @classmethod
    def build(
        cls, engine: Any, stored: Collection[str], source: str, key: Callable[[str], str] = lambda k: k
    ) -> LoadPlan:
        """The plan for entries ``stored`` of ``source`` (its name in errors), requested under ``key``."""
        check_layout(engine)
        strategy = engine.strategy
        has_optimizer = any(key.startswith(OPTIM) for key in stored)
        if has_optimizer:
            init_optimizer_state(strategy)
        else:
            strategy.optimizer.state.clear()
            log.info(
                "%s holds no optimizer state (a model-only checkpoint, or saved before the first step): the "
                "optimizer starts fresh",
                source,
            )
        state = EngineState(engine)
        state.add_model()
        missing = _alias_missing(state, stored)
        masters_saved = [
            f
            for f in state.flats
            if f.master.dtype != f.params[0].dtype and all(MASTER + name in stored for name in f.names)
        ]
        for flat in masters_saved:
            state._add_flat(flat, flat.master, lambda name: MASTER + name)
        if has_optimizer:
            state.add_optimizer(for_load=True)
            _reset_missing_states(state, stored)
        state.add_outer()  # DiLoCo's outer momentum (zeros where the source has none: a fresh outer optimizer)
        problem = None
        if missing:
            more = " ..." if len(missing) > 5 else ""
            problem = CheckpointError(
                f"rank {engine.mesh.rank}: {source} has no model entries {missing[:5]}{more}: it was saved "
                f"from another model. Fix: load it into the model it was trained with."
            )
        request: dict[str, Any] = {key(k): v for k, v in state.entries.items() if k in stored}
        scalars = []
        for name_key, names, tensor in state.scalars:
            found = next((f"{OPTIM}{n}/{name_key}" for n in names if f"{OPTIM}{n}/{name_key}" in stored), None)
            if found is not None:
                request[key(found)] = torch.zeros((), dtype=tensor.dtype)
                scalars.append((key(found), tensor))
        return cls(state, request, scalars, masters_saved, problem)

    @torch.no_grad()
    def finish(self) -> None:
        """Once ``request`` is read: ZeRO's scalars, and masters the source did not hold."""
        for found, tensor in self.scalars:
            tensor.copy_(self.request[found])
        loaded = {id(flat) for flat in self.masters_saved}
        for flat in self.state.flats:
            if flat.shard is None and id(flat) not in loaded:
                _master_from_params(flat)
            elif flat.shard is not None and flat.master is not flat.shard and id(flat) not in loaded:
                flat.master.data.copy_(flat.shard.detach().to(flat.master.dtype))


def load_engine(engine: Any, folder: Path, metadata: Metadata) -> None:
    """Fill ``engine``'s model, masters and optimizer state from the checkpoint in ``folder`` (collective)."""
    stored = _as_canonical(engine, metadata.state_dict_metadata)
    plan = LoadPlan.build(engine, stored, f"checkpoint {folder}", functools.partial(optim_key, engine))
    problem = plan.problem
    if problem is None:
        try:
            storage.check_tensors(metadata, plan.request)
        except CheckpointError as error:
            problem = error
    _agree(engine, problem)
    storage.read(plan.request, folder)
    plan.finish()


def _as_canonical(engine: Any, stored: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's entries as this rank reads them: semi-synchronous replica group g >= 1 sees its own
    ``group<g>/optim/`` entries as the canonical ``optim/`` ones (``canonical.optim_key``); others as stored. A
    checkpoint without them (saved by synchronous training, whose replicas hold one optimizer state) is read as
    it is: every group starts from that state."""
    prefix = optim_key(engine, OPTIM)[: -len(OPTIM)]
    if not prefix or not any(key.startswith(prefix + OPTIM) for key in stored):
        return dict(stored)
    return {
        key[len(prefix) :] if key.startswith(prefix + OPTIM) else key: value
        for key, value in stored.items()
        if not key.startswith(OPTIM)
    }


def _reset_missing_states(state: EngineState, stored: Collection[str]) -> None:
    """States the checkpoint lacks (a parameter that never had a gradient when saved) start fresh: removed for
    a whole parameter; zeros inside a ZeRO shard (logged)."""
    optimizer = state.optimizer
    fresh = []
    for flat in state.flats + state.wholes:
        keys = list(optimizer.state.get(flat.master, {}))
        absent = [n for n in flat.names if any(f"{OPTIM}{n}/{k}" not in stored for k in keys)]
        if len(absent) == len(flat.names):
            optimizer.state.pop(flat.master, None)  # its entries, still built, fill unused tensors
        elif absent:
            for value in optimizer.state[flat.master].values():
                if isinstance(value, torch.Tensor) and value.dim():
                    value.zero_()
        fresh += absent
    for param, values in list(optimizer.state.items()):  # the model's own parameters (zero=0)
        name = state.names.get(id(param))
        if name is not None and any(f"{OPTIM}{name}/{k}" not in stored for k in values):
            optimizer.state.pop(param)
            fresh.append(name)
    if fresh and any(k.startswith(OPTIM) for k in stored):
        log.warning(
            "the checkpoint has no optimizer state for %d parameter(s) (%s ...): they start fresh",
            len(fresh),
            fresh[:3],
        )
