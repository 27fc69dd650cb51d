"""Measure what context parallelism saves and sends, per rank, in spawned gloo ranks.

``plait.observe.memory.SavedActivations`` counts, through ``torch.autograd.graph.saved_tensors_hooks``, every
distinct storage that autograd saves while it is active, leaving out the given parameters (weights saved by a
Linear are not activations). ``python -m benchmarks.context_memory OUT.png`` measures, for cp = 1, 2, 4 (ring and
Ulysses) on a small GPT, and prints as Markdown tables:

- the activation bytes saved per rank against the sequence length (and draws them, with the limit below);
- the longest sequence whose saved activations fit a per-rank limit (``LIMIT``): a search seeded by the
  measured bytes per token and settled by measuring at the answer T (fits) and at T + one split unit (does not);
- the bytes one attention layer sends per rank, forward and backward, measured against ``traffic``'s formulas.
"""

from __future__ import annotations

import sys

import torch

from plait.observe.memory import SavedActivations
from plait.parallel.context.sharding import SequenceSharding
from plait.parallel.context.traffic import measure_wire_bytes, theory_wire_bytes

__all__ = ["gpt_saved_bytes", "longest_sequence"]
LENGTHS = (64, 128, 256, 512, 1024)
LIMIT = 2**20
"""Per-rank budget for saved activations in the longest-sequence figure (1 MiB: the GPT here is tiny)."""
TRAFFIC_SHAPE = {"batch": 2, "heads": 4, "length": 16, "head_dim": 8}
"""The attention layer of tests/test_context_parallel.py, whose bytes the tests check to the byte."""
MODES = ("ring", "ulysses")
LABELS = {"ring": "ring", "ulysses": "Ulysses"}


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
            plait.parallelize(
                model, plait.Layout(dp=1, cp=cp, cp_mode=mode), optimizer=lambda p: torch.optim.SGD(p, lr=0.1)
            )
        tokens = torch.randint(0, 32, (1, length))
        with SavedActivations(exclude=model.parameters()) as saved:
            model(tokens).sum().backward()
        results.append(saved.bytes)
    return results


def longest_sequence(cp: int, mode: str, limit: int = LIMIT) -> tuple[int, int, int]:
    """(T, bytes at T, bytes at T + unit): the longest T, a multiple of the split unit (2cp ring, cp Ulysses),
    whose per-rank saved activations (``gpt_saved_bytes``) fit ``limit``; run on every rank of the cp group."""
    unit = SequenceSharding(mode, cp, 0).chunks if cp > 1 else 1
    probe = 64 * unit
    per_token = gpt_saved_bytes(cp, mode, [probe])[0] / probe
    length = max(unit, int(limit / per_token) // unit * unit)
    while gpt_saved_bytes(cp, mode, [length + unit])[0] <= limit:  # the estimate was short: step up
        length += unit
    while (fits := gpt_saved_bytes(cp, mode, [length])[0]) > limit:  # ... or long: step down
        length -= unit
    return length, fits, gpt_saved_bytes(cp, mode, [length + unit])[0]


def _on_rank(cp: int, lengths: list[int]) -> dict:
    """Everything measured on one rank of a cp-rank job."""
    from plait.comm import Comm
    from plait.layout import Layout
    from plait.mesh import Mesh

    comm = Comm(Mesh.build(Layout(dp=1, cp=cp)))
    return {
        mode: {
            "saved": gpt_saved_bytes(cp, mode, lengths),
            "longest": longest_sequence(cp, mode),
            "traffic": measure_wire_bytes(comm, mode, kv_heads=TRAFFIC_SHAPE["heads"], **TRAFFIC_SHAPE),
        }
        for mode in MODES
    }


def measure(lengths: tuple[int, ...] = LENGTHS) -> dict[int, dict]:
    """{cp: {mode: measurements}} for cp = 1 (one process) and cp = 2, 4 (spawned gloo ranks; the maximum over
    ranks of the saved bytes, which are equal on every rank)."""
    from plait.launch import run_local

    single = {"saved": gpt_saved_bytes(1, "ring", list(lengths)), "longest": longest_sequence(1, "ring")}
    results = {1: {"ring": single}}
    for cp in (2, 4):
        per_rank = run_local(_on_rank, cp, cp, list(lengths), timeout=600)
        results[cp] = per_rank[max(range(cp), key=lambda r: per_rank[r]["ring"]["saved"][-1])]
    return results


def tables(results: dict[int, dict], lengths: tuple[int, ...] = LENGTHS) -> str:
    """The three Markdown tables of the module docstring."""
    columns = [(1, "ring", "cp=1")] + [(cp, mode, f"cp={cp} {LABELS[mode]}") for cp in (2, 4) for mode in MODES]
    lines = ["| T | " + " | ".join(label for *_, label in columns) + " |", "| --- " * (len(columns) + 1) + "|"]
    for i, length in enumerate(lengths):
        saved = (f"{results[cp][mode]['saved'][i]:,}" for cp, mode, _ in columns)
        lines.append(f"| {length} | " + " | ".join(saved) + " |")
    lines += ["", f"| per-rank limit {LIMIT:,} B | longest T | saved at T | saved at T + unit |", "| --- " * 4 + "|"]
    for cp, mode, label in columns:
        length, fits, over = results[cp][mode]["longest"]
        lines.append(f"| {label} | {length:,} | {fits:,} | {over:,} |")
    lines += ["", "| cp, mode | forward measured / theory | backward measured / theory | calls |", "| --- " * 4 + "|"]
    shape = TRAFFIC_SHAPE
    for cp, mode, label in columns[1:]:
        got = results[cp][mode]["traffic"]
        want = theory_wire_bytes(
            mode, cp, shape["batch"], shape["heads"], shape["heads"], shape["length"], shape["head_dim"]
        )
        lines.append(
            f"| {label} | {got['forward']:,.0f} / {want['forward']:,.0f} | "
            f"{got['backward']:,.0f} / {want['backward']:,.0f} | {got['calls']} / {want['calls']} |"
        )
    return "\n".join(lines)


def draw(path: str, results: dict[int, dict], lengths: tuple[int, ...] = LENGTHS) -> None:
    """Saved activations per rank against T (log-log), the per-rank limit, and each setting's longest T."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for cp, by_mode in results.items():
        for mode, measured in by_mode.items():
            label = f"cp={cp}" + (f" {LABELS[mode]}" if cp > 1 else "")
            (line,) = ax.plot(
                lengths,
                [v / 2**20 for v in measured["saved"]],
                marker="o",
                label=label,
                linestyle="--" if mode == "ulysses" else "-",
            )
            longest, fits, _ = measured["longest"]
            ax.plot([longest], [fits / 2**20], marker="*", markersize=12, color=line.get_color())
    ax.axhline(LIMIT / 2**20, color="gray", linestyle=":", label=f"limit {LIMIT / 2**20:g} MiB (* longest T)")
    ax.set_xlabel("sequence length T (tokens)")
    ax.set_ylabel("activations saved for backward per rank (MiB)")
    ax.set_title("GPT (2 layers, d=32, 4 heads, batch 1): memory per rank vs T")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    measured = measure()
    draw(sys.argv[1] if len(sys.argv) > 1 else "docs/img/context_parallel_memory.png", measured)
    print(tables(measured))
