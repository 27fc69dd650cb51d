"""The DeepSpeed-MoE contender of ``benchmarks/moe.py``, run by torchrun of DeepSpeed's own virtualenv:

    PLAIT_ROOT=. torchrun --nproc_per_node 2 benchmarks/moe_deepspeed.py EP MODE STEPS WARMUP

The same model as plait's side (``benchmarks.moe.CONFIG``, the same initial weights: each MoE layer's router and
experts copied from plait's), each block's feed-forward a ``deepspeed.moe.layer.MoE`` with the same routing: top-2
by the softmax scores without DeepSpeed's sampling of the second expert (``top2_2nd_expert_sampling=False``) or
random token priority (``use_rts=False``), capacity ``ceil(factor x T x 2 / E)`` per micro-batch of one sequence
(plait's per-sequence capacity) or dropless (``drop_tokens=False``: DeepSpeed pads every expert to the most loaded
one), no balance loss added. The ranks train DDP-style (ZeRO stage 0, torch's AdamW: no DeepSpeed op is compiled),
the experts split over ``EP`` ranks. Every ``deepspeed.comm`` collective is counted in ring wire bytes as plait's
``CommStats`` counts its own (all-reduce 2 (N-1)/N S, all-to-all (N-1)/N S). Prints one JSON line
(``DEEPSPEED_RESULT {...}``) on rank 0.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn


class Expert(nn.Module):
    """One GELU expert as DeepSpeed deep-copies it: up, GELU, down, no biases (plait's ``GroupedExperts`` slice)."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


def _count_collectives(wire: dict[str, float]) -> None:
    """Wrap deepspeed.comm's all-to-all and all-reduce so that each call adds its ring wire bytes to ``wire``."""
    import deepspeed.comm as dist

    def size(group: Any) -> int:
        return dist.get_world_size(group=group)

    original_a2a, original_ar = dist.all_to_all_single, dist.all_reduce

    def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        n = size(kwargs.get("group"))
        wire["all_to_all"] = wire.get("all_to_all", 0.0) + tensor.numel() * tensor.element_size() * (n - 1) / n
        return original_a2a(output, tensor, *args, **kwargs)

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group", args[1] if len(args) > 1 else None)
        n = size(group)
        wire["all_reduce"] = wire.get("all_reduce", 0.0) + 2 * (n - 1) / n * tensor.numel() * tensor.element_size()
        return original_ar(tensor, *args, **kwargs)

    dist.all_to_all_single, dist.all_reduce = all_to_all_single, all_reduce


def main() -> None:
    sys.path.insert(0, os.environ["PLAIT_ROOT"])
    import deepspeed
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    from benchmarks.moe import MICRO_BATCHES, ROWS, batch, config_for
    from plait.models import GPT, lm_loss
    from plait.observe.memory import SavedActivations, storage_bytes

    ep, mode, steps, warmup = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    config = config_for(mode)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

    class Layer(nn.Module):
        """plait's MoE layer's weights in a DeepSpeed MoE (module docstring)."""

        def __init__(self, plait_moe: Any) -> None:
            super().__init__()
            dropless = config.capacity_factor is None
            factor = 1.0 if dropless else config.capacity_factor
            self.moe = DeepSpeedMoE(
                config.d_model, Expert(config.d_model, config.expert_ffn_dim), num_experts=config.n_experts,
                ep_size=ep, k=config.top_k, capacity_factor=factor, eval_capacity_factor=factor, min_capacity=0,
                drop_tokens=not dropless, use_rts=False, top2_2nd_expert_sampling=False,
            )  # fmt: skip
            local = config.n_experts // ep
            first = (rank % ep) * local
            with torch.no_grad():
                self.moe.deepspeed_moe.gate.wg.weight.copy_(plait_moe.router.gate.weight)
                for i, expert in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
                    expert.up.weight.copy_(plait_moe.experts.w_up[first + i].T)
                    expert.down.weight.copy_(plait_moe.experts.w_down[first + i].T)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.moe(x)[0]

    torch.manual_seed(0)
    model = GPT(config)
    for block in model.blocks.values():
        block.mlp = Layer(block.mlp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ds_config = {"train_micro_batch_size_per_gpu": ROWS // MICRO_BATCHES, "gradient_accumulation_steps": MICRO_BATCHES}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config={**ds_config, "zero_optimization": {}})
    wire: dict[str, float] = {}
    _count_collectives(wire)
    times, losses = [], []
    per = ROWS // MICRO_BATCHES
    for step in range(warmup + steps):
        inputs, targets = batch(step)
        mine = slice(rank * ROWS, (rank + 1) * ROWS)
        torch.distributed.barrier()
        wire.clear()
        start = time.perf_counter()
        total = 0.0
        for micro in range(MICRO_BATCHES):
            rows = slice(mine.start + micro * per, mine.start + (micro + 1) * per)
            loss = lm_loss(engine(inputs[rows]), targets[rows])
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
        elapsed = time.perf_counter() - start
        mean = torch.tensor(total / MICRO_BATCHES)
        torch.distributed.all_reduce(mean)
        losses.append(float(mean) / world)
        if step >= warmup:
            times.append(elapsed)
    step_wire = dict(wire)
    states = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim()]
    params = list(model.parameters())
    held = storage_bytes(params) + storage_bytes([p.grad for p in params if p.grad is not None]) + storage_bytes(states)
    inputs, _ = batch(0)
    with SavedActivations(exclude=params) as saved:
        engine(inputs[rank * ROWS : rank * ROWS + per])
    result = {"times": times, "median": statistics.median(times), "wire": step_wire, "model_state_bytes": held,
              "saved_bytes": saved.bytes, "losses": losses}  # fmt: skip
    if rank == 0:
        print("DEEPSPEED_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
