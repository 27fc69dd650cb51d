"""The record of a model on the meta device: the one ``deferred_init`` kept, or one plait makes by replaying its
construction.

``deferred_init(build, *args, **kwargs)`` records ``build(*args, **kwargs)`` (``record``) and keeps the record on
the model: a replay then gives exactly what ``build`` gives eagerly, for any code whose effect on the model's
tensors goes through torch operations and the CPU generator.

A model built under ``with torch.device("meta")`` carries no record, so one is made from what is known of it:

- plait's ``GPT``: ``GPT(model.config)`` recorded (its constructor draws for every ``nn.Linear`` /
  ``nn.Embedding`` before ``reset_parameters`` redraws, and the replay draws the same);
- a Hugging Face transformers model: ``type(model)._from_config(config)`` recorded (its ``post_init`` ->
  ``init_weights`` -> ``_init_weights`` for every module, ties included; transformers skips that init under a
  ``torch.device("meta")`` context, so the model built there has none);
- any other module: every module's ``reset_parameters()``, children before parents (the order of eager
  construction when each module's ``__init__`` ends by calling it, as torch's layers do). A parameter or buffer
  that none writes cannot be initialised: ``MaterializeError`` names its module before any collective.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from torch import nn

from plait.models.gpt import GPT
from plait.models.hf import is_hf_model
from plait.parallel.materialize.record import InitRecord, module_tensors, record
from plait.parallel.materialize.replay import MaterializeError, plan_replay

RECORD_ATTR = "_plait_init_record"


def deferred_init(build: Callable[..., nn.Module], *args: Any, **kwargs: Any) -> nn.Module:
    """``build(*args, **kwargs)`` on the meta device, its initialisation recorded: ``plait.parallelize`` then
    materialises on each rank only its share, with the values eager ``build`` gives under the same seed
    (docs/startup.md). Nothing is allocated; the CPU generator is left as it was."""
    name = getattr(build, "__qualname__", type(build).__name__)
    model, log = record(lambda: build(*args, **kwargs), f"{name}(...)")
    object.__setattr__(model, RECORD_ATTR, log)
    return model


def _reset_all(model: nn.Module) -> nn.Module:
    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        for child in module.children():
            visit(child)
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()

    visit(model)
    return model


def derived_record(model: nn.Module) -> InitRecord:
    """A record for ``model`` (module docstring), checked to name the model's tensors with their shapes."""
    if isinstance(model, GPT):
        config = model.config
        return record(lambda: GPT(config), f"GPT(config) (plait rebuilt {type(model).__name__} to replay its init)")[1]
    if is_hf_model(model) and hasattr(type(model), "_from_config"):
        config = copy.deepcopy(getattr(model, "config"))  # noqa: B009 - a transformers model has one
        cls: Any = type(model)
        return record(lambda: cls._from_config(config), f"{cls.__name__}._from_config(config)")[1]
    return record(lambda: _reset_all(model), "the reset_parameters() of every module")[1]


def init_record(model: nn.Module) -> InitRecord:
    """The model's record: ``deferred_init``'s, else ``derived_record``'s; MaterializeError (naming the fix) when
    it does not describe this model's tensors or cannot initialise one of them."""
    log = getattr(model, RECORD_ATTR, None)
    if not isinstance(log, InitRecord):
        log = derived_record(model)
    tensors = module_tensors(model)
    for name, (kind, tensor) in tensors.items():
        ref = log.tensors.get(name)
        if kind == "attribute" and ref is None:
            continue
        if ref is None or ref.size != tuple(tensor.shape) or ref.dtype != tensor.dtype:
            what = "has no such tensor" if ref is None else f"makes it {ref.dtype} {ref.size}"
            raise MaterializeError(
                f"the meta model's {kind} {name!r} ({tensor.dtype} {tuple(tensor.shape)}) is not what its "
                f"initialisation gives: {log.source} {what}. Fix: build the model with plait.parallel.materialize."
                f"deferred_init(build, ...) so that its own construction is recorded, or build it on a real device.",
                [name],
            )
    return log


def check_initialisable(model: nn.Module, log: InitRecord, names: list[str]) -> None:
    """MaterializeError naming the first module whose tensors nothing in ``log`` writes."""
    try:
        plan_replay(log, names)
    except MaterializeError as error:
        blocked = error.names or names[:1]
        path = blocked[0].rpartition(".")[0]
        module = model.get_submodule(path) if path else model
        kind = type(module).__name__
        raise MaterializeError(
            f"plait cannot initialise {path or 'the root module'} ({kind}) on the meta device: {error}. Fix: give "
            f"{kind} a reset_parameters() that initialises them with replayable operations (normal_, uniform_, "
            f"fill_, arithmetic), build the model with plait.parallel.materialize.deferred_init(build, ...) so that "
            f"its own init code is recorded, or build it on a real device.",
            blocked,
        ) from None


__all__ = ["RECORD_ATTR", "check_initialisable", "deferred_init", "derived_record", "init_record"]
