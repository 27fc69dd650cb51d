"""What each rank does: train the job for a few steps on the same global batches, one process (the reference,
which writes its whole tensors to a folder) or under a layout (which compares its own with them, in the rank, and
returns only the differences: whole models never travel between processes).

Per step the reference writes ``step{s}.pt``: the synchronised gradients (after clipping, before the optimizer
step) and the parameters after the step, whole, by name; ``init.pt`` holds the parameters before step 0. With
``locate`` the run stops after step ``locate``, during which a ``ModuleTape`` records every module's outputs and
output gradients (the reference writes them to ``modules{s}.pt``; a layout gathers its own to whole tensors and
compares them module by module).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from plait.certification.budget import Budget
from plait.certification.compare import TensorDiff, diff_tensor, rms
from plait.certification.gather import whole_activation, whole_gradients, whole_parameters
from plait.certification.job import CertifyJob, build_engine, reference_layout
from plait.certification.muon import MuonSpread, muon_of
from plait.certification.tape import ModuleTape
from plait.data import ShardedBatches
from plait.determinism import check_group, make_deterministic, state
from plait.distributed import init
from plait.parallel.strategy import GRAD_AXIS


def _engine(job: CertifyJob, layout: Any) -> tuple[Any, Any, ShardedBatches]:
    if job.config.train.deterministic:  # before any work (the launcher set the environment before the group)
        check_group()
        make_deterministic()
    world = init()
    engine, dataset = build_engine(job, layout, world)
    loader = ShardedBatches(
        dataset, job.config.train.global_batch, dp_rank=engine.mesh.index("dp"), dp_size=engine.mesh.size("dp")
    )
    return engine, dataset, loader


def _grad_catcher(engine: Any) -> list[dict[str, torch.Tensor]]:
    """A list that receives each step's whole gradients (on every rank: a collective inside the step)."""
    caught: list[dict[str, torch.Tensor]] = []
    engine.before_optimizer_step.append(lambda e: caught.append(whole_gradients(e)))
    return caught


def _norm(stats: Any, grads: dict[str, torch.Tensor]) -> tuple[float | None, dict[str, float]]:
    """The engine's norm before clipping (None without clipping) and each gradient's sum of squares."""
    squares = {name: float(g.double().pow(2).sum()) for name, g in grads.items()}
    return stats.grad_norm, squares


def reference_rank(job: CertifyJob, folder: str, locate: int | None = None) -> dict[str, Any]:
    """Train ``job`` in this one process; write its tensors to ``folder``; return losses and norms."""
    engine, dataset, loader = _engine(job, reference_layout(job.config.layout))
    root = Path(folder)
    if locate is None:
        torch.save(whole_parameters(engine), root / "init.pt")
        settings, names = muon_of(engine)  # what Muon steps, for the layouts' measured allowance (certification.muon)
        (root / "muon.json").write_text(json.dumps({"settings": settings, "names": names}))
    caught = _grad_catcher(engine)
    tape = ModuleTape(engine.model) if locate is not None else None
    out: dict[str, Any] = {"losses": [], "grad_norms": [], "squares": [], "order": [], "determinism": state()}
    for step in range(job.steps if locate is None else locate + 1):
        caught.clear()
        if tape is not None:
            tape.active = step == locate
        stats = engine.train_step(loader.batch_at(step))
        grads = caught[0] if caught else {}
        norm, squares = _norm(stats, grads)
        out["losses"].append(stats.loss)
        out["grad_norms"].append(norm)
        out["squares"].append(squares)
        if locate is None:
            torch.save({"grads": grads, "params": whole_parameters(engine)}, root / f"step{step}.pt")
    out["order"] = [name for name, _ in engine.model.named_parameters()]
    if tape is not None:
        record = {
            "forward": {n: tape.grouped(n, False, 1) for n in tape.forward_order},
            "backward": {n: tape.grouped(n, True, 1) for n in tape.backward_order},
            "forward_order": tape.forward_order,
            "backward_order": tape.backward_order,
        }
        torch.save(record, root / f"modules{locate}.pt")
        tape.remove()
    return out


def layout_rank(job: CertifyJob, index: int, budget: Budget, folder: str, locate: int | None = None) -> dict:
    """Train ``job`` under its ``index``-th layout on this rank and compare with the reference in ``folder``:
    per step the loss, the norm, and per parameter held here its gradient's and value's ``TensorDiff``; with
    ``locate``, instead, the module-by-module differences of step ``locate``."""
    layout = job.resolved[index]
    engine, dataset, loader = _engine(job, layout)
    root = Path(folder)
    if locate is not None:
        return _locate(engine, dataset, loader, layout, budget, root, locate)
    caught = _grad_catcher(engine)
    previous = torch.load(root / "init.pt", mmap=True, weights_only=True)
    noise: dict[str, torch.Tensor] = {}
    muon = json.loads((root / "muon.json").read_text())
    spread = MuonSpread(muon["settings"], set(muon["names"])) if muon["settings"] else None
    muon_allowed: dict[str, torch.Tensor] = {}  # per Muon matrix: its measured spread times the steps, so far
    out: dict[str, Any] = {"losses": [], "grad_norms": [], "squares": [], "grads": [], "params": []}
    out["determinism"] = state()
    for step in range(job.steps):
        caught.clear()
        stats = engine.train_step(loader.batch_at(step))
        grads = caught[0] if caught else {}
        params = whole_parameters(engine)
        reference = torch.load(root / f"step{step}.pt", mmap=True, weights_only=True)
        rel = budget.rel(step)
        grad_diffs: dict[str, TensorDiff] = {}
        floor = _rms_of([reference["grads"][name] for name in grads])
        for name, grad in grads.items():
            wanted = reference["grads"][name]
            grad_diffs[name] = diff_tensor(name, grad, wanted, rel, floor=floor)
            quiet = wanted.abs() <= 2 * rel * max(rms(wanted), floor)  # rounding noise: Adam steps it either way
            noise[name] = quiet | noise[name] if name in noise else quiet
        param_diffs: dict[str, TensorDiff] = {}
        steps_taken = {
            name: float((reference["params"][name] - previous[name]).abs().max()) if value.numel() else 0.0
            for name, value in params.items()
        }
        any_step = max(steps_taken.values(), default=0.0)  # the optimizer's step size: what noise may be turned into
        for name, grad in grads.items():
            measured = spread.spread(name, grad, reference["grads"][name]) if spread is not None else None
            if measured is not None:  # twice what Muon itself makes of the two runs' gradients
                muon_allowed[name] = muon_allowed.get(name, 0.0) + 2 * measured * steps_taken.get(name, 0.0)
        for name, value in params.items():
            wanted = reference["params"][name]
            extra: torch.Tensor | float = budget.update_rel * (1 + step) * steps_taken[name]
            if name in muon_allowed:
                extra = extra + muon_allowed[name]
            if name in noise:  # a key bias's gradient: how far Adam moves it depends on the noise, up to a full step
                extra = extra + noise[name].double() * 2 * (1 + step) * any_step
            param_diffs[name] = diff_tensor(name, value, wanted, rel, extra)
        norm, squares = _norm(stats, grads)
        out["losses"].append(stats.loss)
        out["grad_norms"].append(norm)
        out["squares"].append(squares)
        out["grads"].append(grad_diffs)
        out["params"].append(param_diffs)
        previous = reference["params"]
    return out


def _rms_of(tensors: list[torch.Tensor]) -> float:
    """The RMS of every element of ``tensors`` together."""
    count = sum(t.numel() for t in tensors)
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors) / count) if count else 0.0


def _ep_modules(model: torch.nn.Module) -> set[str]:
    """Modules holding expert slices: their outputs are the tokens dispatched to this rank (not comparable)."""
    return {
        name or "(model)"
        for name, module in model.named_modules()
        if any(getattr(p, "ep_slice", None) is not None for p in module.parameters(recurse=False))
    }


def _fused(model: torch.nn.Module, name: str) -> int:
    module = model.get_submodule(name) if name != "(model)" else model
    weight = getattr(module, "weight", None)
    return int(getattr(weight, "tp_fused_parts", 1)) if isinstance(weight, torch.Tensor) else 1


def _locate(engine: Any, dataset: Any, loader: Any, layout: Any, budget: Budget, root: Path, step: int) -> dict:
    """Steps 0..``step``; at ``step`` record every module and compare it, whole, with the reference's record."""
    skip = _ep_modules(engine.model) if layout.ep > 1 else set()
    tape = ModuleTape(engine.model, skip)
    scale = 1.0
    for at in range(step + 1):
        tape.active = at == step
        if tape.active:  # each rank's loss gradient is G x the step's (G replicas, then averaged), x the loss scale
            scale = float(engine.mesh.size(GRAD_AXIS)) * float(engine.precision.loss_scale or 1.0)
        engine.train_step(loader.batch_at(at))
    tape.remove()
    reference = torch.load(root / f"modules{step}.pt", weights_only=True)
    rel = budget.rel(step)
    found: dict[str, list[dict[str, Any]]] = {"forward": [], "backward": []}
    for kind in ("forward", "backward"):
        names = sorted(set(getattr(tape, f"{kind}_order")) & set(reference[kind]))
        for name in names:
            wanted = reference[kind][name]
            local = tape.grouped(name, kind == "backward", layout.microbatches)
            if local is not None and kind == "backward":
                local = [grad / scale for grad in local]
            if wanted is None or local is None or len(local) != len(wanted):
                found[kind].append({"module": name, "diff": None})
                continue
            diffs: list[TensorDiff] = []
            comparable = True
            for mine, theirs in zip(local, wanted):
                whole = whole_activation(engine, mine, theirs.shape, dataset.seq_len, _fused(engine.model, name))
                comparable = comparable and whole is not None
                if whole is not None:
                    diffs.append(diff_tensor(name, whole, theirs, rel))
            worst = max(diffs, key=lambda d: d.ratio) if comparable and diffs else None
            found[kind].append({"module": name, "diff": worst})
    return {"modules": found, "order": {k: reference[f"{k}_order"] for k in ("forward", "backward")}}


def grad_norm(norm: float | None, squares: dict[str, float]) -> float:
    """The engine's norm before clipping, else the norm of the (whole) gradients."""
    return norm if norm is not None else math.sqrt(sum(squares.values()))
