"""Replay a recorded construction (``record``) for real, holding only about one tensor at a time.

Which operations run: a backward liveness pass over the log, from the storages whose final values this rank
needs. An operation is *live* when it writes a storage that is needed after it; it then makes the storages it
reads needed before it, and those it creates or overwrites whole (``Op.kills``) no longer needed. Everything else
is skipped: the ``torch.empty`` behind each ``nn.Linear``, its ``kaiming_uniform_`` when the model's own init
overwrites it, the other ranks' tensors.

Random draws: the CPU generator (Mersenne Twister) cannot skip ahead, so to give bitwise the values eager
construction gives, every rank runs *every* operation that draws (``draws="all"``), in the log's order, from the
generator state the recording began with. One that is not live runs on a scratch storage of the same size,
dtype and geometry (so it draws the same count: CPU ``normal_`` takes a vectorised path for contiguous tensors of
16 or more elements) and is freed at once. With ``draws="live"`` (weights read from a file) only the draws of
tensors still to be initialised somewhere run; every rank runs the same ones, so replicas agree.

Memory: a storage is allocated when an operation first needs it and freed after the last operation that needs
its values; a tensor the rank keeps is handed to ``deliver`` after the last operation that writes it, then
freed. For GPT-style inits (each tensor written whole, once or twice) that is one tensor at a time; the peak is
the largest set of storages alive together, which ``ReplayPlan.peak_bytes`` reports.

Compute: every rank draws every random number of the whole model (the price of bitwise equality without a
counter-based generator); torchtitan instead initialises each shard from its own seed (fast, not equal to one
device).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_map

from plait.logging import get_logger
from plait.parallel.materialize.record import REPLAY_DEVICE, InitRecord, MaterializeError, TRef

log = get_logger(__name__)
HOST = torch.device("cpu")
SKIPPED_ON_META = (
    "torch.nn.init's trunc_normal_, orthogonal_, sparse_ and dirac_ do nothing to a meta tensor, and trunc_normal_ "
    "draws until its values fit, which depends on them"
)


@dataclass
class ReplayPlan:
    """Which logged operations run, what is freed after each, and which names are final after each."""

    live: list[int]
    scratch: set[int]
    """Live operations that run only for their draws: their writes go to scratch storages."""
    release: dict[int, list[int]]
    deliver: dict[int, list[str]]
    at_start: list[str] = field(default_factory=list)
    """Names whose values are host constants of the record (delivered before the first operation)."""
    peak_bytes: int = 0


def _touched(record: InitRecord, index: int) -> set[int]:
    op = record.ops[index]
    return set(op.reads | op.writes) | {ref.sid for ref in op.outputs}


def _sweep(record: InitRecord, needed: set[int], draws: Callable[[int], bool]) -> tuple[set[int], set[int], dict]:
    """Backward liveness: (live ops, storages needed before the first op, and for each live op which of the
    storages it touches are needed after it)."""
    live: set[int] = set()
    after: dict[int, set[int]] = {}
    for index in range(len(record.ops) - 1, -1, -1):
        op = record.ops[index]
        by_value = bool(op.writes & needed)
        if not by_value and not (op.rng and draws(index)):
            continue
        live.add(index)
        after[index] = needed & _touched(record, index)
        if by_value:
            needed = (needed - op.kills) | op.reads
        else:  # only its draws matter: its written storage may be scratch, its other inputs are read
            needed = needed | (op.reads - op.writes)
    return live, needed, after


def plan_replay(record: InitRecord, names: Iterable[str], rng_names: Iterable[str] | None = None) -> ReplayPlan:
    """The replay that gives ``names``' final values. Every draw of the log runs (``rng_names`` None: bitwise
    equal to eager construction), or only the draws that some tensor of ``rng_names`` needs (module docstring).
    Raises ``MaterializeError`` when a needed value depends on a meta tensor made before the recording."""
    names = list(names)
    targets: dict[int, list[str]] = {}
    for name in names:
        targets.setdefault(record.tensors[name].sid, []).append(name)
    if rng_names is None:
        draws: Callable[[int], bool] = lambda index: True  # noqa: E731
    else:
        global_live, _, _ = _sweep(record, {record.tensors[n].sid for n in rng_names}, lambda index: False)
        draws = global_live.__contains__
    live, before, after = _sweep(record, set(targets), draws)
    unknown = before & record.unknown
    if unknown:
        blocked = sorted(name for name in names if record.tensors[name].sid in unknown)
        raise MaterializeError(
            f"nothing in {record.source} writes {blocked[:5] or 'an intermediate tensor'} ({SKIPPED_ON_META})",
            blocked,
        )
    order = sorted(live)
    blank = _left_blank(record, order, set(targets))
    if blank:
        blocked = sorted(name for name in names if record.tensors[name].sid in blank)
        raise MaterializeError(
            f"{blocked[:5]} keep the uninitialised memory of torch.empty in {record.source}: nothing wrote them on "
            f"the meta device ({SKIPPED_ON_META})",
            blocked,
        )
    last: dict[int, int] = {}
    for index in order:
        for sid in _touched(record, index):
            last[sid] = index
    plan = ReplayPlan(order, {i for i in order if not (record.ops[i].writes & after[i])}, {}, {})
    for sid, sid_names in targets.items():
        if sid in last:
            plan.deliver.setdefault(last[sid], []).extend(sid_names)
        elif sid in record.external:
            plan.at_start.extend(sid_names)
        else:  # pragma: no cover - a target untouched by live ops is external or unknown (checked above)
            raise MaterializeError(f"nothing writes {sid_names} ({record.source})", sid_names)
    alive: dict[int, int] = {}
    for index in order:
        touched = _touched(record, index)
        for sid in touched:
            if sid not in record.external:
                alive.setdefault(sid, record.nbytes[sid])
        plan.peak_bytes = max(plan.peak_bytes, sum(alive.values()))
        dropped = [
            sid for sid in touched if sid not in record.external and (sid not in after[index] or last[sid] == index)
        ]
        plan.release[index] = dropped
        for sid in dropped:
            alive.pop(sid, None)
    return plan


UNINITIALISED = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
"""Operators whose result is whatever the memory held."""


def _left_blank(record: InitRecord, order: list[int], targets: set[int]) -> set[int]:
    """Target storages whose last whole write is an ``UNINITIALISED`` operator, never written after it."""
    made_blank: dict[int, bool] = {}
    for index in order:
        op = record.ops[index]
        blank = op.func._overloadpacket.__name__ in UNINITIALISED
        for sid in op.writes & targets:
            made_blank[sid] = blank and sid in op.kills
    return {sid for sid, blank in made_blank.items() if blank}


def _view(storage: torch.UntypedStorage, ref: TRef, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=ref.dtype, device=device).set_(storage, ref.offset, ref.size, ref.stride)


class _Run:
    """The state of one replay: the real storages alive, by recorded storage id."""

    def __init__(self, record: InitRecord) -> None:
        self.record = record
        self.real: dict[int, torch.UntypedStorage] = {}

    def storage(self, sid: int) -> torch.UntypedStorage:
        found = self.real.get(sid)
        if found is not None:
            return found
        external = self.record.external.get(sid)
        if external is not None:
            return external.untyped_storage()
        made = torch.UntypedStorage(self.record.nbytes[sid], device=HOST)
        self.real[sid] = made
        return made

    def argument(self, value: Any) -> Any:
        if isinstance(value, TRef):
            return _view(self.storage(value.sid), value, HOST)
        if value is REPLAY_DEVICE:
            return HOST
        return value

    def keep(self, refs: tuple[TRef, ...], out: Any) -> None:
        """Register the storages of an operation's outputs (created by it, or ``self`` of an in-place one)."""
        for ref, tensor in zip(refs, _tensors(out)):
            if ref.sid not in self.record.external:
                self.real[ref.sid] = tensor.untyped_storage()

    def value(self, name: str) -> torch.Tensor:
        ref = self.record.tensors[name]
        return _view(self.storage(ref.sid), ref, HOST)


@torch.no_grad()
def replay(record: InitRecord, plan: ReplayPlan, deliver: Callable[[str, torch.Tensor], None]) -> None:
    """Run ``plan`` on the host from the recorded generator state, handing each final tensor (by name) to
    ``deliver`` (which copies what it keeps: the storage is freed after it returns). When nothing drew from the
    generator since the recording, it is left where eager construction would have left it (with every draw
    replayed); otherwise it is restored afterwards."""
    assert record.rng_state is not None
    now = torch.get_rng_state()
    resume = torch.equal(now, record.rng_state)
    torch.set_rng_state(record.rng_state)
    run = _Run(record)
    try:
        for name in plan.at_start:
            deliver(name, run.value(name))
        for index in plan.live:
            op = record.ops[index]
            if index in plan.scratch:  # draws only: fresh scratch for what it writes
                for sid in op.writes:
                    run.real.pop(sid, None)
            args, kwargs = tree_map(run.argument, (op.args, op.kwargs))
            out = op.func(*args, **kwargs)
            del args, kwargs
            run.keep(op.outputs, out)
            del out  # nothing but ``run.real`` may keep a storage alive past its release
            for name in plan.deliver.get(index, ()):
                deliver(name, run.value(name))
            for sid in plan.release.get(index, ()):
                run.real.pop(sid, None)
    finally:
        if not resume:
            torch.set_rng_state(now)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


__all__ = ["MaterializeError", "ReplayPlan", "plan_replay", "replay"]
