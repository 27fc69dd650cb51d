"""Per-rank memory: what a layout should hold (``estimate_memory``) and what a run really holds (``measure_held``).

Model states, ZeRO paper (Rajbhandari et al. 2020, sec. 3-5), for Psi parameters on N data-parallel ranks,
mixed-precision Adam (2 bytes params + 2 bytes grads + K = 12 bytes of fp32 master, momentum, variance):

    stage 0: (2 + 2 + K) Psi      stage 1: (2 + 2) Psi + K Psi / N
    stage 2: 2 Psi + (2 + K) Psi / N      stage 3: (2 + 2 + K) Psi / N

``zero_paper_bytes`` is exactly that. ``estimate_memory`` applies the same accounting to plait's own
implementation, which keeps parameters and gradients in fp32 (autocast computes in bf16/fp16 from fp32 weights):
params 4 Psi, grads 4 Psi, optimizer states S Psi (S = 8 for Adam/AdamW, 4 for SGD with momentum, 0 without),
and, under ZeRO 1-2, a separate fp32 master shard of 4 Psi / N (under ZeRO-3 the shard *is* the master, unless
it is offloaded: then a host copy of 4 Psi / N is the master).

Every figure is the most a rank holds of that kind over a training step, which is also what it holds at the
optimizer step and between steps, except for gradients: ZeRO-1 holds the full local gradient (4 Psi) from the
backward pass until ``finish_backward`` reduce-scatters it, and then only its shard's sum (4 Psi / N). So
``gradients`` is the peak (4 Psi under stages 0-1, 4 Psi / N under 2-3) and ``gradients_at_step`` what is left
when the optimizer steps; between steps no gradient is held. Communication buffers in flight (a ZeRO-2 bucket
being reduce-scattered, ZeRO-3's gathered units) are working memory, not model states, and are not counted.
Activations per transformer layer (Korthikanti et al. 2022, eq. 2): s b h (34 + 5 a s / h) bytes with 2-byte
activations, s b h (10 + 24/t + 5 a s / (h t)) with tensor parallelism t (eq. 3), s b h (34 + 5 a s / h) / t with
tensor and sequence parallelism (eq. 4: the norm/dropout/residual regions split along the sequence too; plait's
SP keeps the gathered inputs of q/k/v and of the MLP whole instead of re-gathering them in backward, which adds
4 s b h (1 - 1/t): see docs/tensor_parallel.md), and 2 s b h (2 s b h / t with SP) with full
recomputation (only the layer input is kept); scaled by (activation bytes / 2) for fp32.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from plait.config import Layout

if TYPE_CHECKING:
    from plait.engine import Engine

STATE_FLOATS = {"adam": 2, "adamw": 2, "sgd": 0, "sgd_momentum": 1, "adagrad": 1, "rmsprop": 1}
"""fp32 state tensors each optimizer keeps per parameter element."""


def zero_paper_bytes(psi: float, n: int, stage: int, k: int = 12) -> float:
    """Model-state bytes per rank for ``psi`` parameters, ``n`` ranks, ZeRO ``stage`` (the paper's Figure 1)."""
    if stage == 0:
        return (2 + 2 + k) * psi
    if stage == 1:
        return (2 + 2) * psi + k * psi / n
    if stage == 2:
        return 2 * psi + (2 + k) * psi / n
    if stage == 3:
        return (2 + 2 + k) * psi / n
    raise ValueError(f"ZeRO stage {stage} does not exist; use 0, 1, 2 or 3")


def optimizer_kind(optimizer: str | torch.optim.Optimizer) -> str:
    """Map an optimizer (or its name) to a ``STATE_FLOATS`` key."""
    if isinstance(optimizer, torch.optim.Optimizer):
        name = type(optimizer).__name__.lower()
        if name == "sgd":
            return "sgd_momentum" if optimizer.defaults.get("momentum", 0) else "sgd"
        optimizer = name
    if optimizer not in STATE_FLOATS:
        raise ValueError(f"optimizer {optimizer!r} is unknown to the estimator; use one of {', '.join(STATE_FLOATS)}")
    return optimizer


@dataclass
class MemoryEstimate:
    """Bytes per rank, by kind; ``host`` is the part offloaded to CPU/NVMe (not on the device)."""

    parameters: float
    gradients: float
    optimizer_states: float
    master_weights: float
    activations: float = 0.0
    host: float = 0.0
    gradients_at_step: float = 0.0
    """Gradient bytes left when the optimizer steps (equal to ``gradients`` except under ZeRO-1: 4 Psi / N)."""

    @property
    def model_states(self) -> float:
        return self.parameters + self.gradients + self.optimizer_states + self.master_weights

    @property
    def total(self) -> float:
        return self.model_states + self.activations

    @property
    def device(self) -> float:
        return self.total - self.host


def activation_bytes(seq: int, batch: int, hidden: int, heads: int, layers: int, tp: int = 1,
                     recompute_layers: int = 0, act_bytes: int = 2, sequence_parallel: bool = False) -> float:
    """Activations held for backward by ``layers`` transformer layers (Korthikanti et al. 2022)."""
    sbh = seq * batch * hidden
    per_layer = sbh * (10 + 24 / tp + 5 * heads * seq / (hidden * tp)) if tp > 1 else sbh * (34 + 5 * heads * seq / hidden)
    if sequence_parallel and tp > 1:
        per_layer = sbh * (34 + 5 * heads * seq / hidden) / tp
        sbh = sbh / tp  # a recomputed layer keeps only its input, split along the sequence
    kept = (layers - recompute_layers) * per_layer + recompute_layers * 2 * sbh
    return kept * act_bytes / 2


def estimate_memory(
    model: nn.Module | int,
    layout: Layout,
    optimizer: str | torch.optim.Optimizer = "adamw",
    world_size: int | None = None,
    activations: dict[str, int] | None = None,
) -> MemoryEstimate:
    """Per-rank bytes of plait's model states (and activations, given ``seq, batch, hidden, heads, layers``).

    ``model`` is a module (its trainable parameters are counted: call this before ``parallelize``, since ZeRO-3
    leaves the model's own parameters empty between uses) or a parameter count; the data-parallel
    degree comes from ``layout`` (resolved with ``world_size`` when it holds a -1)."""
    psi = model if isinstance(model, int) else sum(p.numel() for p in model.parameters() if p.requires_grad)
    if not layout.is_resolved:
        layout = layout.resolve(world_size or 1)
    n = layout.dp * layout.cp
    states = STATE_FLOATS[optimizer_kind(optimizer)] * 4 * psi
    stage = layout.zero
    offloaded = layout.offload != "none" and stage >= 1
    estimate = MemoryEstimate(
        parameters=4 * psi if stage < 3 else 4 * psi / n,
        gradients=4 * psi if stage < 2 else 4 * psi / n,  # ZeRO-1: the full local gradient, until reduced
        optimizer_states=states if stage == 0 else states / n,
        master_weights=4 * psi / n if stage in (1, 2) or (stage == 3 and offloaded) else 0.0,
        gradients_at_step=4 * psi if stage == 0 else 4 * psi / n,
    )
    if offloaded:
        estimate.host = estimate.optimizer_states + estimate.master_weights
    if activations:
        recompute = layout.recompute
        layers = activations["layers"]
        recomputed = layers if recompute == "full" else (0 if recompute == "none" else len(recompute))
        estimate.activations = activation_bytes(
            activations["seq"], activations["batch"], activations["hidden"], activations["heads"], layers,
            tp=layout.tp, recompute_layers=recomputed, act_bytes=2 if layout.precision != "fp32" else 4,
            sequence_parallel=layout.sequence_parallel,
        )
    return estimate


def storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.numel():
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def measure_held(engine: Engine) -> dict[str, int]:
    """Bytes this rank really holds now, by kind: ``parameters`` (what forward reads: whole parameters, or
    ZeRO-3's shards and gathered units), ``gradients`` (full or sharded), ``master_weights`` (ZeRO's master
    shards where they are not the parameters) and ``optimizer_states`` (0-dim step counters left out).
    Storages count once, so gradients that are views of one bucket count as the bucket."""
    describe = getattr(engine.strategy, "model_state_tensors", None)
    if describe is not None:
        return {kind: storage_bytes(tensors) for kind, tensors in describe().items()}
    model_params = list(engine.model.parameters())
    states = [t for state in engine.optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    return {
        "parameters": storage_bytes(model_params),
        "master_weights": 0,
        "gradients": storage_bytes([p.grad for p in model_params if p.grad is not None]),
        "optimizer_states": storage_bytes([t for t in states if t.dim() > 0]),
    }


class SavedActivations:
    """Context manager counting the activations autograd keeps for backward while it is active: ``bytes`` is the
    total size of the distinct storages passed to ``saved_tensors_hooks``, leaving out ``exclude`` (parameters:
    a Linear saves its weight by reference, which is not an activation). ``add(t)`` counts a tensor held
    beside the graph (e.g. a pipeline stage's received input), once per storage like the rest."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._seen: dict[int, int] = {}
        self._hooks: Any = None

    def add(self, tensor: torch.Tensor) -> torch.Tensor:
        try:
            storage = tensor.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # a tensor without a storage (some subclasses): its own size
            key, size = id(tensor), tensor.numel() * tensor.element_size()
        if key not in self._excluded:
            self._seen.setdefault(key, size)
        return tensor

    def __enter__(self) -> SavedActivations:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.add, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())


def saved_activation_bytes(model: nn.Module, forward: Callable[[], Any]) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``forward()`` runs, ``model``'s parameters
    left out: the activations a rank keeps between forward and backward."""
    with SavedActivations(exclude=model.parameters()) as saved:
        forward()
    return saved.bytes
