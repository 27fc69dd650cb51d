"""Pipeline schedules as data: for each rank, the ordered list of ``Action(stage, kind, microbatch)`` it runs.

A schedule prints as text, one line per rank ("0F0 0F1 0B0 ..."), is checked structurally by ``validate``,
simulated in one process (``simulate.py``), drawn (``draw.py``) and executed by the pipeline runtime. The
generators of the named schedules (GPipe, 1F1B, ...) are in ``generators.py``.

Placement (``Placement``, part of the schedule's data and of its text header): ``p`` ranks, ``v`` virtual stages
(model chunks) per rank, ``p * v`` stages. Chunk ``c = s // p`` of stage ``s`` covers ranks 0..p-1 in order:
- "interleaved" (Megatron's): every chunk goes down the ranks, stage ``s`` on rank ``s % p`` (rank r holds
  r, r + p, r + 2p, ...);
- "v" (ZB-V, DualPipeV): even chunks go down, odd chunks come back up, stage ``s`` on rank ``s % p`` when ``c``
  is even, else ``p - 1 - s % p``. With v = 2 rank r holds stages r and 2p - 1 - r: rank 0 the first and the
  last stage (the loss), and rank p - 1 both stages p - 1 and p, whose hand-over is local (no message).
With v = 1 both are the same: stage s is rank s.

Action kinds (text ``<stage><kind><microbatch>``):
    F  forward                          B  full backward (input and weight gradients)
    I  backward for the input only      W  backward for the weights only (after I; zero-bubble schedules)
    SF send stage s's output forward    RF receive stage s's input (from stage s - 1)
    SB send stage s's input gradient    RB receive stage s's output gradient (from stage s + 1)
The communication kinds appear only in a *lowered* schedule (``lower``); their stage is the local stage.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plait.errors import ScheduleError
from plait.layout import V_SHAPED, Choice


class Kind(Choice):
    """What an action does; its value is its text in a schedule ("0F1", "1SB0")."""

    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    SEND_FORWARD = "SF"
    RECV_FORWARD = "RF"
    SEND_BACKWARD = "SB"
    RECV_BACKWARD = "RB"


COMPUTE_KINDS = (Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)
COMM_KINDS = (Kind.SEND_FORWARD, Kind.RECV_FORWARD, Kind.SEND_BACKWARD, Kind.RECV_BACKWARD)
KINDS = COMPUTE_KINDS + COMM_KINDS
_ACTION = re.compile(r"^(\d+)(SF|RF|SB|RB|F|B|I|W)(\d+)$")
_RANK_PREFIX = re.compile(r"^(\d+)\s*:\s*(.*)$")
HEADER = "# plait pipeline schedule"


class Placement(Choice):
    """Where each stage lives (module doc): its value is the ``placement=`` field of a schedule's header."""

    INTERLEAVED = "interleaved"
    V = "v"


def placement_of(schedule: str) -> Placement:
    """The placement of a named schedule (``Layout.schedule``): a V for the V-shaped ones, else interleaved."""
    return Placement.V if schedule in V_SHAPED else Placement.INTERLEAVED


def stage_rank(stage: int, p: int, placement: str = Placement.INTERLEAVED) -> int:
    """The rank of ``p`` that holds ``stage`` under ``placement`` (module doc): ``s % p`` interleaved; on a V the
    same for even chunks ``s // p`` and ``p - 1 - s % p`` for odd ones."""
    chunk, offset = divmod(stage, p)
    return p - 1 - offset if placement == Placement.V and chunk % 2 else offset


def rank_stages(p: int, v: int, placement: str = Placement.INTERLEAVED) -> list[list[int]]:
    """Per rank of ``p``, the stages of ``p x v`` it holds under ``placement``, in increasing order."""
    out: list[list[int]] = [[] for _ in range(p)]
    for stage in range(p * v):
        out[stage_rank(stage, p, placement)].append(stage)
    return out


@dataclass(frozen=True, order=True, repr=False)
class Action:
    """One step of one rank: ``kind`` of ``stage`` on ``microbatch``; ``str`` gives "1F0", "0B3", "1SF0"."""

    stage: int
    kind: Kind
    """A ``Kind``; its text ("F", "SB", ...) is accepted and converted."""
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ScheduleError(f"unknown action kind {self.kind!r}. Fix: use one of {', '.join(KINDS)}.")
        object.__setattr__(self, "kind", Kind(self.kind))
        for name in ("stage", "microbatch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ScheduleError(f"action {name}={value!r} must be an integer >= 0.")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @classmethod
    def parse(cls, text: str) -> Action:
        """``Action.parse("0B3")`` -> stage 0, full backward, micro-batch 3."""
        match = _ACTION.match(text.strip())
        if not match:
            raise ScheduleError(
                f"cannot parse action {text!r}. Fix: write <stage><kind><microbatch>, e.g. '1F0', '0B3', '2W1', "
                f"'1SF0', with kind one of {', '.join(KINDS)}."
            )
        return cls(int(match.group(1)), Kind(match.group(2)), int(match.group(3)))

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS


@dataclass
class Schedule:
    """``actions[r]`` is what rank r runs, in order; p ranks, m micro-batches, v virtual stages per rank."""

    p: int
    m: int
    actions: list[list[Action]]
    v: int = 1
    name: str = field(default="custom", compare=False)
    placement: str = Placement.INTERLEAVED
    """A ``Placement`` (its text is accepted and converted): which rank holds each stage (``rank_of``)."""

    def __post_init__(self) -> None:
        if self.placement not in Placement.values():
            raise ScheduleError(
                f"unknown placement {self.placement!r}. Fix: use one of {', '.join(map(repr, Placement.values()))}."
            )
        self.placement = Placement(self.placement)

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    def rank_of(self, stage: int) -> int:
        """The rank that holds ``stage``: ``s % p`` on an interleaved placement; on a V, the same for even
        chunks and ``p - 1 - s % p`` for odd ones (module doc)."""
        return stage_rank(stage, self.p, self.placement)

    def stages_on(self, rank: int) -> list[int]:
        """The stages ``rank`` holds, in increasing order."""
        return rank_stages(self.p, self.v, self.placement)[rank]

    @property
    def placement_rule(self) -> str:
        """The placement in words, for messages."""
        if self.placement == Placement.V:
            return "stage s lives on rank s % p for even chunks s // p, p - 1 - s % p for odd ones (a V)"
        return "stage s lives on rank s % p"

    @property
    def is_lowered(self) -> bool:
        """True when the schedule holds send/recv actions (then every cross-rank transfer must be explicit)."""
        return any(a.is_comm for acts in self.actions for a in acts)

    def __str__(self) -> str:
        return self.to_text()

    # ------------------------------------------------------------------ text and CSV
    def header(self) -> str:
        """The first line of the text and CSV forms; ``placement=`` is written when it is not the default."""
        where = "" if self.placement == Placement.INTERLEAVED else f" placement={self.placement}"
        return f"{HEADER} name={self.name} p={self.p} v={self.v} m={self.m}{where}"

    def to_text(self) -> str:
        """A header comment, then one line per rank: its actions separated by spaces."""
        return "\n".join([self.header()] + [" ".join(map(str, acts)) for acts in self.actions]) + "\n"

    @classmethod
    def from_text(
        cls,
        text: str,
        p: int | None = None,
        m: int | None = None,
        v: int | None = None,
        name: str | None = None,
        placement: str | None = None,
    ) -> Schedule:
        """Parse ``to_text`` output or a hand-written schedule: one line per rank (optionally "3: ..."),
        '#' lines are comments; p, m, v and the placement come from the arguments, the header, or are inferred
        (p = number of rank lines, m = largest micro-batch + 1, v = stages / p, placement interleaved)."""
        rows: list[tuple[int | None, list[str]]] = []
        meta: dict[str, str] = {}
        for line in text.splitlines():
            line = line.strip()
            if line.startswith("#"):
                meta.update(_header_fields(line))
            elif line:
                prefix = _RANK_PREFIX.match(line)
                rank, body = (int(prefix.group(1)), prefix.group(2)) if prefix else (None, line)
                rows.append((rank, body.replace(",", " ").split()))
        return cls._build(rows, meta, p, m, v, name, placement)

    def to_csv(self, path: str | Path) -> Path:
        """Write ``rank,action,action,...`` rows (after a '#' header line), readable by ``from_csv``."""
        path = Path(path)
        with open(path, "w", newline="") as f:
            f.write(self.header() + "\n")
            writer = csv.writer(f)
            for rank, acts in enumerate(self.actions):
                writer.writerow([rank, *map(str, acts)])
        return path

    @classmethod
    def from_csv(
        cls,
        path: str | Path,
        p: int | None = None,
        m: int | None = None,
        v: int | None = None,
        name: str | None = None,
        placement: str | None = None,
    ) -> Schedule:
        """Read ``rank,action,...`` rows (any order; '#' lines and a 'rank,...' title row are skipped)."""
        rows: list[tuple[int | None, list[str]]] = []
        meta: dict[str, str] = {}
        with open(path, newline="") as f:
            for cells in csv.reader(f):
                cells = [c.strip() for c in cells if c.strip()]
                if not cells or cells[0].lower() == "rank":
                    continue
                if cells[0].startswith("#"):
                    meta.update(_header_fields(",".join(cells)))
                    continue
                if not cells[0].isdigit():
                    raise ScheduleError(f"{path}: row {cells} must start with the rank number, e.g. '0,0F0,0F1'.")
                rows.append((int(cells[0]), cells[1:]))
        return cls._build(rows, meta, p, m, v, name or meta.get("name") or Path(path).stem, placement)

    @classmethod
    def _build(
        cls,
        rows: list[tuple[int | None, list[str]]],
        meta: dict[str, str],
        p: int | None,
        m: int | None,
        v: int | None,
        name: str | None,
        placement: str | None = None,
    ) -> Schedule:
        parsed = [(rank, [Action.parse(t) for t in tokens]) for rank, tokens in rows]
        if p is None:
            p = int(meta["p"]) if "p" in meta else max([len(parsed)] + [r + 1 for r, _ in parsed if r is not None])
        actions: list[list[Action]] = [[] for _ in range(p)]
        for line_no, (rank, acts) in enumerate(parsed):
            rank = line_no if rank is None else rank
            if rank >= p:
                raise ScheduleError(f"the schedule has a line for rank {rank}, but p={p}. Fix: give p={rank + 1}.")
            actions[rank].extend(acts)
        every = [a for acts in actions for a in acts]
        if m is None:
            m = int(meta["m"]) if "m" in meta else max((a.microbatch for a in every), default=0) + 1
        if v is None:
            v = int(meta["v"]) if "v" in meta else -(-(max((a.stage for a in every), default=0) + 1) // p)
        where = placement or meta.get("placement", Placement.INTERLEAVED)
        return cls(p, m, actions, v, name or meta.get("name", "custom"), where)

    # ------------------------------------------------------------------ structure
    def validate(self) -> Schedule:
        """Check the structure (not the order; ``simulate`` checks that): each stage runs F and either B or
        I + W exactly once per micro-batch, on the rank that owns it; in a lowered schedule every cross-rank
        transfer has its send and its recv. Raises ``ScheduleError`` naming the first offending action."""
        for key in ("p", "m", "v"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ScheduleError(f"schedule {key}={value!r} must be an integer >= 1.")
        if len(self.actions) != self.p:
            raise ScheduleError(f"schedule has {len(self.actions)} rank lists but p={self.p}. Fix: one per rank.")
        S, where = self.num_stages, {}
        for rank, acts in enumerate(self.actions):
            for a in acts:
                if not isinstance(a, Action):
                    raise ScheduleError(f"rank {rank}: {a!r} is not an Action. Fix: use Action.parse('1F0').")
                if a.stage >= S:
                    raise ScheduleError(f"rank {rank}: {a} names stage {a.stage}, but p*v = {S} stages exist.")
                if a.microbatch >= self.m:
                    raise ScheduleError(f"rank {rank}: {a} names micro-batch {a.microbatch}, but m={self.m}.")
                if self.rank_of(a.stage) != rank:
                    raise ScheduleError(
                        f"rank {rank} runs {a}, but stage {a.stage} lives on rank "
                        f"{self.rank_of(a.stage)} ({self.placement_rule})."
                    )
                if a in where:
                    raise ScheduleError(f"rank {rank}: {a} appears twice. Fix: run each action exactly once.")
                if a.is_comm and self.peer(a) is None:
                    raise ScheduleError(
                        f"rank {rank}: {a} has no peer (stage {a.stage} exchanges nothing "
                        f"{'forward' if a.kind in ('SF', 'RB') else 'backward'} with another rank)."
                    )
                where[a] = rank
        for s in range(S):
            for j in range(self.m):
                have = {k for k in COMPUTE_KINDS if Action(s, k, j) in where}
                if Kind.BACKWARD in have and have & {Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT}:
                    raise ScheduleError(
                        f"stage {s} micro-batch {j} has both {Action(s, Kind.BACKWARD, j)} and I/W. "
                        f"Fix: use B alone, or I followed by W."
                    )
                split = Kind.BACKWARD not in have and bool(have & {Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT})
                missing = [
                    k
                    for k in (
                        (Kind.FORWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)
                        if split
                        else (Kind.FORWARD, Kind.BACKWARD)
                    )
                    if k not in have
                ]
                if missing:
                    raise ScheduleError(
                        f"{Action(s, missing[0], j)} is missing (rank {self.rank_of(s)}): every "
                        f"stage runs F and B (or I then W) of every micro-batch exactly once."
                    )
        if self.is_lowered:
            for a, rank in sorted(where.items(), key=lambda item: not item[0].is_comm):  # unmatched halves first
                for comm in [self.required_peer(a)] if a.is_comm else self.comms(a):
                    if comm in where:
                        continue
                    what = "has no matching" if a.is_comm else "needs"
                    raise ScheduleError(
                        f"lowered schedule: {a} on rank {rank} {what} {comm} on rank {self.rank_of(comm.stage)}, "
                        f"which is missing. Fix: add it, or build the schedule with lower()."
                    )
        return self

    def peer(self, action: Action) -> Action | None:
        """The matching half of a send/recv (SF s <-> RF s+1, SB s <-> RB s-1) when it is on another rank."""
        s, j, S = action.stage, action.microbatch, self.num_stages
        other = {
            Kind.SEND_FORWARD: (s + 1, Kind.RECV_FORWARD),
            Kind.RECV_FORWARD: (s - 1, Kind.SEND_FORWARD),
            Kind.SEND_BACKWARD: (s - 1, Kind.RECV_BACKWARD),
            Kind.RECV_BACKWARD: (s + 1, Kind.SEND_BACKWARD),
        }.get(action.kind)
        if other is None or not 0 <= other[0] < S or self.rank_of(other[0]) == self.rank_of(s):
            return None
        return Action(other[0], other[1], j)

    def required_peer(self, action: Action) -> Action:
        """``peer(action)`` of a send/recv that must have one (one that ``comms`` gave, or of a validated
        schedule); a ScheduleError naming the action otherwise."""
        other = self.peer(action)
        if other is None:
            raise ScheduleError(
                f"{action} has no peer (stage {action.stage} exchanges nothing "
                f"{'forward' if action.kind in ('SF', 'RB') else 'backward'} with another rank). Fix: remove it."
            )
        return other

    def comms(self, action: Action) -> list[Action]:
        """The sends/recvs a compute action needs in a lowered schedule: [recv before it, send after it]."""
        kinds = {
            Kind.FORWARD: (Kind.RECV_FORWARD, Kind.SEND_FORWARD),
            Kind.BACKWARD: (Kind.RECV_BACKWARD, Kind.SEND_BACKWARD),
            Kind.BACKWARD_INPUT: (Kind.RECV_BACKWARD, Kind.SEND_BACKWARD),
        }.get(action.kind, ())
        found = [Action(action.stage, kind, action.microbatch) for kind in kinds]
        return [c for c in found if self.peer(c) is not None]


def _header_fields(line: str) -> dict[str, str]:
    """The key=value fields of a ``HEADER`` line (other comment lines are free text)."""
    if not line.startswith(HEADER):
        return {}
    fields = dict(kv.split("=", 1) for kv in line[len(HEADER) :].split() if "=" in kv)
    for key in ("p", "m", "v"):
        if key in fields and not fields[key].isdigit():
            raise ScheduleError(f"schedule header {line!r}: {key}={fields[key]!r} is not a whole number.")
    return fields


def build_schedule(name: str, p: int, m: int, v: int | None = None) -> Schedule:
    """The schedule called ``name`` (a ``Layout.schedule`` value) for p ranks, m micro-batches, v chunks per rank
    (None: the generator's default, 1, or 2 for the V-shaped ones); the generators live in ``generators.py``
    (imported here, late: they build on ``Schedule``)."""
    from plait.parallel.pipeline.generators import GENERATORS

    if name not in GENERATORS:
        raise ScheduleError(f"unknown pipeline schedule {name!r}. Fix: use one of {', '.join(GENERATORS)}.")
    return GENERATORS[name](p, m) if v is None else GENERATORS[name](p, m, v)


def lower(schedule: Schedule, costs: Any = None) -> Schedule:
    """Insert the send/recv actions so that batched isend/irecv execution cannot deadlock.

    Rule: one global order of every compute action and transfer, taken from the unlowered schedule simulated
    on ``costs`` (a ``Costs`` or a dict, default F=1, B=2; by time, a transfer at the end of its producer,
    before anything starting then). A send goes on its rank right after its producer (only other sends and
    recvs may come between); its recv is appended to the receiver's list at that same point of the global
    order, so it is posted before the compute that consumes it. Each rank's list is then a piece of one
    global order in which every send sits next to its recv: it completes even if every send and recv
    blocked until its peer is posted (consecutive ones posted as one ``batch_isend_irecv``), and two ranks
    receive from each other in the order they send. The timeline does not change (simulate.py).
    """
    from plait.parallel.pipeline.simulate import simulate

    if schedule.is_lowered:
        raise ScheduleError(f"schedule {schedule.name!r} is already lowered (it has send/recv actions).")
    spans = simulate(schedule, costs).timelines
    acts, p = schedule.actions, schedule.p
    out: list[list[Action]] = [[] for _ in range(p)]
    posted: set[Action] = set()  # sends placed so far
    nxt = [0] * p
    pending: list[Action | None] = [None] * p  # the send of the rank's last compute, not yet placed

    comms = [[schedule.comms(a) for a in rank_acts] for rank_acts in acts]
    needs = [
        [[schedule.required_peer(c) for c in cs if c.kind in (Kind.RECV_FORWARD, Kind.RECV_BACKWARD)] for cs in rank_cs]
        for rank_cs in comms
    ]

    def candidate(r: int) -> tuple[float, int, int] | None:
        if pending[r] is not None:
            return (spans[r][nxt[r] - 1].end, 0, r)
        if nxt[r] == len(acts[r]):
            return None
        return None if any(send not in posted for send in needs[r][nxt[r]]) else (spans[r][nxt[r]].start, 1, r)

    while keys := [k for k in map(candidate, range(p)) if k is not None]:
        r = min(keys)[2]
        send = pending[r]
        if send is not None:
            recv = schedule.required_peer(send)
            out[r].append(send)
            out[schedule.rank_of(recv.stage)].append(recv)
            posted.add(send)
            pending[r] = None
        else:
            a = acts[r][nxt[r]]
            out[r].append(a)
            nxt[r] += 1
            pending[r] = next(
                (c for c in comms[r][nxt[r] - 1] if c.kind in (Kind.SEND_FORWARD, Kind.SEND_BACKWARD)), None
            )
    if nxt != [len(a) for a in acts]:  # pragma: no cover - simulate() has rejected such a schedule
        raise ScheduleError(f"cannot lower schedule {schedule.name!r}: no consistent send/recv order exists.")
    return Schedule(p, schedule.m, out, schedule.v, schedule.name, schedule.placement)


_MOVED_TO_GENERATORS = ("GENERATORS", "gpipe", "interleaved", "naive", "one_f_one_b", "pipedream", "zero_bubble")


def __getattr__(name: str) -> Any:
    """``from plait.parallel.pipeline.schedule import gpipe`` keeps working: the generators moved to
    ``generators.py``, which imports this module, so they are looked up on first use (PEP 562)."""
    if name in _MOVED_TO_GENERATORS:
        from plait.parallel.pipeline import generators

        return getattr(generators, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "KINDS",
    "Action",
    "Placement",
    "Schedule",
    "ScheduleError",
    "build_schedule",
    "lower",
    "placement_of",
    "rank_stages",
    "stage_rank",
]
