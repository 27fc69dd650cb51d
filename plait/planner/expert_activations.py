"""What a Mixture-of-Experts block keeps for backward: its attention half as a dense block's
(``plait.planner.activations``), its feed-forward replaced by the router, the routed rows through their experts
and the shared experts. Both accountings of ``activations.py``.

**"plait"**: plait's MoE layer (``plait.models.moe``) tensor by tensor, as ``SavedActivations`` measures it
(tests/test_planner_moe.py holds it to the byte). For one MoE layer and micro-batch on this rank, n = b s tokens
(s / cp), n_r = n / t of them routed here under sequence parallelism (each tp rank routes its own chunk; n without
it: the layer is replicated over tp), k chosen experts each, so R = n_r k routed rows, of which R' arrive at this
rank's E / ep experts (R' = R under uniform routing, the planner's assumption; dropless: a capacity factor drops
rows, so this is then an upper bound); f the width of an expert, f_s = shared experts x f, e bytes per
compute-dtype element, h the width:

    router        4 n_r E (fp32 scores) + 8 n_r k (chosen experts)
                  + 4 n_r k + 4 n_r with router_norm_topk (the k weights and their sum)
                  + 4 n_r + 4 b (E + 1) + 4 b with the balance loss (its score sums, the sequences' counts and
                  their squared lengths)
    permutation   16 R (each row's token and its place in the sort, int64) + 4 R (each row's weight)
    experts       c e R' h (the rows each expert's matmuls read: c = 1, or under autocast without expert
                  parallelism one copy per matmul that reads them, 2 with SwiGLU; with ep > 1 the rows travel,
                  and arrive, in the compute dtype) + (2|4) e R' f (GELU: up's output and GELU's; SwiGLU: gate,
                  SiLU, up, product) + e (E / ep) (2|3) h f (autocast's copies of the local experts' weights;
                  none in fp32)
    outputs       4 R h (the experts' outputs in fp32) + 4 R h (weighted, as the combine's sum keeps them)
    shared        (2|4) e n f_s / t + e (2|3) h f_s / t under autocast (as a dense MLP of width f_s)
    input         the router reads the fp32 norm output (4 n_r h); the shared experts' matmuls read it as a dense
                  MLP's do (``activations._matmul_inputs``: one e-byte copy each under autocast; the same fp32
                  tensor in fp32 without sequence parallelism, the gathered one with it)

These replace the dense MLP's matmul inputs, hidden tensors and weight copies in ``plait_block_bytes``. Under
recompute "full" an MoE block keeps only its input, as a dense block; "selective" changes only the attention half;
"op" (the per-operator policy) is counted as the dense block's attention half with the whole feed-forward kept (the
policy's choice inside the experts' per-expert matmuls is not modelled).

**"korthikanti"** (Megatron-style, 2-byte activations, scaled by e / 2), in units of s b h as
``korthikanti_block_bytes``: the MLP's "2 (input) + (4|6) f / h" become 2 (the MoE layer's input) + 4 E / h
(fp32 router probabilities) + k [2 (the permuted rows) + (4|6) f / h (the grouped MLP's fc1 output and
activation) + 2 (the expert outputs the unpermute keeps)] over the routed tokens (/ t with sequence parallelism;
Megatron-Core requires it with tp > 1 and experts), plus (4|6) f_s / h / t for the shared experts.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.models.spec import ModelSpec
from plait.planner.activations import Forward, _matmul_inputs, block_bytes


@dataclass(frozen=True)
class Routing:
    """What the router keeps beyond its scores: the k weights rescaled to sum to 1 (``router_norm_topk``) and the
    balance loss's terms (``moe_balance="aux_loss"`` with a coefficient > 0). plait's defaults: both."""

    norm_topk: bool = True
    aux_loss: bool = True

    @classmethod
    def of(cls, config: object) -> Routing:
        """The routing of a ``GPTConfig`` (plait's defaults for anything else)."""
        norm = getattr(config, "router_norm_topk", True)
        balance = getattr(config, "moe_balance", "aux_loss")
        coef = getattr(config, "aux_loss_coef", 0.01)
        return cls(bool(norm), balance == "aux_loss" and bool(coef))


PLAIT_ROUTING = Routing()
"""plait's default routing (``GPTConfig``'s defaults): both terms kept."""


def _expert_width(spec: ModelSpec) -> int:
    return spec.expert_ffn or spec.ffn


def plait_moe_ffn_bytes(spec: ModelSpec, fwd: Forward, ep: int = 1, routing: Routing = PLAIT_ROUTING) -> float:
    """What plait's MoE feed-forward keeps for one micro-batch under expert parallelism ``ep`` (module docstring),
    its input included."""
    b, s, t, h, e, k = fwd.batch, fwd.seq, fwd.tp, spec.hidden, fwd.e, spec.top_k
    n = b * s
    routed = n / fwd.n
    rows = routed * k
    f, shared = _expert_width(spec), spec.shared_experts * _expert_width(spec)
    gated = spec.gated
    router = 4 * routed * spec.experts + 8 * routed * k
    if routing.norm_topk:
        router += 4 * routed * k + 4 * routed
    if routing.aux_loss:
        router += 4 * routed + 4 * b * (spec.experts + 1) + 4 * b
    permutation = 16 * rows + 4 * rows
    copies = 2 if gated and fwd.autocast and ep == 1 else 1
    experts = copies * e * rows * h + (4 if gated else 2) * e * rows * f
    if fwd.autocast:
        experts += e * (spec.experts // ep) * (3 if gated else 2) * h * f
    outputs = 8 * rows * h
    hidden_input = 4 * routed * h  # the router's fp32 input: the norm output (this rank's chunk under SP)
    shared_bytes = 0.0
    if shared:
        shared_bytes = (4 if gated else 2) * e * n * shared / t
        if fwd.autocast:
            shared_bytes += e * (3 if gated else 2) * h * shared / t + _matmul_inputs(spec, fwd, 2 if gated else 1)
        elif fwd.n > 1:  # the gathered input of the shared experts' column-parallel matmuls
            shared_bytes += _matmul_inputs(spec, fwd, 1)
    return router + permutation + experts + outputs + hidden_input + shared_bytes


def _dense_mlp_bytes(spec: ModelSpec, fwd: Forward) -> float:
    """The terms of ``plait_block_bytes`` that belong to the dense MLP: its input copies, hidden tensors and (under
    autocast) weight copies."""
    sbf = fwd.batch * fwd.seq * spec.ffn
    weights = fwd.e * (3 if spec.gated else 2) * spec.hidden * spec.ffn / fwd.tp if fwd.autocast else 0.0
    hidden = (4 if spec.gated else 2) * fwd.e * sbf / fwd.tp
    return _matmul_inputs(spec, fwd, 2 if spec.gated else 1) + hidden + weights


def plait_moe_operator_bytes(spec: ModelSpec, fwd: Forward) -> float:
    """What the per-operator policy keeps of plait's MoE feed-forward (module docstring): it keeps every
    odd-numbered matmul's output of a block, counting q, k, v, o (1-4), the router (5: its fp32 logits), each
    expert's two (GELU: up, down) or three (SwiGLU: gate, up, down) matmuls in turn, then the shared experts'."""
    b, s, t, h, e, k = fwd.batch, fwd.seq, fwd.tp, spec.hidden, fwd.e, spec.top_k
    n = b * s
    routed = n / fwd.n
    rows = routed * k
    f, shared = _expert_width(spec), spec.shared_experts * _expert_width(spec)
    kept = 4 * routed * spec.experts
    if not spec.gated:  # up #6, down #7, ...: every expert's down; then the shared up (even), down (odd)
        kept += e * rows * h + (e * n * h if shared else 0.0)
        return kept
    # SwiGLU: expert j's gate, up, down are #6+3j, #7+3j, #8+3j: even experts keep up, odd ones gate and down,
    # (f + h / 2) per row under uniform routing; the shared experts follow at #6+3E
    kept += e * rows * (f + h / 2)
    if shared:
        kept += e * n * shared / t if spec.experts % 2 == 0 else e * n * (shared / t + h)
    return kept


def _dense_mlp_operator_outputs(spec: ModelSpec, fwd: Forward) -> float:
    """The MLP's share of what "op" keeps in a dense block: its first matmul's output and, gated, down's."""
    b, s = fwd.batch, fwd.seq
    return fwd.e * b * s * (spec.ffn / fwd.tp + (spec.hidden if spec.gated else 0))


def plait_moe_block_bytes(
    spec: ModelSpec, fwd: Forward, recompute: str = "none", ep: int = 1, routing: Routing = PLAIT_ROUTING
) -> float:
    """Bytes one of plait's MoE blocks keeps for one micro-batch (module docstring)."""
    dense = block_bytes(spec, fwd, recompute, "plait")
    if recompute == "full":
        return dense
    if recompute == "op":
        return dense - _dense_mlp_operator_outputs(spec, fwd) + plait_moe_operator_bytes(spec, fwd)
    return dense - _dense_mlp_bytes(spec, fwd) + plait_moe_ffn_bytes(spec, fwd, ep, routing)


def korthikanti_moe_block_bytes(spec: ModelSpec, fwd: Forward, recompute: str = "none") -> float:
    """Korthikanti et al.'s accounting of an MoE block (module docstring), for one micro-batch."""
    dense = block_bytes(spec, fwd, recompute, "korthikanti")
    if recompute == "full":
        return dense
    s, b, h, t = fwd.seq, fwd.batch, spec.hidden, fwd.tp
    sbh, scale = s * b * h, fwd.e / 2
    if recompute == "op":
        mlp = 2 * _dense_mlp_operator_outputs(spec, fwd) / fwd.e
    else:
        mlp = sbh * (2 / fwd.n + (6 if spec.gated else 4) * spec.ffn / h / t)
    f, shared = _expert_width(spec), spec.shared_experts * _expert_width(spec)
    act = 6 if spec.gated else 4
    routed = spec.top_k * (2 + act * f / h + 2) + 4 * spec.experts / h
    moe = sbh * (2 / fwd.n + routed / fwd.n + act * shared / h / t)
    return dense + (moe - mlp) * scale


def layer_bytes(
    spec: ModelSpec,
    fwd: Forward,
    index: int,
    recompute: str = "none",
    accounting: str = "plait",
    ep: int = 1,
    routing: Routing = PLAIT_ROUTING,
) -> float:
    """Block ``index``'s saved activations for one micro-batch under ``accounting`` and expert parallelism ``ep``:
    an MoE block's (module docstring) or a dense one's."""
    if not spec.is_moe_block(index):
        return block_bytes(spec, fwd, recompute, accounting)
    if accounting == "korthikanti":
        return korthikanti_moe_block_bytes(spec, fwd, recompute)
    return plait_moe_block_bytes(spec, fwd, recompute, ep, routing)


__all__ = [
    "PLAIT_ROUTING",
    "Routing",
    "korthikanti_moe_block_bytes",
    "layer_bytes",
    "plait_moe_block_bytes",
    "plait_moe_ffn_bytes",
]
