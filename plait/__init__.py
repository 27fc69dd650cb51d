"""plait: every paradigm of multi-device training in one small codebase.

import plait, torch
plait.init()
engine = plait.parallelize(model, plait.Layout(dp=2), optimizer=lambda p: torch.optim.AdamW(p, lr=3e-4))
stats = engine.train_step((inputs, targets))
"""

from plait.certification import Certificate, certify
from plait.comm import Comm, CommStats
from plait.distributed import World, init, shutdown
from plait.engine import Engine, EvalStats, StepStats
from plait.errors import CheckpointError, CommError, ConfigError, DataError, LayoutError, PlaitError, ScheduleError
from plait.layout import AXES, Layout
from plait.mesh import Mesh
from plait.observe.memory import measure_held
from plait.parallel.materialize.derive import deferred_init
from plait.parallel.whole_tensor import WholeTensorOptimizer
from plait.parallelize import parallelize
from plait.planner import plan
from plait.planner.memory import MemoryEstimate, estimate_memory

__version__ = "0.1.0"

__all__ = [
    "AXES",
    "Certificate",
    "CheckpointError",
    "Comm",
    "CommError",
    "CommStats",
    "ConfigError",
    "DataError",
    "Engine",
    "EvalStats",
    "Layout",
    "LayoutError",
    "MemoryEstimate",
    "Mesh",
    "PlaitError",
    "ScheduleError",
    "StepStats",
    "WholeTensorOptimizer",
    "World",
    "__version__",
    "certify",
    "deferred_init",
    "estimate_memory",
    "init",
    "measure_held",
    "parallelize",
    "plan",
    "shutdown",
]
