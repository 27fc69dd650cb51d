"""Context parallelism: the sequence split over the ``cp`` mesh axis, with ring attention (zigzag) or
DeepSpeed-Ulysses all-to-all attention, for plait's GPT and Hugging Face models (``hf``). See
docs/context_parallel.md."""

from plait.parallel.context.apply import apply_context_parallel, plan_context_parallel
from plait.parallel.context.hooks import ContextParallelLoss, ContextParallelMeanLoss, ContextParallelModel
from plait.parallel.context.plan import ContextPlan
from plait.parallel.context.ring import RingAttention
from plait.parallel.context.sharding import BlockPiece, SequenceSharding
from plait.parallel.context.ulysses import UlyssesAttention

__all__ = [
    "BlockPiece",
    "ContextParallelLoss",
    "ContextParallelMeanLoss",
    "ContextParallelModel",
    "ContextPlan",
    "RingAttention",
    "SequenceSharding",
    "UlyssesAttention",
    "apply_context_parallel",
    "plan_context_parallel",
]
