"""``plait.parallelize(model, layout, ...)``: validate, build the mesh, place the model, return an Engine.

Paradigms are applied in one fixed order (DESIGN.md): pipeline split -> tensor/sequence parallel -> context
parallel -> expert parallel -> activation recomputation -> compilation per block -> (a model on the meta device:
materialise this rank's share, ``plait.parallel.materialize``; under ZeRO-3 inside the strategy) -> ZeRO/FSDP/DDP.
Everything that can be checked without communication is checked first, so a bad layout raises the same
``LayoutError`` on every rank before any collective runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.comm import Comm, CommStats
from plait.distributed import default_device, default_find_unused_parameters, default_offload_dir, default_timeout_s
from plait.engine import Engine
from plait.errors import LayoutError
from plait.layout import Layout, Offload, PipelineSchedule, Recompute, TpMode
from plait.mesh import Mesh
from plait.models.hf import is_hf_model, return_logits
from plait.models.hf_moe import adapt_hf_moe
from plait.models.loss import LossFn, as_mean_loss, bind_head_chunks, check_head_chunks
from plait.parallel.compile import apply_compile, check_precompiled, plan_compile
from plait.parallel.context import apply_context_parallel, plan_context_parallel
from plait.parallel.ddp import DistributedDataParallel, broadcast_parameters
from plait.parallel.expert import RouterStats, apply_expert_parallel, plan_expert_parallel
from plait.parallel.materialize.apply import MetaPlan, fill, is_meta_model, placeholders, plan_materialize
from plait.parallel.materialize.share import WeightSource
from plait.parallel.param_groups import GroupOf
from plait.parallel.pipeline.apply import PipelinePlan, place_pipeline, plan_pipeline
from plait.parallel.pipeline.pipedream import PipeDreamOptions, PipeDreamRunner, check_pipedream
from plait.parallel.pipeline.runtime import PipelineRunner
from plait.parallel.pipeline.schedule import Schedule
from plait.parallel.pipeline.stage import PipelineStage
from plait.parallel.precision import MixedPrecision
from plait.parallel.recompute import apply_recompute
from plait.parallel.runner import PlainRunner, StepRunner
from plait.parallel.semisync import SemiSync, attach
from plait.parallel.strategy import DataParallelStrategy, OptimizerFactory, data_axes
from plait.parallel.tensor import apply_tensor_parallel, plan_tensor_parallel
from plait.parallel.tensor.plan import Plan
from plait.parallel.tensor.sequence import hand_stage_positions
from plait.parallel.whole_tensor import adopt_plain_factory
from plait.parallel.whole_tensor import check_layout as check_whole_tensors
from plait.parallel.zero.fsdp import FullyShardedStrategy
from plait.parallel.zero.sharded import ShardedOptimizerStrategy

AVAILABLE = {
    "offload": (
        lambda layout: layout.offload == Offload.NONE or layout.zero >= 1,
        "offload without ZeRO (offload needs zero=1, 2 or 3)",
    ),
}
"""What this version of plait can run: a layout asking for more raises LayoutError naming the field."""


def check_available(layout: Layout) -> None:
    """Raise LayoutError for a layout field whose paradigm this version does not implement."""
    for name, (ok, what) in AVAILABLE.items():
        if not ok(layout):
            raise LayoutError(
                f"{what} is not implemented in this version of plait (layout has {name}={getattr(layout, name)!r}). "
                f"Fix: use data parallelism (dp) with {name} left at its default."
            )


def make_strategy(
    model: nn.Module,
    comm: Comm,
    optimizer: OptimizerFactory | torch.optim.Optimizer,
    layout: Layout,
    find_unused_parameters: bool = False,
    offload_dir: str | None = None,
    param_groups: GroupOf | None = None,
    init_shards: Callable[[list[Any]], None] | None = None,
    across_replicas: bool = True,
) -> DataParallelStrategy:
    """The data-parallel strategy for ``layout.zero``: 0 -> DDP, 1/2 -> sharded optimizer (+ sharded
    gradients), 3 -> fully sharded parameters (FSDP-style; ``init_shards`` fills a meta-built model's shards);
    ZeRO over the data axis of ``data_axes`` (HSDP: one replica group's ``shard``). Without ``across_replicas``
    (semi-synchronous training) every stage reduces inside one replica group only."""
    axis, replica = data_axes(layout, across_replicas)  # HSDP: one replica group (each shard then averaged over R)
    strategy = _make_strategy(
        model, comm, optimizer, layout, axis, find_unused_parameters, offload_dir, param_groups, init_shards
    )
    strategy.replica_axis = replica
    return strategy


def _make_strategy(
    model: nn.Module,
    comm: Comm,
    optimizer: OptimizerFactory | torch.optim.Optimizer,
    layout: Layout,
    axis: str,
    find_unused_parameters: bool,
    offload_dir: str | None,
    param_groups: GroupOf | None,
    init_shards: Callable[[list[Any]], None] | None,
) -> DataParallelStrategy:
    if layout.zero == 0:
        return DistributedDataParallel(
            model, comm, optimizer, layout, axis,
            find_unused_parameters=find_unused_parameters, param_groups=param_groups,
        )  # fmt: skip
    if layout.zero in (1, 2):
        return ShardedOptimizerStrategy(
            model, comm, optimizer, layout, axis, offload_dir=offload_dir, param_groups=param_groups
        )
    return FullyShardedStrategy(
        model,
        comm,
        optimizer,
        layout,
        axis,
        offload_dir=offload_dir,
        param_groups=param_groups,
        init_shards=init_shards,
    )


def make_runner(
    model: nn.Module,
    layout: Layout,
    comm: Comm,
    strategy: DataParallelStrategy,
    precision: MixedPrecision,
    pipeline: PipelinePlan | None,
    stages: list[PipelineStage],
    context: Any,
    pipedream: PipeDreamOptions | None,
) -> StepRunner:
    """The engine's step runner, built whole: plain without pp; with pp the schedule's runner (PipeDream's for
    schedule="pipedream"), given the strategy's ``no_sync``, ZeRO-3's per-stage parameter scope and the checks
    every pp rank runs on the first stage's input."""
    if pipeline is None:
        return PlainRunner(model, comm, precision, strategy.no_sync)
    checks: list[Callable[[torch.Tensor], None]] = []
    if context is not None:  # every pp rank checks the tokens the first stage shards
        checks.append(getattr(model, "_plait_context_parallel").check_input)  # noqa: B009 - set by apply_context_parallel
    elif layout.sequence_parallel:  # Megatron-SP x pp: later stages' positions
        checks.append(hand_stage_positions([(stage.module, stage.is_first) for stage in stages], layout.tp))
    strategy.attach_pipeline({stage.index: stage.module for stage in stages})  # ZeRO-3: units per stage
    # only ZeRO-3 does something around each action: the others' runners enter no scope at all
    scope = (
        strategy.pipeline_scope if type(strategy).pipeline_scope is not DataParallelStrategy.pipeline_scope else None
    )
    if layout.schedule == PipelineSchedule.PIPEDREAM:
        return PipeDreamRunner(
            stages, pipeline.schedule, comm, precision, pipedream,
            no_sync=strategy.no_sync, param_scope=scope, input_checks=checks,
        )  # fmt: skip
    return PipelineRunner(
        stages, pipeline.schedule, comm, precision,
        no_sync=strategy.no_sync, param_scope=scope, input_checks=checks,
    )  # fmt: skip


def plan_meta(model: nn.Module, layout: Layout, weights: WeightSource | None) -> MetaPlan | None:
    """None for a model on a real device; for one on the meta device, the checked plan of its materialisation
    (``plait.parallel.materialize``). Pure: the same error on every rank, before any collective."""
    if not is_meta_model(model):
        if weights is not None:
            raise LayoutError(
                f"weights={weights.description} reads into a model on the meta device, but this model is on a real "
                f"device. Fix: build it with plait.parallel.materialize.deferred_init(...), or load the weights "
                f"into it yourself (plait.train.weights.load_weights) and leave weights out."
            )
        return None
    if layout.tp > 1 and layout.tp_mode != TpMode.ONE_D:
        raise LayoutError(
            f"a model on the meta device with tp_mode={layout.tp_mode!r}: plait materialises 1D tensor-parallel "
            f"slices only. Fix: use tp_mode='1d', or build the model on a real device."
        )
    return plan_materialize(model, weights)


def materialize(
    meta: MetaPlan, roots: list[nn.Module], layout: Layout, comm: Comm, device: torch.device
) -> Callable[[list[Any]], None] | None:
    """Swap the meta parameters for placeholders and fill this rank's values: now (zero < 3), or the function
    ZeRO-3 calls once its units know this rank's shard ranges (returned)."""
    placeholders(roots, device)
    tp = (comm.size("tp"), comm.mesh.index("tp"))
    if layout.zero == 3:
        return lambda units: fill(meta, roots, tp, device, units)
    fill(meta, roots, tp, device)
    return None


def parallelize(
    model: nn.Module,
    layout: Layout | None = None,
    *,
    optimizer: OptimizerFactory | torch.optim.Optimizer,
    loss_fn: LossFn = torch.nn.functional.cross_entropy,
    max_grad_norm: float | None = None,
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    device: torch.device | str | None = None,
    timeout_s: float | None = None,
    find_unused_parameters: bool | None = None,
    offload_dir: str | None = None,
    pipeline_cuts: list[int] | None = None,
    pipeline_schedule: Schedule | None = None,
    tp_plan: Plan | None = None,
    pipedream: PipeDreamOptions | None = None,
    param_groups: GroupOf | None = None,
    weights: WeightSource | None = None,
    sync: SemiSync | None = None,
) -> Engine:
    """Spread ``model`` over the ranks of this job as ``layout`` says and return the Engine that trains it.

    Args:
        model: any nn.Module (it stays free of parallel code; plait wraps or swaps its parts). A Hugging Face
            transformers model is made to return its logits (``plait.models.hf.return_logits``).
        layout: the parallel layout (default: data parallel over every rank).
        optimizer: a factory ``params -> torch.optim.Optimizer`` (preferred: sharding strategies call it on
            the parameters they own), or an optimizer already built on ``model.parameters()``.
        loss_fn: ``loss_fn(output, target)``; [B, T, C] outputs are flattened against [B, T] targets. A token mean
            (``plait.models.lm_loss``, torch's cross-entropy, or a ``plait.models.loss.MeanLoss`` of the user's) is
            normalised by the number of scored items of the whole global batch, so uneven loss masks train
            exactly as on one device; any other loss is taken as a mean of equal weight per micro-batch
            (``plait.parallel.loss_normalization``).
        max_grad_norm: clip gradients to this global L2 norm (None: no clipping).
        lr_scheduler: a factory ``optimizer -> scheduler`` stepped after every optimizer step.
        device: where the model runs (default: cuda:LOCAL_RANK with CUDA, else CPU).
        timeout_s: the timeout of every collective, after which the rank raises CommError (None:
            ``PLAIT_TIMEOUT_S`` or 300 s; the environment variables plait reads are all in ``plait.distributed``).
        find_unused_parameters: DDP (zero=0) treats parameters without a gradient as zeros instead of raising
            (None: the PLAIT_FIND_UNUSED_PARAMETERS environment variable decides).
        offload_dir: where ZeRO-1/2/3 with offload="nvme" keeps its files (default: PLAIT_OFFLOAD_DIR or the temp dir).
        pipeline_cuts: with pp > 1, the block (or nn.Sequential child) indices where stages 1.. start (default:
            ``layout.pipeline_cuts``, and without those an even split), e.g. from an automatic partitioner.
        pipeline_schedule: with pp > 1, a custom ``Schedule`` to run instead of ``layout.schedule``'s generator
            (checked by the simulator before anything runs).
        tp_plan: with tp > 1, the tensor-parallel plan ``{module path pattern: style}`` (default: the built-in
            plan of the model's class, see ``plait.parallel.tensor.plan``).
        pipedream: with schedule="pipedream", how the asynchronous pipeline updates (update interval, vertical
            sync; default ``PipeDreamOptions()``: weight stashing, an update after every micro-batch).
        param_groups: ``group_of(name, param) -> hyper-parameter overrides`` (e.g. ``{"weight_decay": 0.0}`` for
            norms and biases): the optimizer factory is then called with torch.optim param groups, under DDP and
            ZeRO-1/2/3 alike (``plait.parallel.param_groups``).
        weights: with a model on the meta device, where to read its tensors from (``plait.train.weights``: a
            safetensors file, an HF folder, a plait checkpoint): each rank reads only the rectangles it keeps;
            tensors the source lacks are initialised as the model's own code would (docs/startup.md).
        sync: semi-synchronous training over ``layout.dp_replicate`` replica groups (``SemiSync("localsgd" |
            "diloco", every=H)``: H inner steps per group, then an outer step; ``plait.parallel.semisync``);
            None: every step synchronous.

    A model whose parameters and buffers are on the meta device (``plait.parallel.materialize.deferred_init``,
    or built under ``torch.device("meta")``) is materialised where the layout knows what each rank keeps: after
    the pipeline split and the tp swaps, each rank writes only its stages, its tp slices and (ZeRO-3) its shard,
    with the values the model's initialisation gives on one device under the same seed (docs/startup.md).
    """
    if (
        layout is not None
        and pipeline_cuts is not None
        and layout.pipeline_cuts
        and list(pipeline_cuts) != list(layout.pipeline_cuts)
    ):
        raise LayoutError(
            f"pipeline_cuts={list(pipeline_cuts)} differ from the layout's pipeline_cuts={list(layout.pipeline_cuts)}."
            f" Fix: give the cuts in one place (the layout, or the pipeline_cuts argument)."
        )
    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    layout = (layout or Layout()).resolve(world_size)
    check_available(layout)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not (isinstance(optimizer, torch.optim.Optimizer) or callable(optimizer)):
        raise TypeError(
            "optimizer must be a factory params -> torch.optim.Optimizer (e.g. lambda p: AdamW(p)) or an optimizer"
        )
    if not callable(loss_fn):
        raise TypeError("loss_fn must be callable as loss_fn(output, target)")
    loss_fn = requested_loss = as_mean_loss(loss_fn) or loss_fn  # torch's cross-entropy: a token mean like lm_loss
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm={max_grad_norm} must be positive (or None to disable clipping)")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("the model has no trainable parameters (requires_grad=True); there is nothing to train")
    if is_hf_model(model):  # a transformers model: forward returns the logits tensor (hooks; names unchanged)
        return_logits(model)
        adapt_hf_moe(model)  # Mixtral, Qwen-MoE, OLMoE: their MoE blocks as plait's (names unchanged)

    cuts = pipeline_cuts if pipeline_cuts is not None else (list(layout.pipeline_cuts) or None)
    pipeline = plan_pipeline(model, layout, cuts, pipeline_schedule)  # pure checks, before any collective
    check_pipedream(layout, pipedream, max_grad_norm)
    optimizer = adopt_plain_factory(layout, optimizer, model)  # a plain Muon factory under tp / ZeRO: made whole
    check_whole_tensors(layout, optimizer, model)  # optimizers that need whole tensors (Muon): docs/optimizers.md
    check_head_chunks(requested_loss, layout.zero, str(layout.tp_mode), layout.tp)  # not ZeRO-3, not 2D-3D tp
    context = plan_context_parallel(model, layout)  # cp > 1: pure checks too (heads, positions, dropout)
    expert = plan_expert_parallel(model, layout, optimizer)  # MoE layers: ep divides their experts, capacity, ...
    tensor = plan_tensor_parallel(model, layout, tp_plan)  # tp > 1: pure checks (plan, sizes, heads, SP)
    compile_backend = plan_compile(layout)  # pure: a known torch.compile backend
    check_precompiled(model, layout)
    meta = plan_meta(model, layout, weights)  # pure: what builds each tensor; a module plait cannot initialise
    if sync is not None:
        sync.check(layout)  # pure: replica groups to average, a synchronous schedule, no fp16 loss scaling

    device = torch.device(device) if device is not None else default_device()
    mesh = Mesh.build(layout)
    comm = Comm(mesh, CommStats(), timeout_s=timeout_s if timeout_s is not None else default_timeout_s(), device=device)
    stages: list[PipelineStage] = []
    if pipeline is not None:
        if (
            layout.recompute != Recompute.SELECTIVE
        ):  # whole blocks first, on the whole model, so that indices are global
            apply_recompute(model, layout.recompute)
        model, stages = place_pipeline(model, pipeline, mesh.index("pp"))
        apply_compile([stage.module for stage in stages], compile_backend)  # per block, after recompute
        for stage in stages:
            if meta is None:
                stage.module.to(device)
    if meta is None:
        model.to(device)
    # --- tensor/sequence parallel (after the pipeline split): swap the planned layers, pick the loss ---
    if tensor is not None:
        if meta is None:
            broadcast_parameters(model, comm, axis="tp")  # every tp rank slices the same initial weights
        loss_fn = apply_tensor_parallel(tensor, [model] + [stage.module for stage in stages], comm, loss_fn)
    # chunked cross-entropy: bound to the (possibly swapped) LM head, before cp wraps the loss
    loss_fn = bind_head_chunks(requested_loss, [model] + [stage.module for stage in stages], loss_fn)
    # --- context parallel (after tensor parallel, before recompute/ZeRO/DDP): shard the sequence over cp ---
    if context is not None:  # with pp: hooks on this rank's stages (the first shards, the last gathers in eval)
        roles = [(stage.module, stage.is_first, stage.is_last) for stage in stages] or None
        loss_fn = apply_context_parallel(model, context, comm, loss_fn, stages=roles)
    # --- expert parallel (after cp, before recompute/ZeRO/DDP): this rank's experts, token exchange over ep ---
    router_stats = None
    if expert is not None:
        moe_layers = apply_expert_parallel(expert, [model] + [stage.module for stage in stages], comm)
        router_stats = RouterStats(expert, moe_layers, comm, layout.sequence_parallel)
    if pipeline is None or layout.recompute == Recompute.SELECTIVE:  # after cp: it wraps the attention kernel in use
        apply_recompute(model, layout.recompute)
        apply_compile([model], compile_backend)  # per block (plait.parallel.compile), before ZeRO/DDP hooks
    init_shards = None
    if meta is None:
        broadcast_parameters(model, comm)
    else:  # materialise this rank's share: every rank replays (or reads) alike, so nothing is broadcast
        init_shards = materialize(meta, [model] + [stage.module for stage in stages], layout, comm, device)
    if find_unused_parameters is None:
        find_unused_parameters = default_find_unused_parameters()
    strategy = make_strategy(
        model,
        comm,
        optimizer,
        layout,
        find_unused_parameters,
        offload_dir or default_offload_dir(),
        param_groups,
        init_shards,
        across_replicas=sync is None,
    )
    scheduler = lr_scheduler(strategy.optimizer) if lr_scheduler is not None else None
    comm.stats.reset()  # report training traffic only, not the start-up broadcast
    precision = MixedPrecision(layout.precision, device)
    runner = make_runner(model, layout, comm, strategy, precision, pipeline, stages, context, pipedream)
    engine = Engine(model, layout, mesh, comm, strategy, runner, loss_fn, device, precision, max_grad_norm, scheduler)
    engine.experts = router_stats
    attach(engine, sync)
    return engine
