"""Activation recomputation side by side: plait's ``Layout(recompute=...)`` modes against torchtitan's per-operator
checkpointing written as torchtitan writes it, in one process on the same model and batch.

``python -m benchmarks.recompute`` trains a Llama-style GPT (RMSNorm, RoPE, SwiGLU, grouped-query attention; fp32,
one intra-op thread) for alternating rounds of every contender and prints a Markdown table: the median step time,
the bytes a forward keeps for backward, both relative to plait without recomputation, and the formula's bytes
(``plait.planner.activations``) next to the measured ones.

The peer is torchtitan's "selective op" policy (``torchtitan/parallelisms/parallelize_llama.py``: keep the outputs of
``aten.mm`` and the SDPA kernels, but recompute every second mm, counted per region and per pass), applied through
``torch.utils.checkpoint`` with ``create_selective_checkpoint_contexts``, the way torchtitan's checkpoint wrapper
does; torchtitan itself is not a dependency. Theory for plait's op against it: the same operators kept, so bytes
ratio 1.0 and time ratio 1.0.

Kept bytes are measured the same way for every contender (``LiveStorages``): the distinct storages created during
the forward and still alive after it, less the loss, which covers autograd's saved tensors and selective
checkpointing's cache alike (parameters left out, as ``SavedActivations`` leaves them out).
"""

from __future__ import annotations

import functools
import statistics
import time
import weakref
from collections import defaultdict
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from plait.layout import Layout
from plait.models import GPT, GPTConfig, ModelSpec, lm_loss
from plait.parallel.blocks import find_blocks
from plait.parallel.recompute import apply_recompute
from plait.planner.memory import estimate_memory

CONFIG = GPTConfig.llama_style(vocab_size=256, seq_len=256, n_layer=6, n_head=8, n_kv_head=2, d_model=256)
BATCH = 4
ROUNDS, STEPS = 5, 3
CONTENDERS = ("plait none", "plait selective", "plait op", "plait full", "torchtitan op (peer)")


class LiveStorages(TorchDispatchMode):
    """Bytes of the distinct storages that operators create while active and that are still alive at ``bytes``,
    leaving out ``exclude``'s (parameters: a matmul saves a transposed view of its weight)."""

    def __init__(self, exclude: Any = ()) -> None:
        super().__init__()
        self.excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self.created: list[tuple[Any, int, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                self.created.append((weakref.ref(tensor), storage.data_ptr(), storage.nbytes()))
        return out

    def bytes(self, leave_out: torch.Tensor) -> int:
        skip = self.excluded | {leave_out.untyped_storage().data_ptr()}
        alive = {ptr: size for ref, ptr, size in self.created if ref() is not None and ptr not in skip}
        return sum(alive.values())


def _torchtitan_context() -> tuple[Any, Any]:
    """torchtitan's selective-op policy: save mm and SDPA outputs, except every second mm (its meta counter)."""
    save = {
        torch.ops.aten.mm.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,  # the CPU kernel of the same call
    }
    meta: dict[str, int] = defaultdict(int)

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
        if func == torch.ops.aten.mm.default:
            meta[key] += 1
        keep = func in save and not (func == torch.ops.aten.mm.default and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _model(contender: str) -> GPT:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    if contender.startswith("plait"):
        apply_recompute(model, contender.split()[1])
    else:
        for _, block in find_blocks(model):
            block.forward = functools.partial(
                checkpoint, block.forward, use_reentrant=False, context_fn=_torchtitan_context
            )
    return model


def measure() -> dict[str, dict[str, float]]:
    """Per contender: median step seconds over alternating rounds, and the bytes one forward keeps."""
    torch.set_num_threads(1)
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.seq_len), generator=torch.Generator().manual_seed(1))
    models = {c: _model(c) for c in CONTENDERS}
    kept = {}
    for contender, model in models.items():
        live = LiveStorages(exclude=model.parameters())
        with live:
            loss = lm_loss(model(tokens), tokens)
        kept[contender] = live.bytes(loss)
        loss.backward()
    times: dict[str, list[float]] = {c: [] for c in CONTENDERS}
    for round_ in range(ROUNDS):
        order = CONTENDERS if round_ % 2 == 0 else tuple(reversed(CONTENDERS))
        for contender in order:
            model = models[contender]
            start = time.perf_counter()
            for _ in range(STEPS):
                lm_loss(model(tokens), tokens).backward()
            times[contender].append((time.perf_counter() - start) / STEPS)
    return {c: {"seconds": statistics.median(times[c]), "kept": kept[c]} for c in CONTENDERS}


def formula_bytes(mode: str) -> float:
    """``estimate_memory``'s activations for ``mode`` less the token ids and targets (created before the forward,
    so ``LiveStorages`` does not see them: 8 bytes each per token)."""
    shape = {"batch": BATCH, "seq": CONFIG.seq_len}
    activations = estimate_memory(CONFIG, Layout(recompute=mode), activations=shape, device="cpu").activations
    return activations - 2 * 8 * BATCH * CONFIG.seq_len


def flops_ratio(mode: str) -> float:
    """Hardware over model FLOPs of a step under ``mode`` (``ModelSpec.recompute_flops_per_token``; the fused
    CPU flash attention kernel)."""
    spec = ModelSpec.from_gpt_config(CONFIG)
    return 1 + spec.recompute_flops_per_token(mode) / spec.flops_per_token()


def table(results: dict[str, dict[str, float]]) -> str:
    base = results["plait none"]
    peer = results["torchtitan op (peer)"]
    rows = [
        "| contender | step (s) | vs plait none | FLOPs vs none (theory) | kept (MiB) | vs plait none | formula (MiB) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for contender, r in results.items():
        mode = contender.split()[1]
        formula = f"{formula_bytes(mode) / 2**20:.2f}" if contender.startswith("plait") else ""
        rows.append(
            f"| {contender} | {r['seconds']:.3f} | {r['seconds'] / base['seconds']:.2f} | {flops_ratio(mode):.2f} | "
            f"{r['kept'] / 2**20:.2f} | {r['kept'] / base['kept']:.2f} | {formula} |"
        )
    op = results["plait op"]
    rows.append("")
    rows.append(
        f"plait op / torchtitan op: time {op['seconds'] / peer['seconds']:.2f}, kept bytes "
        f"{op['kept'] / peer['kept']:.2f} (theory 1.00 and 1.00: the same operators kept)."
    )
    return "\n".join(rows)


def main() -> None:
    shape = f"{CONFIG.n_layer} blocks x d_model {CONFIG.d_model}, seq {CONFIG.seq_len}, batch {BATCH}"
    print(f"Llama-style GPT ({shape}), fp32, 1 thread, {ROUNDS} alternating rounds of {STEPS} steps")
    print(table(measure()))


if __name__ == "__main__":
    main()
