"""Mixture-of-Experts feed-forward: a router, routed experts held as 3-D weights and computed group-wise, shared
experts; load balancing by an auxiliary loss, by DeepSeek-V3's bias, or none; dropless or capacity-capped.

Nothing here knows about parallelism. Two attributes of ``MoE`` are swap points, as ``Attention.core`` is:

- ``dispatch(x_perm, counts, experts, in_flight) -> y_perm``: runs the routed rows (sorted by expert, ``counts[e]``
  rows for expert e) through the experts, and the callable ``in_flight`` (the shared experts) while they are on
  the wire. ``local_dispatch`` calls both directly; expert parallelism (``plait.parallel.expert``) installs one
  that sends each row to the rank holding its expert (uneven all-to-all, issued asynchronously) and back.
- ``sequence_sum(stats) -> stats``: sums per-sequence routing counts over the ranks that hold other positions of
  the same sequences (context parallelism, Megatron sequence parallelism); None on one device.

**Routing.** For a token x the router scores the E experts, s = softmax(x W) or sigmoid(x W) (fp32), chooses the
top k by s (+ the balance bias b under "aux_free", which steers the choice only) and weighs the chosen experts by
their s (rescaled to sum to 1 with ``router_norm_topk``). The output is sum_j w_j expert_{e_j}(x) (+ the shared
experts' MLP). Rows are sorted by expert (stable), so each expert sees one contiguous group: ``GroupedExperts``
computes all groups with ``torch._grouped_mm`` where the device and dtype have it (CUDA, bf16, sm90+), else with an
exact loop of one matmul per expert (the same products, e.g. on CPU).

**Capacity** (``capacity_factor``, None = dropless): each expert takes at most C = ceil(factor x T x k / E)
tokens of each sequence of T tokens, first choices before second choices and earlier positions first (GShard's
priority); the rest are dropped (they contribute nothing; counted per expert). Capacity is per sequence, so it
does not depend on how the batch is split over ranks or micro-batches.

**The balance loss** (DeepSeek-V3, sec. 2.1.2, the sequence-wise auxiliary loss): for a sequence of T tokens

    L_seq = alpha sum_i f_i P_i,   f_i = E / (k T) sum_t 1[i chosen by t],   P_i = (1/T) sum_t s'_{i,t}

with s' the scores normalised to sum to 1 per token; the model's balance loss is the mean of L_seq over the
sequences of the batch. It is a product of sums *within* a sequence and a mean *over* sequences, so it splits
exactly under any split of the batch into whole sequences (data parallelism, micro-batches, pipelines); a
sequence split over ranks (cp, sequence parallelism) needs only its integer counts summed (``sequence_sum``):
given the whole sequence's counts C_i, the loss is *linear* in the scores, so each rank's share
alpha E / (k T^2) sum_i C_i sum_{t local} s'_{i,t} adds up to L_seq and differentiates exactly.

**How it reaches the loss** without changing ``model(x)`` (which returns logits): the layer attaches it to its
output with ``AuxLossGradient``, an identity on the output whose backward also hands the balance term the
gradient ``aux_grad_scale`` (Megatron-Core's MoEAuxLossAutoScaler). The gradient therefore flows wherever the
output's does (pipeline stages, recomputation). ``aux_grad_scale`` None means 1 / (sequences of this forward):
a plain ``loss.backward()`` on one batch trains on loss + mean balance loss. plait's Engine sets it each step to
G / B (B sequences of the global batch, G the data-parallel ranks that average gradients; times the fp16 loss
scale), so that every layout backpropagates the same total.

**Statistics** (training forwards only; a forward that autograd re-runs for recomputation is not counted): per
layer the tokens routed to each expert, the tokens dropped per expert and the balance loss summed over sequences,
accumulated until read (``MoE.take_statistics``; ``finish_moe_step`` for a plain loop; the Engine reads them once
per step). The aux-free bias moves after each step by rate x sign(mean load - load_i) (``MoE.update_bias``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from plait.models.config import GPTConfig


class Dispatch(Protocol):
    """``MoE.dispatch``: the routed rows through the experts (module docstring)."""

    def __call__(
        self, x_perm: Tensor, counts: Tensor, experts: ExpertGroup, in_flight: Callable[[], None] | None = None
    ) -> Tensor: ...


def local_dispatch(
    x_perm: Tensor, counts: Tensor, experts: ExpertGroup, in_flight: Callable[[], None] | None = None
) -> Tensor:
    """Every expert on this device: ``in_flight`` (nothing travels) runs first, then the rows go straight
    through ``experts``."""
    if in_flight is not None:
        in_flight()
    return experts(x_perm, counts)


def grouped_mm_available(device: torch.device, dtype: torch.dtype, width: int, hidden: int) -> bool:
    """Whether ``torch._grouped_mm`` runs these products: a CUDA device of compute capability 9.0 or more, bf16,
    and rows of whole 16-byte units (its strides' requirement)."""
    return (
        hasattr(torch, "_grouped_mm")
        and device.type == "cuda"
        and dtype == torch.bfloat16
        and torch.cuda.get_device_capability(device) >= (9, 0)
        and width % 8 == 0
        and hidden % 8 == 0
    )


def _compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype matmuls of ``x`` run in: autocast's when it is on for x's device, else x's own."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def group_offsets(counts: Tensor | Sequence[int], device: torch.device) -> Tensor:
    """``torch._grouped_mm``'s ``offs``: where each expert's rows end (the cumulative counts, int32)."""
    sizes = counts if isinstance(counts, Tensor) else torch.tensor(list(counts), dtype=torch.int64)
    return sizes.to(device, non_blocking=True).cumsum(0).to(torch.int32)


class ExpertGroup(nn.Module):
    """What ``MoE`` and expert parallelism need of a layer's routed experts, whatever their weights' layout:
    ``forward(x, counts)`` takes rows sorted by expert (``counts[e]`` rows for local expert e) and returns each row
    through its expert; ``weights()`` are 3-D parameters whose dim 0 is the expert, so expert parallelism keeps a
    slice of them: ``first`` is the global index of local expert 0, ``total`` the layer's expert count,
    ``local_experts`` how many this module holds (an attribute, not the weights' shape, which ZeRO-3 empties between
    uses). ``GroupedExperts`` is plait's; ``plait.models.hf_moe`` adapts Hugging Face's fused experts."""

    def __init__(self, n_experts: int) -> None:
        super().__init__()
        self.first = 0
        self.total = n_experts
        self.local_experts = n_experts
        self.kernel = "auto"
        """"auto" (``torch._grouped_mm`` where ``grouped_mm_available``, else a loop), "loop" or "grouped"."""

    def weights(self) -> list[nn.Parameter]:
        """The expert weights (dim 0: the expert), in registration order."""
        raise NotImplementedError

    def use_grouped(self, x: Tensor, hidden: int) -> bool:
        """Whether ``forward`` takes the grouped kernel for rows ``x`` into experts of width ``hidden``."""
        return self.kernel == "grouped" or (
            self.kernel == "auto" and grouped_mm_available(x.device, _compute_dtype(x), x.shape[-1], hidden)
        )


class GroupedExperts(ExpertGroup):
    """``n_experts`` feed-forward experts as 3-D weights: ``w_up`` [E, d, f] (and ``w_gate`` [E, d, f] for SwiGLU),
    ``w_down`` [E, f, d]; no biases. ``forward(x, counts)`` takes rows sorted by expert (``counts[e]`` rows for
    local expert e) and returns each row through its expert. Expert parallelism keeps a slice of the experts:
    ``first`` is the global index of ``w_up[0]`` and ``total`` the layer's expert count.

    ``kernel``: "auto" (``torch._grouped_mm`` where ``grouped_mm_available``, else the loop), "loop" or
    "grouped" (forced, e.g. to test the grouped kernel on a CPU whose torch has it)."""

    def __init__(self, n_experts: int, width: int, hidden: int, gated: bool) -> None:
        super().__init__(n_experts)
        self.gated = gated
        self.w_gate = nn.Parameter(torch.empty(n_experts, width, hidden)) if gated else None
        self.w_up = nn.Parameter(torch.empty(n_experts, width, hidden))
        self.w_down = nn.Parameter(torch.empty(n_experts, hidden, width))

    def weights(self) -> list[nn.Parameter]:
        return [w for w in (self.w_gate, self.w_up, self.w_down) if w is not None]

    def reset_parameters(self, std: float, residual_std: float) -> None:
        """GPT-2 init per expert: w_up / w_gate ~ N(0, std), w_down ~ N(0, residual_std) (into the residual)."""
        for weight in (self.w_gate, self.w_up):
            if weight is not None:
                nn.init.normal_(weight, mean=0.0, std=std)
        nn.init.normal_(self.w_down, mean=0.0, std=residual_std)

    def forward(self, x: Tensor, counts: Tensor | Sequence[int]) -> Tensor:
        return self._grouped(x, counts) if self.use_grouped(x, self.w_up.shape[-1]) else self._loop(x, counts)

    def _loop(self, x: Tensor, counts: Tensor | Sequence[int]) -> Tensor:
        """One matmul per expert on its contiguous rows (an expert without rows gets a 0-row product: every rank and
        every step builds the same graph, and the expert's gradient is an exact zero)."""
        sizes = counts.tolist() if isinstance(counts, Tensor) else list(counts)
        outputs = []
        for expert, rows in enumerate(x.split(sizes)):
            up = rows @ self.w_up[expert]
            hidden = F.gelu(up) if self.w_gate is None else F.silu(rows @ self.w_gate[expert]) * up
            outputs.append(hidden @ self.w_down[expert])
        return torch.cat(outputs) if outputs else x.new_zeros(0, x.shape[-1])

    def _grouped(self, x: Tensor, counts: Tensor | Sequence[int]) -> Tensor:
        """All experts in three (SwiGLU: four) ``torch._grouped_mm`` calls; offsets are the cumulative counts."""
        dtype = _compute_dtype(x)
        offsets = group_offsets(counts, x.device)
        rows = x.to(dtype)
        up = torch._grouped_mm(rows, self.w_up.to(dtype), offs=offsets)
        if self.w_gate is None:
            hidden = F.gelu(up)
        else:
            hidden = F.silu(torch._grouped_mm(rows, self.w_gate.to(dtype), offs=offsets)) * up
        return torch._grouped_mm(hidden, self.w_down.to(dtype), offs=offsets)


class Router(nn.Module):
    """Scores experts in fp32 (``gate``: d -> E, no bias), chooses the top k, weighs them (module docstring).
    Under "aux_free" balancing it holds the selection bias ``expert_bias`` [E] (a buffer: checkpointed, not trained
    by the optimizer)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.d_model, config.n_experts, bias=False)
        self.score, self.top_k, self.norm_topk = config.router_score, config.top_k, config.router_norm_topk
        self.expert_bias: Tensor | None
        if config.moe_balance == "aux_free":
            self.register_buffer("expert_bias", torch.zeros(config.n_experts))
        else:
            self.expert_bias = None

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Rows [n, d] -> (scores [n, E] fp32, chosen experts [n, k], their weights [n, k] fp32)."""
        with torch.autocast(x.device.type, enabled=False):
            logits = self.gate(x.float())
        scores = logits.softmax(dim=-1) if self.score == "softmax" else logits.sigmoid()
        floor = 1e-20 if self.score == "sigmoid" else 0.0  # keeps all-zero sigmoid scores finite
        chosen, weights = choose_experts(scores, self.top_k, self.norm_topk, self.expert_bias, floor)
        return scores, chosen, weights


def choose_experts(
    scores: Tensor, top_k: int, norm_topk: bool, bias: Tensor | None = None, floor: float = 0.0
) -> tuple[Tensor, Tensor]:
    """The ``top_k`` experts of highest score (+ ``bias``, which steers the choice only) and their weights: the
    chosen scores, rescaled to sum to 1 with ``norm_topk`` (divided by their sum + ``floor``)."""
    choice = scores if bias is None else scores + bias
    chosen = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(-1, chosen)
    if norm_topk:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + floor)
    return chosen, weights


class AuxLossGradient(torch.autograd.Function):
    """``output`` unchanged forward; backward passes ``output``'s gradient through and gives ``aux`` the gradient
    ``scale``, so that the balance term is trained as if added to the loss with that weight."""

    @staticmethod
    def forward(ctx: Any, output: Tensor, aux: Tensor, scale: float | Tensor) -> Tensor:
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        scale = ctx.scale
        if isinstance(scale, Tensor):
            scale = scale.to(grad.device, torch.float32)
        return grad, torch.as_tensor(scale, dtype=torch.float32, device=grad.device), None


def capacity_mask(chosen: Tensor, n_experts: int, capacity: int) -> Tensor:
    """Which of the [B, T, k] choices fit: each expert takes at most ``capacity`` of a sequence's choices, first
    choices of every position before second choices, earlier positions first (GShard's priority)."""
    batch, length, k = chosen.shape
    priority = F.one_hot(chosen, n_experts).transpose(1, 2).reshape(batch, k * length, n_experts)
    position = priority.cumsum(dim=1) - 1
    kept = ((position < capacity) & (priority > 0)).any(dim=-1)
    return kept.view(batch, k, length).transpose(1, 2)


def _recomputing() -> bool:
    """A forward that autograd runs inside a backward pass (activation recomputation)."""
    return torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    """The Mixture-of-Experts feed-forward of block ``layer`` (module docstring): ``router``, ``experts``
    (``GroupedExperts``) and ``shared`` (an MLP of the shared experts' total width, or None). A subclass built from
    another library's modules (``plait.models.hf_moe.HFMoE``) calls ``init_routing`` and overrides ``route`` and
    ``shared_output``; the forward, the dispatch, the balance loss and the statistics stay these."""

    def __init__(self, config: GPTConfig, layer: int, shared: nn.Module | None = None) -> None:
        super().__init__()
        self.init_routing(layer, config.n_experts, config.top_k, config.moe_balance, config.aux_loss_coef)
        self.bias_rate = float(config.bias_update_rate)
        self.capacity_factor: float | None = config.capacity_factor
        self.router = Router(config)
        self.experts: ExpertGroup = GroupedExperts(
            config.n_experts, config.d_model, config.expert_ffn_dim, gated=config.mlp == "swiglu"
        )
        self.shared = shared

    def init_routing(self, layer: int, n_experts: int, top_k: int, balance: str, aux_coef: float) -> None:
        """The settings and the state every MoE layer keeps, whoever built its router and experts: ``MoE`` from a
        ``GPTConfig``, ``plait.models.hf_moe.HFMoE`` from a Hugging Face block (which calls this instead of
        ``MoE.__init__``, its router and experts being the family's own modules under the family's names).
        Dropless and without a selection bias unless the builder sets ``capacity_factor`` / ``bias_rate``."""
        self.layer = layer
        self.n_experts, self.top_k = n_experts, top_k
        self.balance, self.aux_coef = balance, float(aux_coef)
        self.bias_rate = 0.0
        self.capacity_factor = None
        self.dispatch: Dispatch = local_dispatch
        self.sequence_sum: Callable[[Tensor], Tensor] | None = None
        self.aux_grad_scale: float | Tensor | None = None
        """d(objective)/d(this layer's balance-loss sum over its sequences); None: 1 / sequences of the forward."""
        self.sequences = 0
        """Sequences seen by training forwards since the statistics were last taken."""
        self._statistics: Tensor | None = None

    # ----------------------------------------------------------------- forward
    def forward(self, x: Tensor) -> Tensor:
        batch, length, width = x.shape
        flat = x.reshape(-1, width)
        scores, chosen, weights = self.route(flat)
        choices = chosen.view(batch, length, self.top_k)
        kept = None
        if self.capacity_factor is not None:
            kept = capacity_mask(choices, self.n_experts, self.capacity(length))
        found: list[Tensor | None] = []  # the shared experts' output, computed while the routed rows travel
        out = self._route(flat, chosen, weights, kept, lambda: found.append(self.shared_output(x)))
        out = out.view(batch, length, width)
        shared = found[0] if found else self.shared_output(x)
        if shared is not None:
            out = out + shared
        aux = None
        if self.balance == "aux_loss" and self.aux_coef > 0 and self.training and torch.is_grad_enabled():
            aux = self._balance_loss(scores.view(batch, length, -1), choices)
            scale = self.aux_grad_scale if self.aux_grad_scale is not None else 1.0 / batch
            out = AuxLossGradient.apply(out, aux, scale)
        if self.training and not _recomputing():
            self._record(chosen, kept, aux, batch)
        return out

    def route(self, flat: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Rows [n, d] -> (scores [n, E] fp32, chosen experts [n, k], their weights [n, k] fp32): the router's."""
        return self.router(flat)

    def shared_output(self, x: Tensor) -> Tensor | None:
        """What the shared experts add to every token's output (None without shared experts)."""
        return self.shared(x) if self.shared is not None else None

    def capacity(self, length: int) -> int:
        """Choices each expert takes per sequence of ``length`` tokens: ceil(capacity_factor x T x k / E)."""
        assert self.capacity_factor is not None
        return math.ceil(self.capacity_factor * length * self.top_k / self.n_experts)

    def _route(
        self,
        flat: Tensor,
        chosen: Tensor,
        weights: Tensor,
        kept: Tensor | None,
        in_flight: Callable[[], None] | None = None,
    ) -> Tensor:
        """Sort the (token, choice) pairs by expert, run them through ``dispatch`` (``in_flight`` while they
        travel), add each token's weighted outputs back (in fp32, returned in the experts' output dtype)."""
        tokens, k = chosen.shape
        key = chosen.reshape(-1)
        if kept is not None:  # dropped choices sort past the last expert and are cut off
            key = torch.where(kept.reshape(-1), key, self.n_experts)
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=self.n_experts + 1)[: self.n_experts]
        if kept is not None:
            order = order[: int(counts.sum())]
        token = torch.div(order, k, rounding_mode="floor")
        y = self.dispatch(flat.index_select(0, token), counts, self.experts, in_flight)
        scale = weights.reshape(-1).index_select(0, order).unsqueeze(-1)
        out = torch.zeros(tokens, flat.shape[-1], dtype=torch.float32, device=flat.device)
        return out.index_add(0, token, y.float() * scale).to(y.dtype)

    def _balance_loss(self, scores: Tensor, choices: Tensor) -> Tensor:
        """This rank's share of sum over its sequences of L_seq (module docstring), given the whole sequences'
        counts (``sequence_sum``)."""
        batch, length, experts = scores.shape
        probs = scores / scores.sum(dim=-1, keepdim=True)
        share = probs.sum(dim=1)  # [B, E]: sum over this rank's positions of s'
        counts = F.one_hot(choices, experts).sum(dim=(1, 2)).to(share.dtype)  # [B, E]
        stats = torch.cat([counts, torch.full((batch, 1), float(length), device=share.device)], dim=1)
        if self.sequence_sum is not None:
            stats = self.sequence_sum(stats)
        whole, positions = stats[:, :experts], stats[:, experts:]
        return self.aux_coef * experts / self.top_k * (whole * share / positions.square()).sum()

    # ----------------------------------------------------------------- statistics and balance
    @torch.no_grad()
    def _record(self, chosen: Tensor, kept: Tensor | None, aux: Tensor | None, sequences: int) -> None:
        experts = self.n_experts
        if self._statistics is None:
            self._statistics = torch.zeros(2 * experts + 1, dtype=torch.float64, device=chosen.device)
        stats = self._statistics
        stats[:experts] += torch.bincount(chosen.reshape(-1), minlength=experts).to(stats.dtype)
        if kept is not None:
            dropped = chosen.reshape(-1)[~kept.reshape(-1)]
            stats[experts : 2 * experts] += torch.bincount(dropped, minlength=experts).to(stats.dtype)
        if aux is not None:
            stats[2 * experts] += aux.detach().to(stats.dtype)
        self.sequences += sequences

    def take_statistics(self) -> Tensor | None:
        """[routed per expert | dropped per expert | balance loss summed over sequences] since the last call (None
        without a training forward), and start again."""
        stats, self._statistics, self.sequences = self._statistics, None, 0
        return stats

    @torch.no_grad()
    def update_bias(self, load: Tensor) -> None:
        """Aux-loss-free balancing (DeepSeek-V3, sec. 2.1.2): b_i += rate x sign(mean load - load_i), i.e. an
        overloaded expert is chosen less often at the next step. ``load``: tokens routed to each expert. Nothing
        to do under the other balance modes."""
        bias = self.router.expert_bias
        if bias is None:
            return
        load = load.to(bias.device, torch.float64)
        bias += (self.bias_rate * torch.sign(load.mean() - load)).to(bias.dtype)


@dataclass
class LayerStatistics:
    """What one MoE layer did in a step (``finish_moe_step``)."""

    load: Tensor
    """Tokens routed to each expert [E] (first choice or not; before any capacity drop)."""
    dropped: Tensor
    """Choices dropped by the capacity cap, per expert [E]."""
    aux_loss: float
    """The layer's balance loss: mean over the step's sequences of L_seq (0 without "aux_loss" balancing)."""

    @property
    def imbalance(self) -> float:
        """Most-loaded expert's tokens over the mean (1.0 is perfect balance)."""
        mean = float(self.load.float().mean())
        return float(self.load.max()) / mean if mean > 0 else float("nan")


def moe_layers(model: nn.Module) -> list[MoE]:
    """The model's MoE layers in module order."""
    return [module for module in model.modules() if isinstance(module, MoE)]


def finish_moe_step(model: nn.Module, update_biases: bool = True) -> dict[int, LayerStatistics]:
    """For a plain training loop on one device: read (and reset) every MoE layer's statistics of the step and, under
    "aux_free" balancing, move its bias (call it after ``optimizer.step()``). plait's Engine does the same with
    the statistics summed over every rank."""
    out = {}
    for layer in moe_layers(model):
        sequences = layer.sequences
        stats = layer.take_statistics()
        if stats is None:
            continue
        experts = layer.n_experts
        load = stats[:experts]
        if update_biases:
            layer.update_bias(load)
        aux = float(stats[2 * experts]) / sequences if sequences else 0.0
        out[layer.layer] = LayerStatistics(load.clone(), stats[experts : 2 * experts].clone(), aux)
    return out


__all__ = [
    "AuxLossGradient",
    "Dispatch",
    "ExpertGroup",
    "GroupedExperts",
    "LayerStatistics",
    "MoE",
    "Router",
    "capacity_mask",
    "choose_experts",
    "finish_moe_step",
    "group_offsets",
    "grouped_mm_available",
    "local_dispatch",
    "moe_layers",
]
