"""Muon under ZeRO-1 and tp against the same run on DDP (docs/optimizers.md), and DeepSpeed's distributed Muon.

``python -m benchmarks.muon [--steps 5] [--rounds 3] [--deepspeed /work/ds-venv/bin/python]`` trains plait's GPT
(fp32, gloo, 2 ranks) with the hybrid optimizer (Muon on the hidden matrices, AdamW on the rest) under DDP, ZeRO-1
(tensor-atomic ownership) and tp=2 (slices gathered whole), each also with AdamW alone, alternating the contenders
in rounds so that machine noise hits all alike, and prints a Markdown table: the median step time and its ratio to
DDP + Muon, the wire bytes per step and axis (``StepStats.comm``), and the bytes Muon adds over AdamW on the same
layout next to the formula:

- ZeRO-1 over N: the Muon bucket is padded to N S_W (S_W the largest owner's load): extra wire 2 (N-1)(S_W - W/N) b;
- tp=t: one all-gather of values and gradients of the slices: extra tp wire 2 (t-1)/t W b;
- DDP: none (every rank orthogonalises every matrix: compute, not bytes).

With ``--deepspeed PYTHON`` (a virtualenv with deepspeed >= 0.18 and the same torch) the same model, batch and
steps also run under DeepSpeed's ZeRO-1 ``MuonWithAuxAdam`` (torchrun of that interpreter, gloo) in the same
invocation; its step time is reported beside plait's (its bytes are not counted by plait's Comm).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import plait
from plait import Layout
from plait.launch import run_local
from plait.models import GPT, GPTConfig, lm_loss
from plait.parallel.whole_tensor import WholeTensorOptimizer, hidden_matrices
from plait.parallel.zero.flat import owned_layout

CONFIG = GPTConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=128, bias=False)
BATCH, WORLD = 8, 2
LAYOUTS = {"DDP": Layout(dp=2), "ZeRO-1": Layout(dp=2, zero=1), "tp=2": Layout(tp=2)}
MUON = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.01}


def muon() -> WholeTensorOptimizer:
    return WholeTensorOptimizer(
        whole=lambda p: torch.optim.Muon(p, **MUON, adjust_lr_fn="match_rms_adamw"),
        rest=lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01),
    )


def adamw(params: object) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)  # type: ignore[arg-type]


def batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, CONFIG.vocab_size, (rows, CONFIG.seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _rank(steps: int, warmup: int, rounds: int) -> dict[str, dict]:
    """On each rank: every contender built once, then ``rounds`` alternating rounds of warm-up + timed steps."""
    engines = {}
    for layout_name, layout in LAYOUTS.items():
        for opt_name, optimizer in (("Muon", muon()), ("AdamW", adamw)):
            torch.manual_seed(0)
            engines[f"{layout_name} + {opt_name}"] = plait.parallelize(
                GPT(CONFIG), layout, optimizer=optimizer, loss_fn=lm_loss, max_grad_norm=1.0
            )
    times: dict[str, list[float]] = {name: [] for name in engines}
    comm: dict[str, dict[str, float]] = {}
    for _ in range(rounds):
        for name, engine in engines.items():
            dp, index = engine.mesh.size("dp"), engine.mesh.index("dp")
            rows = BATCH // dp
            for step in range(warmup + steps):
                inputs, targets = (t[index * rows : (index + 1) * rows] for t in batch(step, BATCH))
                engine.comm.barrier()
                start = time.perf_counter()
                stats = engine.train_step((inputs, targets))
                float(stats.loss)
                if step >= warmup:
                    times[name].append(time.perf_counter() - start)
                    comm[name] = stats.comm.wire_by_axis()
    return {name: {"time": statistics.median(times[name]), "wire": comm[name]} for name in engines}


def formula() -> dict[str, float]:
    """Muon's extra wire bytes per step and rank over AdamW on the same layout (module docstring)."""
    model = GPT(CONFIG)
    hidden = hidden_matrices(model)
    named = [(n, p) for n, p in model.named_parameters() if n in hidden]
    w = sum(p.numel() for _, p in named)
    s_w = owned_layout(named, WORLD).shard_size
    rest = sum(p.numel() for n, p in model.named_parameters() if n not in hidden)
    total = w + rest
    zero1 = 2 * (WORLD - 1) * (math.ceil(rest / WORLD) + s_w - math.ceil(total / WORLD)) * 4
    return {"DDP": 0.0, "ZeRO-1": float(zero1), "tp=2": 2 * (WORLD - 1) / WORLD * w * 4}


DEEPSPEED = """
import os, statistics, sys, time, torch, deepspeed
sys.path.insert(0, os.environ["PLAIT_ROOT"])
from benchmarks.muon import CONFIG, BATCH, MUON, batch
from plait.models import GPT, lm_loss
deepspeed.init_distributed(dist_backend="gloo")
rank, steps, warmup, rounds = int(os.environ["RANK"]), *map(int, sys.argv[1:4])
torch.manual_seed(0)
model = GPT(CONFIG)
for name, p in model.named_parameters():
    p.use_muon = p.dim() == 2 and name.startswith("blocks.")
config = {"train_micro_batch_size_per_gpu": BATCH // 2, "gradient_clipping": 1.0, "zero_optimization": {"stage": 1},
          "optimizer": {"type": "Muon", "params": {**MUON, "adam_lr": 1e-3}}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
times = []
for round_ in range(rounds):
    for step in range(warmup + steps):
        inputs, targets = (t[rank * (BATCH // 2) : (rank + 1) * (BATCH // 2)] for t in batch(step, BATCH))
        torch.distributed.barrier()
        start = time.perf_counter()
        loss = lm_loss(engine(inputs), targets)
        engine.backward(loss)
        engine.step()
        float(loss)
        if step >= warmup:
            times.append(time.perf_counter() - start)
if rank == 0:
    print("DEEPSPEED_MEDIAN", statistics.median(times), flush=True)
"""


def deepspeed_time(python: str, steps: int, warmup: int, rounds: int) -> str:
    """DeepSpeed ZeRO-1 Muon's median step time (s), or why it did not run (its last error line)."""
    root = Path(__file__).resolve().parents[1]
    script = Path(tempfile.mkdtemp()) / "deepspeed_muon.py"
    script.write_text(DEEPSPEED)
    torchrun = str(Path(python).with_name("torchrun"))
    env = {**os.environ, "PLAIT_ROOT": str(root), "OMP_NUM_THREADS": "1"}
    argv = [torchrun, "--nproc_per_node", "2", "--master_port", "29655", str(script), str(steps), str(warmup)]
    try:
        done = subprocess.run([*argv, str(rounds)], env=env, capture_output=True, text=True, timeout=3000)
    finally:
        script.unlink(missing_ok=True)
    for line in done.stdout.splitlines():
        if line.startswith("DEEPSPEED_MEDIAN"):
            return f"{float(line.split()[1]):.3f}"
    errors = [line for line in done.stderr.splitlines() if "Error" in line]
    return f"did not run: {errors[-1] if errors else done.stderr[-300:]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--deepspeed", help="python of a virtualenv with deepspeed >= 0.18")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = run_local(_rank, WORLD, args.steps, args.warmup, args.rounds, timeout=3000)[0]
    extra = formula()
    base = results["DDP + Muon"]["time"]
    print(f"`python -m benchmarks.muon --steps {args.steps} --rounds {args.rounds}` (fp32, gloo, world {WORLD}, "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs)\n")  # fmt: skip
    print("| run | step (s) | / DDP + Muon | wire MB/step by axis | Muon extra MB (measured / formula) |")
    print("| --- | --- | --- | --- | --- |")
    for name, row in results.items():
        layout, opt = name.split(" + ")
        wire = ", ".join(f"{axis} {b / 1e6:.3f}" for axis, b in sorted(row["wire"].items()))
        measured = ""
        if opt == "Muon":
            over = sum(row["wire"].values()) - sum(results[f"{layout} + AdamW"]["wire"].values())
            measured = f"{over / 1e6:.4f} / {extra[layout] / 1e6:.4f}"
        print(f"| {name} | {row['time']:.3f} | {row['time'] / base:.2f} | {wire} | {measured} |")
    if args.deepspeed:
        ds = deepspeed_time(args.deepspeed, args.steps, args.warmup, args.rounds)
        ratio = f"{float(ds) / base:.2f}" if ds[0].isdigit() else ""
        print(f"| DeepSpeed ZeRO-1 MuonWithAuxAdam (peer) | {ds} | {ratio} | (not counted) | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
