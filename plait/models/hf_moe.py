"""Hugging Face Mixture-of-Experts causal LMs as plait MoE layers: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.

transformers (>= 5) keeps these families' routed experts as two fused 3-D parameters per layer, ``experts.
gate_up_proj`` [E, 2I, d] (each expert's gate rows, then its up rows) and ``experts.down_proj`` [E, d, I], and their
router as ``gate.weight`` [E, d]: a softmax over the E logits, the top k chosen, their probabilities as weights
(renormalised to sum to 1: always for Mixtral, with ``norm_topk_prob`` for the others); Qwen2-MoE adds a shared
expert (an MLP) gated per token by sigmoid(``shared_expert_gate``(x)). ``adapt_hf_moe(model)`` replaces each such
sparse block with an ``HFMoE``, a ``plait.models.moe.MoE`` whose router and experts are the family's own modules
and Parameter objects under the family's own names (``model.layers.L.mlp.gate.weight``, ``...experts.gate_up_proj``,
...), so the state dict, checkpoints, ``save_pretrained`` and ``from_pretrained`` see the model unchanged, and the
forward is the family's (tests/test_hf_moe.py compares the logits). What plait's MoE brings with it:

- expert parallelism (``Layout(ep=N)``: the fused weights sliced on dim 0 and the rows exchanged by
  ``plait.parallel.expert``), the routing statistics of every step (``StepStats.moe``, metrics.jsonl), and the
  grouped kernel where the device has it (``torch._grouped_mm`` on the fused weights, transposed views);
- the balance loss. The families' own (``load_balancing_loss_func``, trained by HF only when the forward gets
  labels and ``output_router_logits``) is Switch Transformer's E sum_i f_i P_i over the whole batch and every
  layer at once: a product of batch means, which no split of the batch into ranks or micro-batches reproduces
  (the mean of the parts' products is not the product of the means), and which plait's Engine, computing the
  loss from the logits, never receives. plait trains DeepSeek-V3's sequence-wise balance loss instead
  (``plait.models.moe``), exact under every split, when the config asks for a balance loss
  (``output_router_logits=True``), with alpha = beta x k / L (beta = ``router_aux_loss_coef``, L MoE layers, N
  tokens): a balanced router then scores beta x k as HF's does, and each router probability gets HF's gradient
  beta E F_i / (L N) (F_i: expert i's share of the batch's choices) when the layers and the sequences route alike
  (``balance_settings``). ``adapt_hf_moe(model, balance=..., aux_loss_coef=...)`` chooses otherwise. The router
  runs in fp32 (the family's runs its logits in the input dtype: the same in fp32; under
  mixed precision plait's routing is the more precise).

Refused (``LayoutError`` with the fix): Mixtral's ``router_jitter_noise`` > 0 (random noise on the hidden states,
which no two layouts draw alike) and a block of a listed family whose structure is not the one above. Other
transformers MoE families are left as they are: data parallelism and ZeRO train them with their own forward,
expert parallelism refuses them (``plait.parallel.expert.plan``).

``fuse_expert_layout`` reads the layout ``save_pretrained`` writes for these families (one tensor per expert:
Mixtral's ``block_sparse_moe.experts.e.w1/w3/w2.weight``, the others' ``mlp.experts.e.gate_proj/up_proj/
down_proj.weight``) into the fused one, for plait's own readers of HF folders (``plait.models.hf_load.
read_hf_weights``: ``plait convert``, ``train.init_from``). Nothing here imports transformers: families are
recognised by ``config.model_type`` and class names.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from plait.errors import ConfigError, LayoutError
from plait.logging import get_logger
from plait.models.moe import ExpertGroup, MoE, _compute_dtype, choose_experts, group_offsets

log = get_logger(__name__)


@dataclass(frozen=True)
class Family:
    """How a transformers MoE family keeps its experts: the sparse block's class, and the per-expert tensor names
    of its saved checkpoints (``gate``, ``up``, ``down``; Mixtral's under ``block_sparse_moe`` instead of ``mlp``)."""

    block: str
    legacy: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    legacy_block: str | None = None


FAMILIES = {
    "mixtral": Family("MixtralSparseMoeBlock", ("w1", "w3", "w2"), "block_sparse_moe"),
    "qwen2_moe": Family("Qwen2MoeSparseMoeBlock"),
    "qwen3_moe": Family("Qwen3MoeSparseMoeBlock"),
    "olmoe": Family("OlmoeSparseMoeBlock"),
}
"""``config.model_type`` -> family: the transformers MoE families plait adapts."""
CHILDREN = {"gate", "experts", "shared_expert", "shared_expert_gate"}
"""What a sparse block of these families holds (the last two: Qwen2-MoE's shared expert)."""
BALANCE_MODES = ("aux_loss", "none")
SUPPORTED_TRANSFORMERS = "transformers>=5.23,<6, pip install 'plait[hf]'"
"""The transformers versions whose MoE layout this adapts (pyproject's ``hf`` extra)."""


def _attribute(module: nn.Module, name: str, kind: type) -> Any:
    """``module.name`` when it is a ``kind``; else the LayoutError of a block that is not what plait adapts."""
    value = getattr(module, name, None)
    if not isinstance(value, kind):
        raise LayoutError(
            f"{type(module).__name__} has no {kind.__name__} {name!r}: not the MoE layout plait adapts. Fix: use the "
            f"transformers version plait supports ({SUPPORTED_TRANSFORMERS})."
        )
    return value


def _parameter(module: nn.Module, name: str) -> nn.Parameter:
    return _attribute(module, name, nn.Parameter)


class FusedExperts(ExpertGroup):
    """A Hugging Face experts module's weights as plait's ``ExpertGroup``: ``gate_up_proj`` [E, 2I, d] (the same
    Parameter object), ``down_proj`` [E, d, I], the family's activation ``act_fn``. Expert e maps a row x to
    down_proj[e] (act(g) * u), [g | u] = gate_up_proj[e] x: the family's own products, one expert at a time (or
    grouped)."""

    def __init__(self, experts: nn.Module) -> None:
        gate_up, down = _parameter(experts, "gate_up_proj"), _parameter(experts, "down_proj")
        if (
            gate_up.dim() != 3
            or down.dim() != 3
            or gate_up.shape[1] != 2 * down.shape[2]
            or gate_up.shape[2] != down.shape[1]
            or getattr(experts, "is_transposed", False)
            or getattr(experts, "has_bias", False)
            or not getattr(experts, "is_concatenated", True)
        ):
            raise LayoutError(
                f"{type(experts).__name__} stores its experts as gate_up_proj {tuple(gate_up.shape)}, down_proj "
                f"{tuple(down.shape)} (transposed, biased or interleaved): not the [E, 2I, d] / [E, d, I] layout plait "
                f"adapts. Fix: use the transformers version plait supports ({SUPPORTED_TRANSFORMERS})."
            )
        super().__init__(gate_up.shape[0])
        self.gate_up_proj = gate_up
        self.down_proj = down
        self.act_fn: nn.Module = _attribute(experts, "act_fn", nn.Module)

    def weights(self) -> list[nn.Parameter]:
        return [self.gate_up_proj, self.down_proj]

    def forward(self, x: Tensor, counts: Tensor | Sequence[int]) -> Tensor:
        if self.use_grouped(x, self.down_proj.shape[-1]):
            return self._grouped(x, counts)
        sizes = counts.tolist() if isinstance(counts, Tensor) else list(counts)
        outputs = []
        for expert, rows in enumerate(x.split(sizes)):  # an expert without rows: a 0-row product (same graph)
            gate, up = F.linear(rows, self.gate_up_proj[expert]).chunk(2, dim=-1)
            outputs.append(F.linear(self.act_fn(gate) * up, self.down_proj[expert]))
        return torch.cat(outputs) if outputs else x.new_zeros(0, x.shape[-1])

    def _grouped(self, x: Tensor, counts: Tensor | Sequence[int]) -> Tensor:
        """Both products in one ``torch._grouped_mm`` each, on transposed views of the fused weights."""
        dtype, offsets = _compute_dtype(x), group_offsets(counts, x.device)
        gate_up = torch._grouped_mm(x.to(dtype), self.gate_up_proj.to(dtype).transpose(-2, -1), offs=offsets)
        gate, up = gate_up.chunk(2, dim=-1)
        return torch._grouped_mm(self.act_fn(gate) * up, self.down_proj.to(dtype).transpose(-2, -1), offs=offsets)


class HFMoE(MoE):
    """A Hugging Face sparse MoE block as plait's ``MoE`` (module docstring): the block's own children under their
    own names (``gate``, ``experts`` as ``FusedExperts``, Qwen2-MoE's ``shared_expert`` and ``shared_expert_gate``),
    in the block's order; routing, dispatch, balance loss and statistics are ``MoE``'s."""

    def __init__(self, block: nn.Module, layer: int, balance: str, aux_coef: float) -> None:
        nn.Module.__init__(self)  # not MoE.__init__: the router and experts are the block's, not built from a config
        children = dict(block.named_children())
        unknown = sorted(set(children) - CHILDREN)
        if unknown or not {"gate", "experts"} <= set(children):
            raise LayoutError(
                f"{type(block).__name__} holds {sorted(children)}, not the router 'gate' and 'experts' (and a shared "
                f"expert) plait adapts. Fix: use the transformers version plait supports ({SUPPORTED_TRANSFORMERS})."
            )
        if float(getattr(block, "jitter_noise", 0.0) or 0.0) > 0:
            raise LayoutError(
                f"{type(block).__name__} multiplies its input by random jitter (router_jitter_noise="
                f"{block.jitter_noise}) in training: noise that no two layouts draw alike, so no run could be "
                f"compared with another. Fix: router_jitter_noise=0.0 (the default) in the model's config."
            )
        gate = children["gate"]
        self.init_routing(
            layer, _attribute(gate, "num_experts", int), _attribute(gate, "top_k", int), balance, aux_coef
        )
        self.norm_topk = bool(getattr(gate, "norm_topk_prob", True))  # Mixtral's router always renormalises
        experts = FusedExperts(children["experts"])
        weight = _parameter(gate, "weight")
        if tuple(weight.shape) != (experts.total, experts.gate_up_proj.shape[-1]):
            raise LayoutError(
                f"{type(block).__name__}'s router weight {tuple(weight.shape)} does not score its {experts.total} "
                f"experts. Fix: use the transformers version plait supports ({SUPPORTED_TRANSFORMERS})."
            )
        for name, child in children.items():
            setattr(self, name, experts if name == "experts" else child)

    def route(self, flat: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The family's router in fp32: softmax of x gate.weight^T, the top k, their probabilities as weights."""
        weight = _parameter(self.get_submodule("gate"), "weight")
        with torch.autocast(flat.device.type, enabled=False):
            logits = F.linear(flat.float(), weight.float())
        scores = logits.softmax(dim=-1)
        chosen, weights = choose_experts(scores, self.top_k, self.norm_topk)
        return scores, chosen, weights

    def shared_output(self, x: Tensor) -> Tensor | None:
        """Qwen2-MoE: sigmoid(shared_expert_gate(x)) * shared_expert(x); None for the others."""
        if "shared_expert" not in self._modules:
            return None
        return torch.sigmoid(self.get_submodule("shared_expert_gate")(x)) * self.get_submodule("shared_expert")(x)

    def update_bias(self, load: Tensor) -> None:
        """Nothing to move: these families route without a selection bias."""


def family_of(model: nn.Module) -> Family | None:
    """The family of a transformers model plait adapts (by ``config.model_type``), else None."""
    return FAMILIES.get(str(getattr(getattr(model, "config", None), "model_type", "")))


def balance_settings(config: Any, moe_layers: int) -> tuple[str, float]:
    """(balance mode, alpha) for a family config: "aux_loss" with alpha = router_aux_loss_coef x top_k / moe_layers
    when it asks for a balance loss (``output_router_logits``), else "none" (module docstring)."""
    beta = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    if not getattr(config, "output_router_logits", False) or beta <= 0 or moe_layers == 0:
        return "none", 0.0
    return "aux_loss", beta * int(config.num_experts_per_tok) / moe_layers


def _layer_index(path: str) -> int:
    """The decoder layer of a block path such as ``model.layers.3.mlp``: its last integer component."""
    numbers = [int(part) for part in path.split(".") if part.isdigit()]
    return numbers[-1] if numbers else 0


def adapt_hf_moe(model: nn.Module, balance: str | None = None, aux_loss_coef: float | None = None) -> list[HFMoE]:
    """Replace every sparse MoE block of a transformers model of a listed family with an ``HFMoE`` (in place;
    parameter names and objects unchanged; a block adapted before stays). ``balance`` / ``aux_loss_coef``: the
    balance loss ("aux_loss" with alpha, or "none"; default ``balance_settings``). Returns the model's HFMoE
    layers; [] for any other model."""
    family = family_of(model)
    if family is None:
        return []
    if balance is not None and balance not in BALANCE_MODES:
        raise ConfigError(f"balance={balance!r}: HF MoE models take one of {BALANCE_MODES}. Fix: choose one.")
    blocks = [(path, m) for path, m in model.named_modules() if type(m).__name__ == family.block]
    adapted = [m for m in model.modules() if isinstance(m, HFMoE)]
    mode, alpha = balance_settings(model.config, len(blocks) + len(adapted))
    if balance is not None:
        mode, alpha = balance, alpha if aux_loss_coef is None else float(aux_loss_coef)
    elif aux_loss_coef is not None:
        mode, alpha = "aux_loss", float(aux_loss_coef)
    if mode == "aux_loss" and not alpha > 0:
        raise ConfigError(f"balance='aux_loss' needs aux_loss_coef > 0 (got {alpha}). Fix: give one, or 'none'.")
    for path, block in blocks:
        parent_path, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent_path), name, HFMoE(block, _layer_index(path), mode, alpha))
    if blocks:
        model.register_forward_pre_hook(_no_router_logits, with_kwargs=True)
        log.info(
            "%s: %d MoE blocks run as plait MoE layers (balance %s, alpha %.3g)", family.block, len(blocks), mode, alpha
        )
    return [m for m in model.modules() if isinstance(m, HFMoE)]


def _no_router_logits(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """The family's forward would gather router logits for its own balance loss, which plait replaces."""
    return args, {**kwargs, "output_router_logits": False}


def fuse_expert_layout(state: dict[str, Tensor], model_type: str) -> dict[str, Tensor]:
    """``state`` with a listed family's per-expert tensors (module docstring) stacked into the fused
    ``experts.gate_up_proj`` [E, 2I, d] / ``experts.down_proj`` [E, d, I] (other tensors and families as they are);
    ConfigError when a layer's experts are incomplete."""
    family = FAMILIES.get(model_type)
    if family is None:
        return state
    gate, up, down = family.legacy
    pattern = re.compile(rf"^(.*\.experts)\.(\d+)\.({gate}|{up}|{down})\.weight$")
    out: dict[str, Tensor] = {}
    layers: dict[str, dict[int, dict[str, Tensor]]] = {}
    for name, tensor in state.items():
        if family.legacy_block is not None:
            name = name.replace(f".{family.legacy_block}.", ".mlp.")
        found = pattern.match(name)
        if found is None:
            out[name] = tensor
            continue
        layers.setdefault(found[1], {}).setdefault(int(found[2]), {})[found[3]] = tensor
    for prefix, experts in layers.items():
        count = max(experts) + 1
        missing = [f"{e}.{part}" for e in range(count) for part in (gate, up, down) if part not in experts.get(e, {})]
        if missing:
            raise ConfigError(
                f"the weights hold an incomplete set of experts under {prefix} (missing {missing[:3]}). Fix: save the "
                f"model again with save_pretrained."
            )
        ordered = [experts[e] for e in range(count)]
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([e[gate], e[up]]) for e in ordered])
        out[f"{prefix}.down_proj"] = torch.stack([e[down] for e in ordered])
    return out


def unfuse_expert_layout(
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], read: Callable[[str], Tensor], model_type: str
) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], Callable[[str], Tensor]]:
    """The inverse of ``fuse_expert_layout`` for a streaming writer: ``specs`` (name -> (dtype, shape)) with a
    listed family's fused ``experts.gate_up_proj`` / ``experts.down_proj`` replaced by the per-expert tensors
    ``save_pretrained`` writes (in place, expert by expert), and a reader of those names that reads each fused
    tensor once (the last one read is kept: the writer asks for a fused tensor's pieces one after another)."""
    family = FAMILIES.get(model_type)
    if family is None:
        return specs, read
    gate, up, down = family.legacy
    pieces: dict[str, tuple[str, int, slice | None]] = {}  # per-expert name -> (fused name, expert, rows)
    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for name, (dtype, shape) in specs.items():
        prefix, _, kind = name.rpartition(".")
        if not prefix.endswith(".experts") or kind not in ("gate_up_proj", "down_proj") or len(shape) != 3:
            out[name] = (dtype, shape)
            continue
        saved = prefix if family.legacy_block is None else prefix.replace(".mlp.", f".{family.legacy_block}.")
        experts, rows, cols = shape
        for expert in range(experts):
            if kind == "gate_up_proj":
                half = rows // 2
                for part, span in ((gate, slice(0, half)), (up, slice(half, rows))):
                    key = f"{saved}.{expert}.{part}.weight"
                    out[key], pieces[key] = (dtype, (half, cols)), (name, expert, span)
            else:
                key = f"{saved}.{expert}.{down}.weight"
                out[key], pieces[key] = (dtype, (rows, cols)), (name, expert, None)
    last: dict[str, Tensor] = {}

    def read_piece(key: str) -> Tensor:
        if key not in pieces:
            return read(key)
        fused, expert, span = pieces[key]
        if fused not in last:
            last.clear()
            last[fused] = read(fused)
        tensor = last[fused][expert]
        return (tensor if span is None else tensor[span]).contiguous()

    return out, read_piece


__all__ = [
    "FAMILIES",
    "Family",
    "FusedExperts",
    "HFMoE",
    "adapt_hf_moe",
    "balance_settings",
    "family_of",
    "fuse_expert_layout",
    "unfuse_expert_layout",
]
