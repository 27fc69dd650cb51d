"""Measure what context parallelism saves: bytes of activations kept for backward, per rank.

``SavedActivations`` counts, through ``torch.autograd.graph.saved_tensors_hooks``, every distinct storage that
autograd saves while it is active, leaving out the given parameters (weights saved by a Linear are not
activations). ``python -m plait.parallel.context.measure OUT.png`` draws the per-rank saved bytes of the test
GPT's forward against sequence length for cp = 1, 2, 4 (ring and Ulysses), from numbers measured in
spawned gloo ranks.
"""

from __future__ import annotations

import sys

import torch

from plait.memory import SavedActivations

__all__ = ["SavedActivations", "gpt_saved_bytes"]


def gpt_saved_bytes(cp: int, mode: str, lengths: list[int]) -> list[int]:
    """On each rank of a cp-rank job: bytes saved for backward by one forward of a small GPT (batch 1) at each
    sequence length, with the sequence sharded over cp (cp = 1: plain single-device model)."""
    import plait
    from plait.models import GPT, GPTConfig

    results = []
    for length in lengths:
        torch.manual_seed(0)
        config = GPTConfig(vocab_size=32, seq_len=max(lengths), n_layer=2, n_head=4, d_model=32, bias=False)
        model = GPT(config)
        if cp > 1:
            plait.parallelize(model, plait.Layout(dp=1, cp=cp, cp_mode=mode),
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
        tokens = torch.randint(0, 32, (1, length))
        with SavedActivations(exclude=model.parameters()) as saved:
            model(tokens).sum().backward()
        results.append(saved.bytes)
    return results


def draw(path: str, lengths: tuple[int, ...] = (64, 128, 256, 512)) -> dict[str, list[int]]:
    """Measure (spawning 2 and 4 gloo ranks through the test harness) and draw the plot; returns the numbers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sys.path.insert(0, "tests")
    from harness import run_distributed

    measured = {"cp=1": gpt_saved_bytes(1, "ring", list(lengths))}
    for cp in (2, 4):
        for mode in ("ring", "ulysses"):
            measured[f"cp={cp} {mode}"] = run_distributed(gpt_saved_bytes, cp, cp, mode, list(lengths), timeout=300)[0]
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, values in measured.items():
        ax.plot(lengths, [v / 2**20 for v in values], marker="o", label=label,
                linestyle="--" if "ulysses" in label else "-")
    ax.set_xlabel("sequence length T (tokens)")
    ax.set_ylabel("activations saved for backward per rank (MiB)")
    ax.set_title("GPT (2 layers, d=32, 4 heads, batch 1): memory per rank vs T")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return measured


if __name__ == "__main__":
    for label, values in draw(sys.argv[1] if len(sys.argv) > 1 else "docs/img/context_parallel_memory.png").items():
        print(label, values)
