"""The budget: how far a layout's tensors may be from the one-process run's, computed from the dtype and the
reductions that the layout reorders, and printed with the verdict.

Derivation. A sum of n floating-point terms computed in any order has an error of at most
gamma_(n-1) * sum_i |x_i|, gamma_m = m u / (1 - m u), u the unit roundoff (Higham, *Accuracy and Stability of
Numerical Algorithms*, 2nd ed., eq. 4.4). Two orders of the same sum therefore differ by at most
2 gamma_(n-1) sum_i |x_i|. A layout cuts each reduction it touches into k partial sums (data and context
parallelism: the batch's and sequence's gradient sums into dp x cp x micro-batches pieces; tensor parallelism: a
row-parallel matmul into tp pieces; expert parallelism: each token's combine into ep pieces), so it reorders the
top log2(k)..k levels of those sums: k u per reduction, to first order. The sum of |x_i| is not observable after
the fact (it is the sum of every token's contribution), so certify uses the tensor's own scale in its place: an
element e may differ by ``rel * (|e| + rms(tensor))`` (the RMS floor covers elements that are small because their
terms cancelled), with

    rel = C * k * u * (1 + s)

where s is the step (differences compound: step s trains on parameters that already differ) and C = 2^11 stands
for the reductions and roundings a difference passes through on its way to the compared tensor (the layers of the
forward and the backward) and for what is not a plain reordering (ring attention's online softmax). C is set from
measurements, not derived: with C = 2^9 plait's own layouts used up to 0.55 of the gradient budget (a 2-layer
GPT-2-small slice, dp=2 x ZeRO-3 x ring cp=2, 5 steps), so 2^11 leaves them 7x inside; the mutants of
tests/test_certify.py stay 380x and more outside it. The dtypes:

- fp32 (u = 2^-24): the formula as written.
- bf16 / fp16 autocast (u = 2^-8 / 2^-11): both runs round every matmul's output to 16 bits; a reordered fp32
  accumulator flips such a rounding by one 16-bit ulp, so rel = 2^3 * u * (1 + s) (a few ulps), whatever k is.
- Parameters after an optimizer step: as above, and coordinates whose reference gradient is within the gradient
  budget of zero (pure rounding noise: Adam divides it by its own size plus eps, so the step it takes depends on
  the noise and can be anything up to a full step of either sign) may move by up to 2 (1 + s) times the largest
  step the reference took on any parameter (the optimizer's step size at s; the tensor's own largest step is not
  a bound: a key bias whose every gradient is noise took a tiny step in the reference and a different one here). Muon orthogonalises its update with a bf16
  Newton-Schulz iteration: 2^3 bf16 ulps of the update are added for every parameter when Muon steps, and for
  each matrix Muon steps twice what Muon itself makes of the two runs' gradients, measured in the layout's ranks
  (``plait.certification.muon``: Newton-Schulz amplifies rounding in ill-conditioned directions).

k = 1 (one process, one micro-batch) reorders nothing: the runs must then be **bitwise** equal, and certify says
so when they are.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from plait.layout import Layout

UNIT_ROUNDOFF = {"fp32": 2.0**-24, "bf16": 2.0**-8, "fp16": 2.0**-11}
"""u = 2^-p for a p-bit significand (fp32: 24, bf16: 8, fp16: 11)."""
C_FP32 = 2.0**11
"""Reordered reductions and roundings a difference passes through (see the module doc)."""
C_HALF = 2.0**3
"""16-bit ulps allowed per step under autocast."""
MUON_ULPS = 2.0**3
"""bf16 ulps of Muon's orthogonalised update (its Newton-Schulz iteration runs in bf16)."""


def reordered_terms(layout: Layout) -> int:
    """k: the pieces the layout cuts its reductions into (>= 1; 1 reorders nothing)."""
    return max(1, layout.dp * layout.cp * layout.microbatches * layout.tp * max(layout.ep, 1) * layout.pp)


@dataclass(frozen=True)
class Budget:
    """The relative budget of one layout against the one-process run."""

    dtype: str
    terms: int
    muon: bool = False

    @property
    def unit_roundoff(self) -> float:
        return UNIT_ROUNDOFF[self.dtype]

    def rel(self, step: int) -> float:
        """The relative budget at ``step`` (0-based): an element e may differ by ``rel * (|e| + rms)``."""
        if self.dtype == "fp32":
            return C_FP32 * self.terms * self.unit_roundoff * (1 + step)
        return C_HALF * self.unit_roundoff * (1 + step)

    @property
    def update_rel(self) -> float:
        """Relative error of an optimizer's update allowed besides ``rel`` (Muon's bf16 Newton-Schulz)."""
        return MUON_ULPS * UNIT_ROUNDOFF["bf16"] if self.muon else 0.0

    def describe(self) -> str:
        """The budget in words, as the report prints it."""
        if self.dtype == "fp32":
            text = (
                f"fp32 reduction-order rounding: rel = 2^11 x k x u x (1+step) = {self.rel(0):.3g} x (1+step) "
                f"(k = {self.terms} reordered partial sums, u = 2^-24)"
            )
        else:
            text = f"{self.dtype} autocast: rel = 2^3 x u x (1+step) = {self.rel(0):.3g} x (1+step) (u = {self.unit_roundoff:.3g})"
        if self.muon:
            text += f"; Muon's bf16 Newton-Schulz: + {self.update_rel:.3g} x the reference's largest step"
        return text + "; an element e may differ by rel x (|e| + rms of its tensor)"

    def to_dict(self) -> dict:
        return {**asdict(self), "rel_step0": self.rel(0), "update_rel": self.update_rel, "text": self.describe()}


def budget_for(layout: Layout, reference: Layout, muon: bool) -> Budget:
    """The budget of ``layout`` against the one-process ``reference`` (the coarser of their precisions)."""
    precisions = {str(layout.precision), str(reference.precision)}
    dtype = "bf16" if "bf16" in precisions else "fp16" if "fp16" in precisions else "fp32"
    return Budget(dtype, reordered_terms(layout), muon)
