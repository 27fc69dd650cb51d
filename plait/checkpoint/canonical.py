"""An engine's state in the checkpoint's layout-free form: ``Chunked`` global tensors by canonical key.

Keys (parameter names are the single-device model's: plait keeps them under pipeline splits and tp swaps)::

    model/<state_dict key>        every parameter and persistent buffer (tied aliases under each name)
    master/<param>                the fp32 master copy, only where ZeRO keeps one beside 16-bit parameters
    optim/<param>/<state key>     optimizer state: elementwise tensors (the parameter's global shape) and
                                  0-dim scalars (Adam's ``step``); others replicated, only without tp slicing
    group<g>/optim/...            semi-synchronous training: replica group g's inner optimizer state (g >= 1)
    outer/<param>/momentum        DiLoCo's outer momentum (``plait.parallel.semisync``)

Where the pieces come from depends on the data-parallel strategy: whole (tp-local) tensors with zero=0 and for
ZeRO-1/2's replicated parameters; the flat shards (``buckets`` of ZeRO-1/2, ``units`` of ZeRO-3, read through
their ``FlatLayout``) for masters, optimizer states and ZeRO-3's parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from plait.checkpoint.chunks import Chunked, flat_pieces, global_shape, is_tp_slice, whole_pieces
from plait.errors import LayoutError
from plait.layout import TpMode
from plait.logging import get_logger

log = get_logger(__name__)
MODEL, MASTER, OPTIM, OUTER = "model/", "master/", "optim/", "outer/"


@dataclass(eq=False)
class Flat:
    """One flat sharded buffer of a ZeRO strategy: a ZeRO-1/2 bucket or a ZeRO-3 unit."""

    layout: Any  # FlatLayout
    rank: int
    master: nn.Parameter
    params: list[nn.Parameter]
    shard: torch.Tensor | None = None
    """ZeRO-3: the parameter shard forward gathers (the master itself unless offloaded)."""

    @property
    def names(self) -> list[str]:
        return list(self.layout.names)


def flats(strategy: Any) -> list[Flat]:
    """The strategy's flat buffers (empty for replicated data parallelism, whose DDP buckets are transient)."""
    if not getattr(strategy, "sharded", False):
        return []
    views = getattr(strategy, "group_views", None)
    if views:  # parameter groups: the optimizer steps one view per (buffer, group), each a flat of its own
        return [Flat(v.layout, v.rank, v.master, list(v.params), v.shard) for v in views]
    if hasattr(strategy, "units"):
        return [Flat(u.layout, u.rank, u.master, list(u.params), u.shard) for u in strategy.units if not u.empty]
    if hasattr(strategy, "buckets"):
        return [Flat(b.layout, b.rank, b.master, list(b.params)) for b in strategy.buckets]
    return []


def whole_flats(strategy: Any) -> list[Flat]:
    """Tensors a whole-tensor optimizer steps that are not the model's parameters (``plait.parallel.whole_tensor``:
    views of ZeRO master shards, tp slices gathered whole), one flat each: their optimizer state only."""
    wholes = getattr(strategy, "whole_flats", None)
    return [Flat(f.layout, f.rank, f.master, list(f.params)) for f in wholes()] if wholes is not None else []


def check_layout(engine: Any) -> None:
    """Refuse what the canonical form cannot describe yet (the same answer on every rank)."""
    if engine.layout.tp > 1 and engine.layout.tp_mode != TpMode.ONE_D:
        raise LayoutError(
            f"checkpoints of tp_mode={engine.layout.tp_mode!r} (2D/2.5D/3D grid blocks) are not implemented: only "
            f"Megatron 1D slices are mapped to whole tensors. Fix: export whole weights with "
            f"plait.parallel.tensor.gather_parameters(engine.model, engine.comm), or train with tp_mode='1d'."
        )


@dataclass
class EngineState:
    """This rank's part of every canonical tensor (views of the live buffers), built for save or load."""

    engine: Any
    entries: dict[str, Chunked] = field(default_factory=dict)
    scalars: list[tuple[str, list[str], torch.Tensor]] = field(default_factory=list)
    """ZeRO: (state key, parameter names of the buffer, the optimizer's 0-dim tensor) filled after a load."""
    flats: list[Flat] = field(default_factory=list)
    tied_copies: dict[str, str] = field(default_factory=dict)
    """Pipeline: the last stage's copy of a tied weight (a buffer) -> the first stage's parameter."""

    def __post_init__(self) -> None:
        strategy = self.engine.strategy
        self.model: nn.Module = strategy.model
        self.optimizer: torch.optim.Optimizer = strategy.optimizer
        self.tp_rank, self.tp = self.engine.mesh.index("tp"), self.engine.mesh.size("tp")
        self.flats = flats(strategy)
        self.wholes = whole_flats(strategy)
        """Whole-tensor optimizer's stepped tensors: optimizer state only (the values live in ``flats``/the model)."""
        self.names = {id(p): n for n, p in self.model.named_parameters()}
        self.aliases: dict[str, str] = {}
        """model state key -> the key holding the same values (itself, unless tied)."""
        pipeline = getattr(self.engine, "pipeline", None)
        stages = getattr(pipeline, "stages", None) or {}
        for stage in stages.values() if isinstance(stages, dict) else stages:
            for first, last in getattr(stage, "tied", None) or ():
                self.tied_copies[last] = first

    # ----------------------------------------------------------------- model
    def add_model(self) -> None:
        sharded: dict[int, tuple[torch.Size, list]] = {}
        for flat in self.flats:
            if flat.shard is None:
                continue
            for index, param in enumerate(flat.params):
                shape = flat.layout.shapes[index]
                sharded[id(param)] = (global_shape(param, shape, self.tp), [])
            for piece in flat.layout.slices(flat.rank):
                param = flat.params[piece.index]
                sharded[id(param)][1].extend(
                    flat_pieces(
                        flat.shard,
                        piece.at,
                        flat.layout.shapes[piece.index],
                        piece.start,
                        piece.end,
                        param,
                        self.tp_rank,
                        self.tp,
                    )
                )
        first_key: dict[int, str] = {}
        for key, value in self.model.state_dict(keep_vars=True).items():
            if not isinstance(value, torch.Tensor):
                continue
            self.aliases[key] = first_key.setdefault(id(value), key)  # tied weights: the same tensor twice
            if id(value) in sharded:
                size, pieces = sharded[id(value)]
                self.entries[MODEL + key] = Chunked(size, pieces, value.dtype)
            else:
                size = global_shape(value, value.shape, self.tp)
                pieces = whole_pieces(value, value, self.tp_rank, self.tp)
                self.entries[MODEL + key] = Chunked(size, pieces, value.dtype)

    def add_masters(self) -> None:
        """fp32 masters that differ from 16-bit parameters (ZeRO with bf16/fp16 parameters)."""
        for flat in self.flats:
            if flat.master.dtype != flat.params[0].dtype:
                self._add_flat(flat, flat.master, lambda name: MASTER + name)

    def _add_flat(self, flat: Flat, tensor: torch.Tensor, key: Callable[[str], str]) -> None:
        for index, param in enumerate(flat.params):
            size = global_shape(param, flat.layout.shapes[index], self.tp)
            self.entries[key(flat.layout.names[index])] = Chunked(size, [], tensor.dtype)
        for piece in flat.layout.slices(flat.rank):
            param = flat.params[piece.index]
            self.entries[key(flat.layout.names[piece.index])].pieces.extend(
                flat_pieces(
                    tensor.detach().reshape(-1),  # a whole tensor stepped as it is (Muon's state) is read flat
                    piece.at,
                    flat.layout.shapes[piece.index],
                    piece.start,
                    piece.end,
                    param,
                    self.tp_rank,
                    self.tp,
                )
            )

    # ----------------------------------------------------------------- semi-synchronous training
    def add_outer(self) -> None:
        """DiLoCo's outer momentum by parameter, in the layout of what this rank holds (``OUTER``)."""
        outer = getattr(self.engine, "outer", None)
        if outer is None or not outer.momentum_pieces():
            return
        key = lambda name: f"{OUTER}{name}/momentum"  # noqa: E731
        for flat in self.flats:
            momentum = outer.momentum_of(flat.master)
            if momentum is not None:
                self._add_flat(flat, momentum, key)
        if not self.flats:
            for param, momentum in outer.momentum_pieces():
                size = global_shape(param, param.shape, self.tp)
                pieces = whole_pieces(momentum, param, self.tp_rank, self.tp)
                self.entries[key(self.names[id(param)])] = Chunked(size, pieces, momentum.dtype)

    # ----------------------------------------------------------------- optimizer
    def add_optimizer(self, for_load: bool = False) -> None:
        for flat in self.flats + self.wholes:
            for key, value in self.optimizer.state.get(flat.master, {}).items():
                self._add_flat_state(flat, key, value, for_load)
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                name = self.names.get(id(param))
                if name is None:
                    continue
                for key, value in self.optimizer.state.get(param, {}).items():
                    self._add_param_state(name, param, key, value)

    def _check_tensor(self, name: str, key: str, value: Any) -> bool:
        if value is None:
            return False
        if not isinstance(value, torch.Tensor):
            raise LayoutError(
                f"optimizer state {key!r} of {name!r} is a {type(value).__name__}, not a tensor: plait checkpoints "
                f"hold tensors only (no pickles). Fix: use an optimizer whose state is tensors (torch.optim's are)."
            )
        return True

    def _add_param_state(self, name: str, param: nn.Parameter, key: str, value: Any) -> None:
        if not self._check_tensor(name, key, value):
            return
        fqn = f"{OPTIM}{name}/{key}"
        if value.dim() == 0:
            self.entries[fqn] = Chunked(torch.Size(), whole_pieces(value, value, 0, 1), value.dtype)
        elif value.shape == param.shape:
            size = global_shape(param, param.shape, self.tp)
            self.entries[fqn] = Chunked(size, whole_pieces(value, param, self.tp_rank, self.tp), value.dtype)
        elif is_tp_slice(param, self.tp):
            raise LayoutError(
                f"optimizer state {key!r} of {name!r} has shape {tuple(value.shape)}, not the parameter's "
                f"{tuple(param.shape)}: a non-elementwise state of a tensor-parallel slice has no whole-tensor form. "
                f"Fix: checkpoint this optimizer with tp=1, or use an elementwise optimizer (Adam, AdamW, SGD, ...)."
            )
        else:
            self.entries[fqn] = Chunked(value.shape, whole_pieces(value, value, 0, 1), value.dtype)

    def _add_flat_state(self, flat: Flat, key: str, value: Any, for_load: bool) -> None:
        name0 = flat.layout.names[0]
        if not self._check_tensor(name0, key, value):
            return
        if value.dim() == 0:
            if for_load:
                self.scalars.append((key, flat.names, value))
            else:
                for name in flat.names:
                    self.entries[f"{OPTIM}{name}/{key}"] = Chunked(torch.Size(), whole_pieces(value, value, 0, 1))
        elif value.shape == flat.master.shape:
            self._add_flat(flat, value, lambda name: f"{OPTIM}{name}/{key}")
        else:
            raise LayoutError(
                f"ZeRO optimizer state {key!r} of shape {tuple(value.shape)} is not elementwise over "
                f"its shard of {tuple(flat.master.shape)}; it cannot be checkpointed."
            )


def save_state(engine: Any) -> dict[str, Chunked]:
    """Every canonical entry this rank holds a part of (views of live tensors, for ``storage.write``)."""
    check_layout(engine)
    outer = getattr(engine, "outer", None)
    if outer is not None:  # semi-synchronous: at outer-step boundaries only (every group holds the same weights)
        outer.check_save(engine.step)
    state = EngineState(engine)
    state.add_model()
    state.add_masters()
    state.add_optimizer()
    state.add_outer()
    return {optim_key(engine, key): value for key, value in state.entries.items()}


def optim_key(engine: Any, key: str) -> str:
    """Where canonical entry ``key`` is stored: semi-synchronous replica group g >= 1 keeps its own inner optimizer
    state under ``group<g>/optim/...`` (``plait.parallel.semisync``); every other key as it is."""
    outer = getattr(engine, "outer", None)
    return outer.optim_prefix() + key if outer is not None and key.startswith(OPTIM) else key


def group_names(engine: Any) -> list[list[str]]:
    """Parameter names per optimizer param group (under ZeRO, the names of the flat buffers a group steps)."""
    strategy = engine.strategy
    by_master = {id(f.master): f.names for f in flats(strategy) + whole_flats(strategy)}
    names = {id(p): n for n, p in strategy.model.named_parameters()}
    out = []
    for group in strategy.optimizer.param_groups:
        members: list[str] = []
        for param in group["params"]:
            members += by_master.get(id(param), [names[id(param)]] if id(param) in names else [])
        out.append(members)
    return out
