"""``python -m benchmarks.pipeline_partition [--p 4] [--layers 8] [--vocab 4096] [--memory-limit-mib M]``: automatic
pipeline partitioning of the reference GPT, predicted vs measured per-stage times, next to the even split.

The GPT's blocks cost the same, but the embedding and above all the LM head (d_model x vocab) weigh on the first
and last stage; ``auto_partition`` profiles [embedding, block 0..L-1, head] on one micro-batch and cuts where
the slowest stage is fastest. Both splits are then measured stage by stage (forward + backward of each stage as
one piece, median of ``--repeats``), so the table shows what the predicted bottleneck is worth.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from plait.models import GPT, GPTConfig
from plait.planner.partition import auto_partition
from plait.planner.profile import gpt_layers, measure_splits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--p", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="micro-batch size")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--memory-limit-mib", type=float, help="per-stage memory limit (states + activations)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    config = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_head=4, d_model=args.d_model)
    model = GPT(config).to(device)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    chain = gpt_layers(model)
    limit = args.memory_limit_mib * 2**20 if args.memory_limit_mib else None
    result = auto_partition(chain, tokens, args.p, limit, repeats=args.repeats, measure=False)
    size, extra = divmod(args.layers, args.p)
    even = [0]
    for k in range(args.p):
        even.append(even[-1] + size + (1 if k < extra else 0))
    auto_measured, even_measured = measure_splits(
        chain, tokens, [chain.layer_bounds(result.bounds), chain.layer_bounds(even)], repeats=args.repeats
    )
    result = replace(result, measured_times=tuple(auto_measured))
    print(
        f"GPT {args.layers} layers, d_model {args.d_model}, vocab {args.vocab}, micro-batch {args.batch}x{args.seq} "
        f"on {device}; auto partition:"
    )
    print(result.summary())
    print(
        f"even split cuts={even[1:-1]}: measured per stage (ms) {[round(t * 1e3, 2) for t in even_measured]}, "
        f"slowest {max(even_measured) * 1e3:.2f} ms"
    )
    print(
        f"auto split cuts={result.cuts}: measured slowest {max(auto_measured) * 1e3:.2f} ms "
        f"({max(even_measured) / max(auto_measured):.2f}x the even split's throughput; both measured together)"
    )


if __name__ == "__main__":
    main()
