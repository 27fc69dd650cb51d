"""plait's Mixture-of-Experts against DeepSpeed-MoE, and expert parallelism against none, at equal world size.

``python -m benchmarks.moe [--steps 5] [--warmup 2] [--rounds 3] [--deepspeed /work/ds-venv/bin/python]
[--out BENCHMARKS.md]`` (``--curves DENSE_RUN MOE_RUN --png F``: the held-out curves of two ``plait train`` runs
instead, docs/expert_parallel.md) trains one model, a 4-block GPT (d 128, 4 heads, sequence 128) whose every feed-forward is
8 GELU experts of width 256 with top-2 routing, on 2 gloo ranks in fp32 (one intra-op thread each), DDP-style
(no ZeRO), AdamW, a global batch of 8 sequences in 4 micro-batches of one sequence per rank:

- plait with ``Layout(dp=2, ep=2)`` (each rank holds 4 experts; tokens travel by uneven all-to-all) and
  ``Layout(dp=2)`` (every rank holds all 8);
- DeepSpeed-MoE (``deepspeed.moe.layer.MoE``, ``benchmarks/moe_deepspeed.py``, torchrun of DeepSpeed's own
  virtualenv) with ``ep_size=2`` and ``ep_size=1``, the same initial weights and the same routing: top-2 by score,
  capacity ceil(1.25 x 128 x 2 / 8) = 40 rows per expert and micro-batch (one sequence: plait's per-sequence
  capacity and DeepSpeed's per-micro-batch one coincide), first choices before second choices, no random token
  priority nor sampled second expert, no balance loss; and the same run dropless (plait's default; DeepSpeed's
  ``drop_tokens=False``).

Rounds alternate the contenders (plait's two layouts in one launch, then DeepSpeed's two) so that machine noise
hits all alike. Reported per contender: the median step time and tokens/s, the wire bytes per step and rank by
collective (plait: ``StepStats.comm``; DeepSpeed: its ``deepspeed.comm`` calls counted the same way), model-state
bytes per rank (parameters and AdamW states), the activations one micro-batch's forward keeps, and the step-0 loss
(the same model and routing give the same loss; with drops DeepSpeed renormalises the weight left to a token whose
other choice was dropped, plait keeps the router's, so the losses differ slightly there). Next to the ratios: the
theory. All-to-all bytes: plait sends the rows it routes, 4 x n k (P - 1) / P rows of d per MoE layer and
micro-batch under uniform routing (n tokens, k = 2, P = ep); DeepSpeed sends capacity-padded [E, C, d] buffers,
4 x E C (P - 1) / P rows, so DeepSpeed / plait = E C / (n k) = 1.25 at capacity 40 (dropless: E x the most loaded
expert's rows). Gradient all-reduce: every parameter's at ep = 1, 2 (N - 1) / N psi; at ep = 2 = N the experts'
edp group is one rank, so only the dense parameters' are reduced.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import plait
from plait import Layout
from plait.launch import run_local
from plait.models import GPT, GPTConfig, lm_loss

CONFIG = GPTConfig(
    vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=128, bias=False, n_experts=8, top_k=2, moe_d_ff=256,
    moe_balance="none", capacity_factor=1.25,
)  # fmt: skip
WORLD, ROWS, MICRO_BATCHES = 2, 4, 4
"""2 ranks, 4 sequences per rank and step, in 4 micro-batches of one sequence."""
MODES = ("capacity 1.25", "dropless")


def config_for(mode: str) -> GPTConfig:
    """The benchmark model under ``mode`` (``MODES``)."""
    if mode == "dropless":
        return GPTConfig(**{**CONFIG.to_dict(), "capacity_factor": None})
    return CONFIG


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: WORLD x ROWS random sequences (inputs, next-token targets)."""
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, CONFIG.vocab_size, (WORLD * ROWS, CONFIG.seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _plait_rank(mode: str, steps: int, warmup: int) -> dict[str, dict[str, Any]]:
    """On each rank: plait at ep = 2 and ep = 1, ``warmup`` + ``steps`` steps each (module docstring)."""
    from plait.observe.memory import SavedActivations, measure_held

    out = {}
    for ep in (2, 1):
        torch.manual_seed(0)
        engine = plait.parallelize(
            GPT(config_for(mode)),
            Layout(dp=WORLD, ep=ep, microbatches=MICRO_BATCHES),
            optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
            loss_fn=lm_loss,
        )
        rank = engine.mesh.index("dp")
        times, losses, wire = [], [], {}
        for step in range(warmup + steps):
            inputs, targets = batch(step)
            mine = slice(rank * ROWS, (rank + 1) * ROWS)
            engine.comm.barrier()
            start = time.perf_counter()
            stats = engine.train_step((inputs[mine], targets[mine]))
            losses.append(float(stats.loss))
            if step >= warmup:
                times.append(time.perf_counter() - start)
            wire = {f"{axis} {op}": entry.wire_bytes for (axis, op), entry in stats.comm.counts.items()}
        held = measure_held(engine)
        params = list(engine.model.parameters())
        inputs, _ = batch(0)
        with SavedActivations(exclude=params) as saved:
            engine.model(inputs[rank * ROWS : rank * ROWS + 1])
        out[f"plait ep={ep}"] = {
            "median": statistics.median(times),
            "wire": wire,
            "model_state_bytes": held["parameters"] + held["optimizer_states"] + held["master_weights"],
            "saved_bytes": saved.bytes,
            "losses": losses,
        }
    return out


def deepspeed_run(python: str, ep: int, mode: str, steps: int, warmup: int, port: int) -> dict[str, Any]:
    """DeepSpeed-MoE's result (``moe_deepspeed.py``), or {"error": its last error line} when it did not run."""
    root = Path(__file__).resolve().parents[1]
    torchrun = str(Path(python).with_name("torchrun"))
    env = {**os.environ, "PLAIT_ROOT": str(root), "OMP_NUM_THREADS": "1"}
    argv = [torchrun, "--nproc_per_node", str(WORLD), "--master_port", str(port)]
    argv += [str(root / "benchmarks" / "moe_deepspeed.py"), str(ep), mode, str(steps), str(warmup)]
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as error:
        return {"error": f"{type(error).__name__}: {error}"}
    for line in done.stdout.splitlines():
        if line.startswith("DEEPSPEED_RESULT "):
            result: dict[str, Any] = json.loads(line.split(" ", 1)[1])
            return result
    errors = [line for line in done.stderr.splitlines() if "Error" in line]
    return {"error": errors[-1] if errors else done.stderr[-300:]}


def theory() -> dict[str, float]:
    """Wire bytes per step and rank of the token exchange under uniform routing, and of the gradient all-reduce
    (module docstring): "plait a2a", "deepspeed a2a" (capacity 40), "allreduce ep=1", "allreduce ep=2"."""
    model = GPT(CONFIG)
    layers, n, k, d, e = len(CONFIG.moe_layers), CONFIG.seq_len, CONFIG.top_k, CONFIG.d_model, 4
    rows = 4 * n * k * (WORLD - 1) / WORLD * layers * MICRO_BATCHES
    capacity = -(-int(1.25 * n * k) // CONFIG.n_experts)
    padded = 4 * CONFIG.n_experts * capacity * (WORLD - 1) / WORLD * layers * MICRO_BATCHES
    routed = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    total = sum(p.numel() for p in model.parameters())
    reduce = 2 * (WORLD - 1) / WORLD * e
    return {
        "plait a2a": rows * d * e,
        "deepspeed a2a": padded * d * e,
        "allreduce ep=1": reduce * total,
        "allreduce ep=2": reduce * (total - routed),
    }


def _state_ratio() -> float:
    """Model states (parameters and AdamW states) per rank at ep = 2 over ep = 1: the routed experts halved."""
    model = GPT(CONFIG)
    routed = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    total = sum(p.numel() for p in model.parameters())
    return (total - routed / WORLD) / total


def _a2a(row: dict[str, Any]) -> float:
    return sum(b for key, b in row["wire"].items() if "all_to_all" in key)


def _reduce(row: dict[str, Any]) -> float:
    return sum(b for key, b in row["wire"].items() if "all_reduce" in key and key.split()[0] != "ep")


def markdown(results: dict[str, dict[str, dict[str, Any]]], args: argparse.Namespace) -> str:
    """The BENCHMARKS.md block: one table per mode, then the ratios next to theory."""
    tokens = WORLD * ROWS * CONFIG.seq_len
    lines = [
        f"`python -m benchmarks.moe --steps {args.steps} --warmup {args.warmup} --rounds {args.rounds}"
        + (f" --deepspeed {args.deepspeed}`" if args.deepspeed else "`")
        + f" (fp32, gloo, {WORLD} ranks, torch {torch.__version__}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f} at the end)",
        "",
    ]
    law = theory()
    for mode, rows in results.items():
        lines += [
            f"**{mode}**",
            "",
            "| contender | step (s) | tokens/s | a2a MB/step | grad all-reduce MB/step | model states MB | "
            "activations of a micro-batch MB | step-0 loss |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for name, row in rows.items():
            if "error" in row:
                lines.append(f"| {name} | did not run: {row['error']} | | | | | | |")
                continue
            lines.append(
                f"| {name} | {row['median']:.3f} | {tokens / row['median']:,.0f} | {_a2a(row) / 1e6:.3f} | "
                f"{_reduce(row) / 1e6:.3f} | {row['model_state_bytes'] / 1e6:.2f} | {row['saved_bytes'] / 1e6:.2f} | "
                f"{row['losses'][0]:.6f} |"
            )
        lines += ["", *_ratios(rows, law, mode), ""]
    return "\n".join(lines)


def _ratios(rows: dict[str, dict[str, Any]], law: dict[str, float], mode: str) -> list[str]:
    """The measured ratios next to theory (module docstring)."""
    ok = {name: row for name, row in rows.items() if "error" not in row}
    out = []
    plait2, plait1 = ok.get("plait ep=2"), ok.get("plait ep=1")
    ds2, ds1 = ok.get("DeepSpeed ep=2"), ok.get("DeepSpeed ep=1")
    if plait2:
        out.append(
            f"- plait ep=2 all-to-all bytes / uniform-routing theory: {_a2a(plait2) / law['plait a2a']:.3f} (theory "
            f"{law['plait a2a'] / 1e6:.3f} MB; the routers' actual choices move it)"
        )
    if ds2 and mode != "dropless":
        out.append(
            f"- DeepSpeed ep=2 all-to-all bytes / its capacity-padded theory: {_a2a(ds2) / law['deepspeed a2a']:.3f} "
            f"(theory {law['deepspeed a2a'] / 1e6:.3f} MB, whatever the routing)"
        )
    if ds2 and plait2:
        padded = f"{law['deepspeed a2a'] / law['plait a2a']:.2f}" if mode != "dropless" else "E x max rows / (n k)"
        out.append(f"- DeepSpeed / plait all-to-all bytes at ep=2: {_a2a(ds2) / _a2a(plait2):.2f} (theory {padded})")
        out.append(f"- DeepSpeed / plait step time at ep=2: {ds2['median'] / plait2['median']:.2f}")
    if plait1 and plait2:
        theory_reduce = law["allreduce ep=2"] / law["allreduce ep=1"]
        theory_total = (law["allreduce ep=2"] + law["plait a2a"]) / law["allreduce ep=1"]
        total = (_reduce(plait2) + _a2a(plait2)) / max(_reduce(plait1) + _a2a(plait1), 1.0)
        out.append(
            f"- ep=2 / ep=1 at world 2, plait: step time {plait2['median'] / plait1['median']:.2f}, gradient "
            f"all-reduce bytes {_reduce(plait2) / max(_reduce(plait1), 1.0):.3f} (theory {theory_reduce:.3f}), all "
            f"bytes {total:.3f} (theory {theory_total:.3f}), model states "
            f"{plait2['model_state_bytes'] / plait1['model_state_bytes']:.3f} (theory {_state_ratio():.3f})"
        )
    if ds1 and ds2:
        out.append(
            f"- ep=2 / ep=1 at world 2, DeepSpeed: step time {ds2['median'] / ds1['median']:.2f}, gradient all-reduce "
            f"bytes {_reduce(ds2) / max(_reduce(ds1), 1.0):.3f}, model states "
            f"{ds2['model_state_bytes'] / ds1['model_state_bytes']:.3f}"
        )
    return out


def run(args: argparse.Namespace) -> dict[str, dict[str, dict[str, Any]]]:
    """Every mode's contenders over ``args.rounds`` alternating rounds (module docstring)."""
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for mode in MODES:
        collected: dict[str, list[dict[str, Any]]] = {}
        for round_ in range(args.rounds):
            for name, row in run_local(_plait_rank, WORLD, mode, args.steps, args.warmup, timeout=1800)[0].items():
                collected.setdefault(name, []).append(row)
            if args.deepspeed:
                for ep in (2, 1):
                    row = deepspeed_run(args.deepspeed, ep, mode, args.steps, args.warmup, 29671 + round_)
                    collected.setdefault(f"DeepSpeed ep={ep}", []).append(row)
        results[mode] = {name: _merge(rows) for name, rows in collected.items()}
    return results


def _merge(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One contender's rounds: the median of the rounds' medians, the rest from the first round."""
    good = [row for row in rows if "error" not in row]
    if not good:
        return rows[0]
    return {**good[0], "median": statistics.median(row["median"] for row in good)}


def curves(dense: Path, moe: Path, png: Path | None = None) -> str:
    """The held-out curves of two ``plait train`` runs (``--preset stdlib-lm`` and ``--preset stdlib-moe``) side by
    side: a Markdown table of held-out loss, perplexity and accuracy at each evaluation, the mean training loss of
    the last 50 steps and tokens/s, and (``png``) the picture of docs/expert_parallel.md."""
    from plait.train.metrics import read_metrics

    runs = {
        "dense (stdlib-lm)": read_metrics(dense / "metrics.jsonl"),
        "MoE (stdlib-moe)": read_metrics(moe / "metrics.jsonl"),
    }
    evals = {name: [r for r in records if r["kind"] == "eval"] for name, records in runs.items()}
    trains = {name: [r for r in records if r["kind"] == "train"] for name, records in runs.items()}
    steps = [r["step"] for r in next(iter(evals.values()))]
    lines = ["| run | " + " | ".join(f"step {s}" for s in steps) + " | train loss, last 50 | tokens/s |"]
    lines.append("| --- | " + " | ".join("---" for _ in steps) + " | --- | --- |")
    for name in runs:
        by_step = {r["step"]: r for r in evals[name]}
        cells = [
            f"{by_step[s]['loss']:.3f} ({math.exp(by_step[s]['loss']):.0f}, {100 * by_step[s]['accuracy']:.1f}%)"
            if s in by_step else "" for s in steps
        ]  # fmt: skip
        tail = [r["loss"] for r in trains[name][-50:]]
        rate = statistics.median(r["tokens_per_s"] for r in trains[name])
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {statistics.fmean(tail):.3f} | {rate:,.0f} |")
    if png is not None:
        _plot(trains, evals, png)
    return "\n".join(lines)


def _plot(trains: dict[str, list[dict[str, Any]]], evals: dict[str, list[dict[str, Any]]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for (name, train), color in zip(trains.items(), ("tab:blue", "tab:red")):
        losses = [r["loss"] for r in train]
        smooth = [statistics.fmean(losses[max(0, i - 19) : i + 1]) for i in range(len(losses))]
        ax.plot([r["step"] for r in train], smooth, color=color, lw=1, alpha=0.6, label=f"{name}: train (20-step mean)")
        ax.plot([r["step"] for r in evals[name]], [r["loss"] for r in evals[name]], "o-", color=color,
                label=f"{name}: held-out")  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_ylim(3.5, 8.5)
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title("stdlib corpus: MoE (8 experts, top-2) vs dense, same active parameters")
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--curves", nargs=2, metavar=("DENSE_RUN", "MOE_RUN"), help="compare two plait train run folders instead"
    )
    parser.add_argument("--png", help="with --curves: draw the picture here")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--deepspeed", help="python of a virtualenv with deepspeed (e.g. /work/ds-venv/bin/python)")
    parser.add_argument("--out", help="write the table into this file's <!-- bench:moe --> block (BENCHMARKS.md)")
    args = parser.parse_args(argv)
    if args.curves:
        print(curves(Path(args.curves[0]), Path(args.curves[1]), Path(args.png) if args.png else None))
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    text = markdown(run(args), args)
    print(text)
    if args.out:
        from benchmarks.report import replace_block

        replace_block(Path(args.out), "moe", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
