"""Published measurements the cost model is checked against (tests/test_planner_validation.py, docs/planner.md).

MEGATRON_2021: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC21, arXiv:2104.04473), Table 1 (weak scaling, GPT models, vocabulary 51,200, sequence 2048,
A100 80GB SXM in DGX A100 nodes with 8 x 200 Gb/s HDR InfiniBand, mixed precision, full activation
recomputation): parameters (billions), attention heads, hidden size, layers, tensor-parallel size,
pipeline-parallel size, GPUs, global batch, achieved TFLOP/s per GPU (their FLOP count includes
recomputation: 96 B s l h^2 (1 + s/6h + V/16lh)).

How each row is predicted, the same for every row (a description of that system, not a fit): micro-batch 1,
the 1F1B (PipeDream-flush) schedule, data parallel = GPUs / (tp x pp), gradients reduced after the backward
pass without overlap, fp16 gradients, pipeline scatter/gather on, attention without flash attention
(``IMPLEMENTATIONS["megatron-2021"]``). The single fitted number is ``costs.COMPUTE_EFFICIENCY``:
``fit_compute_efficiency()`` finds the value at which the median ratio measured / predicted is 1.

ZERO_FIGURE_1: Rajbhandari et al. 2020, Figure 1: a 7.5B-parameter model on 64 data-parallel ranks, mixed
precision Adam (K = 12): 120 GB per rank without ZeRO, 31.4 GB with P_os, 16.6 GB with P_os+g, 1.9 GB with
P_os+g+p.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from plait.layout import Layout
from plait.planner.costs import IMPLEMENTATIONS, Implementation
from plait.planner.models import ModelSpec
from plait.planner.predict import Prediction, predict


@dataclass(frozen=True)
class PublishedRow:
    billions: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops_per_gpu: float

    @property
    def spec(self) -> ModelSpec:
        return ModelSpec(
            f"gpt-{self.billions:g}b",
            self.layers,
            self.hidden,
            self.heads,
            4 * self.hidden,
            51200,
            2048,
            learned_positions=True,
            bias=True,
        )

    @property
    def layout(self) -> Layout:
        dp = self.gpus // (self.tp * self.pp)
        return Layout(
            dp=dp,
            tp=self.tp,
            pp=self.pp,
            microbatches=self.batch // dp,
            schedule="1f1b",
            recompute="full",
            precision="fp16",
        )


MEGATRON_2021: tuple[PublishedRow, ...] = (
    PublishedRow(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    PublishedRow(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    PublishedRow(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    PublishedRow(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    PublishedRow(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    PublishedRow(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    PublishedRow(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    PublishedRow(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    PublishedRow(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    PublishedRow(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)

ZERO_FIGURE_1 = {"psi": 7.5e9, "dp": 64, "bytes_by_stage": {0: 120e9, 1: 31.4e9, 2: 16.6e9, 3: 1.9e9}}


def predict_row(row: PublishedRow, implementation: Implementation | None = None) -> Prediction:
    impl = implementation or IMPLEMENTATIONS["megatron-2021"]
    return predict(row.spec, row.layout, "a100-80gb", global_batch=row.batch, implementation=impl)


def errors(implementation: Implementation | None = None) -> list[tuple[PublishedRow, float, float]]:
    """(row, predicted TFLOP/s per GPU, relative error) for every row of MEGATRON_2021."""
    out = []
    for row in MEGATRON_2021:
        predicted = predict_row(row, implementation).tflops_per_device
        out.append((row, predicted, predicted / row.tflops_per_gpu - 1))
    return out


def fit_compute_efficiency(low: float = 0.3, high: float = 1.0) -> float:
    """The compute efficiency at which the median of measured / predicted TFLOP/s over MEGATRON_2021 is 1."""
    base = IMPLEMENTATIONS["megatron-2021"]
    for _ in range(14):  # +-0.0001 of the answer
        mid = (low + high) / 2
        ratio = statistics.median(r.tflops_per_gpu / p for r, p, _ in errors(replace(base, compute_efficiency=mid)))
        low, high = (low, mid) if ratio < 1 else (mid, high)
    return round((low + high) / 2, 3)


__all__ = ["MEGATRON_2021", "PublishedRow", "ZERO_FIGURE_1", "errors", "fit_compute_efficiency", "predict_row"]
