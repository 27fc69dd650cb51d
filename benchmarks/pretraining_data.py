"""Pre-training data as the large runs do it (issue 27): what document masking, chunked cross-entropy and weighted
mixtures cost and save. ``python -m benchmarks.pretraining_data [documents|chunked|mixture|all] [--out F.json]``
prints Markdown tables (BENCHMARKS.md):

- ``documents``: one ring-attention layer (forward + backward, fp32, gloo ranks) on the same T tokens, causal vs
  packed documents (lengths drawn from a geometric law of the given mean): median time over alternating rounds,
  wire bytes per rank (``CommStats``), block pieces computed and skipped (``RingAttention.counts``);
- ``chunked``: a GPT with a 32k vocabulary, one training step with ``lm_loss`` vs ``ChunkedCrossEntropy``, each
  contender in a fresh process: bytes autograd keeps (``SavedActivations``), ``estimate_memory``'s figures, the
  largest vocabulary-wide tensor any operator makes, the process's peak RSS growth, and the step time;
- ``mixture``: whole global batches from a two-source ``MixtureDataset`` (the stdlib corpus and the machine's
  license texts, one tokenizer) against ``plait train`` on the same mixture.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["chunked_step", "document_lengths", "ring_case"]

RING_SHAPE = {"batch": 1, "heads": 8, "head_dim": 64, "length": 4096}
CHUNKED_SHAPE = {"vocab": 32768, "d_model": 320, "n_layer": 2, "n_head": 4, "batch": 4, "seq": 512}
"""d_model differs from every chunk size, so a chunk's logits never look like the head's weight transposed."""
ROUNDS = 5
LICENSES = Path("/usr/share/common-licenses")


def document_lengths(total: int, mean: int, seed: int = 0) -> list[int]:
    """Document lengths (geometric, the given mean) filling ``total`` tokens."""
    generator = torch.Generator().manual_seed(seed)
    lengths, left = [], total
    while left:
        drawn = int(torch.empty(1).exponential_(1 / mean, generator=generator).ceil())
        lengths.append(max(1, min(left, drawn)))
        left -= lengths[-1]
    return lengths


def ring_case(mean: int | None, rounds: int = ROUNDS) -> dict[str, Any]:
    """On each rank of a cp job: one ring layer forward + backward, causal (``mean`` None) or on packed documents
    of that mean length; this rank's times (ms), wire bytes on "cp" and block pieces."""
    from plait import Layout
    from plait.comm import Comm
    from plait.mesh import Mesh
    from plait.parallel.context.ring import RingAttention
    from plait.parallel.context.sharding import SequenceSharding

    torch.set_num_threads(1)
    mesh = Mesh.build(Layout(dp=1, cp=torch.distributed.get_world_size()))
    comm = Comm(mesh)
    cp, rank = comm.size("cp"), mesh.index("cp")
    sharding = SequenceSharding("ring", cp, rank)
    b, h, d, length = (RING_SHAPE[key] for key in ("batch", "heads", "head_dim", "length"))
    index = sharding.local_positions(length)
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(b, h, length, d, generator=generator)[:, :, index].contiguous() for _ in range(3))
    positions = None
    if mean is not None:
        whole = torch.cat([torch.arange(n) for n in document_lengths(length, mean)]).expand(b, length)
        positions = whole[:, index].contiguous()
    core = RingAttention(comm, sharding, causal=True)
    times = []
    for step in range(rounds + 1):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        core.counts.reset()
        before = comm.stats.snapshot()
        comm.barrier("cp")
        start = time.perf_counter()
        core.attend(*leaves, positions=positions).sum().backward()
        comm.barrier("cp")
        if step:  # the first is a warm-up
            times.append(1000 * (time.perf_counter() - start))
        wire = comm.stats.since(before).wire("cp")
    return {"ms": times, "wire": wire, "computed": core.counts.computed, "skipped": core.counts.skipped}


def documents(cps: tuple[int, ...] = (2, 4), means: tuple[int, ...] = (256, 1024)) -> list[dict[str, Any]]:
    from plait.launch import run_local

    rows = []
    for cp in cps:
        cases: list[int | None] = [None, *means]
        results: dict[int | None, list[list[float]]] = {case: [] for case in cases}
        last: dict[int | None, list[dict[str, Any]]] = {}
        for turn in range(2):  # A B C, C B A: drift hits every contender alike
            for case in cases if turn == 0 else reversed(cases):
                per_rank = run_local(ring_case, cp, case, timeout=600)
                results[case].append([max(times) for times in zip(*(r["ms"] for r in per_rank))])
                last[case] = per_rank
        for case in cases:
            steps = [t for run in results[case] for t in run]
            per_rank = last[case]
            rows.append(
                {
                    "cp": cp,
                    "documents": "causal" if case is None else f"mean {case}",
                    "ms": statistics.median(steps),
                    "ms_range": (min(steps), max(steps)),
                    "wire_bytes": per_rank[0]["wire"],
                    "computed": sum(r["computed"] for r in per_rank),
                    "skipped": sum(r["skipped"] for r in per_rank),
                }
            )
    return rows


def chunked_step(chunk: int) -> dict[str, Any]:
    """In a fresh process: one warm-up and ``ROUNDS`` timed training steps of the GPT of ``CHUNKED_SHAPE``; bytes
    saved for backward, the largest vocabulary-wide tensor, peak RSS growth, step times, the estimate."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import plait
    from plait import Layout, estimate_memory
    from plait.models import GPT, GPTConfig, lm_loss
    from plait.models.loss import ChunkedCrossEntropy
    from plait.observe.memory import SavedActivations

    torch.set_num_threads(1)
    shape = CHUNKED_SHAPE
    config = GPTConfig(
        vocab_size=shape["vocab"],
        seq_len=shape["seq"],
        n_layer=shape["n_layer"],
        n_head=shape["n_head"],
        d_model=shape["d_model"],
    )
    torch.manual_seed(0)
    loss = ChunkedCrossEntropy(chunk) if chunk else lm_loss
    engine = plait.parallelize(GPT(config), Layout(), optimizer=lambda p: torch.optim.SGD(p, lr=0.01), loss_fn=loss)
    generator = torch.Generator().manual_seed(0)
    batch = (
        torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=generator),
        torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=generator),
    )
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # the model built, no step yet
    engine.train_step(batch)  # warm-up: the optimizer's and allocator's first allocations

    class Largest(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(tensor, torch.Tensor) and tensor.dim() >= 2 and tensor.shape[-1] == shape["vocab"]:
                    if tuple(tensor.shape) != (shape["d_model"], shape["vocab"]):  # the head's weight, transposed
                        Largest.largest = max(Largest.largest, tensor.numel() * tensor.element_size())
            return out

    with SavedActivations(exclude=engine.model.parameters()) as saved, Largest():
        engine.train_step(batch)
    times = [_seconds(engine.train_step, batch) for _ in range(ROUNDS)]
    activations = {"batch": shape["batch"], "loss_chunk": chunk}
    estimate = estimate_memory(config, engine.layout, "sgd", activations=activations, device="cpu")
    return {
        "chunk": chunk,
        "saved": saved.bytes,
        "estimate_saved": estimate.activations,
        "estimate_peak": estimate.peak,
        "largest_vocab_tensor": Largest.largest,
        "rss_growth_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before,
        "times": times,
    }


def _seconds(function: Any, *args: Any) -> float:
    start = time.perf_counter()
    function(*args)
    return time.perf_counter() - start


def chunked(chunks: tuple[int, ...] = (0, 1024, 256)) -> list[dict[str, Any]]:
    """Each contender in a fresh process (its peak RSS is its own), alternating over two turns."""
    from plait.launch import run_local

    rows: dict[int, list[dict[str, Any]]] = {chunk: [] for chunk in chunks}
    for turn in range(2):
        for chunk in chunks if turn == 0 else reversed(chunks):
            rows[chunk].append(run_local(chunked_step, 1, chunk, timeout=900)[0])
    out = []
    for chunk in chunks:
        runs = rows[chunk]
        steps = [t for r in runs for t in r["times"]]
        out.append(
            {
                **runs[0],
                "step_s": statistics.median(steps),
                "step_range": (min(steps), max(steps)),
                "rss_growth_kb": [r["rss_growth_kb"] for r in runs],
            }
        )
    return out


def mixture(work: Path) -> dict[str, Any]:
    """Loader tokens/s of a two-source mixture (stdlib corpus 0.8, license texts 0.2) against training on it."""
    from plait.data import MixtureDataset, ShardedBatches, prepare
    from plait.data.stdlib_corpus import ensure_stdlib_tokens

    stdlib = ensure_stdlib_tokens(4096, 0.0)
    licenses = work / "licenses"
    if not (licenses / "meta.json").is_file():
        prepare([LICENSES], licenses, tokenizer=str(Path(stdlib) / "tokenizer.json"), val_fraction=0.05)
    sources = [
        {"path": str(stdlib), "weight": 0.8, "name": "stdlib"},
        {"path": str(licenses), "weight": 0.2, "name": "licenses"},
    ]
    dataset = MixtureDataset(sources, seq_len=128, seed=0, attention="document")
    loader = ShardedBatches(dataset, global_batch=32)
    rates = []
    for turn in range(ROUNDS):
        start = time.perf_counter()
        for step in range(turn * 50, turn * 50 + 50):
            loader.batch_at(step)
        rates.append(50 * 32 * 128 / (time.perf_counter() - start))
    names = [source.get("name", Path(source["path"]).name) for source in sources]
    toml = "[" + ", ".join(f'{{path="{s["path"]}", weight={s["weight"]}, name="{n}"}}' for s, n in zip(sources, names))
    toml += "]"
    out = work / "run"
    command = [
        sys.executable, "-m", "plait", "train", "--preset", "stdlib-lm", "--nproc", "2", "--out", str(out),
        "--set", "data.name=tokens", "--set", f"data.sources={toml}", "--set", "data.attention=document",
        "--set", "train.steps=40", "--set", "train.eval_every=0", "--set", "train.save_every=0",
        "--set", "train.samples=0",
    ]  # fmt: skip
    subprocess.run(command, check=True)
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    seen = [r["tokens_by_source"] for r in records if r["kind"] == "train"][-1]
    return {
        "loader_tokens_per_s": statistics.median(rates),
        "loader_range": (min(rates), max(rates)),
        "train_tokens_per_s": summary["tokens_per_s"],
        "tokens_by_source": seen,
        "sources_tokens": {
            s["name"]: d.folder.splits["train"]["tokens"] for s, d in zip(dataset.sources, dataset.datasets)
        },
    }


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table, and a blank line after it."""
    return [f"| {' | '.join(header)} |", "|" + " --- |" * len(header)] + [f"| {' | '.join(r)} |" for r in rows] + [""]


def _ranged(value: float, span: tuple[float, float], digits: int) -> str:
    return f"{value:.{digits}f} ({span[0]:.{digits}f}..{span[1]:.{digits}f})"


def _markdown(results: dict[str, Any]) -> str:
    lines = []
    if "documents" in results:
        header = ["cp", "documents", "ms per layer fwd+bwd, median (min..max)", "wire bytes per rank"]
        rows = [
            [str(r["cp"]), r["documents"], _ranged(r["ms"], r["ms_range"], 1), f"{int(r['wire_bytes']):,}"]
            + [str(r["computed"]), str(r["skipped"])]
            for r in results["documents"]
        ]
        lines += _table(header + ["tiles computed", "skipped"], rows)
    if "chunked" in results:
        header = ["loss", "saved for backward (estimate)", "largest V-wide tensor", "peak RSS growth, MB (runs)"]
        rows = [
            [
                f"chunked, {r['chunk']} tokens" if r["chunk"] else "whole (lm_loss)",
                f"{r['saved']:,} ({r['estimate_saved']:,.0f})",
                f"{r['largest_vocab_tensor']:,}",
                ", ".join(f"{kb / 1024:,.0f}" for kb in r["rss_growth_kb"]),
                f"{r['estimate_peak'] / 2**20:,.1f} MiB",
                _ranged(r["step_s"], r["step_range"], 2),
            ]
            for r in results["chunked"]
        ]
        lines += _table(header + ["estimate_memory peak", "step s (min..max)"], rows)
    if "mixture" in results:
        m = results["mixture"]
        low, high = m["loader_range"]
        lines += [
            "| what | tokens/s |",
            "| --- | --- |",
            f"| loader (two-source mixture, whole global batches, one process) | {m['loader_tokens_per_s']:,.0f} "
            f"({low:,.0f}..{high:,.0f}) |",
            f"| training (`plait train --preset stdlib-lm --nproc 2` on the mixture) | {m['train_tokens_per_s']:,.0f} |",
            "",
            f"tokens by source after the run: {m['tokens_by_source']} (sources hold {m['sources_tokens']} tokens)",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", nargs="?", default="all", choices=["documents", "chunked", "mixture", "all"])
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"load_before": os.getloadavg()[0]}
    if args.what in ("documents", "all"):
        results["documents"] = documents()
    if args.what in ("chunked", "all"):
        results["chunked"] = chunked()
    if args.what in ("mixture", "all"):
        with tempfile.TemporaryDirectory(prefix="plait-mixture-") as work:
            results["mixture"] = mixture(Path(work))
    results["load_after"] = os.getloadavg()[0]
    print(_markdown(results))  # noqa: T201 - a benchmark's report
    print(f"\n1-minute load: {results['load_before']:.1f} before, {results['load_after']:.1f} after")  # noqa: T201
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0 if all(math.isfinite(results[k]) for k in ("load_before", "load_after")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
