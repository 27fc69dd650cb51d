"""Which optimizers ZeRO can run (docs/zero.md, "Optimizers").

Every ZeRO stage steps each rank's *flat shard*: a 1-D slice of the parameters laid end to end, cutting across
tensors. An optimizer takes there the same step as on the whole model iff the update of every element depends
only on that element's gradient and state history and on scalars (lr, betas, the step count): iff it is
*elementwise*. Read from the torch.optim sources (torch 2.13), the elementwise ones are ``ELEMENTWISE``; the
others compute statistics of a whole tensor (``NOT_ELEMENTWISE`` says which), so on shards they would be a
different algorithm. The rule: under zero >= 1 an optimizer whose class derives from a torch.optim optimizer
must derive from an elementwise one; an optimizer written elsewhere (directly on ``torch.optim.Optimizer``) is
trusted to be elementwise, the user's contract.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from plait.errors import LayoutError

ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adadelta,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.ASGD,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
)
"""torch.optim optimizers whose update is elementwise (scalars aside): they run on flat shards unchanged."""

NOT_ELEMENTWISE = {
    "Adafactor": "factors a matrix's second moment into row and column means and scales each step by the "
    "parameter's RMS, both over the whole tensor",
    "Muon": "orthogonalises each 2-D parameter's whole update (Newton-Schulz iterations)",
    "SparseAdam": "needs sparse gradients, and ZeRO's reduced gradient shards are dense",
    "LBFGS": "takes dot products over all the parameters as one vector",
}
"""Why torch.optim's other optimizers cannot step a flat shard (class name -> reason)."""


def check_elementwise(optimizer: torch.optim.Optimizer, stage: int) -> None:
    """Raise LayoutError for a torch.optim optimizer that is not elementwise (``ELEMENTWISE``) under ZeRO."""
    if isinstance(optimizer, ELEMENTWISE):
        return
    from_torch = [
        c
        for c in type(optimizer).__mro__[:-1]
        if c.__module__.startswith("torch.optim") and c is not torch.optim.Optimizer
    ]
    if not from_torch:
        return
    name = from_torch[0].__name__
    why = NOT_ELEMENTWISE.get(name, "is not one of torch.optim's elementwise optimizers")
    allowed = ", ".join(c.__name__ for c in ELEMENTWISE)
    raise LayoutError(
        f"zero={stage} cannot run torch.optim.{name}: ZeRO steps each rank's flat 1-D shard of the parameters "
        f"(slices cutting across tensors), and {name} {why}, so on shards it would be a different algorithm. "
        f"Fix: use zero=0 (DDP: whole parameters on every rank) with {name}, or an elementwise optimizer "
        f"({allowed}) with ZeRO."
    )


def factory_failed_on_shards(error: ValueError, shards: Sequence[torch.Tensor], stage: int) -> LayoutError:
    """The error to raise when the optimizer factory refuses this rank's 1-D master shards (torch.optim.Muon
    accepts only 2-D parameters): what it was given, why, and the fix."""
    sizes = ", ".join(str(shard.numel()) for shard in shards[:4]) + (", ..." if len(shards) > 4 else "")
    allowed = ", ".join(c.__name__ for c in ELEMENTWISE)
    return LayoutError(
        f"the optimizer factory failed on this rank's zero={stage} master shards, flat 1-D tensors of {sizes} "
        f"elements ({error}). ZeRO builds the optimizer on such shards, so it must accept 1-D tensors and be "
        f"elementwise. Fix: use zero=0 (DDP) with this optimizer, or an elementwise optimizer ({allowed})."
    )
