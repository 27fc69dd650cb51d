"""Hugging Face transformers models as plait models: ``model(input_ids)`` returns the logits tensor.

plait's Engine computes ``loss_fn(model(inputs), targets)``; a transformers causal LM returns an output object
(``CausalLMOutputWithPast``) and, in training, builds a key/value cache nobody reads. ``return_logits(model)``
adds two hooks to the top module and nothing else, so parameter names, the state dict and the model's own
code stay as they are: a forward pre-hook that passes ``use_cache=False`` unless the caller chose (only to a
forward that has that parameter), one that renames plait's ``positions`` keyword (packed documents,
``plait.models.inputs``) to the model's ``position_ids`` (transformers derives its packed-sequence mask from
positions that restart: no token attends across a document boundary), and a forward
hook that returns ``output.logits``. ``plait.parallelize`` applies it to every transformers model it is given.
Detection goes by the class's module name, so plait imports without transformers installed.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from plait.logging import get_logger

log = get_logger(__name__)


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers model (a class of its MRO comes from the ``transformers`` package)."""
    return any(cls.__module__.split(".", 1)[0] == "transformers" for cls in type(model).__mro__)


def _no_cache(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    return args, {"use_cache": False, **kwargs}


def _position_ids(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
    if "positions" not in kwargs:
        return None
    kwargs = dict(kwargs)
    kwargs["position_ids"] = kwargs.pop("positions")
    return args, kwargs


def _logits(module: nn.Module, args: tuple, output: Any) -> Any:
    return output.logits if hasattr(output, "logits") else output


def return_logits(model: nn.Module) -> nn.Module:
    """Make ``model(input_ids)`` return the logits tensor, and ``model(input_ids, positions=...)`` pass packed
    documents' positions as ``position_ids`` (in place, once; returns ``model``)."""
    if not getattr(model, "_plait_returns_logits", False):
        if "use_cache" in inspect.signature(model.forward).parameters:
            model.register_forward_pre_hook(_no_cache, with_kwargs=True)
        model.register_forward_pre_hook(_position_ids, with_kwargs=True)
        model.register_forward_hook(_logits)
        model._plait_returns_logits = True  # type: ignore[assignment]  # Module.__setattr__'s stub: Tensor | Module
        log.debug("%s: forward returns logits (use_cache=False)", type(model).__name__)
    return model


__all__ = ["is_hf_model", "return_logits"]
