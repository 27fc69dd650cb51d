"""``plait.certification(...)``: run the job in one process and under each layout for a few steps on the same global
batches, compare, and for each layout that DIFFERS find the first module that leaves the budget.

Processes are started with plait's local launcher (``plait.launch.run_local``): one for the reference, then the
layout's world size for each layout, one after another; a layout that differs is run once more (and the
reference too, once per step located) with every module recorded at its first bad step.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plait.certification.budget import budget_for
from plait.certification.certificate import DIFFERS, LayoutCertificate, locate, merge
from plait.certification.job import CertifyJob, reference_layout, uses_muon
from plait.certification.run import layout_rank, reference_rank
from plait.determinism import DETERMINISTIC_ENV
from plait.launch import run_local
from plait.logging import get_logger
from plait.train.config import RunConfig, load_config

log = get_logger(__name__)


@dataclass
class Certificate:
    """Every layout's certificate and the reference's trajectory."""

    job: CertifyJob
    reference: dict[str, Any]
    layouts: list[LayoutCertificate] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def equal(self) -> bool:
        """Whether every layout is bitwise equal or equal within its budget (``plait certify`` exits 0)."""
        return all(layout.verdict != DIFFERS for layout in self.layouts)

    def write(self, out: str | Path) -> list[Path]:
        """certificate.json, summary.md and certificate.png under ``out``; returns their paths."""
        from plait.certification.report import write_report

        return write_report(self, Path(out))


def certify(
    config: RunConfig | str | Path | None = None,
    layouts: list[str] | tuple[str, ...] = ("dp=2",),
    steps: int = 5,
    *,
    overrides: list[str] | None = None,
    preset: str | None = None,
    model: str = "",
    layers: int = 0,
    optimizer: str = "",
    deterministic: bool = False,
    nproc: int | None = None,
    locate_divergence: bool = True,
    backend: str = "gloo",
    timeout_s: float = 3600.0,
    comm_timeout_s: float = 300.0,
) -> Certificate:
    """Certify the job ``config`` (a RunConfig, or a TOML path with ``overrides``/``preset`` as ``plait train``
    takes them) under each of ``layouts`` (``"tp=2,pp=2,microbatches=4"``) for ``steps`` steps. ``model``: a
    ``"module:function"`` factory of the user's own nn.Module (trained with the LM loss on the job's data);
    ``layers``: certify a depth-``layers`` slice; ``optimizer``: ``"module:name"`` of the user's own optimizer
    factory (or ``WholeTensorOptimizer``) in place of ``train.optimizer``; ``deterministic``: deterministic mode
    (``train.deterministic``, ``plait.determinism``) in every process. Bad input raises ConfigError before any
    process starts."""
    if not isinstance(config, RunConfig):
        config = load_config(config, list(overrides or []), preset)
    elif overrides or preset:
        raise ValueError("overrides and preset apply to a TOML configuration; pass a RunConfig without them")
    if deterministic:
        config = dataclasses.replace(config, train=dataclasses.replace(config.train, deterministic=True))
    job = CertifyJob(config, list(layouts), steps, nproc, model, layers, optimizer).check()
    started = time.perf_counter()
    launch: dict[str, Any] = {"timeout": timeout_s, "comm_timeout_s": comm_timeout_s, "backend": backend}
    if job.config.train.deterministic:  # in every rank's environment before its process group starts
        launch["env"] = dict(DETERMINISTIC_ENV)
    reference_run = reference_layout(job.config.layout)
    muon = uses_muon(job)
    with tempfile.TemporaryDirectory(prefix="plait-certify-") as folder:
        log.info("certify: the reference (one process), %d steps", steps)
        reference = run_local(reference_rank, 1, job, folder, **launch)[0]
        certificate = Certificate(job, reference)
        located: set[int] = set()
        for index, (text, layout) in enumerate(zip(job.layouts, job.resolved)):
            budget = budget_for(layout, reference_run, muon)
            log.info("certify: %s (%s) on %d processes", text, layout.short(), layout.world_size)
            per_rank = run_local(layout_rank, layout.world_size, job, index, budget, folder, **launch)
            result = merge(text, layout, budget, reference, per_rank)
            result.determinism = [rank["determinism"] for rank in per_rank]
            divergence = result.divergence
            if divergence is not None and locate_divergence and divergence.what != "parameter":
                step = divergence.step
                if step not in located:
                    run_local(reference_rank, 1, job, folder, step, **launch)
                    located.add(step)
                modules = run_local(layout_rank, layout.world_size, job, index, budget, folder, step, **launch)
                locate(divergence, modules)
            log.info("certify: %s: %s", text, result.verdict + (f" ({divergence.describe()})" if divergence else ""))
            certificate.layouts.append(result)
    certificate.seconds = time.perf_counter() - started
    return certificate
