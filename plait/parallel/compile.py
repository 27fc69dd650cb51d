"""``Layout(compile=...)``: ``torch.compile`` per transformer block, composable with every data-parallel strategy.

What is compiled is each block's ``forward`` (the blocks found as for recomputation: the children of a
ModuleList/ModuleDict named ``blocks``, ``layers``, ``h``, ...), or, for a model without such blocks, the model's
(or each pipeline stage's) ``forward``. This is torchtitan's per-block compilation, with one difference that
matters here: the *method* ``forward`` is replaced, not the module, so

- module hooks stay eager Python around the compiled code: ZeRO-3 gathers a unit in its forward pre-hook and
  frees it in its forward hook, swapping parameter storage. ``torch.compile(model)`` before ``parallelize`` puts
  those hooks inside dynamo's trace: it guards on their bookkeeping (``len(self._pre_record) == k``), recompiles
  for every unit, and the traced in-place refills of gathered storage then break autograd's saved tensors
  ("modified by an inplace operation", reproduced on CPU; ``check_precompiled`` refuses it up front). DDP's and
  ZeRO-1/2's gradient hooks fire on the parameters' accumulate-grad nodes, outside the compiled backward;
- parameter names, module paths and checkpoints do not change (no ``_orig_mod.`` prefix);
- every block of a class shares one compiled graph: dynamo lifts the parameters of built-in modules into graph
  inputs (``torch._dynamo.config.inline_inbuilt_nn_modules``), so a ZeRO-3 unit's freshly gathered parameters
  are inputs like any other and n blocks compile once.

Order in ``parallelize``: after activation recomputation (dynamo traces ``torch.utils.checkpoint`` as one
higher-order op and recomputes inside the compiled backward), before ZeRO/DDP hooks are attached. Dynamo
traces at the first call, so the layers that tensor/context parallelism swapped in are what it sees. A layer
that holds a ``Comm`` (tensor-parallel linears, ring / Ulysses attention cores) calls collectives, which dynamo
cannot put in a graph, and so do the forward hooks the tensor-parallel plan puts on a block's sub-modules: such
layers and every sub-module hook run eagerly (``torch.compiler.disable``), one graph break on each side, and the
code between them is compiled; every ``Comm`` collective runs eagerly too (``run_eagerly_under_compile``).
(Traced, ring attention's loop of p2p exchanges split into dozens of graph breaks and recompiled per ring step,
and tensor parallelism's input hook recompiled for each signature it saw.)
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from plait.comm import Comm
from plait.comm.collectives import run_eagerly_under_compile
from plait.errors import LayoutError
from plait.layout import Layout
from plait.parallel.recompute import find_blocks

DEFAULT_BACKEND = "inductor"
_COMPILED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""Modules whose forward this process compiled (each once)."""
_EAGER: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""Layers inside compiled blocks that run eagerly (they hold a Comm)."""
_EAGER_HOOKS: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()
"""Hooks wrapped to run eagerly (each wrapped once)."""


def is_compiled(module: nn.Module) -> bool:
    """Whether ``apply_compile`` compiled ``module``'s forward."""
    return module in _COMPILED


def plan_compile(layout: Layout) -> str | None:
    """The torch.compile backend ``layout.compile`` asks for (None: no compilation); a LayoutError naming the
    known backends for an unknown one. Pure: checked on every rank before any collective."""
    if layout.compile is False:
        return None
    backend = DEFAULT_BACKEND if layout.compile is True else str(layout.compile)
    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise LayoutError(
            f"compile={layout.compile!r} is not a torch.compile backend this torch knows. Fix: use compile=true "
            f"({DEFAULT_BACKEND}) or one of {', '.join(map(repr, sorted(known)))}."
        )
    return backend


def check_precompiled(model: nn.Module, layout: Layout) -> None:
    """Refuse a model already wrapped by ``torch.compile`` under ZeRO-3 (its hooks would be traced, module
    docstring), naming the fix; other strategies keep their hooks outside the traced module and accept it."""
    dynamo = sys.modules.get("torch._dynamo")  # never imported: nothing can have been compiled
    if layout.zero == 3 and dynamo is not None and isinstance(model, dynamo.eval_frame.OptimizedModule):
        raise LayoutError(
            "the model was compiled with torch.compile before parallelize, and zero=3 gathers and frees parameters in "
            "module hooks that the compiled model would trace (dynamo recompiles on every unit until its limit, then "
            "autograd fails with 'modified by an inplace operation'). Fix: pass the uncompiled model and set "
            "Layout(compile=True), which compiles each block with the hooks outside."
        )


def _keep_eager(layer: nn.Module) -> None:
    """Inside a compiled block: run ``layer`` eagerly if it holds a ``Comm`` (it calls collectives), and its
    forward hooks always (tensor parallelism's input/output hooks call collectives too; a hook is arbitrary
    Python whose bookkeeping dynamo would otherwise guard on and recompile for, once per module signature)."""
    if isinstance(getattr(layer, "comm", None), Comm) and layer not in _EAGER:
        layer.forward = torch.compiler.disable(layer.forward)
        _EAGER.add(layer)
    for hooks in (layer._forward_pre_hooks, layer._forward_hooks):
        for key, hook in list(hooks.items()):
            if hook not in _EAGER_HOOKS:
                eager = torch.compiler.disable(hook)
                _EAGER_HOOKS.add(eager)
                hooks[key] = eager


def apply_compile(modules: list[nn.Module], backend: str | None) -> list[nn.Module]:
    """Compile the ``forward`` of each block of each module in ``modules`` (of the module itself when it has no
    blocks) with ``backend``, once per module; returns what was compiled (nothing when ``backend`` is None)."""
    if backend is None:
        return []
    run_eagerly_under_compile()  # collectives: graph breaks, never traced
    compiled = []
    for module in modules:
        targets = [block for _, block in find_blocks(module)] or [module]
        for target in targets:
            if target in _COMPILED:
                continue
            for layer in target.modules():
                if layer is not target:
                    _keep_eager(layer)
            target.forward = torch.compile(target.forward, backend=backend)
            _COMPILED.add(target)
            compiled.append(target)
    return compiled


__all__ = ["DEFAULT_BACKEND", "apply_compile", "check_precompiled", "is_compiled", "plan_compile"]
