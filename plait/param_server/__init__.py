"""Parameter server (issue #7): servers own size-balanced shards of the parameters and apply any torch.optim
optimizer to pushed gradients; workers pull, compute on their own data and push without waiting for each other.
Consistency: BSP, ASP, SSP (bounded staleness). Faults: workers may die (SIGKILL) or join at any moment; pushes
are applied at most once; servers checkpoint atomically. Wire: authenticated JSON headers + raw tensor bytes, nothing
received is executed. ``train(model_fn, data, loss_fn, ...)`` trains any model. See docs/param_server.md."""

from plait.param_server.api import TrainResult, train
from plait.param_server.consistency import MODES, Consistency, StalenessStats
from plait.param_server.launch import JobConfig, JobResult, LocalCluster, run_local, run_worker, serve_shard
from plait.param_server.server import OptimizerSpec, ServerSettings, ShardServer
from plait.param_server.service import Service
from plait.param_server.sharding import ParamSpec, assign_shards, model_spec
from plait.param_server.task import AdditionGPT, ModelTask, SectionModel
from plait.param_server.worker import PSWorker

__all__ = [
    "MODES",
    "AdditionGPT",
    "Consistency",
    "JobConfig",
    "JobResult",
    "LocalCluster",
    "ModelTask",
    "OptimizerSpec",
    "PSWorker",
    "ParamSpec",
    "ServerSettings",
    "Service",
    "SectionModel",
    "ShardServer",
    "StalenessStats",
    "TrainResult",
    "assign_shards",
    "model_spec",
    "run_local",
    "run_worker",
    "serve_shard",
    "train",
]
