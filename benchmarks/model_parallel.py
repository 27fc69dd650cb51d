"""Contenders for the model-parallel suites: pipeline (``pp``), tensor (``tp``) and context (``cp``) parallelism.

Each rank of these layouts trains the whole global batch (dp = 1; ``batch_split="whole"``), except the cp suite's
no-cp baseline, plain data parallelism over the same ranks. The torch peers:

- pipeline: the reference GPT cut by hand into ``world`` stages of n_layer/world blocks (the embeddings go with
  the first, the final norm and the LM head with the last; the same even split as plait's default), each a
  ``torch.distributed.pipelining.PipelineStage``, run by ``ScheduleGPipe`` or ``Schedule1F1B`` with ``lm_loss``
  per micro-batch (torch scales the gradients by 1/m, plait the loss: the same batch-mean gradients). The
  V-shaped schedules (``ppv``: ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``) cut it into 2 x ``world``
  stages, two per rank placed in a V (rank r: stages r and 2p - 1 - r, both ends on rank 0), as plait's.
- tensor: ``parallelize_module`` with ``ColwiseParallel`` for q/k/v/up, ``RowwiseParallel`` for o/down,
  ``RowwiseParallel`` on the token embedding (split by vocabulary rows, as plait's ``VocabParallelEmbedding``)
  and a ``ColwiseParallel`` LM head whose logits stay sharded over the vocabulary for ``loss_parallel()``, the
  same vocab-parallel cross-entropy plait uses (no full logits on any rank).

Clipping in the torch peers is global (``trainer.clip_global_``), as plait's is: the squares of the stages' /
tp slices' gradients are summed over the ranks, the replicated gradients counted once.
"""

from __future__ import annotations

import copy
import statistics
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import plait
from benchmarks.trainer import Batch, Probe, StepOut, Trainer, clip_global_, gather_named, plait_trainer, torch_held
from benchmarks.workload import Workload
from plait.models import lm_loss

TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "zb-v": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
"""plait's ``Layout.schedule`` name -> the class of ``torch.distributed.pipelining`` that runs the same order."""


# ----------------------------------------------------------------------------------------------- pipeline
def build_plait_pp(schedule: str):  # noqa: ANN201 - a Builder
    """plait ``Layout(pp=N, schedule=schedule, microbatches=m)``; parameters gathered from the stages by name."""

    def build(model: nn.Module, workload: Workload, rank: int, world: int) -> Trainer:
        order = [name for name, _ in model.named_parameters()]
        layout = plait.Layout(pp=world, dp=1, schedule=schedule, microbatches=workload.microbatches)
        full = lambda engine: lambda: gather_named(dict(engine.model.named_parameters()), order)  # noqa: E731
        return plait_trainer(model, workload, layout, full)

    return build


def stage_of(model: nn.Module, stage: int, stages: int) -> nn.Module:
    """The reference GPT cut by hand for pipeline stage ``stage`` of ``stages``: an even run of its blocks, the
    embeddings on the first stage, the final norm and LM head on the last (the model returns hidden states where
    its head is missing and takes them where its embedding is)."""
    layers = len(model.blocks)
    if layers % stages:
        raise ValueError(f"{layers} blocks do not split evenly over {stages} stages; use a divisor of {layers}")
    per = layers // stages
    for key in list(model.blocks.keys()):
        if not stage * per <= int(key) < (stage + 1) * per:
            del model.blocks[key]
    if stage != 0:
        model.tok_embed, model.pos_embed = None, None
    if stage != stages - 1:
        model.norm_f, model.lm_head = None, None
    return model


V_SCHEDULES = frozenset({"zb-v", "dualpipev"})
"""Schedules whose 2p stages sit in a V: rank r holds stages r and 2p - 1 - r (both ends on rank 0)."""


def stages_on(rank: int, world: int, schedule: str) -> tuple[int, ...]:
    """The stage indices rank ``rank`` holds: its own (one stage per rank), or r and 2p - 1 - r in a V (torch's
    ``generate_rank_to_stage_mapping(style="v")``, plait's ``Placement.V``)."""
    return (rank, 2 * world - 1 - rank) if schedule in V_SCHEDULES else (rank,)


def build_torch_pp(schedule: str):  # noqa: ANN201 - a Builder
    """``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B`` from ``torch.distributed.pipelining``; for a V
    (``ScheduleZBVZeroBubble`` / ``ScheduleDualPipeV``), two ``PipelineStage``s per rank, stages r and 2p - 1 - r
    of 2p, each its own copy of the model cut by hand (the list the multi-stage schedules take)."""

    def build(model: nn.Module, workload: Workload, rank: int, world: int) -> Trainer:
        from torch.distributed import pipelining

        order = [name for name, _ in model.named_parameters()]
        indices = stages_on(rank, world, schedule)
        num_stages = world * len(indices)
        if len(indices) == 1:
            modules = [stage_of(model, rank, num_stages)]
        else:
            modules = [stage_of(copy.deepcopy(model), s, num_stages) for s in indices]
        stages = [
            pipelining.PipelineStage(module, s, num_stages, torch.device("cpu")) for s, module in zip(indices, modules)
        ]
        runner = getattr(pipelining, TORCH_SCHEDULES[schedule])(
            stages[0] if len(stages) == 1 else stages, n_microbatches=workload.microbatches, loss_fn=lm_loss
        )
        holder = nn.ModuleList(modules)
        params = [p for p in holder.parameters() if p.requires_grad]
        optimizer = workload.optimizer(params)
        probe = Probe()
        first, last = 0 in indices, num_stages - 1 in indices
        loss_rank = 0 if len(indices) == 2 else world - 1  # the rank holding the last stage

        def step(batch: Batch) -> StepOut:
            inputs, targets = batch
            losses: list[torch.Tensor] = []
            args = (inputs,) if first else ()
            if last:
                runner.step(*args, target=targets, losses=losses)
            else:
                runner.step(*args)
            if workload.max_grad_norm:
                clip_global_([p.grad for p in params if p.grad is not None], [], workload.max_grad_norm)
            probe.take(lambda: torch_held(params, optimizer))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss = torch.tensor(statistics.fmean(float(x.detach()) for x in losses) if last else 0.0)
            dist.broadcast(loss, src=loss_rank)  # the batch mean on every rank, as plait reports it
            return loss.item(), None

        def info() -> dict[str, Any]:  # modelled: what rank 0 sends (activations; in a V also gradients), once
            bytes_of = pipeline_v_bytes if len(indices) == 2 else pipeline_bytes
            return {"wire_bytes_per_step": bytes_of(workload, world)}

        named = {name: p for module in modules for name, p in module.named_parameters()}
        return Trainer(step, holder, info, probe, lambda: gather_named(named, order))

    return build


def pipeline_bytes(workload: Workload, world: int) -> float:
    """Bytes pipeline rank 0 sends per step: the fp32 activation [G/m, T, d] of each of m micro-batches, once
    (it receives the gradients; it has none to send): G x T x d x 4."""
    return float(workload.global_batch * workload.model.seq_len * workload.model.d_model * 4)


def pipeline_v_bytes(workload: Workload, world: int) -> float:
    """Bytes rank 0 of a V sends per step: stage 0's activations forward and, since it holds the last stage too,
    the gradient of stage 2p - 1's input back to stage 2p - 2, once per micro-batch each: 2 G x T x d x 4."""
    return 2.0 * pipeline_bytes(workload, world)


# ----------------------------------------------------------------------------------------------- tensor
def build_plait_tp(model: nn.Module, workload: Workload, rank: int, world: int) -> Trainer:
    """plait ``Layout(tp=N)``: its built-in GPT plan, vocab-parallel embedding and cross-entropy."""
    from plait.parallel.tensor.layers import gather_parameters

    order = [name for name, _ in model.named_parameters()]

    def full(engine: Any):  # noqa: ANN202
        return lambda: [gather_parameters(engine.model, engine.comm)[name] for name in order]

    return plait_trainer(model, workload, plait.Layout(tp=world, dp=1), full)


def torch_tp_plan(model: nn.Module) -> dict[str, Any]:
    """The Megatron plan in ``torch.distributed.tensor.parallel`` styles, layer for layer plait's ``gpt_plan``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {
        "tok_embed": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),  # for loss_parallel
    }
    for key, block in model.blocks.items():
        columns = ["attn.q", "attn.k", "attn.v", "mlp.up"] + (["mlp.gate"] if hasattr(block.mlp, "gate") else [])
        plan.update({f"blocks.{key}.{name}": ColwiseParallel() for name in columns})
        plan.update({f"blocks.{key}.{name}": RowwiseParallel() for name in ("attn.o", "mlp.down")})
    return plan


def build_torch_tp(model: nn.Module, workload: Workload, rank: int, world: int) -> Trainer:
    """``parallelize_module(model, mesh, plan)`` + ``loss_parallel()`` over a 1-D CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(model, mesh, torch_tp_plan(model))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = workload.optimizer(params)
    probe = Probe()

    def is_split(tensor: torch.Tensor) -> bool:
        return any(isinstance(place, Shard) for place in getattr(tensor, "placements", ()))

    def step(batch: Batch) -> StepOut:
        inputs, targets = batch
        logits = model(inputs)
        with loss_parallel():
            loss = lm_loss(logits, targets)
            loss.backward()
        if workload.max_grad_norm:
            grads = [p.grad for p in params if p.grad is not None]
            clip_global_(
                [g for g in grads if is_split(g)],
                [g for g in grads if not is_split(g)],
                workload.max_grad_norm,
                group=mesh.get_group(),
            )
        probe.take(lambda: torch_held(params, optimizer))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        return float(value.detach()), None

    def full_params() -> list[torch.Tensor]:
        return [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]

    return Trainer(step, model, probe=probe, full_params=full_params)


def tensor_bytes(workload: Workload, world: int) -> float:
    """Megatron 1D TP, ring all-reduces of S = G T d x 4 bytes: 2 per layer forward (g) and 2 backward (f), the
    embedding's forward and the head's backward, and the vocab-parallel loss's [3, G T] fp32:
    2(t-1)/t x ((4 L + 2) S + 12 G T)."""
    m = workload.model
    tokens = workload.global_batch * m.seq_len
    return 2.0 * (world - 1) / world * ((4 * m.n_layer + 2) * tokens * m.d_model * 4 + 12 * tokens)


# ----------------------------------------------------------------------------------------------- context
def build_plait_cp(mode: str):  # noqa: ANN201 - a Builder
    """plait ``Layout(cp=N, cp_mode=mode)``: the whole batch on every rank, each keeping T/N of every sequence."""

    def build(model: nn.Module, workload: Workload, rank: int, world: int) -> Trainer:
        return plait_trainer(model, workload, plait.Layout(cp=world, dp=1, cp_mode=mode))

    return build


def _gradient_all_reduce(workload: Workload, world: int) -> float:
    return 2.0 * (world - 1) / world * workload.num_parameters() * 4


def ring_cp_bytes(workload: Workload, world: int) -> float:
    """Gradients all-reduced over dp_cp, plus per layer the K and V blocks (B x T/cp x d each, fp32) sent cp-1
    times in forward, again in backward with their fp32 gradient accumulators: 6 (cp-1) blocks."""
    m = workload.model
    block = workload.global_batch * m.seq_len // world * m.kv_heads * m.head_dim * 4
    return _gradient_all_reduce(workload, world) + m.n_layer * 6 * (world - 1) * block


def ulysses_cp_bytes(workload: Workload, world: int) -> float:
    """Gradients all-reduced over dp_cp, plus per layer 4 all-to-alls forward (q, k, v, out) and 4 backward,
    each (cp-1)/cp of the local tokens' B x T/cp x (2H + 2KV) x D fp32 per direction."""
    m = workload.model
    local = workload.global_batch * m.seq_len // world * (2 * m.n_head + 2 * m.kv_heads) * m.head_dim * 4
    return _gradient_all_reduce(workload, world) + m.n_layer * 2 * (world - 1) / world * local
