"""The certificate of one layout: its ranks' results merged, per step the loss and gradient norm against the
reference, per parameter the worst gradient and value differences, and the verdict.

Verdicts: **bitwise** (every loss, norm, gradient and parameter identical), **equal within the budget**, or
**DIFFERS**, with the first step that leaves the budget, the first parameter gradient there (in backward order:
the model's last parameters get their gradients first) and, from the module-by-module pass, the first module
whose output (forward) or output gradient (backward) leaves it. When every module and every gradient is within
the budget and only the parameters are not, the optimizer step is named.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from plait.certification.budget import Budget
from plait.certification.compare import TensorDiff, diff_scalar
from plait.certification.run import grad_norm

BITWISE, EQUAL, DIFFERS = "bitwise", "equal within the budget", "DIFFERS"


def _merge(per_rank: list[dict[str, TensorDiff]]) -> dict[str, TensorDiff]:
    """By parameter name, the worst of the ranks holding it (replicas over dp, cp, tp must agree too)."""
    merged: dict[str, TensorDiff] = {}
    for diffs in per_rank:
        for name, diff in diffs.items():
            if name not in merged or (diff.ratio > merged[name].ratio) or not diff.bitwise and merged[name].bitwise:
                merged[name] = diff
    return merged


def _squares(per_rank: list[dict[str, float]]) -> dict[str, float]:
    merged: dict[str, float] = {}
    for squares in per_rank:
        merged.update(squares)
    return merged


@dataclass
class StepRecord:
    step: int
    loss: float
    reference_loss: float
    loss_diff: TensorDiff
    grad_norm: float
    reference_grad_norm: float
    grad_norm_diff: TensorDiff
    grads: dict[str, TensorDiff]
    params: dict[str, TensorDiff]

    def within(self) -> bool:
        return all(d.within for d in [self.loss_diff, self.grad_norm_diff, *self.grads.values()]) and all(
            d.within for d in self.params.values()
        )

    def bitwise(self) -> bool:
        diffs = [self.loss_diff, self.grad_norm_diff, *self.grads.values(), *self.params.values()]
        return all(d.bitwise for d in diffs)


@dataclass
class Divergence:
    """Where a layout first leaves its budget."""

    step: int
    what: str
    """"loss", "gradient" or "parameter" (the optimizer step)."""
    parameter: str | None = None
    """The first parameter whose gradient (or, for the optimizer, value) leaves the budget."""
    module: str | None = None
    """The first module whose output leaves the budget; for a gradient-only divergence, the parameter's module."""
    direction: str | None = None
    """"forward", "backward" (the module's output gradient), "gradient sync" or "optimizer step"."""
    module_diff: TensorDiff | None = None
    modules: list[dict[str, Any]] = field(default_factory=list)
    """Every compared module of the located step, in execution order: kind, name, diff (None: not comparable)."""

    def describe(self) -> str:
        where = f"step {self.step}: {self.what}"
        if self.parameter:
            where += f", first parameter {self.parameter}"
        if self.module is not None:
            where += f"; first module {self.module} ({self.direction})"
        return where


@dataclass
class LayoutCertificate:
    layout: str
    short: str
    world: int
    budget: Budget
    steps: list[StepRecord]
    verdict: str = EQUAL
    divergence: Divergence | None = None
    determinism: list[dict[str, Any]] = field(default_factory=list)
    """Per rank, the deterministic-mode settings in force (``plait.determinism.state``)."""

    @property
    def differs(self) -> bool:
        return self.verdict == DIFFERS


def merge(
    text: str, layout: Any, budget: Budget, reference: dict[str, Any], per_rank: list[dict[str, Any]]
) -> LayoutCertificate:
    """One layout's ranks' results against the reference's, with its verdict (before any module pass)."""
    records = []
    for step, reference_loss in enumerate(reference["losses"]):
        rel = budget.rel(step)
        loss = per_rank[0]["losses"][step]
        norm = grad_norm(per_rank[0]["grad_norms"][step], _squares([r["squares"][step] for r in per_rank]))
        reference_norm = grad_norm(reference["grad_norms"][step], reference["squares"][step])
        records.append(
            StepRecord(
                step,
                loss,
                reference_loss,
                diff_scalar("loss", loss, reference_loss, rel),
                norm,
                reference_norm,
                diff_scalar("grad_norm", norm, reference_norm, rel),
                _merge([r["grads"][step] for r in per_rank]),
                _merge([r["params"][step] for r in per_rank]),
            )
        )
    certificate = LayoutCertificate(text, layout.short(), layout.world_size, budget, records)
    if all(record.bitwise() for record in records):
        certificate.verdict = BITWISE
    elif all(record.within() for record in records):
        certificate.verdict = EQUAL
    else:
        certificate.verdict = DIFFERS
        certificate.divergence = first_divergence(records, reference["order"])
    return certificate


def first_divergence(records: list[StepRecord], order: list[str]) -> Divergence:
    """The first step outside the budget and what left it there."""
    backward = list(reversed(order))
    for record in records:
        if record.within():
            continue
        bad_grads = [name for name in backward if name in record.grads and not record.grads[name].within]
        if bad_grads:
            return Divergence(record.step, "gradient", bad_grads[0])
        if not record.loss_diff.within or not record.grad_norm_diff.within:
            return Divergence(record.step, "loss" if not record.loss_diff.within else "gradient norm")
        bad = [name for name in order if name in record.params and not record.params[name].within]
        module = bad[0].rpartition(".")[0] if bad else None
        return Divergence(record.step, "parameter", bad[0] if bad else None, module or None, "optimizer step")
    raise ValueError("no step leaves the budget")


def locate(divergence: Divergence, per_rank: list[dict[str, Any]]) -> Divergence:
    """``divergence`` with the first module of the module-by-module pass (forward order, then backward order);
    when none leaves the budget, the module of the first parameter gradient (the gradient synchronisation)."""
    order = per_rank[0]["order"]
    divergence.modules = []
    first: tuple[str, str, TensorDiff] | None = None
    for kind in ("forward", "backward"):
        diffs: dict[str, TensorDiff | None] = {}
        for result in per_rank:
            for entry in result["modules"][kind]:
                name, diff = entry["module"], entry["diff"]
                if diff is not None and (diffs.get(name) is None or diff.ratio > diffs[name].ratio):  # type: ignore[union-attr]
                    diffs[name] = diff
                else:
                    diffs.setdefault(name, diff)
        for name in order[kind]:
            diff = diffs.get(name)
            divergence.modules.append({"kind": kind, "module": name, "diff": diff})
            if first is None and diff is not None and not diff.within:
                first = (name, kind, diff)
    if first is not None:
        divergence.module, divergence.direction, divergence.module_diff = first
    elif divergence.parameter:
        divergence.module = divergence.parameter.rpartition(".")[0] or None
        divergence.direction = "gradient sync"
    return divergence
