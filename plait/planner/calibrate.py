"""``plait calibrate``: measure this machine in seconds, so the cost model can predict it ("this-machine").

- compute: the best single-thread matmul FLOP/s over a few square sizes (2 n^3 FLOPs per n x n product; ranks
  run one intra-op thread each), and how many such matmuls the machine sustains at once: the ``nproc`` ranks
  multiply for the same half second, and their summed rate / one rank's alone is ``compute_units`` (the
  processors the ranks really get, counting what other programs take);
- memory: copy bandwidth of a 64 MiB tensor (bytes read + written per second);
- overhead: the fixed cost of one transformer block's forward + backward whatever its size (Python, dispatcher,
  autograd): the slope over the layer count of a tiny plait GPT's training-step time (``block_overhead``);
- split backward: zero-bubble's I + W over one B, timed on plait's own pipeline stage (``split_backward``);
- communication: for each collective of ``plait.comm.Comm`` (all_reduce, all_gather, reduce_scatter,
  all_to_all, broadcast, send_recv), the median time over ``repeats`` runs at payload sizes from 4 KiB up to
  ``max_bytes`` (by default 32 MiB: the gradients of the models timed on this machine, so the fit holds where the
  data-parallel reductions are), in ``nproc`` local gloo processes, fitted to the alpha-beta model t = alpha +
  beta x bytes (Hockney 1994) by least squares on relative errors (each size counts alike, so neither the
  latency-bound small sizes nor the large ones dominate). ZeRO's collectives are timed as ZeRO calls them: the
  reduce-scatter of a flat gradient buffer averaged (``op="avg"``) and issued asynchronously, then waited for, and
  the all-gather of the parameter shards. The fits hold for groups of ``nproc`` ranks (``Hardware.measured_ranks``;
  other sizes are scaled by the ring formulas in ``costs.collective_time``), so calibrate with the rank count you
  will run.

The result is written as JSON (``hardware.calibration_path()``): ``get_hardware("this-machine")`` reads it. With
the fits, predicted step times of layouts run on this machine can be compared with measured ones.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from plait.errors import ConfigError
from plait.files import private_folder
from plait.logging import get_logger
from plait.planner.hardware import COLLECTIVES, THIS_MACHINE, Hardware, calibration_path

logger = get_logger(__name__)
MAX_BYTES = 32 * 2**20
"""The largest collective payload timed by default (the reference GPT of benchmarks/planner_validation.py has
~14 MB of fp32 gradients)."""


def payload_sizes(max_bytes: int = MAX_BYTES, smallest: int = 4 * 2**10) -> list[int]:
    """Payload sizes in bytes, 4 KiB then x4 up to ``max_bytes`` (included)."""
    sizes, size = [], smallest
    while size < max_bytes:
        sizes.append(size)
        size *= 4
    return [*sizes, max_bytes]


def fit_alpha_beta(nbytes: list[float], seconds: list[float]) -> tuple[float, float]:
    """(alpha, beta) of t = alpha + beta x bytes by least squares on relative errors (weights 1 / t), both
    clamped at >= 0."""
    if len(nbytes) < 2:
        raise ValueError("an alpha-beta fit needs at least two sizes")
    t = np.asarray(seconds, dtype=float)
    beta, alpha = np.polyfit(np.asarray(nbytes, dtype=float), t, 1, w=1 / np.maximum(t, 1e-12))
    return max(float(alpha), 0.0), max(float(beta), 1e-15)


def measure_matmul_flops(sizes: tuple[int, ...] = (256, 512, 1024), repeats: int = 3) -> float:
    """The best single-thread FLOP/s of an n x n matmul over ``sizes``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = 0.0
        for n in sizes:
            a, b = torch.randn(n, n), torch.randn(n, n)
            a @ b  # warm-up
            for _ in range(repeats):
                start = time.perf_counter()
                a @ b
                best = max(best, 2 * n**3 / (time.perf_counter() - start))
        return best
    finally:
        torch.set_num_threads(threads)


def measure_block_overhead(layers: tuple[int, ...] = (1, 5), repeats: int = 15) -> float:
    """Seconds one block adds to a forward + backward when its tensors are tiny (width 8, 4 tokens): the
    least-squares slope of the median step time of a plait GPT over ``layers`` blocks, on one thread."""
    from plait.models import GPT, GPTConfig

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        medians = []
        for n in layers:
            model = GPT(GPTConfig(vocab_size=8, seq_len=4, n_layer=n, n_head=1, d_model=8))
            tokens = torch.zeros(1, 4, dtype=torch.long)
            samples = []
            for _ in range(repeats + 1):
                start = time.perf_counter()
                model(tokens).sum().backward()
                samples.append(time.perf_counter() - start)
            medians.append(statistics.median(samples[1:]))
        return max(0.0, float(np.polyfit(np.asarray(layers, dtype=float), np.asarray(medians), 1)[0]))
    finally:
        torch.set_num_threads(threads)


def measure_split_backward(width: int = 256, seq: int = 128, batch: int = 2, repeats: int = 7) -> float:
    """Zero-bubble's I + W over one B on this machine: plait's ``PipelineStage`` running a 2-block chunk of a GPT
    (one thread) as forward + backward and as forward + backward_input + backward_weight. With the forward a third
    of forward + backward (B = 2F in FLOPs), (I + W) / B = (3 r - 1) / 2 for the ratio r of the two medians
    (``Hardware.split_backward``; at least 1)."""
    from plait.models import GPT, GPTConfig
    from plait.parallel.pipeline.stage import PipelineStage

    class Chunk(torch.nn.Module):
        def __init__(self, blocks: list[torch.nn.Module]) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(blocks)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = GPT(GPTConfig(vocab_size=8, seq_len=seq, n_layer=2, n_head=4, d_model=width))
        stage = PipelineStage(Chunk([model.blocks["0"], model.blocks["1"]]), 1, 3)  # a middle stage
        x, grad = torch.randn(batch, seq, width), torch.randn(batch, seq, width)
        whole, split = [], []
        for _ in range(repeats + 1):  # alternating, so that drift touches both alike
            start = time.perf_counter()
            stage.forward(0, x)
            stage.backward(0, grad)
            whole.append(time.perf_counter() - start)
            start = time.perf_counter()
            stage.forward(0, x)
            stage.backward_input(0, grad)
            stage.backward_weight(0)
            split.append(time.perf_counter() - start)
        ratio = statistics.median(split[1:]) / statistics.median(whole[1:])
        return max(1.0, (3 * ratio - 1) / 2)
    finally:
        torch.set_num_threads(threads)


def sustained_matmul_flops(seconds: float = 0.5, n: int = 512) -> float:
    """FLOP/s of back-to-back n x n matmuls for ``seconds`` on this thread (what a busy rank sustains)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    return count * 2 * n**3 / (time.perf_counter() - start)


def measure_memory_bandwidth(mib: int = 64, repeats: int = 3) -> float:
    src = torch.empty(mib * 2**18)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * 4 / min(times)


def _collective_calls(comm: Any, x: torch.Tensor, size: int, rank: int, peer: int | None) -> dict[str, Any]:
    """One call per collective of ``COLLECTIVES`` on ``x`` (``size`` elements per rank), through plait's Comm; the
    reduce-scatter and all-gather as ZeRO makes them (an averaged, asynchronous reduce-scatter of a flat buffer,
    then waited for; an all-gather of the shards)."""
    return {
        "all_reduce": lambda: comm.all_reduce(x, "dp"),
        "all_gather": lambda: comm.all_gather(x[:size], "dp"),
        "reduce_scatter": lambda: comm.reduce_scatter(x, "dp", op="avg", async_op=True).wait(),
        "all_to_all": lambda: comm.all_to_all(x, "dp", 0, 0),
        "broadcast": lambda: comm.broadcast(x, "dp"),
        "send_recv": lambda: comm.send_recv(
            [(x, peer)] if rank == 0 else [], [(x, peer)] if rank == 1 else [], axis="dp"
        ),
    }


def _bench_rank(repeats: int, max_bytes: int) -> tuple[dict[str, list[tuple[float, float]]], float] | None:
    """One calibration rank (under ``plait.launch.run_local``): every collective through plait's Comm, timed on
    rank 0, which returns (timings, the ranks' matmul FLOP/s together); the other ranks return None."""
    import torch.distributed as dist

    from plait.comm import Comm
    from plait.layout import Layout
    from plait.mesh import Mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = Comm(Mesh.build(Layout(dp=world)), timeout_s=60)
    peer = 1 - rank if rank < 2 else None
    timings: dict[str, list[tuple[float, float]]] = {op: [] for op in COLLECTIVES}
    for payload in payload_sizes(max_bytes):
        size = max(1, payload // (4 * world))  # float32 elements per rank; the whole tensor is size x world
        x = torch.ones(size * world)
        calls = _collective_calls(comm, x, size, rank, peer)
        for op, call in calls.items():
            samples = []
            for _ in range(repeats + 1):
                comm.barrier("dp")
                start = time.perf_counter()
                if op != "send_recv" or peer is not None:
                    call()
                samples.append(time.perf_counter() - start)
            payload = x.numel() * 4 if op != "all_gather" else size * world * 4
            timings[op].append((payload, statistics.median(samples[1:])))
    comm.barrier("dp")
    together = comm.all_reduce(torch.tensor([sustained_matmul_flops()], dtype=torch.float64), "dp")
    return (timings, float(together[0])) if rank == 0 else None


def calibrate(
    nproc: int = 2, repeats: int = 7, out: str | Path | None = None, max_bytes: int = MAX_BYTES
) -> dict[str, Any]:
    """Measure this machine (module docstring), write the JSON and return it."""
    if not isinstance(nproc, int) or nproc < 2:
        raise ConfigError(f"--nproc {nproc!r}: calibrating collectives needs at least 2 processes. Fix: --nproc 2.")
    started = time.perf_counter()
    flops, bandwidth = measure_matmul_flops(), measure_memory_bandwidth()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    alone, overhead, split = sustained_matmul_flops(), measure_block_overhead(), measure_split_backward()
    torch.set_num_threads(threads)
    from plait.launch import run_local

    measured = run_local(_bench_rank, nproc, repeats, max_bytes, timeout=900, comm_timeout_s=300)[0]
    assert measured is not None  # rank 0 returns its timings
    timings, together = measured
    fits = {op: fit_alpha_beta([b for b, _ in rows], [t for _, t in rows]) for op, rows in timings.items()}
    link = 1 / fits["send_recv"][1]
    hardware = Hardware(
        name=THIS_MACHINE,
        peak_flops={"fp32": flops, "bf16": flops, "fp16": flops},
        memory_bytes=float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / nproc,
        memory_bandwidth=bandwidth,
        intra_node_bandwidth=link,
        inter_node_bandwidth=link,
        devices_per_node=nproc,
        intra_node_latency=fits["send_recv"][0],
        inter_node_latency=fits["send_recv"][0],
        block_overhead=overhead,
        split_backward=split,
        measured=fits,
        measured_ranks=nproc,
        compute_units=min(float(nproc), max(1.0, together / alone)),
        source=f"plait calibrate, {nproc} gloo processes, {time.strftime('%Y-%m-%d %H:%M')}",
    )
    data = {
        "hardware": hardware.to_dict(),
        "timings": {op: rows for op, rows in timings.items()},
        "seconds": time.perf_counter() - started,
    }
    path = Path(out) if out else calibration_path()
    if out or os.environ.get("PLAIT_CALIBRATION"):
        path.parent.mkdir(parents=True, exist_ok=True)  # a place the user chose
    else:
        private_folder(path.parent)  # plait's cache folder ~/.cache/plait: mode 0700
    path.write_text(json.dumps(data, indent=1))
    logger.info(
        "calibrated this machine in %.1f s: %.1f GFLOP/s matmul, %.1f GB/s memory -> %s",
        data["seconds"],
        flops / 1e9,
        bandwidth / 1e9,
        path,
    )
    data["path"] = str(path)
    return data


__all__ = [
    "MAX_BYTES",
    "calibrate",
    "fit_alpha_beta",
    "measure_block_overhead",
    "measure_matmul_flops",
    "measure_memory_bandwidth",
    "measure_split_backward",
    "payload_sizes",
    "sustained_matmul_flops",
]
