"""The optimizer, its learning-rate schedule and its weight-decay groups, as ``[train]`` describes them.

- ``optimizer_factory``: ``train.optimizer`` ("adamw", "adam", "sgd", "nadam", "radam", "adamax", "rmsprop",
  "adagrad": torch.optim's elementwise optimizers, so every one also runs under ZeRO) with ``lr``,
  ``weight_decay``, ``betas``, ``eps`` and ``momentum`` where the optimizer has them; "muon" (``muon_optimizer``):
  Muon on the hidden matrices and AdamW on the rest, a ``WholeTensorOptimizer`` that every layout runs exactly.
- ``lr_factor``: the multiplier of ``lr`` at each step: a linear warm-up over ``warmup_steps`` (step s gets
  (s+1)/warmup), then ``lr_schedule`` from 1 down to the floor r = min_lr / lr at ``steps``: "cosine"
  r + (1-r)(1 + cos(pi p))/2 (Loshchilov & Hutter 2017, without restarts), "linear" r + (1-r)(1-p), or
  "constant" 1, where p is the share of the decay steps done.
- ``decay_groups``: weight decay shrinks weights towards zero, which is meant for the matrices of linear maps
  (AdamW, Loshchilov & Hutter 2019). Norm gains and biases are exempt in GPT-2/3, nanoGPT and Megatron-LM (a gain
  pulled to 0 switches a unit off; a bias sets an offset, not a scale), and embeddings in minGPT. ``weight_decay_skip``
  names the kinds exempt here ("norms", "biases", "embeddings"); the kinds are read off the model's modules before
  parallelisation, by parameter name, and become ``parallelize(..., param_groups=...)``, which keeps the groups
  under DDP and ZeRO-1/2/3 (``plait.parallel.param_groups``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from plait.errors import ConfigError
from plait.parallel.kernels import fast_optimizer_kwargs
from plait.parallel.param_groups import GroupOf
from plait.parallel.whole_tensor import WholeTensorOptimizer

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
    "sgd": torch.optim.SGD,
    "nadam": torch.optim.NAdam,
    "radam": torch.optim.RAdam,
    "adamax": torch.optim.Adamax,
    "rmsprop": torch.optim.RMSprop,
    "adagrad": torch.optim.Adagrad,
}
"""``train.optimizer`` -> torch.optim class (elementwise ones: ZeRO steps them on flat shards unchanged)."""

WITH_BETAS = ("adamw", "adam", "nadam", "radam", "adamax")
WITH_EPS = (*WITH_BETAS, "rmsprop", "adagrad")
WITH_MOMENTUM = ("sgd", "rmsprop")
SCHEDULES = ("cosine", "linear", "constant")
SKIP_KINDS = ("norms", "biases", "embeddings")
MUON_RMS_BOUND = 0.2 * math.sqrt(2**31)
"""Muon's ``match_rms_adamw`` multiplies its lr by 0.2 sqrt(max(A, B)); this is that factor for the widest matrix a
checked config can have (``plait.models.hf_fields.MAX_SIZE``)."""


def optimizer_kwargs(train: Any) -> dict[str, Any]:
    """The keyword arguments of ``train.optimizer``'s class: lr, weight_decay and what it takes of betas, eps and
    momentum."""
    name = train.optimizer
    kwargs: dict[str, Any] = {"lr": train.lr, "weight_decay": train.weight_decay}
    if name in WITH_BETAS:
        kwargs["betas"] = tuple(float(beta) for beta in train.betas)
    if name in WITH_EPS:
        kwargs["eps"] = train.eps
    if name in WITH_MOMENTUM:
        kwargs["momentum"] = train.momentum
    return kwargs


def muon_optimizer(train: Any, device: torch.device | str = "cpu") -> WholeTensorOptimizer:
    """``train.optimizer = "muon"``: torch.optim.Muon on the hidden matrices (the 2-D weights inside the model's
    blocks: attention and MLP), AdamW on embeddings (tied or not), the output head, norms and biases, as Moonlight
    and modded-nanogpt. Muon takes ``muon_lr`` (default ``lr``), ``muon_momentum`` (0.95, Nesterov) and
    ``muon_weight_decay`` (default ``weight_decay``) with ``adjust_lr_fn="match_rms_adamw"``: its update is scaled
    to 0.2 sqrt(max(A, B)), the RMS of an AdamW update, so AdamW's lr and weight decay carry over (Liu et al. 2025,
    "Muon is Scalable for LLM Training"). Every layout hands Muon whole matrices (``plait.parallel.whole_tensor``)."""
    adamw = {**optimizer_kwargs(replace(train, optimizer="adamw")), **fast_optimizer_kwargs(torch.optim.AdamW, device)}
    muon = {
        "lr": train.lr if train.muon_lr is None else train.muon_lr,
        "momentum": train.muon_momentum,
        "weight_decay": train.weight_decay if train.muon_weight_decay is None else train.muon_weight_decay,
        "nesterov": True,
        "adjust_lr_fn": "match_rms_adamw",
    }
    return WholeTensorOptimizer(
        whole=lambda params: torch.optim.Muon(params, **muon), rest=lambda params: torch.optim.AdamW(params, **adamw)
    )


def optimizer_factory(
    train: Any, device: torch.device | str = "cpu"
) -> Callable[[Any], torch.optim.Optimizer] | WholeTensorOptimizer:
    """``params_or_groups -> optimizer`` for ``plait.parallelize`` (a list of tensors, or torch.optim groups); on
    CUDA with the fused kernel where torch has one for the class (``plait.parallel.kernels``). "muon": the hybrid
    ``muon_optimizer``."""
    if train.optimizer == "muon":
        return muon_optimizer(train, device)
    cls = OPTIMIZERS[train.optimizer]
    kwargs = {**optimizer_kwargs(train), **fast_optimizer_kwargs(cls, device)}

    def build(params: Any) -> torch.optim.Optimizer:
        return cls(params, **kwargs)

    return build


def lr_factor(schedule: str, warmup: int, total: int, floor: float) -> Callable[[int], float]:
    """The lr multiplier after ``step`` optimizer steps (module docstring): warm-up, then ``schedule`` to ``floor``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def lr_scheduler_factory(train: Any) -> Callable[[torch.optim.Optimizer], Any]:
    """``optimizer -> LambdaLR`` following ``lr_factor`` (the floor is ``train.min_lr``, default lr / 10)."""
    min_lr = train.lr / 10 if train.min_lr is None else train.min_lr
    factor = lr_factor(train.lr_schedule, train.warmup_steps, train.steps, min_lr / train.lr)
    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _is_norm(module: nn.Module) -> bool:
    normalisations = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase, nn.RMSNorm)
    return isinstance(module, normalisations) or type(module).__name__.endswith(("Norm", "RMSNorm", "LayerNorm"))


def parameter_kinds(model: nn.Module) -> dict[str, str]:
    """Each trainable parameter's kind by name: "norms" (of a normalisation layer), "embeddings" (of an
    nn.Embedding), "biases" (any other parameter named ``bias``) or "weights"."""
    kinds: dict[str, str] = {}
    for prefix, module in model.named_modules():
        for local, _param in module.named_parameters(recurse=False):
            name = f"{prefix}.{local}" if prefix else local
            if _is_norm(module):
                kinds[name] = "norms"
            elif isinstance(module, nn.Embedding):
                kinds[name] = "embeddings"
            elif local == "bias":
                kinds[name] = "biases"
            else:
                kinds[name] = "weights"
    wanted = {name for name, param in model.named_parameters() if param.requires_grad}
    return {name: kind for name, kind in kinds.items() if name in wanted}


def decay_groups(model: nn.Module, skip: list[str] | tuple[str, ...]) -> GroupOf | None:
    """``group_of`` giving the kinds in ``skip`` weight_decay 0 (None when nothing is skipped). A name the model
    did not have before parallelisation falls back to its shape: vectors (gains, biases) count as "biases"."""
    skipped = set(skip)
    if not skipped:
        return None
    kinds = parameter_kinds(model)

    def group_of(name: str, param: nn.Parameter) -> Mapping[str, Any]:
        kind = kinds.get(name) or ("biases" if param.dim() < 2 else "weights")
        return {"weight_decay": 0.0} if kind in skipped else {}

    return group_of


def step_scale(train: Any) -> float:
    """The largest factor an optimizer step multiplies an update by, as a float32 scalar: lr / (1 - beta1) for
    Adam's family (its first, bias-corrected step: torch's ``lr / (1 - beta1^t)``), lr for the others, Muon's lr
    times ``MUON_RMS_BOUND``. Beyond float32's range torch fails mid-step ("value cannot be converted to type
    float without overflow")."""
    scale = float(train.lr)
    if train.optimizer in (*WITH_BETAS, "muon"):
        scale /= 1.0 - float(train.betas[0])
    if train.optimizer == "muon":
        scale = max(scale, float(train.lr if train.muon_lr is None else train.muon_lr) * MUON_RMS_BOUND)
    return scale


def check_optim_config(train: Any) -> None:
    """ConfigError (with the fix) for an optimizer, schedule or decay setting that cannot work."""
    if train.optimizer not in (*OPTIMIZERS, "muon"):
        raise ConfigError(
            f"train.optimizer={train.optimizer!r} is unknown. Fix: use one of {sorted((*OPTIMIZERS, 'muon'))}."
        )
    if not 0.0 <= train.muon_momentum < 1.0:
        raise ConfigError(f"train.muon_momentum={train.muon_momentum!r} must be in [0, 1). Fix: e.g. 0.95.")
    if train.muon_lr is not None and not train.muon_lr > 0:
        raise ConfigError(f"train.muon_lr={train.muon_lr!r} must be positive (or unset: lr). Fix: e.g. 0.02.")
    if train.muon_weight_decay is not None and not train.muon_weight_decay >= 0:
        raise ConfigError(f"train.muon_weight_decay={train.muon_weight_decay!r} must be >= 0 (or unset).")
    if train.lr_schedule not in SCHEDULES:
        raise ConfigError(f"train.lr_schedule={train.lr_schedule!r} is unknown. Fix: use one of {list(SCHEDULES)}.")
    betas = train.betas
    if not (isinstance(betas, (list, tuple)) and len(betas) == 2 and all(0.0 <= float(b) < 1.0 for b in betas)):
        raise ConfigError(f"train.betas={betas!r} must be two numbers in [0, 1). Fix: e.g. train.betas=[0.9, 0.95].")
    if not train.eps > 0:
        raise ConfigError(f"train.eps={train.eps!r} must be positive. Fix: e.g. 1e-8.")
    if not 0.0 <= train.momentum < 1.0:
        raise ConfigError(f"train.momentum={train.momentum!r} must be in [0, 1). Fix: e.g. 0.9.")
    if not train.weight_decay >= 0:
        raise ConfigError(f"train.weight_decay={train.weight_decay!r} must be >= 0.")
    if train.min_lr is not None and not 0.0 <= train.min_lr <= train.lr:
        raise ConfigError(
            f"train.min_lr={train.min_lr!r} must lie in [0, lr={train.lr}]. Fix: e.g. train.min_lr={train.lr / 10:g}."
        )
    from plait.train.config import FLOAT32_MAX

    scale = step_scale(train)
    if not scale <= FLOAT32_MAX:
        raise ConfigError(
            f"train.lr={train.lr!r} with {train.optimizer} (betas={list(train.betas)}) makes a step of lr x "
            f"{scale / train.lr:.3g} = {scale:.3g}, beyond float32's range ({FLOAT32_MAX:.3g}), the dtype of the "
            f"weights it updates: the step would fail. Fix: a learning rate such as train.lr=3e-4."
        )
    unknown = sorted(set(train.weight_decay_skip) - set(SKIP_KINDS))
    if unknown:
        raise ConfigError(
            f'train.weight_decay_skip names {unknown}. Fix: a list of {list(SKIP_KINDS)} (e.g. ["norms", "biases"]).'
        )


__all__ = [
    "OPTIMIZERS",
    "SCHEDULES",
    "SKIP_KINDS",
    "check_optim_config",
    "decay_groups",
    "lr_factor",
    "lr_scheduler_factory",
    "muon_optimizer",
    "optimizer_factory",
    "optimizer_kwargs",
    "parameter_kinds",
    "step_scale",
]
