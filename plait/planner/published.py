"""Published training runs the cost model is checked against (``plait.planner.accuracy``, docs/planner.md).

Each ``PublishedRun`` is one row of a published table: the model, the layout and system that ran, and what was
measured. Nothing here is fitted; where a table leaves a setting out, the row's ``note`` says what is assumed. The
sources (``SOURCES``) are of two roles:

- "fit": the GPU generation's compute efficiency (``hardware.GENERATION_EFFICIENCY``) is fitted on these rows
  (Ampere: Megatron-LM 2021 Table 1; Hopper: MosaicML's H100 BF16 table); their errors are in-sample, and
  leave-one-out errors are reported next to them.
- "test": never used for fitting. Out-of-sample papers (Korthikanti 2022, MT-NLG, BLOOM, Llama 3, torchtitan) and
  out-of-table rows of the fitting sources (Megatron-LM 2021 Table 2; MosaicML's A100 table, which fits nothing
  on Ampere) are predicted with the fitted value of their generation.

ZERO_FIGURE_1 (Rajbhandari et al. 2020, Figure 1: a 7.5B-parameter model on 64 data-parallel ranks, mixed precision
Adam, K = 12: 120 / 31.4 / 16.6 / 1.9 GB per rank for ZeRO stages 0-3) checks the memory formulas.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from plait.layout import RECOMPUTE_MODES, Layout
from plait.planner.hardware import CATALOGUE, GB, Hardware, NetworkLevel
from plait.planner.models import NAMED, ModelSpec


@dataclass(frozen=True)
class Source:
    """Where a table comes from: ``citation`` (authors, title, venue), ``table``, ``where`` (the copy the numbers
    were read from), the GPU ``generation`` and the ``role`` ("fit" or "test", module docstring)."""

    citation: str
    table: str
    where: str
    generation: str
    role: str
    paper: str
    """Short name of the paper or report (for counting independent sources)."""


SOURCES: dict[str, Source] = {
    "megatron-2021-t1": Source(
        "Narayanan, Shoeybi, Casper, LeGresley, Patwary, Korthikanti, et al., Efficient Large-Scale Language Model "
        "Training on GPU Clusters Using Megatron-LM, SC21, arXiv:2104.04473",
        "Table 1 (weak scaling, achieved TFLOP/s per GPU)",
        "the paper",
        "ampere",
        "fit",
        "Megatron-LM 2021",
    ),
    "megatron-2021-t2": Source(
        "Narayanan et al. 2021 (as above)",
        "Table 2 (PTD-P vs ZeRO-3 without model parallelism, 175B and 530B GPT, TFLOP/s per GPU)",
        "the paper; TFLOP/s and settings as transcribed in cli99/llm-analysis examples/megatron-lm/run_train.sh and "
        "run_train_zero.sh (commit b60b392)",
        "ampere",
        "test",
        "Megatron-LM 2021",
    ),
    "korthikanti-2022-t5": Source(
        "Korthikanti, Casper, Lym, McAfee, Andersch, Shoeybi, Catanzaro, Reducing Activation Recomputation in Large "
        "Transformer Models, MLSys 2023, arXiv:2205.05198",
        "Table 5 (end-to-end iteration time, full recomputation vs sequence parallel + selective recomputation)",
        "iteration times and configurations as transcribed in calculon-ai/calculon calculon/llm/validation.py "
        "(seqsel_tab5) and validation/*_{full,seqsel}.json (commit 0efb74e); MFU of the selective runs in the "
        "NVIDIA/Megatron-LM README (41.5 / 51.4 / 56.0 / 56.3 %)",
        "ampere",
        "test",
        "Korthikanti 2022",
    ),
    "mt-nlg-2022": Source(
        "Smith, Patwary, Norick, LeGresley, Rajbhandari, Casper, et al., Using DeepSpeed and Megatron to Train "
        "Megatron-Turing NLG 530B, arXiv:2201.11990",
        "Section 2.4 (system throughput: batch 1920 on 280 / 350 / 420 DGX A100 nodes, 60.1 / 50.2 / 44.4 s per "
        "iteration, 126 / 121 / 113 TFLOP/s per GPU)",
        "the paper, as quoted in cli99/llm-analysis examples/megatron-turing-nlg/README.md",
        "ampere",
        "test",
        "MT-NLG 2022",
    ),
    "bloom-2022": Source(
        "BigScience Workshop, BLOOM: A 176B-Parameter Open-Access Multilingual Language Model, arXiv:2211.05100; "
        "training log of tr11-176B-ml",
        "the training log line at iteration 85376 (global batch 2048, 104.70 s per iteration, TFLOPs: 149.77, "
        "hardware FLOPs with the recomputation)",
        "bigscience-workshop/bigscience train/tr11-176B-ml/README.md (commit 00327f8): hardware (384 A100 80GB, 8 "
        "per node, 4 Omni-Path links per node), TP=4 PP=12 DP=8 MBS=2, the stage partition, ZeRO-1, bf16, "
        "activation checkpointing",
        "ampere",
        "test",
        "BLOOM 2022",
    ),
    "llama3-2024-t4": Source(
        "Llama Team, AI @ Meta, The Llama 3 Herd of Models, arXiv:2407.21783",
        "Table 4 (scaling configurations and BF16 MFU of Llama 3 405B pre-training)",
        "the paper (Table 4 and sec. 3.3: H100 80GB at 700 W, 400 Gb/s RoCE per GPU, interleaved pipeline, no "
        "activation checkpointing at 8K tokens, FSDP gradients reduce-scattered in fp32)",
        "hopper",
        "test",
        "Llama 3 2024",
    ),
    "torchtitan-2024": Source(
        "Liang, Liu, Wright, Constable, Gu, Huang, et al., TorchTitan: One-stop PyTorch native solution for "
        "production ready LLM pre-training, ICLR 2025, arXiv:2410.06511; the torchtitan repository's performance page",
        "'Llama 3 performance numbers' and 'Llama 2 performance numbers' (FSDP2 on 64 A100 80GB, tokens/s per GPU)",
        "pytorch/torchtitan docs/performance.md (commit 0413364): local batch 1-2 per GPU, global batch = local x 64, "
        "sequence 8192 (Llama 3) / 4096 (Llama 2), activation checkpointing none / every second block ('selective "
        "layer') / every block ('full') / per operator ('selective op'); bf16 parameters, fp32 gradient "
        "reduce-scatter (torchtitan's defaults then)",
        "ampere",
        "test",
        "torchtitan 2024",
    ),
    "mosaicml-h100": Source(
        "MosaicML, llm-foundry MPT training benchmarks",
        "'H100 80GB BF16' table, the rows on one node of 8 GPUs (MFU): the compute efficiency is fitted where the "
        "network matters least",
        "mosaicml/llm-foundry scripts/train/benchmarking/README.md (commit 061f2c7); model shapes from "
        "scripts/train/yamls/pretrain/mpt-*.yaml (vocabulary 50368, learned positions, biases: the NumParams "
        "column matches them exactly)",
        "hopper",
        "fit",
        "MosaicML llm-foundry",
    ),
    "mosaicml-h100-nodes": Source(
        "MosaicML, llm-foundry MPT training benchmarks",
        "'H100 80GB BF16' table, the rows on more than one node of 8 (MFU)",
        "mosaicml/llm-foundry scripts/train/benchmarking/README.md (commit 061f2c7)",
        "hopper",
        "test",
        "MosaicML llm-foundry",
    ),
    "mosaicml-a100": Source(
        "MosaicML, llm-foundry MPT training benchmarks",
        "'A100 80GB with 1600 Gbps node-node interconnect (RoCE)' table (MFU)",
        "mosaicml/llm-foundry scripts/train/benchmarking/README.md (commit 061f2c7)",
        "ampere",
        "test",
        "MosaicML llm-foundry",
    ),
    # Mixture-of-Experts runs (plait/planner/published_moe.py): never fitted on, reported apart
    "megatron-core-moe": Source(
        "NVIDIA, Megatron-Core MoE (megatron/core/transformer/moe/README.md)",
        "'468 TFLOPS for Mixtral 8X7B bf16 training' (MCore v0.9) and the 'Reference Best Parallel Mapping' table",
        "NVIDIA/Megatron-LM megatron/core/transformer/moe/README.md (commit 022bcb5)",
        "hopper",
        "test",
        "Megatron-Core MoE",
    ),
    "megatron-moe-modelzoo": Source(
        "NVIDIA, Megatron MoE Model Zoo, Qwen3 best practice",
        "'Performance Results' (Qwen3-235B-A22B, 256 H100, BF16: step time and TFLOP/s per GPU)",
        "yanring/Megatron-MoE-ModelZoo best_practice/Qwen3/readme.md (commit c1ad0b5)",
        "hopper",
        "test",
        "Megatron-Core MoE",
    ),
}


@dataclass(frozen=True)
class PublishedRun:
    """One published measurement (module docstring). ``metric``: "hardware_tflops" (achieved TFLOP/s per GPU
    counting recomputation, as Megatron-LM reports), "mfu" (model FLOPs utilization, 0-1), "step_time" (seconds
    per iteration) or "tokens_per_gpu" (tokens per second per GPU)."""

    source: str
    label: str
    spec: ModelSpec
    layout_fields: tuple[tuple[str, Any], ...]
    gpu: str | Hardware
    global_batch: int
    implementation: str
    metric: str
    value: float
    note: str = ""
    why_pending: str = ""
    """Why this row cannot be predicted (a layout the planner does not describe); "" when it can."""

    @property
    def generation(self) -> str:
        return SOURCES[self.source].generation

    @property
    def role(self) -> str:
        return SOURCES[self.source].role

    @property
    def pending(self) -> str:
        """Why this row cannot be predicted yet ("" when it can)."""
        recompute = dict(self.layout_fields).get("recompute", "none")
        if isinstance(recompute, str) and recompute not in RECOMPUTE_MODES:
            return f"needs Layout(recompute={recompute!r}), which this plait does not have yet"
        return self.why_pending

    @property
    def layout(self) -> Layout:
        return Layout(**dict(self.layout_fields))


def _fields(**kwargs: Any) -> tuple[tuple[str, Any], ...]:
    return tuple(kwargs.items())


def gpt(name: str, layers: int, hidden: int, heads: int, vocab: int = 51200, seq: int = 2048) -> ModelSpec:
    """A Megatron-LM GPT (learned positions, biases, tied embeddings, MLP 4h, dropout 0.1: Megatron-LM's default
    hidden and attention dropout, which Korthikanti et al.'s eq. 2 counts)."""
    return ModelSpec(
        name, layers, hidden, heads, 4 * hidden, vocab, seq, tied_embeddings=True, learned_positions=True, bias=True,
        dropout=0.1,
    )  # fmt: skip


# ------------------------------------------------------------------------------------ Megatron-LM 2021, Table 1
MEGATRON_T1_ROWS = (  # billions, heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s per GPU
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)


def _megatron_t1() -> list[PublishedRun]:
    runs = []
    for billions, heads, hidden, layers, tp, pp, gpus, batch, tflops in MEGATRON_T1_ROWS:
        dp = gpus // (tp * pp)
        layout = _fields(
            dp=dp, tp=tp, pp=pp, microbatches=batch // dp, schedule="1f1b", recompute="full", precision="fp16"
        )
        runs.append(
            PublishedRun(
                "megatron-2021-t1",
                f"{billions:g}B, {gpus} GPUs",
                gpt(f"gpt-{billions:g}b", layers, hidden, heads),
                layout,
                "a100-80gb",
                batch,
                "megatron-2021",
                "hardware_tflops",
                tflops,
                "micro-batch 1 and 1F1B assumed (not in the table)",
            )
        )
    return runs


# ------------------------------------------------------------------------------------ Megatron-LM 2021, Table 2
GPT_175B = gpt("gpt3-175b", 96, 12288, 96)
GPT_530B = gpt("gpt-530b", 105, 20480, 128)


def _megatron_t2() -> list[PublishedRun]:
    runs = []
    for spec, tp, pp, batch, rows in (
        (GPT_175B, 8, 12, 1536, ((384, 153), (768, 149), (1536, 141))),
        (GPT_530B, 8, 35, 2240, ((560, 171), (1120, 167), (2240, 159))),
    ):
        for gpus, tflops in rows:
            dp = gpus // (tp * pp)
            layout = _fields(
                dp=dp, tp=tp, pp=pp, microbatches=batch // dp, schedule="1f1b", recompute="full", precision="fp16"
            )
            runs.append(
                PublishedRun(
                    "megatron-2021-t2",
                    f"PTD-P {spec.name}, {gpus} GPUs",
                    spec,
                    layout,
                    "a100-80gb",
                    batch,
                    "megatron-2021",
                    "hardware_tflops",
                    tflops,
                    "micro-batch 1, 1F1B",
                )
            )
    for spec, zero3_rows in (
        (GPT_175B, ((384, 1536, 144), (768, 1536, 88), (1536, 1536, 44))),
        (GPT_530B, ((640, 2560, 138), (1120, 2240, 98), (2240, 2240, 48))),
    ):
        for gpus, batch, tflops in zero3_rows:
            layout = _fields(dp=gpus, zero=3, microbatches=1, recompute="full", precision="fp16")
            runs.append(
                PublishedRun(
                    "megatron-2021-t2",
                    f"ZeRO-3 {spec.name}, {gpus} GPUs",
                    spec,
                    layout,
                    "a100-80gb",
                    batch,
                    "deepspeed-zero3",
                    "hardware_tflops",
                    tflops,
                    f"micro-batch {batch // gpus} (the batch over the GPUs), no gradient accumulation",
                )
            )
    return runs


# ------------------------------------------------------------------------------------ Korthikanti et al. 2022
def _korthikanti() -> list[PublishedRun]:
    runs = []
    models = (  # spec, tp, pp, interleave, batch, micro-batch, full-recompute seconds, selective + SP seconds
        (gpt("gpt-22b", 48, 6144, 64), 8, 1, 1, 4, 4, 1.42, 1.10),
        (GPT_175B, 8, 8, 3, 64, 1, 18.13, 13.75),
        (GPT_530B, 8, 35, 3, 280, 1, 49.05, 37.83),
        (gpt("gpt-1t", 128, 25600, 160), 8, 64, 1, 512, 1, 94.42, 71.49),
    )
    for spec, tp, pp, v, batch, mbs, full, selective in models:
        schedule = "interleaved" if v > 1 else "1f1b"
        common = dict(dp=1, tp=tp, pp=pp, microbatches=batch // mbs, schedule=schedule, virtual_stages=v)
        for mode, seconds in (("full", full), ("selective", selective)):
            sp = mode == "selective"
            runs.append(
                PublishedRun(
                    "korthikanti-2022-t5",
                    f"{spec.name} {'SP + selective' if sp else 'full recompute'}",
                    spec,
                    _fields(**common, recompute=mode, sequence_parallel=sp, precision="fp16"),
                    "a100-80gb",
                    batch,
                    "megatron-2021",
                    "step_time",
                    seconds,
                    f"{pp} stages x {v} chunks, micro-batch {mbs} (calculon's transcription)",
                )
            )
    return runs


# ------------------------------------------------------------------------------------ MT-NLG, BLOOM
def _mt_nlg() -> list[PublishedRun]:
    runs = []
    for nodes, tflops in ((280, 126), (350, 121), (420, 113)):
        dp = nodes * 8 // (8 * 35)
        runs.append(
            PublishedRun(
                "mt-nlg-2022",
                f"530B, {nodes * 8} GPUs",
                GPT_530B,
                _fields(dp=dp, tp=8, pp=35, microbatches=1920 // dp, recompute="full", precision="bf16"),
                "a100-80gb",
                1920,
                "megatron-deepspeed",
                "hardware_tflops",
                tflops,
                "micro-batch 1, activation checkpointing, vocabulary padded to 51200 assumed",
            )
        )
    return runs


JEAN_ZAY = dataclasses.replace(
    CATALOGUE["a100-80gb"],
    name="jean-zay-a100",
    levels=(
        NetworkLevel("nvlink", 8, 300 * GB, 5e-6),
        NetworkLevel("omni-path", 0, 4 * 100 / 8 / 8 * GB, 1e-5),  # 4 x 100 Gb/s links per node of 8 GPUs
    ),
    source="IDRIS Jean Zay A100 80GB nodes (bigscience tr11-176B-ml README): 8 GPUs on NVLink, 4 Omni-Path links",
)
# no dropout (BLOOM's config.json: hidden_dropout and attention_dropout 0.0)
BLOOM_176B = ModelSpec("bloom-176b", 70, 14336, 112, 4 * 14336, 250880, 2048, tied_embeddings=True, bias=True)


def _bloom() -> list[PublishedRun]:
    cuts = (5, *range(11, 66, 6))  # pp rank 0: embedding + 5 blocks, ranks 1-10: 6 blocks, rank 11: 5 blocks
    return [
        PublishedRun(
            "bloom-2022",
            "176B, 384 GPUs",
            BLOOM_176B,
            _fields(
                dp=8,
                tp=4,
                pp=12,
                zero=1,
                microbatches=2048 // (8 * 2),
                recompute="full",
                precision="bf16",
                pipeline_cuts=cuts,
            ),
            JEAN_ZAY,
            2048,
            "megatron-deepspeed",
            "hardware_tflops",
            149.77,
            "the published stage partition (5, 6 x 10, 5 blocks); bf16 gradients reduced",
        )
    ]


# ------------------------------------------------------------------------------------ Llama 3
def _llama3() -> list[PublishedRun]:
    runs = []
    for gpus, cp, dp, seq, per_dp, mfu in (
        (8192, 1, 64, 8192, 32, 0.43),
        (16384, 1, 128, 8192, 16, 0.41),
        (16384, 16, 8, 131072, 16, 0.38),
    ):
        runs.append(
            PublishedRun(
                "llama3-2024-t4",
                f"405B, {gpus} GPUs, cp{cp}, seq {seq}",
                NAMED["llama3-405b"].with_seq(seq),
                _fields(
                    dp=dp,
                    tp=8,
                    pp=16,
                    cp=cp,
                    zero=1,
                    microbatches=per_dp,
                    schedule="interleaved",
                    virtual_stages=4,
                    sequence_parallel=True,
                    precision="bf16",
                ),
                "h100",
                dp * per_dp,
                "llama3",
                "mfu",
                mfu,
                "micro-batch 1; the interleaving depth is not in the table (the text implies one layer per virtual "
                "stage; plait's chunks hold at least one block, so 4 chunks per rank stand in); FSDP as ZeRO-1 "
                "(parameters kept through the step); model FLOPs count full (not causal) attention",
            )
        )
    return runs


# ------------------------------------------------------------------------------------ torchtitan
TORCHTITAN_A100 = (  # model, sequence, local batch, activation checkpointing, tokens/s per GPU
    ("llama3-8b", 8192, 1, "selective layer", 2904),
    ("llama3-8b", 8192, 1, "selective op", 2973),
    ("llama3-70b", 8192, 1, "full", 331),
    ("llama-13b", 4096, 2, "no", 2162),
    ("llama-13b", 4096, 2, "selective layer", 1914),
    ("llama-13b", 4096, 2, "selective op", 1904),
    ("llama-70b", 4096, 1, "selective op", 355),
    ("llama-70b", 4096, 2, "full", 353),
)


def _torchtitan_recompute(checkpointing: str, layers: int) -> str | tuple[int, ...]:
    """torchtitan's activation checkpointing as a plait recompute choice: "selective layer" wraps every second
    block (its integer option, counted from 1: blocks 1, 3, 5, ...); "selective op" saves the outputs of chosen
    operators (every other matmul, attention), which is no plait mode: such a row stays pending."""
    if checkpointing == "selective layer":
        return tuple(range(1, layers, 2))
    return {"no": "none", "full": "full", "selective op": "op"}[checkpointing]


def _torchtitan() -> list[PublishedRun]:
    runs = []
    for name, seq, local, checkpointing, tokens in TORCHTITAN_A100:
        spec = NAMED[name].with_seq(seq)
        family = "Llama 3" if name.startswith("llama3") else "Llama 2"
        size = name.rsplit("-", 1)[1].upper()
        recompute = _torchtitan_recompute(checkpointing, spec.layers)
        runs.append(
            PublishedRun(
                "torchtitan-2024",
                f"{family} {size}, 64 GPUs, batch {local}, AC {checkpointing}",
                spec,
                _fields(dp=64, zero=3, microbatches=1, recompute=recompute, precision="bf16"),
                "a100-80gb",
                64 * local,
                "torchtitan-fsdp2",
                "tokens_per_gpu",
                tokens,
                "FSDP2 as ZeRO-3; the cluster's network is not stated: a DGX A100's (8 x 200 Gb/s per node) assumed",
            )
        )
    return runs


# ------------------------------------------------------------------------------------ MosaicML llm-foundry
MPT = {  # layers, d_model, heads (d_model / 128)
    "1b": (24, 2048, 16),
    "3b": (32, 2560, 20),
    "7b": (32, 4096, 32),
    "13b": (40, 5120, 40),
    "30b": (48, 7168, 56),
    "70b": (80, 8192, 64),
}
MOSAIC_H100 = (  # size, seq, GPUs, MFU %, micro-batch, accumulation, activation checkpointing, PURE bf16
    ("70b", 2048, 64, 42.57, 8, 4, True, False),
    ("70b", 2048, 32, 36.15, 2, 16, True, False),
    ("30b", 2048, 32, 43.92, 14, 3, True, False),
    ("30b", 2048, 16, 43.07, 10, 3, True, False),
    ("30b", 2048, 8, 38.11, 3, 21, True, False),
    ("30b", 4096, 8, 35.86, 1, 21, True, False),
    ("13b", 4096, 8, 41.6, 10, 3, True, False),
    ("13b", 2048, 64, 39.86, 2, 1, False, False),
    ("13b", 2048, 8, 39.79, 2, 1, False, False),
    ("7b", 8192, 8, 37.14, 8, 2, True, False),
    ("7b", 4096, 8, 40.42, 16, 2, True, False),
    ("7b", 2048, 8, 46.44, 6, 1, False, False),
    ("3b", 4096, 8, 42.31, 5, 6, False, False),
    ("3b", 2048, 64, 40.8, 6, 3, False, False),
    ("1b", 4096, 8, 40.26, 7, 4, False, False),
    ("1b", 2048, 64, 40.85, 20, 1, False, False),
)
MOSAIC_A100 = (
    ("70b", 2048, 64, 53.33, 8, 4, True, True),
    ("30b", 2048, 8, 55.3, 3, 21, True, False),
    ("30b", 4096, 8, 51.37, 1, 21, True, False),
    ("13b", 4096, 8, 57.62, 10, 3, True, False),
    ("13b", 2048, 8, 59.57, 2, 3, False, False),
    ("7b", 4096, 8, 54.84, 16, 2, True, False),
    ("7b", 2048, 8, 64.23, 6, 2, False, False),
    ("3b", 4096, 8, 60.53, 5, 6, False, False),
    ("1b", 2048, 8, 59.86, 14, 4, False, False),
)


def mpt(size: str, seq: int) -> ModelSpec:
    layers, hidden, heads = MPT[size]
    return ModelSpec(
        f"mpt-{size}",
        layers,
        hidden,
        heads,
        4 * hidden,
        50368,
        seq,
        tied_embeddings=True,
        learned_positions=True,
        bias=True,
    )


def _mosaic(source: str, rows: tuple, gpu: str) -> list[PublishedRun]:
    runs = []
    for size, seq, gpus, mfu, mbs, accum, checkpointing, pure in rows:
        layout = _fields(
            dp=gpus, zero=3, microbatches=accum, recompute="full" if checkpointing else "none", precision="bf16"
        )
        runs.append(
            PublishedRun(
                source,
                f"mpt-{size} seq {seq}, {gpus} x {gpu}{' (AC)' if checkpointing else ''}",
                mpt(size, seq),
                layout,
                gpu,
                gpus * mbs * accum,
                "composer-fsdp-pure" if pure else "composer-fsdp",
                "mfu",
                mfu / 100,
                "FSDP FULL_SHARD as ZeRO-3",
            )
        )
    return runs


def published_runs() -> list[PublishedRun]:
    """Every published row, fitting sources first."""
    return [
        *_megatron_t1(),
        *_mosaic("mosaicml-h100", tuple(r for r in MOSAIC_H100 if r[2] <= 8), "h100"),
        *_megatron_t2(),
        *_korthikanti(),
        *_mt_nlg(),
        *_bloom(),
        *_llama3(),
        *_torchtitan(),
        *_mosaic("mosaicml-h100-nodes", tuple(r for r in MOSAIC_H100 if r[2] > 8), "h100"),
        *_mosaic("mosaicml-a100", MOSAIC_A100, "a100-80gb"),
    ]


ZERO_FIGURE_1 = {"psi": 7.5e9, "dp": 64, "bytes_by_stage": {0: 120e9, 1: 31.4e9, 2: 16.6e9, 3: 1.9e9}}


__all__ = ["JEAN_ZAY", "PublishedRun", "SOURCES", "Source", "ZERO_FIGURE_1", "gpt", "mpt", "published_runs"]
