"""Peak host memory per rank while a model is built, loaded and trained its first steps, next to theory.

``python -m benchmarks.startup_memory [--worlds 2 4] [--layers 8 16] [--out BENCHMARKS.md]`` builds plait's GPT
(d_model 512, 8 heads, vocabulary 8192, 64 positions; ``--layers`` blocks) in spawned gloo ranks on the CPU, four
ways, in one run:

- ``eager``: ``GPT(config)`` whole on every rank, then ``plait.parallelize(model, Layout(dp=N, zero=3))``;
- ``plait meta``: ``deferred_init(GPT, config)``, then the same ``parallelize`` (each rank replays the init and
  keeps its ZeRO-3 shard: ``plait.parallel.materialize``);
- ``plait meta + load``: the same, its weights read from a ``.safetensors`` file / a plait checkpoint
  (``parallelize(weights=open_weights(PATH))``: each rank reads the rows of its shard);
- ``torch FSDP2 meta``: torchtitan's way: the model built under ``torch.device("meta")``, ``fully_shard`` on each
  block and the root, ``to_empty(device="cpu")``, then ``model.reset_parameters()`` on the DTensor shards;

and two single-process programs: ``plait convert CKPT OUT.safetensors`` (streamed) and ``plait generate``'s
``model_from_checkpoint`` (built on meta, filled tensor by tensor).

A phase's peak is ``VmHWM`` (the process's resident peak, reset by writing 5 to ``/proc/self/clear_refs`` when the
phase begins) minus the resident size when it began: what the phase added at its worst. "build" covers
construction + ``parallelize`` (+ reading the weights); "2 steps" the first two AdamW steps after it (batch 1 x 64
tokens per rank). Theory (fp32, P parameters, N ranks): plait meta = 4P/N + the largest tensor (the replay's or
the read's one scratch tensor); FSDP2 meta = 4P/N (``to_empty`` allocates the shards, the init writes them in
place); eager = 4P (+ one unit's flat copy). Peaks are increments over the resident size when the phase begins,
so memory a previous phase freed but the allocator kept (glibc's heap) can serve a later one unnoticed.

The functions are what ``tests/test_sharded_loading.py`` measures with.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MIB = 1 << 20
MODEL = {"d_model": 512, "n_head": 8, "vocab_size": 8192, "seq_len": 64}
"""The GPT's fixed fields (``--layers`` sets n_layer)."""
HOWS = ("eager", "plait meta", "plait meta + load .safetensors", "plait meta + load checkpoint", "torch FSDP2 meta")


def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident size now (``VmRSS``) or its peak since the last reset (``VmHWM``), in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")  # pragma: no cover - Linux only


def start_phase() -> int:
    """Reset the resident peak to the present size (Linux ``clear_refs`` 5); the size it starts from."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    return rss_bytes()


def phase_peak(start: int) -> int:
    """What the phase begun at ``start`` added to the resident size at its worst, in bytes."""
    return rss_bytes("VmHWM") - start


@dataclass(frozen=True)
class Sizes:
    parameters: int
    largest: int
    """Bytes of the largest tensor (the embedding or the LM head here)."""

    @property
    def model(self) -> int:
        return 4 * self.parameters


def gpt_config(layers: int) -> Any:
    from plait.models import GPTConfig

    return GPTConfig(n_layer=layers, **MODEL)


def sizes(layers: int) -> Sizes:
    from plait.models import GPT

    with torch.device("meta"):
        model = GPT(gpt_config(layers))
    return Sizes(sum(p.numel() for p in model.parameters()), max(4 * p.numel() for p in model.parameters()))


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(
        0, MODEL["vocab_size"], (1, MODEL["seq_len"] + 1), generator=torch.Generator().manual_seed(rank)
    )
    return tokens[:, :-1], tokens[:, 1:]


def _plait_engine(layers: int, how: str, weights: str | None) -> Any:
    import plait
    from plait.models import GPT, lm_loss
    from plait.parallel.materialize import deferred_init
    from plait.train.weights import open_weights

    torch.manual_seed(0)
    if how == "eager":
        model = GPT(gpt_config(layers))
    else:
        model = deferred_init(GPT, gpt_config(layers))
    source = open_weights(weights)[0] if weights else None
    world = torch.distributed.get_world_size()
    layout = plait.Layout(dp=world, zero=3)
    return plait.parallelize(
        model, layout, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4), loss_fn=lm_loss, weights=source
    )


def _fsdp2_step(layers: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from plait.models import GPT, lm_loss

    with torch.device("meta"):
        model = GPT(gpt_config(layers))
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    model.reset_parameters()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        lm_loss(model(batch[0]), batch[1]).backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def _warm_up(how: str) -> None:
    """One step of a one-block model the same way: what any first use costs (imports, gloo's threads and
    buffers, autograd's engine) is paid before the measurement."""
    global MODEL
    saved, MODEL = MODEL, {**MODEL, "d_model": 64, "vocab_size": 64}
    try:
        if how == "torch FSDP2 meta":
            _fsdp2_step(1)(_batch(0))
        else:
            _plait_engine(1, how, None).train_step(_batch(0))
    finally:
        MODEL = saved


def rank_peaks(layers: int, how: str, weights: str | None = None, steps: int = 2) -> dict[str, int]:
    """On each rank of a gloo job: bytes the build (construction + parallelize, or FSDP2's shard + to_empty +
    init) and the first ``steps`` steps added to this rank's resident size at their worst (after a warm-up)."""
    rank = torch.distributed.get_rank()
    _warm_up(how)
    start = start_phase()
    if how == "torch FSDP2 meta":
        step = _fsdp2_step(layers)
    else:
        engine = _plait_engine(layers, how, weights)
        step = engine.train_step
    build = phase_peak(start)
    start = start_phase()
    for _ in range(steps):
        step(_batch(rank))
    return {"build": build, "steps": phase_peak(start) if steps else 0}


def write_weights(layers: int, folder: Path) -> dict[str, str]:
    """The seed-0 GPT's weights as a ``.safetensors`` file and a model-only plait checkpoint under ``folder``."""
    from safetensors.torch import save_file

    from plait.checkpoint import save_model_state
    from plait.models import GPT

    torch.manual_seed(0)
    model = GPT(gpt_config(layers))
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    save_file(state, str(folder / "gpt.safetensors"))
    save_model_state(folder / "ckpt", state, {"step": 0, "model": {"config": model.config.to_dict()}})
    return {"safetensors": str(folder / "gpt.safetensors"), "checkpoint": str(folder / "ckpt")}


def _child(program: str, args: list[str]) -> None:
    """``--child convert CKPT OUT`` / ``--child generate CKPT``: run it, print the peak it added (JSON)."""
    import torch.distributed.checkpoint  # noqa: F401 - what any first use imports, before the measurement

    from plait.checkpoint.convert import convert
    from plait.train.weights import model_from_checkpoint

    start = start_phase()
    if program == "convert":
        convert(args[0], args[1])
    else:
        model_from_checkpoint(Path(args[0]), None, 0, 0)
    print(json.dumps({"peak": phase_peak(start)}))


def child_peak(program: str, *args: str) -> int:
    """The peak ``_child`` measures in a fresh process (its own imports excluded)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent), *sys.path])}
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.startup_memory", "--child", program, *args],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return int(json.loads(out.stdout.strip().splitlines()[-1])["peak"])


def measure(worlds: list[int], layer_counts: list[int]) -> list[dict[str, Any]]:
    from plait.launch import run_local

    rows = []
    for layers in layer_counts:
        size = sizes(layers)
        with tempfile.TemporaryDirectory(prefix="plait-startup-") as tmp:
            files = write_weights(layers, Path(tmp))
            for world in worlds:
                for how in HOWS:
                    weights = files["safetensors"] if ".safetensors" in how else None
                    weights = files["checkpoint"] if "checkpoint" in how else weights
                    peaks = run_local(rank_peaks, world, layers, how, weights, timeout=900)
                    theory = {"eager": size.model, "torch FSDP2 meta": size.model / world}.get(
                        how, size.model / world + size.largest
                    )
                    rows.append(
                        {
                            "params_m": size.parameters / 1e6,
                            "model_mib": size.model / MIB,
                            "world": world,
                            "how": how,
                            "build_mib": max(p["build"] for p in peaks) / MIB,
                            "theory_mib": theory / MIB,
                            "steps_mib": max(p["steps"] for p in peaks) / MIB,
                        }
                    )
            for program, args in (
                ("convert", [files["checkpoint"], f"{tmp}/out.safetensors"]),
                ("generate", [files["checkpoint"]]),
            ):
                rows.append(
                    {
                        "params_m": size.parameters / 1e6,
                        "model_mib": size.model / MIB,
                        "world": 1,
                        "how": f"plait {program} (one process)",
                        "build_mib": child_peak(program, *args) / MIB,
                        "theory_mib": (size.largest if program == "convert" else size.model + size.largest) / MIB,
                        "steps_mib": 0.0,
                    }
                )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| parameters | model (MiB) | ranks | how | build + load peak / rank (MiB) | theory (MiB) | 2 steps peak (MiB) |",
        "|---:|---:|---:|---|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['params_m']:.1f} M | {row['model_mib']:.0f} | {row['world']} | {row['how']} | "
            f"{row['build_mib']:.0f} | {row['theory_mib']:.0f} | {row['steps_mib']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child[0], args.child[1:])
        return 0
    print(table(measure(args.worlds, args.layers)))
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["child_peak", "phase_peak", "rank_peaks", "rss_bytes", "sizes", "start_phase", "write_weights"]
