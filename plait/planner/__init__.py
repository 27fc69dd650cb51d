"""The planner: predict what a layout costs and search for the best one (issue #9).

    import plait
    result = plait.plan("llama-70b", 1024, gpu="h100", seq=8192, global_batch=1024)
    result.best.layout, result.best.step_time, result.best.mfu, result.best.memory.as_dict()
    plait.planner.predict("llama-70b", plait.Layout(dp=16, tp=8, pp=8, microbatches=64), "h100", global_batch=1024)

Modules: hardware.py (catalogue, network levels, efficiency per GPU generation, this-machine), hardware_file.py
(--hardware FILE.toml), models.py (named models), hf_config.py (Hugging Face config.json), profile.py (layer
profiles), costs.py (FLOPs, roofline compute time, alpha-beta collectives, implementations), activations.py + model_states.py +
memory.py (what a block keeps, ZeRO paper, a step's peak), predict.py (one layout, pipeline via the schedule simulator), inter_op.py (the chain DP:
Alpa's inter-op pass, per-rank stage balance), intra_op.py (Alpa sharding ILP), search.py (enumerate + Alpa's passes
+ rank), report.py (tables, TOML), calibrate.py, published.py + accuracy.py (published runs, fit and errors),
partition.py (PipeDream's partitioner).
See docs/planner.md.
"""

from plait.planner.costs import IMPLEMENTATIONS, Implementation
from plait.planner.hardware import CATALOGUE, Hardware, get_hardware
from plait.planner.hf_config import from_hf_config
from plait.planner.inter_op import InterOpPlan, balanced_stages, inter_op_plan
from plait.planner.intra_op import IntraOpPlan, block_operators, solve_intra_op
from plait.planner.models import NAMED, ModelSpec, resolve_model
from plait.planner.predict import Prediction, predict
from plait.planner.profile import LayerProfile, profile_layers
from plait.planner.search import PlanResult, plan

__all__ = [
    "CATALOGUE",
    "Hardware",
    "IMPLEMENTATIONS",
    "Implementation",
    "InterOpPlan",
    "IntraOpPlan",
    "LayerProfile",
    "ModelSpec",
    "NAMED",
    "PlanResult",
    "Prediction",
    "balanced_stages",
    "block_operators",
    "from_hf_config",
    "get_hardware",
    "inter_op_plan",
    "plan",
    "predict",
    "profile_layers",
    "resolve_model",
    "solve_intra_op",
]
