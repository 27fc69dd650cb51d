"""Published Mixture-of-Experts training runs the cost model is checked against (``published_moe_runs``), apart from
the dense table (``published.py``): nothing is fitted on them, and they are reported on their own
(``python -m benchmarks.planner_published``, docs/planner.md).

What could be read with its layout, in BF16 on H100s, is from one implementation, Megatron-Core (two of its
pages, two models); that is thin for a held-out check, and the docs say so. Each row records where it was read
and what is assumed. Rows whose layout the planner cannot describe are kept, pending, with the reason.

**Megatron-Core MoE README** (NVIDIA/Megatron-LM, megatron/core/transformer/moe/README.md at commit 022bcb5):
"With MCore v0.9, we've achieved remarkable performance of 468 TFLOPS for Mixtral 8X7B bf16 training", and on
the same page the reference mapping for Mixtral 8x7B (dropless, all-to-all dispatcher, BF16, 64 GPUs, sequence
4096, TP 1, EP 8, PP 4, VP 8, MBS 1, GBS 256) on 8 x H100 80GB servers with NVLink 4 and 8 x 400 Gbit/s InfiniBand
(PyTorch 24.09, TransformerEngine 1.11). The 468 is assumed to be that mapping's. Megatron's TFLOP/s count model
FLOPs as plait does (attention over the whole s x s square, the routed experts a token uses, the logits), without
the router's 2 h E per token (0.02% here); no recomputation.

**Megatron MoE Model Zoo, Qwen3** (yanring/Megatron-MoE-ModelZoo, best_practice/Qwen3/readme.md at commit
c1ad0b5): Qwen3-235B-A22B on 256 H100s (NVLink 4, InfiniBand 8 x 50 GB/s), BF16, sequence 4096, global batch
2048, step times in seconds (the metric used here: no FLOP convention needed). Its layouts give attention TP / DP /
PP and the experts' EP with ETP = 1 ("parallel folding": EP spans the tp ranks), written here as plait layouts
whose ep x tp is that EP (``Implementation.fold_experts``). "recompute norm, act" (output-discarding recomputation of
the norms and the experts' activation function) is planned as no recomputation: what it recomputes is elementwise
work the model charges no FLOPs for. "DeepEP" and "A2A" are token dispatchers (DeepSeek's kernels, NCCL's
all-to-all); the model has one all-to-all. Whether the routing was forced to balance is not stated for these rows
(the page's long-context table gives both); uniform routing is assumed.
"""

from __future__ import annotations

from plait.planner.hf_config import spec_from_hf_dict
from plait.planner.models import ModelSpec
from plait.planner.published import PublishedRun

MIXTRAL_8X7B = ModelSpec(
    "mixtral-8x7b", 32, 4096, 32, 14336, 32000, 4096, kv_heads=8, gated=True, experts=8, top_k=2
)  # fmt: skip
"""Mixtral 8x7B (Jiang et al. 2024; its config.json): 32 blocks of 4096, 32 heads (8 kv), 8 SwiGLU experts of 14336,
top-2, vocabulary 32000, untied; planned at the run's 4096 tokens."""

QWEN3_235B = spec_from_hf_dict(
    {
        "model_type": "qwen3_moe", "num_hidden_layers": 94, "hidden_size": 4096, "num_attention_heads": 64,
        "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 12288, "moe_intermediate_size": 1536,
        "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936, "max_position_embeddings": 40960,
        "hidden_act": "silu", "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
    },
    "Qwen3-235B-A22B config.json",
    "qwen3-235b-a22b",
    4096,
)  # fmt: skip
"""Qwen3-235B-A22B (its config.json): 94 MoE blocks of 4096, 64 heads of 128 (4 kv), 128 SwiGLU experts of 1536,
top-8."""

QWEN3_ROWS = (  # label, dispatcher, attention tp / dp / pp / vpp, folded EP, micro-batches, recompute, ZeRO, s/step
    ("TP2 EP32 PP8 VPP4, DeepEP", 2, 16, 8, 4, 32, 128, "none", 1, "megatron-core", 19.7, ""),
    ("TP2 EP32 PP8 VPP4, DeepEP, 1F1B A2A overlap", 2, 16, 8, 4, 32, 128, "none", 1, "megatron-core-overlap", 17.6, ""),
    ("TP2 EP8 FSDP, DeepEP, full recompute", 2, 128, 1, 1, 8, 4, "full", 3, "megatron-core", 17.6, ""),
    (
        "TP2 EP8 PP32 VPP3, A2A", 2, 4, 32, 3, 8, 512, "none", 1, "megatron-core", 24.2,
        "pp 32 x vpp 3 = 96 chunks for 94 blocks: Megatron's uneven pipeline layout leaves chunks without a block, "
        "which the planner's pipeline does not describe",
    ),
    ("TP4 EP8 PP8 VPP4, DeepEP", 4, 8, 8, 4, 8, 256, "none", 1, "megatron-core", 29.0, ""),
)  # fmt: skip


def _fields(**kwargs: object) -> tuple[tuple[str, object], ...]:
    return tuple(kwargs.items())


def published_moe_runs() -> list[PublishedRun]:
    """Every published MoE row (module docstring)."""
    mixtral = PublishedRun(
        "megatron-core-moe",
        "Mixtral 8x7B, 64 GPUs, TP1 EP8 PP4 VP8",
        MIXTRAL_8X7B,
        _fields(dp=16, pp=4, ep=8, virtual_stages=8, schedule="interleaved", microbatches=16, zero=1, precision="bf16"),
        "h100",
        256,
        "megatron-core",
        "hardware_tflops",
        468.0,
        "the distributed optimizer as ZeRO-1; the 468 assumed to be the reference mapping's (module docstring)",
    )
    runs = [mixtral]
    for label, tp, dp, pp, vpp, ep, micro, recompute, zero, impl, seconds, pending in QWEN3_ROWS:
        layout = _fields(
            dp=dp,
            tp=tp,
            pp=pp,
            ep=ep // tp,  # EP folded over the tp ranks: plait's ep counts the data ranks
            virtual_stages=vpp,
            schedule="interleaved" if vpp > 1 else "1f1b",
            microbatches=micro,
            recompute=recompute,
            zero=zero,
            sequence_parallel=True,
            precision="bf16",
        )
        runs.append(
            PublishedRun(
                "megatron-moe-modelzoo",
                f"Qwen3-235B-A22B, 256 GPUs, {label}",
                QWEN3_235B,
                layout,
                "h100",
                2048,
                impl,
                "step_time",
                seconds,
                "FSDP as ZeRO-3, the distributed optimizer as ZeRO-1; 'norm, act' recomputation as none",
                why_pending=pending,
            )
        )
    return runs


__all__ = ["MIXTRAL_8X7B", "QWEN3_235B", "published_moe_runs"]
