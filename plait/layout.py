"""The parallel ``Layout``: how many ranks each paradigm gets, and how they run.

A Layout is plain data. ``Layout(...)`` checks what it can on its own (known names, positive degrees);
``layout.resolve(world_size)`` fills a ``-1`` degree with the rest of the ranks and checks that the degrees
multiply to the world size. Every check is pure and deterministic, so every rank raises the same
``LayoutError`` before any collective runs.

Ranks are laid out in the order ``AXES`` = (pp, dp, cp, tp): pp outermost, tp innermost (tp peers are
neighbours, so on a cluster they share a node's fast links).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Any

from plait.errors import LayoutError

AXES: tuple[str, ...] = ("pp", "dp", "cp", "tp")
"""Mesh axes from outermost to innermost: rank = ((pp * DP + dp) * CP + cp) * TP + tp."""


class Choice(str, Enum):
    """A named choice whose text is its value: equal to, hashed as, printed and serialised (TOML, JSON) as that
    string, so ``layout.schedule == PipelineSchedule.ONE_F_ONE_B`` and ``PipelineSchedule.ONE_F_ONE_B`` are interchangeable and every text
    format stays as it was."""

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return str(self.value)

    def __repr__(self) -> str:  # messages read schedule='1f1b', as the user wrote it
        return repr(str(self.value))

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(member.value for member in cls)


class PipelineSchedule(Choice):
    """The pipeline schedules (``plait.parallel.pipeline.generators``)."""

    NAIVE = "naive"
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZERO_BUBBLE = "zero-bubble"
    PIPEDREAM = "pipedream"
    ZB_V = "zb-v"
    DUALPIPEV = "dualpipev"


V_SHAPED = (PipelineSchedule.ZB_V, PipelineSchedule.DUALPIPEV)
"""Schedules whose 2 x pp stages are placed in a V (two chunks per rank; ``plait.parallel.pipeline.vshape``)."""
SPLIT_BACKWARD = (PipelineSchedule.ZERO_BUBBLE, *V_SHAPED)
"""Schedules that split a backward into I (input gradient) and W (weight gradient), at least for some actions."""


class Precision(Choice):
    """Compute precision (master weights stay fp32)."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


class ReduceDtype(Choice):
    """Gradient reduction dtype: fp32 (the gradients' own), or the compute dtype of ``precision`` (half the bytes)."""

    FP32 = "fp32"
    COMPUTE = "compute"


class Recompute(Choice):
    """Activation recomputation: none; "selective" recomputes only every block's attention core (softmax, dropout
    and the product with the values: Korthikanti et al. 2022); "op" keeps the outputs of every block's attention
    kernel and of every second matmul and recomputes the rest (torchtitan's per-operator policy); "full" every
    block (``Layout.recompute`` may also be a tuple of block indices)."""

    NONE = "none"
    SELECTIVE = "selective"
    OP = "op"
    FULL = "full"


class CpMode(Choice):
    """Context-parallel algorithms: ring attention (zigzag), DeepSpeed-Ulysses (all-to-all)."""

    RING = "ring"
    ULYSSES = "ulysses"


class Offload(Choice):
    """Where ZeRO keeps optimizer states and master weights."""

    NONE = "none"
    CPU = "cpu"
    NVME = "nvme"


class TpMode(Choice):
    """Tensor-parallel algorithms: Megatron 1D, SUMMA 2D (q x q), Tesseract 2.5D (q x q x depth), 3D (q x q x q)."""

    ONE_D = "1d"
    TWO_D = "2d"
    TWO_AND_HALF_D = "2.5d"
    THREE_D = "3d"


SCHEDULES = PipelineSchedule.values()
PRECISIONS = Precision.values()
REDUCE_DTYPES = ReduceDtype.values()
RECOMPUTE_MODES = Recompute.values()
CP_MODES = CpMode.values()
OFFLOADS = Offload.values()
TP_MODES = TpMode.values()
CHOICES: dict[str, type[Choice]] = {
    "schedule": PipelineSchedule,
    "precision": Precision,
    "cp_mode": CpMode,
    "offload": Offload,
    "reduce_dtype": ReduceDtype,
    "tp_mode": TpMode,
}
"""Layout fields that hold one of a fixed set of names (``recompute`` also takes a tuple of block indices)."""


@dataclass(frozen=True)
class Layout:
    """How a training job is spread over ranks.

    Attributes:
        dp: data-parallel degree (replicas that split the batch). -1 = the ranks left by the other degrees.
        tp: tensor-parallel degree (layers split across ranks; innermost axis).
        pp: pipeline-parallel degree (stages; outermost axis).
        cp: context-parallel degree (the sequence split across ranks).
        zero: ZeRO stage over the dp axis: 0 off, 1 optimizer states, 2 + gradients, 3 + parameters.
        microbatches: micro-batches per step (gradient accumulation; pipeline micro-batches).
        schedule: pipeline schedule, one of ``SCHEDULES``.
        virtual_stages: model chunks per pipeline rank (interleaved schedules; the V-shaped "zb-v" and "dualpipev"
            run two, and a layout naming them with virtual_stages left at 1 gets 2).
        recompute: activation recomputation: "none", "selective" (the attention cores), "op" (per operator: the
            attention kernels' and every second matmul's outputs kept, the rest recomputed), "full", or a tuple of
            block indices to recompute whole.
        precision: compute precision, one of ``PRECISIONS`` (master weights stay fp32).
        cp_mode: context-parallel algorithm, one of ``CP_MODES``.
        sequence_parallel: Megatron sequence parallelism inside the tp group.
        offload: where ZeRO keeps optimizer states and master weights, one of ``OFFLOADS``.
        bucket_mb: gradient bucket size for data-parallel reduction, in MiB.
        tp_mode: tensor-parallel algorithm, one of ``TP_MODES``; "2d" needs tp = q^2, "2.5d" tp = q^2 x tp_depth,
            "3d" tp = q^3 (see ``tp_grid_dims``).
        tp_depth: the depth d of 2.5D (Tesseract) tensor parallelism (1 for every other mode).
        tp_pad_vocab: 1D tensor parallelism pads a vocabulary that tp does not divide with zero rows (never looked
            up, logits masked out of the loss and cut off the gathered logits) instead of raising a LayoutError.
        reduce_dtype: the dtype data parallelism reduces gradients in, one of ``REDUCE_DTYPES``: "fp32" (the
            fp32 gradients as they are), or "compute": cast to ``precision``'s bf16/fp16 for the all-reduce /
            reduce-scatter (half the bytes; the same as "fp32" when precision is fp32).
        pipeline_cuts: with pp > 1, the block (or nn.Sequential child) indices where pipeline stages 1, 2, ...
            start, increasing (pp x virtual_stages - 1 of them); empty: an even split. ``plait plan`` writes the
            cuts it chose here, so a planned run.toml reaches the runtime unchanged.
        compile: ``torch.compile`` each transformer block (the whole model when it has no blocks): False, True
            (the default backend, inductor) or the name of a torch.compile backend ("inductor", "aot_eager", ...).
            Per block, as torchtitan does: the paradigms' hooks (ZeRO-3's gathers, DDP's buckets) stay outside the
            compiled code (``plait.parallel.compile``).
        ep: expert-parallel degree: the experts of every Mixture-of-Experts layer split over ``ep`` of the
            data-parallel ranks (dp x cp), which stay data-parallel (context-parallel) ranks for the rest of the
            model. Not a factor of the world size: ``Layout(dp=4, ep=2)`` runs on 4 ranks. ep must divide dp x cp
            (the mesh folds the data ranks into ``ep`` x ``edp``: docs/expert_parallel.md).
        dp_replicate: HSDP (hybrid sharded data parallelism): the data ranks form ``dp_replicate`` = R replica
            groups of dp/R x cp ranks each; ZeRO-1/2/3 shard inside a group (mesh axis ``shard``) and each reduced
            shard's gradient is then all-reduced over the R groups (mesh axis ``replicate``, outer: across nodes).
            R must divide dp; 1 (the default) is plain ZeRO over every data rank. With zero=0 nothing is sharded
            and the step is plain data parallelism (one all-reduce over dp x cp), whatever R
            (docs/zero.md, HSDP).
    """

    dp: int = -1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero: int = 0
    microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    recompute: str | tuple[int, ...] = "none"
    precision: str = "fp32"
    cp_mode: str = "ring"
    sequence_parallel: bool = False
    offload: str = "none"
    bucket_mb: float = 25.0
    tp_mode: str = "1d"
    tp_depth: int = 1
    tp_pad_vocab: bool = False
    reduce_dtype: str = "fp32"
    pipeline_cuts: tuple[int, ...] = ()
    compile: bool | str = False
    ep: int = 1
    dp_replicate: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.recompute, list):
            object.__setattr__(self, "recompute", tuple(self.recompute))
        if isinstance(self.pipeline_cuts, list):
            object.__setattr__(self, "pipeline_cuts", tuple(self.pipeline_cuts))
        self._coerce_choices()
        if self.schedule in V_SHAPED and self.virtual_stages == 1:
            object.__setattr__(self, "virtual_stages", 2)  # a V is two chunks per rank
        self._check_degrees()
        self._check_choices()

    # ------------------------------------------------------------------ validation
    def _check_degrees(self) -> None:
        for axis in AXES:
            value = getattr(self, axis)
            if not isinstance(value, int) or isinstance(value, bool):
                raise LayoutError(
                    f"{axis}={value!r} is not an integer. Fix: give {axis} as a whole number >= 1 (or -1)."
                )
            if value == 0 or value < -1:
                raise LayoutError(
                    f"{axis}={value} is not a valid degree. Fix: use {axis} >= 1, or {axis}=-1 for 'the rest of the ranks'."
                )
        inferred = [axis for axis in AXES if getattr(self, axis) == -1]
        if len(inferred) > 1:
            raise LayoutError(
                f"{' and '.join(inferred)} are all -1, but only one degree can be inferred from the world size. "
                f"Fix: give all but one of them explicitly."
            )
        for name, low in (("microbatches", 1), ("virtual_stages", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise LayoutError(f"{name}={value!r} must be an integer >= {low}. Fix: set {name}={low} or more.")
        if not isinstance(self.ep, int) or isinstance(self.ep, bool) or self.ep < 1:
            raise LayoutError(f"ep={self.ep!r} must be an integer >= 1. Fix: ep=1 (no expert parallelism) or more.")
        self._check_expert_degree()
        self._check_replicas()
        if self.zero not in (0, 1, 2, 3):
            raise LayoutError(f"zero={self.zero!r} is not a ZeRO stage. Fix: use 0 (off), 1, 2 or 3.")
        if (
            not isinstance(self.bucket_mb, (int, float))
            or isinstance(self.bucket_mb, bool)
            or not 0 < self.bucket_mb < float("inf")  # NaN fails both comparisons
        ):
            raise LayoutError(f"bucket_mb={self.bucket_mb!r} must be a positive size in MiB. Fix: e.g. bucket_mb=25.")

    def _check_expert_degree(self) -> None:
        """ep splits the data ranks (dp x cp): it must divide them once both are known."""
        if self.ep == 1 or self.dp == -1 or self.cp == -1:
            return
        data = self.dp * self.cp
        if data % self.ep:
            divisors = [d for d in range(1, data + 1) if data % d == 0]
            raise LayoutError(
                f"ep={self.ep} must divide the data-parallel ranks dp x cp = {self.dp} x {self.cp} = {data}: expert "
                f"parallelism splits the experts over ep of them. Fix: use ep in {divisors}, or make dp x cp a "
                f"multiple of {self.ep}."
            )

    def _check_replicas(self) -> None:
        """HSDP: R = dp_replicate replica groups split dp; under expert parallelism an ep group (the ranks that
        exchange tokens) must lie inside one replica group, so that the expert slices a rank holds are sharded over
        its group and all-reduced over the groups like every other parameter."""
        value = self.dp_replicate
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise LayoutError(
                f"dp_replicate={value!r} must be an integer >= 1. Fix: dp_replicate=1 (plain ZeRO over every data "
                f"rank) or the number of replica groups of HSDP, a divisor of dp."
            )
        if value == 1 or self.dp == -1:
            return
        if self.dp % value:
            divisors = [d for d in range(1, self.dp + 1) if self.dp % d == 0]
            raise LayoutError(
                f"dp_replicate={value} must divide dp={self.dp}: HSDP splits the dp ranks into dp_replicate replica "
                f"groups of equal size. Fix: use dp_replicate in {divisors}, or a dp that is a multiple of {value}."
            )
        if self.ep > 1 and self.cp != -1 and (self.dp // value * self.cp) % self.ep:
            group = self.dp // value * self.cp
            raise LayoutError(
                f"ep={self.ep} must divide the ranks of one HSDP replica group, dp/dp_replicate x cp = "
                f"{self.dp // value} x {self.cp} = {group}: the ranks that exchange tokens hold the experts that one "
                f"replica group shards, and the groups all-reduce each shard. Fix: use ep in "
                f"{[d for d in range(1, group + 1) if group % d == 0]}, or a smaller dp_replicate."
            )

    def _coerce_choices(self) -> None:
        """Each named choice (``CHOICES``, and ``recompute`` when it is a name) as its ``Choice`` member: a
        LayoutError naming the valid names for anything else."""
        fields = [(name, kind) for name, kind in CHOICES.items()]
        if isinstance(self.recompute, str):
            fields.append(("recompute", Recompute))
        for name, kind in fields:
            value = getattr(self, name)
            try:
                member = kind(value)
            except ValueError:
                raise LayoutError(
                    f"{name}={value!r} is unknown. Fix: use one of {', '.join(map(repr, kind.values()))}"
                    + (" or a list of block indices." if name == "recompute" else ".")
                ) from None
            object.__setattr__(self, name, member)

    def _check_choices(self) -> None:
        if isinstance(self.recompute, str):
            if self.recompute not in RECOMPUTE_MODES:
                raise LayoutError(
                    f"recompute={self.recompute!r} is unknown. Fix: use 'none', 'selective', 'op', 'full' or a list "
                    f"of block indices."
                )
        elif not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.recompute):
            raise LayoutError(f"recompute={self.recompute!r} must list block indices >= 0. Fix: e.g. recompute=[0, 2].")
        if not isinstance(self.sequence_parallel, bool):
            raise LayoutError(f"sequence_parallel={self.sequence_parallel!r} must be true or false.")
        if not (isinstance(self.compile, bool) or (isinstance(self.compile, str) and self.compile.strip())):
            raise LayoutError(
                f"compile={self.compile!r} must be true, false or a torch.compile backend name. Fix: e.g. compile=true "
                f"(inductor) or compile='aot_eager'."
            )
        cuts = self.pipeline_cuts
        if not isinstance(cuts, tuple) or not all(isinstance(i, int) and not isinstance(i, bool) for i in cuts):
            raise LayoutError(f"pipeline_cuts={cuts!r} must list block indices. Fix: e.g. pipeline_cuts=[6] for pp=2.")
        if any(i < 1 for i in cuts) or list(cuts) != sorted(set(cuts)):
            raise LayoutError(
                f"pipeline_cuts={list(cuts)} must be increasing block indices >= 1 (where stages 1, 2, ... start). "
                f"Fix: e.g. pipeline_cuts=[4, 8, 12] for 4 stages of a 16-block model."
            )
        if cuts and self.pp == 1:
            raise LayoutError(
                f"pipeline_cuts={list(cuts)} cut the model into pipeline stages, but pp=1. Fix: set pp > 1, or drop "
                f"pipeline_cuts."
            )
        if cuts and self.pp > 1 and len(cuts) != self.pp * self.virtual_stages - 1:
            raise LayoutError(
                f"pipeline_cuts={list(cuts)} make {len(cuts) + 1} stages, but pp={self.pp} x virtual_stages="
                f"{self.virtual_stages} needs {self.pp * self.virtual_stages}. Fix: give "
                f"{self.pp * self.virtual_stages - 1} cut(s), or drop pipeline_cuts for an even split."
            )
        if self.recompute == Recompute.OP and self.schedule in SPLIT_BACKWARD and self.pp != 1:
            raise LayoutError(
                f"recompute='op' cannot run under schedule={self.schedule!r}: its split backward (I, then W) runs two "
                "backward passes over each block, and torch's selective checkpointing allows one per region. Fix: "
                "use recompute='full' or 'selective', or schedule='1f1b' or 'interleaved'."
            )
        if self.ep > 1 and self.pp > 1 and self.schedule == PipelineSchedule.PIPEDREAM:
            raise LayoutError(
                f"ep={self.ep} with schedule='pipedream' is not implemented: PipeDream's asynchronous updates are not "
                f"parity-tested with experts split over ranks. Fix: use a synchronous schedule (e.g. schedule='1f1b'), "
                f"or ep=1."
            )
        if self.schedule in V_SHAPED and self.virtual_stages != 2:
            raise LayoutError(
                f"schedule={self.schedule!r} places two model chunks per rank in a V, but virtual_stages="
                f"{self.virtual_stages}. Fix: set virtual_stages=2 (or leave it at 1: the layout then sets 2), or use "
                f"schedule='interleaved' for {self.virtual_stages} chunks per rank."
            )
        if self.virtual_stages > 1 and self.schedule not in (PipelineSchedule.INTERLEAVED, *V_SHAPED):
            raise LayoutError(
                f"virtual_stages={self.virtual_stages} needs schedule='interleaved' (got {self.schedule!r}). "
                f"Fix: set schedule='interleaved' or virtual_stages=1."
            )
        if self.tp != -1:
            tp_grid_dims(self.tp, self.tp_mode, self.tp_depth)
        if not isinstance(self.tp_pad_vocab, bool):
            raise LayoutError(f"tp_pad_vocab={self.tp_pad_vocab!r} must be true or false.")
        if self.tp_pad_vocab and self.tp_mode != TpMode.ONE_D:
            raise LayoutError(
                f"tp_pad_vocab=True pads Megatron 1D's vocab-parallel embedding and head; tp_mode={self.tp_mode!r} "
                f"splits the embedding's features, not its vocabulary. Fix: set tp_pad_vocab=False or tp_mode='1d'."
            )
        if self.sequence_parallel and self.tp_mode != TpMode.ONE_D:
            raise LayoutError(
                f"sequence_parallel=True is Megatron 1D's; tp_mode={self.tp_mode!r} already splits the activations. "
                f"Fix: set sequence_parallel=False or tp_mode='1d'."
            )
        if self.sequence_parallel and self.tp == 1:
            raise LayoutError(
                "sequence_parallel=True splits the sequence inside the tp group, but tp=1. Fix: set tp >= 2."
            )

    # ------------------------------------------------------------------ derived
    @property
    def degrees(self) -> dict[str, int]:
        """The degree of each axis in ``AXES`` order (may contain one -1 before ``resolve``)."""
        return {axis: getattr(self, axis) for axis in AXES}

    @property
    def is_resolved(self) -> bool:
        return all(d >= 1 for d in self.degrees.values())

    @property
    def world_size(self) -> int:
        """The number of ranks this layout needs (only once resolved)."""
        if not self.is_resolved:
            raise LayoutError(f"{self.short()} has a -1 degree. Fix: call layout.resolve(world_size) first.")
        size = 1
        for degree in self.degrees.values():
            size *= degree
        return size

    def resolve(self, world_size: int) -> Layout:
        """Fill a -1 degree with ``world_size / (product of the others)`` and check the product is ``world_size``."""
        if not isinstance(world_size, int) or world_size < 1:
            raise LayoutError(
                f"world size {world_size!r} must be a positive integer. Fix: launch at least one process."
            )
        known = 1
        for degree in self.degrees.values():
            known *= degree if degree > 0 else 1
        formula = " * ".join(f"{axis}={getattr(self, axis)}" for axis in AXES if getattr(self, axis) != 1)
        formula = formula or "all degrees 1"
        inferred = [axis for axis in AXES if getattr(self, axis) == -1]
        if inferred:
            axis = inferred[0]
            if world_size % known:
                raise LayoutError(
                    f"{axis}=-1 cannot be inferred: the other degrees multiply to {known}, which does not divide the "
                    f"world size {world_size}. Fix: choose degrees whose product divides {world_size}, or launch a "
                    f"multiple of {known} processes."
                )
            degrees: dict[str, Any] = {axis: world_size // known}
            resolved = dataclasses.replace(self, **degrees)  # __post_init__ checks ep against the resolved dp x cp
            if axis == "tp":
                tp_grid_dims(resolved.tp, resolved.tp_mode, resolved.tp_depth)
            return resolved
        if known != world_size:
            raise LayoutError(
                f"the degrees ({formula}) multiply to {known} ranks, but the world size is {world_size}. "
                f"Fix: set dp=-1 to give data parallelism the rest of the ranks, choose degrees whose product is "
                f"{world_size}, or launch {known} processes (e.g. --nproc {known})."
            )
        return self

    def check_batch(self, global_batch: int) -> int:
        """Check that the global batch splits over dp ranks and micro-batches; return the micro-batch size."""
        if not self.is_resolved:
            raise LayoutError(f"{self.short()} has a -1 degree. Fix: call layout.resolve(world_size) first.")
        parts = self.dp * self.microbatches
        if global_batch < 1 or global_batch % parts:
            raise LayoutError(
                f"global batch {global_batch} does not split into dp={self.dp} x microbatches={self.microbatches} = "
                f"{parts} equal parts. Fix: use a global batch that is a multiple of {parts}, or change dp/microbatches."
            )
        return global_batch // parts

    def short(self) -> str:
        """A compact description such as ``dp2 tp2 pp1 cp1 zero1 mb4``."""
        parts = [f"{axis}{getattr(self, axis)}" for axis in AXES] + ([f"ep{self.ep}"] if self.ep > 1 else [])
        parts += [f"replicate{self.dp_replicate}"] if self.dp_replicate > 1 else []
        compiled = [] if self.compile is False else ["compiled" if self.compile is True else f"compiled:{self.compile}"]
        return " ".join(parts + [f"zero{self.zero}", f"mb{self.microbatches}", self.precision, *compiled])

    def to_dict(self) -> dict[str, Any]:
        data = {
            key: str(value) if isinstance(value, Choice) else value for key, value in dataclasses.asdict(self).items()
        }
        if isinstance(self.recompute, tuple):
            data["recompute"] = list(self.recompute)
        data["pipeline_cuts"] = list(self.pipeline_cuts)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Layout:
        """Build a Layout from a mapping (e.g. a TOML table), rejecting unknown keys with the valid ones listed."""
        return from_mapping(cls, data, "layout", LayoutError)


def _nearest(tp: int, power: int, scale: int = 1) -> str:
    """``"tp=a or tp=b"``: the nearest valid degrees scale * q^power below and above ``tp``."""
    q = max(1, round((tp / scale) ** (1.0 / power)))
    while scale * q**power > tp and q > 1:
        q -= 1
    below, above = scale * q**power, scale * (q + 1) ** power
    return f"tp={below} or tp={above}" if below != tp else f"tp={above}"


def tp_grid_dims(tp: int, tp_mode: str, tp_depth: int = 1) -> dict[str, int]:
    """The sizes of the tp sub-axes ``{"tp_dep": d, "tp_row": q, "tp_col": q}`` of an nD tensor-parallel mode
    ({} for "1d"); LayoutError naming valid degrees when tp is not q^2 (2D), q^2 d (2.5D) or q^3 (3D). Pure."""
    if not isinstance(tp_depth, int) or isinstance(tp_depth, bool) or tp_depth < 1:
        raise LayoutError(f"tp_depth={tp_depth!r} must be an integer >= 1. Fix: e.g. tp_depth=2 with tp_mode='2.5d'.")
    if tp_depth != 1 and tp_mode != "2.5d":
        raise LayoutError(
            f"tp_depth={tp_depth} is the depth of 2.5D tensor parallelism, but tp_mode={tp_mode!r}. "
            f"Fix: set tp_mode='2.5d', or tp_depth=1."
        )
    if tp_mode == "1d":
        return {}
    if tp_mode == "3d":
        q = round(tp ** (1.0 / 3.0))
        if q**3 != tp:
            raise LayoutError(
                f"tp={tp} is not a cube, which tp_mode='3d' needs (q x q x q ranks). Fix: use {_nearest(tp, 3)}."
            )
        return {"tp_dep": q, "tp_row": q, "tp_col": q}
    depth = tp_depth if tp_mode == "2.5d" else 1
    if tp % depth:
        raise LayoutError(
            f"tp={tp} does not split into tp_depth={depth} layers (2.5D needs tp = q^2 x depth). "
            f"Fix: use {_nearest(tp, 2, depth)}, or another tp_depth."
        )
    q = round((tp // depth) ** 0.5)
    if q * q * depth != tp:
        shape = "a square" if depth == 1 else f"{depth} x a square"
        raise LayoutError(
            f"tp={tp} is not {shape}, which tp_mode={tp_mode!r} needs (q x q"
            f"{' x depth' if depth > 1 else ''} ranks). Fix: use {_nearest(tp, 2, depth)}."
        )
    return {"tp_dep": depth, "tp_row": q, "tp_col": q}


def from_mapping(cls: type, data: dict[str, Any], section: str, error: type[Exception]) -> Any:
    """Construct dataclass ``cls`` from ``data``; unknown keys raise ``error`` naming the valid ones."""
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise error(
            f"unknown key(s) {', '.join(f'{section}.{k}' for k in unknown)}. "
            f"Fix: use one of {', '.join(f'{section}.{n}' for n in names)}."
        )
    return cls(**data)


__all__ = [
    "AXES",
    "CHOICES",
    "Choice",
    "CpMode",
    "Layout",
    "Offload",
    "PipelineSchedule",
    "SPLIT_BACKWARD",
    "V_SHAPED",
    "Precision",
    "Recompute",
    "ReduceDtype",
    "TP_MODES",
    "TpMode",
    "from_mapping",
    "tp_grid_dims",
]
