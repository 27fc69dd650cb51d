"""Muon's own amplification of a rounding difference, measured step by step: the allowance of the parameters Muon
steps, on top of the budget.

Muon orthogonalises its Nesterov momentum with a bf16 Newton-Schulz quintic p(x) = a x + b x^3 + c x^5 whose slope
at 0 is a = 3.4445, so a rounding difference of its input grows by up to a per iteration in the directions of the
input's small singular values (a^5 ~ 487 over five), and gradients are that ill-conditioned (a tiny Llama's at
init: condition numbers 1e7 to 4e9). A 2-layer Llama's o_proj gradient under ZeRO-3, 5e-7 (relative) from the
one-process one by reordered sums, gave a step 112 bf16 ulps of its largest element away: more than a fixed
allowance can grant while still telling Muon stepping slices (8 to 10 times the 2^3-ulp one) from rounding.

So each layout rank measures it: ``MuonSpread`` follows Muon's momentum of both runs' whole gradients (the
layout's and the reference's, after clipping, as Muon receives them) and runs torch's own Newton-Schulz on both
inputs; twice the difference of the two orthogonalised updates, relative to the reference's largest element,
times the reference's step on the tensor, is what the parameter may differ by besides the budget, accumulated over
the steps (twice: the step's scale is read from the reference's largest step, weight decay included). That is exactly the difference Muon makes of the two gradients; a layout whose Muon steps anything but the
whole matrix's update (a slice of it) differs from its own whole-gradient update and stays outside.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

MUON_KEYS = ("momentum", "nesterov", "ns_coefficients", "ns_steps", "eps")
"""The settings of ``torch.optim.Muon`` its update depends on (besides the lr, which scales both runs alike)."""


def muon_settings(optimizer: Any) -> dict[str, Any] | None:
    """The ``MUON_KEYS`` of ``optimizer`` (a built torch.optim.Muon), None for any other optimizer."""
    if not isinstance(optimizer, torch.optim.Muon):
        return None
    return {key: optimizer.defaults[key] for key in MUON_KEYS}


class MuonSpread:
    """Per parameter Muon steps (by name), the elementwise difference of the two runs' orthogonalised updates."""

    def __init__(self, settings: dict[str, Any], names: set[str]) -> None:
        self.settings, self.names = settings, names
        self.buffers: dict[str, tuple[Tensor, Tensor]] = {}

    def _update(self, grad: Tensor, buffer: Tensor) -> tuple[Tensor, Tensor]:
        """torch.optim.Muon's step input from ``grad`` and its momentum ``buffer`` (updated), orthogonalised."""
        from torch.optim._muon import _zeropower_via_newtonschulz

        momentum = self.settings["momentum"]
        buffer = buffer.lerp(grad, 1 - momentum)
        update = grad.lerp(buffer, momentum) if self.settings["nesterov"] else buffer
        ortho = _zeropower_via_newtonschulz(
            update, self.settings["ns_coefficients"], self.settings["ns_steps"], self.settings["eps"]
        )
        return ortho, buffer

    def spread(self, name: str, mine: Tensor, theirs: Tensor) -> Tensor | None:
        """|NS(layout's input) - NS(reference's input)| / max |NS(reference's input)| for this step (the momentum
        carried on), or None for a parameter Muon does not step."""
        if name not in self.names or mine.dim() != 2:
            return None
        mine_buffer, their_buffer = self.buffers.get(name, (torch.zeros_like(mine), torch.zeros_like(theirs)))
        mine_ortho, mine_buffer = self._update(mine.float(), mine_buffer)
        their_ortho, their_buffer = self._update(theirs.float(), their_buffer)
        self.buffers[name] = (mine_buffer, their_buffer)
        largest = float(their_ortho.abs().max())
        return (mine_ortho - their_ortho).abs().double() / largest if largest > 0 else None


def muon_of(engine: Any) -> tuple[dict[str, Any] | None, list[str]]:
    """The settings of the torch.optim.Muon that ``engine``'s optimizer steps with (or of a hybrid's Muon part) and
    the names of the parameters it steps; (None, []) without Muon. For the one-process reference engine, whose
    optimizer holds the model's own parameters."""
    optimizer = engine.strategy.optimizer
    names = {id(param): name for name, param in engine.model.named_parameters()}
    for part in getattr(optimizer, "parts", [optimizer]):
        settings = muon_settings(part)
        if settings is not None:
            held = [names[id(p)] for group in part.param_groups for p in group["params"] if id(p) in names]
            return settings, held
    return None, []
