"""What ``plait certify`` runs: the user's job (a ``RunConfig``, optionally with a model factory of their own) and
the layouts to certify, checked before any process starts; and, on a rank, that job's engine under one layout.

The job is the one ``plait train`` runs: ``plait.train.loop.build`` makes the data, the model, the optimizer, its
schedule, the loss and the clipping from the same configuration. ``model_factory`` (``"module:function"``) swaps in
a user's own ``nn.Module`` factory, trained with the LM loss on the job's data; ``layers`` certifies a depth-N slice
of a model too large for one process (the same widths: plait's GPT's ``n_layer``, a Hugging Face model's
``num_hidden_layers`` with the folder's weights of its first N layers).

A layout is written as ``plait train``'s ``--set layout.KEY=VALUE`` values joined by commas: ``"tp=2,pp=2,
microbatches=4"``; the keys not given are the configuration's ``[layout]`` (where ``dp=-1`` takes the ranks the
other degrees leave). The reference is one process: the same job with every degree 1, one micro-batch, no ZeRO
and the configuration's precision.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from plait.errors import ConfigError, LayoutError, PlaitError, ScheduleError
from plait.layout import Layout
from plait.train.config import RunConfig, parse_value

SLICE_KEYS = {"gpt": "n_layer", "hf": "num_hidden_layers"}
"""The [model] key ``--layers`` sets: plait's GPT and its presets' ``n_layer``; a Hugging Face model's
``num_hidden_layers`` (``plait.models.hf_load.depth_slice``: its first N layers, the folder's weights of those)."""


def parse_layout(text: str, base: Layout) -> Layout:
    """``"tp=2,pp=2,microbatches=4"`` on top of ``base``: one-line ConfigError with the fix for anything else."""
    fields = base.to_dict()
    items = [item.strip() for item in str(text).split(",") if item.strip()]
    if not items:
        raise ConfigError(f"layout {text!r} is empty. Fix: write degrees as KEY=VALUE pairs, e.g. 'dp=2,tp=2'.")
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ConfigError(
                f"layout {text!r}: {item!r} is not KEY=VALUE. Fix: e.g. 'tp=2,pp=2,microbatches=4' (Layout fields)."
            )
        fields[key.strip()] = parse_value(value.strip())
    try:
        return Layout.from_dict(fields)
    except (LayoutError, TypeError, ValueError) as error:
        raise ConfigError(f"layout {text!r}: {_one_line(error)}") from error


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def reference_layout(base: Layout) -> Layout:
    """One process: every degree 1, one micro-batch, no ZeRO, plain execution; ``base``'s precision."""
    return Layout(dp=1, precision=base.precision)


@dataclass
class CertifyJob:
    """The job and the layouts to certify (picklable: every rank rebuilds the same engine from it)."""

    config: RunConfig
    layouts: list[str]
    steps: int = 5
    nproc: int | None = None
    """Processes per layout (default: the largest world size any layout needs)."""
    model_factory: str = ""
    """``"module:function"``: a zero-argument function returning the user's own nn.Module."""
    layers: int = 0
    """Certify a depth-``layers`` slice of the model (0: the whole model)."""
    optimizer_factory: str = ""
    """``"module:name"``: the user's own optimizer, a factory ``params -> torch.optim.Optimizer`` (a plain Muon
    factory too: ``plait.parallel.whole_tensor.adopt_plain_factory``) or a ``WholeTensorOptimizer``, in place of
    the configuration's ``train.optimizer`` (its lr schedule and clipping stay)."""
    resolved: list[Layout] = field(default_factory=list)
    """The layouts resolved to ``world`` (set by ``check``)."""

    @property
    def world(self) -> int:
        return max(layout.world_size for layout in self.resolved) if self.resolved else 1

    def check(self) -> CertifyJob:
        """Refuse bad input with one line naming the fix, before any process starts; returns self, resolved."""
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps <= 0:
            raise ConfigError(f"--steps {self.steps!r} must be a positive integer. Fix: e.g. --steps 5.")
        if not self.layouts:
            raise ConfigError("no layout to certify. Fix: e.g. --layouts 'dp=2' 'tp=2,pp=2,microbatches=2'.")
        if self.nproc is not None and (isinstance(self.nproc, bool) or self.nproc < 1):
            raise ConfigError(f"--nproc {self.nproc!r} must be at least 1. Fix: e.g. --nproc 4.")
        if isinstance(self.layers, bool) or not isinstance(self.layers, int) or self.layers < 0:
            raise ConfigError(f"--layers {self.layers!r} must be a positive integer. Fix: e.g. --layers 2.")
        if self.layers:
            self.config = sliced(self.config, self.layers, bool(self.model_factory))
        parsed = [parse_layout(text, self.config.layout) for text in self.layouts]
        nproc = self.nproc or max(_needed(layout) for layout in parsed)
        self.resolved = []
        for text, layout in zip(self.layouts, parsed):
            try:
                resolved = layout.resolve(nproc)
            except LayoutError as error:
                raise ConfigError(
                    f"layout {text!r} needs {_needed(layout)} processes, but certify runs {nproc} "
                    f"(--nproc{'' if self.nproc else ', the largest any layout needs'}). Fix: make its degrees "
                    f"multiply to {nproc} (e.g. add dp={max(1, nproc // _needed(layout))}), or pass --nproc "
                    f"{_needed(layout)} and certify it on its own."
                ) from error
            try:
                resolved.check_batch(self.config.train.global_batch)
            except LayoutError as error:
                raise ConfigError(f"layout {text!r}: {_one_line(error)} (train.global_batch)") from error
            self.resolved.append(resolved)
        if self.model_factory:
            load_factory(self.model_factory)  # importable and callable, before any process starts
        if self.optimizer_factory:
            load_factory(self.optimizer_factory, "--optimizer", "params -> torch.optim.Optimizer")
        self._check_data()
        return self

    def _check_data(self) -> None:
        """The data exists and fits the model; every cp layout can cut its sequences (as a rank would refuse)."""
        from plait.data import make_dataset
        from plait.models.build import check_model_section
        from plait.parallel.context.sharding import SequenceSharding
        from plait.train.config import check_model_fits_data

        data = self.config.data
        try:
            dataset = make_dataset(data.dataset_name, **data.dataset_kwargs())
        except ValueError as error:
            raise ConfigError(f"[data] section: {_one_line(error)}") from error
        if not self.model_factory:
            check_model_fits_data(self.config.model, dataset.vocab_size, dataset.seq_len, data.path or data.name)
            check_model_section(self.config.model, dataset.vocab_size, dataset.seq_len)
        for text, layout in zip(self.layouts, self.resolved):
            if layout.cp > 1:
                try:
                    SequenceSharding(str(layout.cp_mode), layout.cp, 0).check_length(dataset.seq_len)
                except LayoutError as error:
                    raise ConfigError(f"layout {text!r}: {_one_line(error)}") from error
        if not self.model_factory:
            self._check_plans(dataset.vocab_size, dataset.seq_len)

    def _check_plans(self, vocab_size: int, seq_len: int) -> None:
        """Each layout's plans for the job's model as ``plait.parallelize`` makes them before any collective: the
        pipeline split, context, expert and tensor parallelism, pure checks on the model built on the meta device
        (nothing allocated). What every rank would refuse (a Hugging Face Llama's attention under
        sequence_parallel, a vocabulary tp does not divide, pp with cp on a Hugging Face model) is refused here in
        one line, before any process. A ``--model`` factory is not built here: it may patch the process it runs in."""
        from plait.models.build import build_model
        from plait.models.hf import is_hf_model, return_logits
        from plait.models.hf_moe import adapt_hf_moe
        from plait.parallel.context.apply import plan_context_parallel
        from plait.parallel.expert.plan import plan_expert_parallel
        from plait.parallel.materialize import deferred_init
        from plait.parallel.pipeline.apply import plan_pipeline
        from plait.parallel.tensor.apply import plan_tensor_parallel
        from plait.train.optim import optimizer_factory

        optimizer = optimizer_factory(self.config.train, "cpu")
        for text, layout in zip(self.layouts, self.resolved):
            model = deferred_init(build_model, self.config.model, vocab_size, seq_len, weights=False)
            if is_hf_model(model):  # as parallelize adapts it: logits out, MoE blocks as plait's
                return_logits(model)
                adapt_hf_moe(model)
            try:
                plan_pipeline(model, layout, list(layout.pipeline_cuts) or None)
                plan_context_parallel(model, layout)
                plan_expert_parallel(model, layout, optimizer)
                plan_tensor_parallel(model, layout)
            except (LayoutError, ScheduleError) as error:
                raise ConfigError(f"layout {text!r}: {_one_line(error)}") from error


def _needed(layout: Layout) -> int:
    """The processes ``layout`` needs (a dp=-1 counted as 1)."""
    size = 1
    for degree in layout.degrees.values():
        size *= max(degree, 1)
    return size


def sliced(config: RunConfig, layers: int, own_model: bool) -> RunConfig:
    """``config`` with its model cut to its first ``layers`` blocks, the same widths (``SLICE_KEYS``); ConfigError
    for a user's own model factory, whose depth certify cannot set."""
    from plait.models.build import is_hf_section

    if own_model:
        raise ConfigError(
            f"--layers {layers}: certify cannot set the depth of --model's factory (its code builds the model). Fix: "
            f"make the factory build the shallower model (e.g. read the depth from an environment variable), and "
            f"drop --layers; or certify a plait GPT, preset or Hugging Face model (--set model.hf=FOLDER) with --layers."
        )
    key = SLICE_KEYS["hf" if is_hf_section(config.model) else "gpt"]
    return dataclasses.replace(config, model={**config.model, key: layers})


def load_factory(spec: str, flag: str = "--model", what: str = "a function returning the nn.Module") -> Any:
    """The callable named ``"module:function"`` (``flag``'s value); ConfigError naming the fix when it cannot be
    found."""
    module_name, sep, function = spec.partition(":")
    if not sep or not module_name or not function:
        raise ConfigError(f"{flag} {spec!r} is not MODULE:FUNCTION. Fix: e.g. {flag} mypkg.models:make_it ({what}).")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(
            f"{flag} {spec!r}: cannot import {module_name!r} ({error}). Fix: put it on PYTHONPATH."
        ) from error
    factory = getattr(module, function, None)
    if not callable(factory):
        raise ConfigError(f"{flag} {spec!r}: {module_name} has no function {function!r}. Fix: name {what}.")
    return factory


def uses_muon(job: CertifyJob) -> bool:
    """Whether the job's optimizer steps with torch.optim.Muon (its budget then allows Muon's bf16 Newton-Schulz):
    ``train.optimizer = "muon"``, or a user's optimizer whose whole-tensor part, tried on one meta matrix, is one."""
    if not job.optimizer_factory:
        return job.config.train.optimizer == "muon"
    from plait.parallel.whole_tensor import WholeTensorOptimizer

    factory = load_factory(job.optimizer_factory, "--optimizer")
    factory = factory.whole if isinstance(factory, WholeTensorOptimizer) else factory
    try:
        built = factory([nn.Parameter(torch.empty(2, 2, device="meta"))])
    except Exception:  # noqa: BLE001 - a factory that needs real tensors: not Muon as far as certify can tell
        return False
    return isinstance(built, torch.optim.Muon)


def build_engine(job: CertifyJob, layout: Layout, world: Any) -> tuple[Any, Any]:
    """This rank's engine for ``job`` under ``layout`` and the job's dataset: ``plait train``'s ``build``, or with
    a model factory the same optimizer, schedule, clipping and LM loss around the user's module."""
    from plait.train.loop import build

    config = dataclasses.replace(job.config, layout=layout)
    optimizer = load_factory(job.optimizer_factory, "--optimizer") if job.optimizer_factory else None
    if not job.model_factory:
        engine, dataset, _ = build(config, world, optimizer)
        return engine, dataset
    from plait.data import make_dataset
    from plait.models import lm_loss
    from plait.parallelize import parallelize
    from plait.train.optim import decay_groups, lr_scheduler_factory, optimizer_factory

    dataset = make_dataset(config.data.dataset_name, **config.data.dataset_kwargs())
    train = config.train
    torch.manual_seed(train.seed)
    model = load_factory(job.model_factory)()
    if not isinstance(model, nn.Module):
        raise PlaitError(f"--model {job.model_factory!r} returned {type(model).__name__}, not a torch.nn.Module.")
    engine = parallelize(
        model,
        layout,
        optimizer=optimizer if optimizer is not None else optimizer_factory(train, world.device),
        loss_fn=lm_loss,
        max_grad_norm=train.max_grad_norm or None,
        lr_scheduler=lr_scheduler_factory(train),
        device=world.device,
        param_groups=decay_groups(model, train.weight_decay_skip) if train.weight_decay else None,
    )
    return engine, dataset
