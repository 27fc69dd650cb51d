"""Intra-operator planning: choose each operator's sharding inside a tensor-parallel group with an integer
linear program (Alpa, Zheng et al. 2022, sec. 4.2).

Every operator v has strategies k with a compute cost c_vk and memory m_vk; a boolean s_vk picks one. Along each
edge (u, v) the output layout of u's strategy must be converted to the input layout v's strategy wants, at a
resharding cost R_uv[i, j] (alpha-beta collectives). Alpa linearises s_u[i] s_v[j] with e_uv[i, j] >= 0,
sum_j e_uv[i, j] = s_u[i], sum_i e_uv[i, j] = s_v[j], and solves

    min  sum_v c_v . s_v + sum_(u,v) R_uv . e_uv    s.t.  sum_v m_v . s_v <= memory budget

with HiGHS (``scipy.optimize.milp``). Layouts of an activation: "R" replicated, "H" split on the hidden (last)
dimension, "S" split on the sequence, "P" partial sums. Strategies of a linear layer y = x W: replicate (R -> R),
column (R -> H, W split by columns), row (H -> P, W split by rows), sequence (S -> S, W replicated, its gradient
all-reduced). A transformer block is a chain whose last operator feeds the next block's first, so the block
boundary layout is chosen too: for tp > 1 the optimum is Megatron-LM's column / row pairs with sequence-parallel
norms (Korthikanti et al. 2022).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from plait.errors import ConfigError
from plait.planner.costs import collective_time
from plait.planner.hardware import Hardware
from plait.planner.models import ModelSpec

RESHARD_OPS = {
    ("H", "R"): "all_gather",
    ("S", "R"): "all_gather",
    ("P", "R"): "all_reduce",
    ("P", "S"): "reduce_scatter",
    ("P", "H"): "reduce_scatter",
    ("H", "S"): "all_to_all",
    ("S", "H"): "all_to_all",
}
"""The collective that converts an activation from one layout to another (R -> H or S is a local slice)."""


@dataclass(frozen=True)
class Strategy:
    name: str
    needs: str
    gives: str
    cost: float
    memory: float


@dataclass(frozen=True)
class Operator:
    """One operator of the chain: its name, strategies, and the bytes of its output activation."""

    name: str
    strategies: tuple[Strategy, ...]
    output_bytes: float


@dataclass(frozen=True)
class IntraOpPlan:
    choice: dict[str, str]
    cost: float

    def tp_plan(self) -> dict[str, str]:
        """The choice as a plait tensor-parallel plan for the reference GPT's blocks (module path -> style)."""
        names = {
            "qkv": ("attn.q", "attn.k", "attn.v"),
            "out": ("attn.o",),
            "up": ("mlp.up", "mlp.gate"),
            "down": ("mlp.down",),
        }
        styles = {"column": "colwise", "row": "rowwise", "replicate": "replicate", "sequence": "sequence"}
        return {
            f"blocks.*.{path}": styles[self.choice[op]]
            for op, paths in names.items()
            for path in paths
            if op in self.choice
        }


def reshard_cost(source: str, target: str, nbytes: float, tp: int, hw: Hardware) -> float:
    """Seconds to convert an activation of ``nbytes`` from layout ``source`` to ``target`` in a tp group."""
    if source == target or (source == "R" and target in ("H", "S")):
        return 0.0
    if (source, target) not in RESHARD_OPS:
        return math.inf
    return collective_time(hw, RESHARD_OPS[(source, target)], nbytes, tp, span=tp)


def block_operators(
    spec: ModelSpec,
    tp: int,
    tokens: int,
    hw: Hardware,
    act_bytes: int = 2,
    peak_fraction: float | None = None,
    precision: str = "bf16",
) -> list[Operator]:
    """The operators of one transformer block for ``tokens`` tokens, with their strategies' costs (matmuls at
    ``peak_fraction`` of the peak: by default the hardware's fitted compute efficiency)."""
    h, f, e = spec.hidden, spec.ffn, act_bytes
    flops_rate = hw.flops(precision) * (hw.compute_efficiency if peak_fraction is None else peak_fraction)
    bandwidth = hw.memory_bandwidth * 0.8
    kv = 2 * spec.kv * spec.head_dim

    def linear(name: str, d_in: int, d_out: int) -> Operator:
        t_full = 2 * tokens * d_in * d_out / flops_rate
        w = d_in * d_out * e
        grad_sync = collective_time(hw, "all_reduce", w, tp, span=tp)
        return Operator(
            name,
            (
                Strategy("replicate", "R", "R", t_full, w),
                Strategy("column", "R", "H", t_full / tp, w / tp),
                Strategy("row", "H", "P", t_full / tp, w / tp),
                Strategy("sequence", "S", "S", t_full / tp + grad_sync, w),
            ),
            tokens * d_out * e,
        )

    def pointwise(name: str, width: int, split_hidden: bool) -> Operator:
        t_full = 4 * tokens * width * e / bandwidth
        options = [Strategy("replicate", "R", "R", t_full, 0.0), Strategy("sequence", "S", "S", t_full / tp, 0.0)]
        if split_hidden:
            options.append(Strategy("split", "H", "H", t_full / tp, 0.0))
        return Operator(name, tuple(options), tokens * width * e)

    q = spec.q_width
    attn_flops = 4 * tokens * tokens * q / flops_rate  # one sequence of ``tokens``
    kv_gather = collective_time(hw, "all_gather", tokens * kv * e, tp, span=tp)
    attention = Operator(
        "attention",
        (
            Strategy("replicate", "R", "R", attn_flops, 0.0),
            Strategy("heads", "H", "H", attn_flops / tp, 0.0),
            Strategy("sequence", "S", "S", attn_flops / tp + kv_gather, 0.0),
        ),
        tokens * q * e,
    )
    return [
        pointwise("norm1", h, False),
        linear("qkv", h, q + kv),
        attention,
        linear("out", q, h),
        pointwise("norm2", h, False),
        linear("up", h, (2 if spec.gated else 1) * f),
        pointwise("act", f, True),
        linear("down", f, h),
    ]


def _edge_costs(ops: list[Operator], tp: int, hw: Hardware) -> list[np.ndarray]:
    """R[u][i, j] for each edge u -> u + 1 (the last wraps to the first: blocks repeat)."""
    edges = []
    for u, src in enumerate(ops):
        dst = ops[(u + 1) % len(ops)]
        edges.append(
            np.array(
                [
                    [reshard_cost(a.gives, b.needs, src.output_bytes, tp, hw) for b in dst.strategies]
                    for a in src.strategies
                ]
            )
        )
    return edges


def solve_intra_op(ops: list[Operator], tp: int, hw: Hardware, memory_budget: float = math.inf) -> IntraOpPlan:
    """Alpa's ILP over ``ops`` (module docstring), solved with HiGHS through ``scipy.optimize.milp``."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    edges = _edge_costs(ops, tp, hw)
    big = 1e6 * max(1.0, max(s.cost for op in ops for s in op.strategies))
    n_s = [len(op.strategies) for op in ops]
    s_offset = np.cumsum([0] + n_s)
    e_offset = s_offset[-1] + np.cumsum([0] + [e.size for e in edges])
    total = int(e_offset[-1])
    c = np.zeros(total)
    for v, op in enumerate(ops):
        c[s_offset[v] : s_offset[v + 1]] = [s.cost for s in op.strategies]
    for u, edge in enumerate(edges):
        c[e_offset[u] : e_offset[u + 1]] = np.where(np.isfinite(edge), edge, big).ravel()
    rows: list[np.ndarray] = []
    bounds: list[tuple[float, float]] = []  # (lower, upper) of each row
    for v in range(len(ops)):  # one strategy per operator
        row = np.zeros(total)
        row[s_offset[v] : s_offset[v + 1]] = 1
        rows.append(row)
        bounds.append((1, 1))
    for u, edge in enumerate(edges):
        v = (u + 1) % len(ops)
        n_i, n_j = edge.shape
        for i in range(n_i):  # sum_j e[i, j] = s_u[i]
            row = np.zeros(total)
            row[e_offset[u] + i * n_j : e_offset[u] + (i + 1) * n_j] = 1
            row[s_offset[u] + i] = -1
            rows.append(row)
            bounds.append((0, 0))
        for j in range(n_j):  # sum_i e[i, j] = s_v[j]
            row = np.zeros(total)
            row[[e_offset[u] + i * n_j + j for i in range(n_i)]] = 1
            row[s_offset[v] + j] = -1
            rows.append(row)
            bounds.append((0, 0))
    if math.isfinite(memory_budget):
        row = np.zeros(total)
        for v, op in enumerate(ops):
            row[s_offset[v] : s_offset[v + 1]] = [s.memory for s in op.strategies]
        rows.append(row)
        bounds.append((0, memory_budget))
    integrality = np.zeros(total)
    integrality[: s_offset[-1]] = 1
    result = milp(
        c,
        constraints=LinearConstraint(np.array(rows), [lo for lo, _ in bounds], [hi for _, hi in bounds]),
        integrality=integrality,
        bounds=Bounds(0, 1),
    )
    if result.x is None or result.fun >= big:
        raise ConfigError(
            f"no sharding of the block fits a memory budget of {memory_budget:.3g} bytes at tp={tp}. "
            f"Fix: raise the budget or the tp degree."
        )
    choice = {
        op.name: op.strategies[int(np.argmax(result.x[s_offset[v] : s_offset[v + 1]]))].name for v, op in enumerate(ops)
    }
    return IntraOpPlan(choice, float(result.fun))


def brute_force(ops: list[Operator], tp: int, hw: Hardware, memory_budget: float = math.inf) -> IntraOpPlan:
    """Every combination, for checking the ILP on small chains."""
    edges = _edge_costs(ops, tp, hw)
    best: IntraOpPlan | None = None
    for picks in itertools.product(*[range(len(op.strategies)) for op in ops]):
        if sum(op.strategies[k].memory for op, k in zip(ops, picks)) > memory_budget:
            continue
        cost = sum(op.strategies[k].cost for op, k in zip(ops, picks))
        cost += sum(edges[u][picks[u], picks[(u + 1) % len(ops)]] for u in range(len(ops)))
        if best is None or cost < best.cost:
            best = IntraOpPlan({op.name: op.strategies[k].name for op, k in zip(ops, picks)}, cost)
    if best is None or not math.isfinite(best.cost):
        raise ConfigError("no sharding fits the memory budget.")
    return best


__all__ = ["IntraOpPlan", "Operator", "Strategy", "block_operators", "brute_force", "reshard_cost", "solve_intra_op"]
