"""Measure a chain of layers on this device, for the automatic partitioner (``partition.py``).

``profile_layers`` runs each layer on the activation the previous one produced and records, per layer:
the median forward and backward time over ``repeats`` runs after ``warmup`` runs (``time.perf_counter``
around each pass, with ``torch.cuda.synchronize`` on CUDA so that asynchronous kernels are counted), the
forward FLOPs (``torch.utils.flop_counter``: the matmuls and convolutions torch counts), the parameters
(elements and bytes), the activation bytes autograd keeps for the backward (every tensor saved during the
forward, counted once per storage through ``torch.autograd.graph.saved_tensors_hooks``, parameters excluded
— what one in-flight micro-batch costs the stage), and the output bytes (what crosses a stage boundary
forward, and its gradient backward). It is the one layer profile of plait: the pipeline partitioner
(``partition.py``) cuts by its times, and the planner accepts a list of them as a model (``resolve_model``).

``measure_stages`` runs each stage's layers forward and backward as one chain, so predicted per-stage times
(the sums of per-layer times) can be compared with measured ones (``measure_splits``: several splits timed
together, round robin, to compare them under the same load).

``gpt_layers(model)`` presents the reference GPT as such a chain: [embedding, block 0, ..., block L-1, head],
small wrappers around the model's own modules (parameters shared, ``gpt.py`` untouched). The embedding and
the head are attached to the first and last unit (``LayerChain.lead`` / ``trail``), so the partitioner's cut
points are block indices, as ``split.py``'s ``cuts`` expect.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

from plait.errors import ConfigError, LayoutError
from plait.models.gpt import GPT
from plait.observe.memory import SavedActivations


@dataclass(frozen=True)
class LayerProfile:
    """One layer measured on one micro-batch: median seconds and bytes (see the module doc)."""

    name: str
    forward_s: float
    backward_s: float
    param_bytes: int
    activation_bytes: int
    output_bytes: int
    flops: float = 0.0
    """Forward FLOPs for the profiled micro-batch (``torch.utils.flop_counter``)."""
    parameters: int = 0
    """Parameter elements of the layer."""

    @property
    def time_s(self) -> float:
        """Forward + backward: the layer's share of a stage's time per micro-batch."""
        return self.forward_s + self.backward_s


@dataclass(frozen=True)
class LayerChain:
    """Modules run one after the other. The first ``lead`` and last ``trail`` modules always stay with the first
    and last stage (embeddings, LM head): they join the first / last *unit*, and cut points count units."""

    modules: tuple[nn.Module, ...]
    names: tuple[str, ...]
    lead: int = 0
    trail: int = 0

    def __post_init__(self) -> None:
        if len(self.names) != len(self.modules):
            raise ValueError(f"LayerChain has {len(self.modules)} modules but {len(self.names)} names.")
        if self.lead < 0 or self.trail < 0 or self.lead + self.trail >= len(self.modules):
            raise ValueError(
                f"LayerChain of {len(self.modules)} modules with lead={self.lead}, trail={self.trail} "
                f"leaves no unit to cut. Fix: lead + trail < number of modules."
            )

    @property
    def num_units(self) -> int:
        return len(self.modules) - self.lead - self.trail

    def layer_bounds(self, unit_bounds: Sequence[int]) -> list[int]:
        """Unit boundaries [0, c1, ..., n_units] -> module boundaries [0, ..., len(modules)]."""
        inner = [b + self.lead for b in unit_bounds[1:-1]]
        return [0, *inner, len(self.modules)]


def as_chain(layers: Sequence[nn.Module] | LayerChain) -> LayerChain:
    """A plain sequence of modules (an ``nn.Sequential``, a list) is a chain whose every module is a unit."""
    if isinstance(layers, LayerChain):
        return layers
    modules = tuple(layers)
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise ValueError(
            "layers must be a non-empty sequence of nn.Module (e.g. an nn.Sequential, or "
            "gpt_layers(model) for the reference GPT)."
        )
    names = tuple(f"{i}" for i in range(len(modules)))
    return LayerChain(modules, names)


class _Embedding(nn.Module):
    """Token ids [B, T] -> hidden states: the GPT's token (+ learned position) embedding and dropout."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        assert model.tok_embed is not None, "gpt_layers checked that the model is whole"
        self.tok_embed: nn.Embedding = model.tok_embed
        self.pos_embed, self.drop = model.pos_embed, model.drop

    def forward(self, tokens: Tensor) -> Tensor:
        hidden = self.tok_embed(tokens)
        if self.pos_embed is not None:
            hidden = hidden + self.pos_embed(torch.arange(tokens.shape[1], device=tokens.device))
        return self.drop(hidden)


class _Block(nn.Module):
    """One transformer block applied at positions 0..T-1 (what ``GPT.forward`` does without ``positions``)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, hidden: Tensor) -> Tensor:
        return self.block(hidden, torch.arange(hidden.shape[1], device=hidden.device))


class _Head(nn.Module):
    """Hidden states -> logits: the GPT's final norm and LM head."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        assert model.norm_f is not None and model.lm_head is not None, "gpt_layers checked that the model is whole"
        self.norm_f: nn.Module = model.norm_f
        self.lm_head: nn.Linear = model.lm_head

    def forward(self, hidden: Tensor) -> Tensor:
        return self.lm_head(self.norm_f(hidden))


def gpt_layers(model: nn.Module) -> LayerChain:
    """The reference GPT as [embedding, block 0..L-1, head] sharing the model's parameters; lead = trail = 1, so
    unit k is block k (the first unit carries the embedding, the last the head) and cuts are block indices."""
    missing = [name for name in ("tok_embed", "blocks", "norm_f", "lm_head") if getattr(model, name, None) is None]
    if missing:
        raise LayoutError(
            f"gpt_layers needs a whole reference GPT, but {', '.join(missing)} is missing. Fix: pass "
            f"the full plait.models.GPT before it is split into stages."
        )
    gpt = cast(GPT, model)  # has every part of the reference GPT (checked above)
    keys = sorted(gpt.blocks.keys(), key=int)
    modules = (_Embedding(gpt), *(_Block(gpt.blocks[k]) for k in keys), _Head(gpt))
    names = ("embedding", *(f"blocks.{k}" for k in keys), "head")
    return LayerChain(modules, names, lead=1, trail=1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_of(value: Any) -> torch.device:
    return value.device if isinstance(value, Tensor) else torch.device("cpu")


def _leaf(value: Tensor) -> Tensor:
    """The layer's input as a fresh leaf; floating inputs require grad (the stage sends their gradient back)."""
    leaf = value.detach()
    return leaf.requires_grad_(True) if leaf.is_floating_point() else leaf


def _output_tensor(output: Any, name: str) -> Tensor:
    if not isinstance(output, Tensor) or not output.is_floating_point():
        raise ValueError(
            f"layer {name} returned {type(output).__name__}, but a pipeline stage passes one floating "
            f"point tensor on. Fix: wrap the layer so that it returns a single tensor."
        )
    return output


def _run_backward(output: Tensor, leaf: Tensor, modules: Sequence[nn.Module]) -> None:
    """Backward of ``output`` with a gradient of ones into the parameters and the input, then drop the grads."""
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    inputs = params + ([leaf] if leaf.requires_grad else [])
    if inputs and output.requires_grad:
        torch.autograd.backward(output, torch.ones_like(output), inputs=inputs)
    for p in params:
        p.grad = None


def saved_activation_bytes(module: nn.Module, value: Tensor) -> tuple[int, Tensor]:
    """Bytes autograd saves for the backward while ``module`` runs on ``value`` (each storage once, parameters
    excluded), and the output."""
    with SavedActivations(exclude=module.parameters()) as saved:
        output = module(_leaf(value))
    return saved.bytes, output


def forward_flops(module: nn.Module, value: Tensor) -> float:
    """FLOPs of one forward of ``module`` on ``value`` as ``torch.utils.flop_counter`` counts them."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        module(_leaf(value))
    return float(counter.get_total_flops())


def _time_once(modules: Sequence[nn.Module], value: Tensor, name: str) -> tuple[float, float]:
    """Seconds of one forward and one backward of ``modules`` run in sequence on ``value``."""
    device = _device_of(value)
    leaf = _leaf(value)
    _sync(device)
    start = time.perf_counter()
    output = leaf
    for module in modules:
        output = module(output)
    output = _output_tensor(output, name)
    _sync(device)
    middle = time.perf_counter()
    _run_backward(output, leaf, modules)
    _sync(device)
    return middle - start, time.perf_counter() - middle


def _median_times(
    pieces: Sequence[tuple[Sequence[nn.Module], Tensor, str]], repeats: int, warmup: int
) -> list[tuple[float, float]]:
    """Median forward and backward seconds of each piece (modules, input, name). The repeats go round robin over
    the pieces, so a burst of load from other processes spreads over all of them instead of one piece's runs."""
    runs: list[list[tuple[float, float]]] = [[] for _ in pieces]
    for run in range(warmup + repeats):
        for k, (modules, value, name) in enumerate(pieces):
            measured = _time_once(modules, value, name)
            if run >= warmup:
                runs[k].append(measured)
    return [(statistics.median(f for f, _ in r), statistics.median(b for _, b in r)) for r in runs]


def _inputs(chain: LayerChain, sample_input: Tensor, bounds: Sequence[int]) -> list[Tensor]:
    """The input of each piece ``bounds[k]:bounds[k+1]`` of the chain (one no-grad forward), and the output."""
    values, value = [sample_input], sample_input
    with torch.no_grad():
        for k in range(len(bounds) - 1):
            for module, name in zip(chain.modules[bounds[k] : bounds[k + 1]], chain.names[bounds[k] : bounds[k + 1]]):
                value = _output_tensor(module(value), name)
            values.append(value)
    return values


def check_sample_input(sample_input: object) -> None:
    """ConfigError unless ``sample_input`` is a tensor (one micro-batch of the model's inputs), not a count."""
    if not isinstance(sample_input, Tensor):
        raise ConfigError(
            f"sample_input must be one micro-batch of the model's inputs as a tensor, got "
            f"{type(sample_input).__name__} {sample_input!r:.40}. Fix: pass e.g. "
            f"torch.randint(vocab_size, (micro_batch_size, seq_len)) for a GPT's token ids."
        )


def profile_layers(
    layers: Sequence[nn.Module] | LayerChain, sample_input: Tensor, repeats: int = 5, warmup: int = 2
) -> list[LayerProfile]:
    """Time and size each layer of the chain on ``sample_input`` (one micro-batch), in order (module doc)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats} must be >= 1 and warmup={warmup} >= 0.")
    check_sample_input(sample_input)
    chain = as_chain(layers)
    values = _inputs(chain, sample_input, range(len(chain.modules) + 1))
    pieces = [([module], values[i], name) for i, (module, name) in enumerate(zip(chain.modules, chain.names))]
    times = _median_times(pieces, repeats, warmup)
    profiles = []
    for i, (module, name) in enumerate(zip(chain.modules, chain.names)):
        activation, _ = saved_activation_bytes(module, values[i])
        param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        output = values[i + 1]
        profiles.append(
            LayerProfile(
                name,
                times[i][0],
                times[i][1],
                param_bytes,
                activation,
                output.numel() * output.element_size(),
                flops=forward_flops(module, values[i]),
                parameters=sum(p.numel() for p in module.parameters()),
            )
        )
    return profiles


def measure_stages(
    layers: Sequence[nn.Module] | LayerChain,
    sample_input: Tensor,
    bounds: Sequence[int],
    repeats: int = 5,
    warmup: int = 2,
) -> list[float]:
    """Median forward + backward seconds of each stage, stage k running modules ``bounds[k]:bounds[k+1]`` of the
    chain as one piece (its input computed by the stages before it)."""
    return measure_splits(layers, sample_input, [bounds], repeats, warmup)[0]


def measure_splits(
    layers: Sequence[nn.Module] | LayerChain,
    sample_input: Tensor,
    splits: Sequence[Sequence[int]],
    repeats: int = 5,
    warmup: int = 2,
) -> list[list[float]]:
    """``measure_stages`` for several splits at once, their stages timed round robin, so that two splits are
    compared under the same load."""
    chain = as_chain(layers)
    pieces = []
    for bounds in splits:
        values = _inputs(chain, sample_input, bounds)
        pieces += [(chain.modules[bounds[k] : bounds[k + 1]], values[k], f"stage {k}") for k in range(len(bounds) - 1)]
    times = [f + b for f, b in _median_times(pieces, repeats, warmup)]
    out, start = [], 0
    for bounds in splits:
        out.append(times[start : start + len(bounds) - 1])
        start += len(bounds) - 1
    return out


__all__ = [
    "LayerChain",
    "LayerProfile",
    "as_chain",
    "forward_flops",
    "gpt_layers",
    "measure_splits",
    "measure_stages",
    "profile_layers",
    "saved_activation_bytes",
]
