"""``python -m benchmarks.pipeline_profile [--world 4] [--steps 5] [--top 0] [--schedules gpipe,1f1b]``: the host
work of a pipeline step, plait's runtime against ``torch.distributed.pipelining``, counted with cProfile on every
rank.

Both contenders are the ``pp`` suite's (``benchmarks.model_parallel``: the same GPT, stages, micro-batches and
optimizer); for the V-shaped schedules (``--schedules zb-v,dualpipev``) the ``ppv`` suite's 8-block GPT. Python function calls per step are a count, not a time: unlike the step time they do not move with the
machine's load, so they compare the runtimes' per-action host work even on a busy machine. ``--top N`` also prints
rank 1's N most called functions for plait (where the calls go).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
from pathlib import Path

import torch

from plait.launch import run_local

SCHEDULES = "gpipe,1f1b"


def profile_rank(contender: str, steps: int, folder: str, top: int) -> dict:
    """This rank's calls and seconds per step for ``contender`` ("plait:1f1b", "torch:gpipe", ...)."""
    import time

    from benchmarks.contenders import SUITES
    from benchmarks.model_parallel import V_SCHEDULES, build_plait_pp, build_torch_pp
    from benchmarks.workload import write_text
    from plait.data import ByteTextDataset, ShardedBatches

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    text = write_text(Path(folder) / f"text-{rank}.txt")
    kind, schedule = contender.split(":")
    workload = SUITES["ppv" if schedule in V_SCHEDULES else "pp"].workload.with_text(text)
    build = build_plait_pp if kind == "plait" else build_torch_pp
    trainer = build(schedule)(workload.build_model(), workload, rank, world)
    loader = ShardedBatches(ByteTextDataset(str(text), seq_len=workload.model.seq_len), workload.global_batch)
    for step in range(3):  # warm-up: shapes, optimizer state
        trainer.step(loader.batch_at(step))
    profile = cProfile.Profile()
    started = time.perf_counter()
    profile.enable()
    for step in range(3, 3 + steps):
        trainer.step(loader.batch_at(step))
    profile.disable()
    stats = pstats.Stats(profile)
    listing = io.StringIO()
    if top and rank == 1 and kind == "plait":
        pstats.Stats(profile, stream=listing).sort_stats("ncalls").print_stats(top)
    return {
        "calls": stats.total_calls / steps,  # type: ignore[attr-defined]  # set by pstats from the profile
        "seconds": (time.perf_counter() - started) / steps,
        "listing": listing.getvalue(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=0)
    parser.add_argument("--schedules", default=SCHEDULES, help="comma-separated (gpipe, 1f1b, zb-v, dualpipev)")
    args = parser.parse_args()
    contenders = [f"{side}:{name}" for name in args.schedules.split(",") for side in ("plait", "torch")]
    with tempfile.TemporaryDirectory() as folder:
        for contender in contenders:
            ranks = run_local(profile_rank, args.world, contender, args.steps, folder, args.top, timeout=900)
            calls = " ".join(f"{r['calls']:,.0f}" for r in ranks)
            print(f"{contender:12s} calls/step per rank: {calls}   step {1e3 * ranks[0]['seconds']:.0f} ms")
            for r in ranks:
                if r["listing"]:
                    print(r["listing"])


if __name__ == "__main__":
    main()
