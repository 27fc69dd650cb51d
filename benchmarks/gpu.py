"""``python -m benchmarks.gpu [--shapes small,medium] [--micro 8,16] [--steps 20] [--out BENCHMARKS.md]``: plait on one
GPU against a plain PyTorch loop and a compiled plain loop, bf16, steps back to back.

Contenders, on the same model (plait's reference GPT at GPT-2 small / medium shape: 12 / 24 layers, d_model 768 /
1024, 12 / 16 heads, vocabulary 50304, 1024 tokens), batch, optimizer (AdamW, fused on CUDA) and clipping (1.0):

- ``plain``: forward under bf16 autocast, loss, backward, ``clip_grad_norm_``, step, ``zero_grad``; nothing read on
  the host (the loss is read once after the timed steps), as a tuned single-GPU loop does;
- ``plain compiled``: the same with ``torch.compile(model)``;
- ``plait``: ``plait.parallelize(model, Layout(precision="bf16"))`` and ``engine.train_step``;
- ``plait compiled``: ``Layout(precision="bf16", compile=True)`` (per-block compilation).

Timing: ``--warmup`` untimed steps (compilation happens there), a device sync, ``--steps`` steps back to back with
no sync, a device sync: tokens/s = steps x batch x seq / elapsed. Contenders alternate in ``--rounds`` rounds (the
order reversed every other round) and the median round is reported. MFU = tokens/s x model FLOPs per token
(``plait.train.metrics.model_flops_per_token``) / the GPU's dense bf16 peak (hardware catalogue). Peak memory is
``torch.cuda.max_memory_allocated`` over the timed steps of a contender; plait's rows also give
``plait.planner.memory.estimate_memory`` for the same layout, model and batch.

``--device cpu --tiny`` runs the same code on a tiny GPT on the CPU (what tests/test_gpu_benchmark.py does): the
figures mean nothing there, the point is that every contender runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

SHAPES: dict[str, dict[str, int]] = {
    "small": {"n_layer": 12, "d_model": 768, "n_head": 12},
    "medium": {"n_layer": 24, "d_model": 1024, "n_head": 16},
    "tiny": {"n_layer": 2, "d_model": 32, "n_head": 2},
}
VOCAB, SEQ = 50304, 1024
TINY_VOCAB, TINY_SEQ = 64, 16
CONTENDERS = ("plain", "plain compiled", "plait", "plait compiled")
LR, CLIP = 3e-4, 1.0


@dataclass(frozen=True)
class Case:
    """One benchmark cell: a model shape and a micro-batch, on a device."""

    shape: str
    micro: int
    device: str

    @property
    def vocab(self) -> int:
        return TINY_VOCAB if self.shape == "tiny" else VOCAB

    @property
    def seq(self) -> int:
        return TINY_SEQ if self.shape == "tiny" else SEQ

    def config(self) -> Any:
        from plait.models import GPTConfig

        return GPTConfig(vocab_size=self.vocab, seq_len=self.seq, bias=False, **SHAPES[self.shape])

    def batch(self, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, self.vocab, (self.micro, self.seq + 1), generator=generator)
        return tokens[:, :-1].to(self.device), tokens[:, 1:].to(self.device)


def optimizer_factory(device: str) -> Callable[[Any], torch.optim.Optimizer]:
    from plait.parallel.kernels import fast_optimizer_kwargs

    options = fast_optimizer_kwargs(torch.optim.AdamW, torch.device(device))
    return lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=0.1, **options)


def _model(case: Case) -> nn.Module:
    from plait.models import GPT

    torch.manual_seed(0)
    return GPT(case.config()).to(case.device)


StepFn = Callable[[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]


def build(contender: str, case: Case) -> tuple[StepFn, dict[str, Any]]:
    """A step function returning the loss tensor (never read on the host), and facts about the contender."""
    import plait
    from plait.models import lm_loss

    model = _model(case)
    if contender.startswith("plait"):
        layout = plait.Layout(precision="bf16", compile=contender.endswith("compiled"))
        engine = plait.parallelize(
            model, layout, optimizer=optimizer_factory(case.device), loss_fn=lm_loss, max_grad_norm=CLIP
        )
        return (lambda batch: engine.train_step(batch).loss_tensor), {"layout": engine.layout}
    module = torch.compile(model) if contender.endswith("compiled") else model
    optimizer = optimizer_factory(case.device)(model.parameters())
    autocast = torch.autocast(torch.device(case.device).type, dtype=torch.bfloat16)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        with autocast:
            loss = lm_loss(module(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step, {}


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def measure(contender: str, case: Case, steps: int, warmup: int) -> dict[str, Any]:
    """Build ``contender``, run ``warmup`` steps, then time ``steps`` steps back to back."""
    step, facts = build(contender, case)
    batches = [case.batch(seed) for seed in range(4)]
    for index in range(warmup):
        step(batches[index % len(batches)])
    cuda = torch.device(case.device).type == "cuda"
    _sync(case.device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(case.device)
    start = time.perf_counter()
    losses = [step(batches[index % len(batches)]) for index in range(steps)]
    _sync(case.device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(case.device) if cuda else None
    row = {
        "contender": contender,
        "seconds": seconds,
        "tokens_per_s": steps * case.micro * case.seq / seconds,
        "final_loss": float(losses[-1]),
        "peak_bytes": peak,
        **facts,
    }
    del step, facts, losses
    if cuda:
        torch.cuda.empty_cache()
    return row


def estimated_bytes(case: Case, layout: Any) -> float:
    """``estimate_memory``'s device bytes for plait's layout on this case (model states + activations)."""
    from plait.planner.memory import estimate_memory

    config = case.config()
    activations = {
        "seq": case.seq,
        "batch": case.micro,
        "hidden": config.d_model,
        "heads": config.n_head,
        "layers": config.n_layer,
    }
    params = sum(p.numel() for p in _model_on_meta(case).parameters())
    estimate = estimate_memory(params, layout, "adamw", activations=activations)
    peak = getattr(estimate, "peak", None)  # the memory model's peak where it gives one
    return float(peak) if peak is not None else float(estimate.model_states - estimate.host + estimate.activations)


def _model_on_meta(case: Case) -> nn.Module:
    from plait.models import GPT

    with torch.device("meta"):
        return GPT(case.config())


def mfu(tokens_per_s: float, case: Case) -> float | None:
    """Model FLOPs utilisation of one device at bf16, or None where the device's peak is unknown."""
    from plait.train.metrics import model_flops_per_token, peak_flops

    peak, _source = peak_flops(torch.device(case.device), "bf16", 1)
    return tokens_per_s * model_flops_per_token(case.config(), case.seq) / peak if peak else None


def run_case(case: Case, steps: int, warmup: int, rounds: int, contenders: tuple[str, ...]) -> list[dict[str, Any]]:
    """Every contender on ``case``, alternating over ``rounds`` (reversed order every other round); the median
    round of each, with the ratio to its peer (plait to the plain loop, compiled to compiled)."""
    measured: dict[str, list[dict[str, Any]]] = {c: [] for c in contenders}
    for round_index in range(rounds):
        order = contenders if round_index % 2 == 0 else tuple(reversed(contenders))
        for contender in order:
            measured[contender].append(measure(contender, case, steps, warmup))
    rows = []
    for runs in measured.values():
        runs.sort(key=lambda r: r["tokens_per_s"])
        row = dict(runs[len(runs) // 2])
        row.update(shape=case.shape, micro=case.micro, rounds=rounds, steps=steps)
        row["spread"] = (runs[0]["tokens_per_s"], runs[-1]["tokens_per_s"])
        row["mfu"] = mfu(row["tokens_per_s"], case)
        layout = row.pop("layout", None)
        row["estimate_bytes"] = estimated_bytes(case, layout) if layout is not None else None
        rows.append(row)
    by_name = {r["contender"]: r for r in rows}
    for row in rows:
        peer = "plain compiled" if row["contender"].endswith("compiled") else "plain"
        row["vs_peer"] = row["tokens_per_s"] / by_name[peer]["tokens_per_s"] if peer in by_name else None
    return rows


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


def markdown(rows: list[dict[str, Any]], command: str, device_name: str) -> str:
    """The rows as one markdown table with the command and the device."""
    header = "| shape | micro-batch | contender | tokens/s (min..max) | x peer | MFU | peak GiB | estimate GiB |"
    lines = [f"`{command}`", "", header, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        low, high = r["spread"]
        vs_peer = "-" if r["vs_peer"] is None else f"{r['vs_peer']:.3f}"
        utilisation = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        lines.append(
            f"| {r['shape']} | {r['micro']} | {r['contender']} | {r['tokens_per_s']:,.0f} ({low:,.0f}..{high:,.0f}) | "
            f"{vs_peer} | {utilisation} | {_gib(r['peak_bytes'])} | {_gib(r['estimate_bytes'])} |"
        )
    first = rows[0] if rows else {"steps": 0, "rounds": 0}
    lines += [
        "",
        f"{device_name}, torch {torch.__version__}; bf16 autocast, fp32 master weights, AdamW (fused on CUDA), clip "
        f"{CLIP}; {first['steps']} timed steps back to back per contender and round, median of {first['rounds']} "
        "rounds; x peer: plait / plain loop, compiled / compiled plain loop.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="small,medium", help="comma-separated: small, medium (tiny for smoke runs)")
    parser.add_argument("--micro", default="8,16", help="comma-separated micro-batch sizes")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny shape only (smoke run, e.g. on CPU)")
    parser.add_argument("--out", type=Path, help="write the table into this file's <!-- bench:gpu --> block")
    args = parser.parse_args(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print("benchmarks.gpu: no CUDA device here. Fix: run it on a GPU machine (or --device cpu --tiny).")
        return 2
    shapes = ["tiny"] if args.tiny else args.shapes.split(",")
    contenders = tuple(c.strip() for c in args.contenders.split(","))
    unknown = sorted(set(shapes) - set(SHAPES)) + sorted(set(contenders) - set(CONTENDERS))
    if unknown:
        print(f"benchmarks.gpu: unknown {unknown}. Fix: shapes {list(SHAPES)}, contenders {list(CONTENDERS)}.")
        return 2
    rows: list[dict[str, Any]] = []
    for shape in shapes:
        for micro in (int(m) for m in args.micro.split(",")):
            rows += run_case(Case(shape, micro, args.device), args.steps, args.warmup, args.rounds, contenders)
    cuda = torch.device(args.device).type == "cuda"
    device_name = torch.cuda.get_device_name(args.device) if cuda else "CPU"
    command = "python -m benchmarks.gpu " + " ".join(sys.argv[1:] if argv is None else argv)
    text = markdown(rows, command.strip(), device_name)
    print(text)
    if args.out:
        from benchmarks.report import replace_block

        replace_block(args.out, "gpu", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
