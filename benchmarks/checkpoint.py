"""``python -m benchmarks.run --suite checkpoint``: plait's checkpoints against plain DCP, and the training stall of
synchronous vs asynchronous saves.

**Save / load.** On the same model, optimizer and layout, after two training steps (so AdamW's states exist):

- plait: ``engine.save(dir)`` (layout-free pieces, plait.json, RNG files, SHA-256 of every file) and
  ``engine.load(dir)`` (checks every file's size and digest, each rank its share, then reads);
- plain DCP: ``get_state_dict(model, optimizer)`` + ``dcp.save(state, checkpoint_id=dir)``, and
  ``get_state_dict`` + ``dcp.load`` + ``set_state_dict`` on torch's own parallel model of the same layout:
  ``dp2`` DistributedDataParallel, ``tp2`` ``parallelize_module`` (Colwise/Rowwise plan), ``dp2 x tp2 ZeRO-3``
  ``parallelize_module`` over the tp dim of a 2-D mesh then ``fully_shard`` over its dp dim (FSDP2 + TP).

Seconds are wall clock on rank 0 between barriers (the job waits for its slowest rank), the median over rounds
that alternate the contenders (A B, B A, ...), with min..max; bytes are the checkpoint folder's. "sha256 s" is
the time one process takes to digest every file of plait's checkpoint (the ranks share it when saving and
loading), to show what the checksums cost.

**Stall.** plait at ``dp2 x tp2 ZeRO-3`` trains ``steps`` steps with a save every ``every`` steps (retention keeps
2), with no save, synchronous saves (``Checkpointer``) and asynchronous saves (``Checkpointer(async_save=True)``,
the job waiting for the last save at the end), the modes interleaved over rounds. Stall per save = (block time -
no-save block time) / saves; "blocking s" is the median time a ``save`` call held the training loop (an async one:
waiting for the previous save, the small files, staging the host copy).
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.launch import launch
from benchmarks.model_parallel import torch_tp_plan
from benchmarks.workload import Workload, write_text
from plait.models import GPTConfig, lm_loss

log = logging.getLogger("benchmarks.checkpoint")

WORKLOAD = Workload(model=GPTConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=256), global_batch=16)
"""A larger GPT than the training suites' (3.3 M parameters: a 40 MB checkpoint with AdamW), so that writing
bytes, not per-entry overhead, dominates."""
CASES: dict[str, tuple[int, dict[str, Any]]] = {
    "dp2": (2, {"dp": 2}),
    "tp2": (2, {"tp": 2, "dp": 1}),
    "dp2 x tp2 ZeRO-3": (4, {"dp": 2, "tp": 2, "zero": 3}),
}
STALL_CASE = "dp2 x tp2 ZeRO-3"


@dataclass(frozen=True)
class Spec:
    """One launch (picklable)."""

    case: str
    workload: Workload
    rounds: int
    folder: str
    stall_steps: int = 12
    stall_every: int = 4
    stall: bool = False


@dataclass
class Timings:
    save_s: dict[str, list[float]] = field(default_factory=dict)
    load_s: dict[str, list[float]] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)
    sha256_s: float = 0.0
    stall: dict[str, list[float]] = field(default_factory=dict)
    blocking: dict[str, list[float]] = field(default_factory=dict)
    saves_per_block: int = 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _folder_bytes(folder: Path) -> tuple[int, int]:
    files = [p for p in folder.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


def _timed(fn: Any) -> float:
    _barrier()
    started = time.perf_counter()
    fn()
    _barrier()
    return time.perf_counter() - started


# ----------------------------------------------------------------------------------------------- contenders
class PlaitContender:
    def __init__(self, workload: Workload, layout: dict[str, Any]) -> None:
        import plait

        self.engine = plait.parallelize(
            workload.build_model(),
            plait.Layout(**layout),
            optimizer=workload.optimizer,
            loss_fn=lm_loss,
            max_grad_norm=workload.max_grad_norm,
        )
        self.dp = (self.engine.mesh.index("dp"), self.engine.mesh.size("dp"))

    def step(self, batch: Any) -> None:
        self.engine.train_step(batch)

    def save(self, folder: Path) -> None:
        self.engine.save(folder)

    def load(self, folder: Path) -> None:
        self.engine.load(folder)


class TorchContender:
    """torch's own parallel model of the layout, AdamW, and DCP through ``get_state_dict`` / ``set_state_dict``."""

    def __init__(self, workload: Workload, layout: dict[str, Any]) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import parallelize_module

        model = workload.build_model()
        dp, tp = layout.get("dp", 1), layout.get("tp", 1)
        rank = dist.get_rank()
        self.loss_parallel = tp > 1
        if tp > 1 and dp > 1:
            mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
            parallelize_module(model, mesh["tp"], torch_tp_plan(model))
            for block in model.blocks.values():
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
            self.dp = (rank // tp, dp)
        elif tp > 1:
            parallelize_module(model, init_device_mesh("cpu", (tp,)), torch_tp_plan(model))
            self.dp = (0, 1)
        else:
            model = nn.parallel.DistributedDataParallel(model)
            self.dp = (rank, dp)
        self.model = model
        self.optimizer = workload.optimizer([p for p in model.parameters() if p.requires_grad])

    def step(self, batch: Any) -> None:
        from torch.distributed.tensor.parallel import loss_parallel

        inputs, targets = batch
        logits = self.model(inputs)
        if self.loss_parallel:
            with loss_parallel():
                lm_loss(logits, targets).backward()
        else:
            lm_loss(logits, targets).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def save(self, folder: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(folder))

    def load(self, folder: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(folder))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


CONTENDERS = {"plait": PlaitContender, "DCP get_state_dict": TorchContender}


# ----------------------------------------------------------------------------------------------- one rank
def _rank(spec: Spec) -> Timings:
    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    try:
        return _measure(spec)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _measure(spec: Spec) -> Timings:
    world, layout = CASES[spec.case]
    rank = dist.get_rank() if dist.is_initialized() else 0
    base = Path(spec.folder)
    out = Timings()
    contenders = {name: cls(spec.workload, layout) for name, cls in CONTENDERS.items()}
    batches = {name: spec.workload.batches(*c.dp, 2 + spec.stall_steps) for name, c in contenders.items()}
    for name, contender in contenders.items():
        for step in range(2):
            contender.step(batches[name][step])
    for r in range(spec.rounds):
        order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
        for name in order:
            folder = base / f"{name.split()[0]}-{r}"
            contender = contenders[name]
            out.save_s.setdefault(name, []).append(_timed(lambda c=contender, f=folder: c.save(f)))
            out.load_s.setdefault(name, []).append(_timed(lambda c=contender, f=folder: c.load(f)))
            if rank == 0:
                out.bytes[name], out.files[name] = _folder_bytes(folder)
                if name == "plait" and r == 0:
                    from plait.checkpoint.integrity import digest_file

                    started = time.perf_counter()
                    for path in folder.rglob("*"):
                        if path.is_file():
                            digest_file(path)
                    out.sha256_s = time.perf_counter() - started
            _barrier()
            if rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
    if spec.stall:
        _stall(spec, contenders["plait"], batches["plait"][2:], out)
    return out


def _stall(spec: Spec, plait: PlaitContender, batches: list[Any], out: Timings) -> None:
    from plait.checkpoint import Checkpointer

    engine = plait.engine
    modes = ("none", "sync", "async")
    out.saves_per_block = spec.stall_steps // spec.stall_every
    for r in range(spec.rounds):
        for mode in modes if r % 2 == 0 else tuple(reversed(modes)):
            root = Path(spec.folder) / f"stall-{mode}-{r}"
            saver = Checkpointer(engine, root, keep=2, async_save=mode == "async")

            def block(mode: str = mode, saver: Checkpointer = saver) -> None:
                for k, batch in enumerate(batches):
                    engine.train_step(batch)
                    if mode != "none" and (k + 1) % spec.stall_every == 0:
                        saver.save()
                        out.blocking.setdefault(mode, []).append(saver.last_blocking_s)
                saver.wait()

            out.stall.setdefault(mode, []).append(_timed(block))
            if dist.get_rank() == 0:
                shutil.rmtree(root, ignore_errors=True)


# ----------------------------------------------------------------------------------------------- the suite
def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run_checkpoint_suite(
    rounds: int = 3,
    stall_steps: int = 12,
    stall_every: int = 4,
    cases: tuple[str, ...] = tuple(CASES),
    stall_case: str = STALL_CASE,
    workload: Workload = WORKLOAD,
) -> list[dict[str, Any]]:
    """Each of ``cases`` (plait vs DCP save/load) and the stall at ``stall_case``; one row per contender and case,
    and one per stall mode."""
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="plait-bench-ckpt-") as tmp:
        workload = workload.with_text(write_text(Path(tmp) / "text.txt"))
        for case in cases:
            world = CASES[case][0]
            log.info(
                "checkpoint %s: save/load rounds %d at %d ranks%s",
                case,
                rounds,
                world,
                " + stall" if case == stall_case else "",
            )
            spec = Spec(case, workload, rounds, str(Path(tmp) / "ckpt"), stall_steps, stall_every, case == stall_case)
            result: Timings = launch(_rank, world, spec)[0]
            plait_save = statistics.median(result.save_s["plait"])
            for name in CONTENDERS:
                rows.append(
                    {
                        "suite": "checkpoint",
                        "kind": "save/load",
                        "case": case,
                        "world": world,
                        "contender": name,
                        "save_s": _spread(result.save_s[name]),
                        "load_s": _spread(result.load_s[name]),
                        "bytes": result.bytes[name],
                        "files": result.files[name],
                        "sha256_s": result.sha256_s if name == "plait" else None,
                        "save_vs_dcp": plait_save / statistics.median(result.save_s[name]),
                        "rounds": rounds,
                        "workload": workload.describe(),
                    }
                )
            if result.stall:
                none = statistics.median(result.stall["none"])
                for mode, seconds in result.stall.items():
                    blocking = result.blocking.get(mode, [])
                    rows.append(
                        {
                            "suite": "checkpoint",
                            "kind": "stall",
                            "case": case,
                            "world": world,
                            "contender": mode,
                            "block_s": _spread(seconds),
                            "stall_per_save_s": (statistics.median(seconds) - none) / result.saves_per_block
                            if mode != "none"
                            else 0.0,
                            "blocking_s": statistics.median(blocking) if blocking else 0.0,
                            "saves": result.saves_per_block,
                            "steps": stall_steps,
                            "rounds": rounds,
                            "workload": workload.describe(),
                        }
                    )
    return rows


def _s(spread: dict[str, float]) -> str:
    return f"{spread['median']:.3f} ({spread['min']:.3f}..{spread['max']:.3f})"


def markdown(rows: list[dict[str, Any]], command: str, conditions: str) -> str:
    """The suite's block for BENCHMARKS.md: the save/load table, then the stall table."""
    lines = [f"`{command}`", ""]
    lines += [
        "| layout | ranks | contender | save s (min..max) | load s (min..max) | MB on disk | files | sha256 s, 1 core |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in (r for r in rows if r["kind"] == "save/load"):
        sha = "-" if row["sha256_s"] is None else f"{row['sha256_s']:.3f}"
        lines.append(
            f"| {row['case']} | {row['world']} | {row['contender']} | {_s(row['save_s'])} | {_s(row['load_s'])} | "
            f"{row['bytes'] / 1e6:.2f} | {row['files']} | {sha} |"
        )
    stall = [r for r in rows if r["kind"] == "stall"]
    if stall:
        first = stall[0]
        lines += [
            "",
            f"Training stall, plait {first['case']} ({first['world']} ranks): {first['steps']} steps, a save every "
            f"{first['steps'] // max(1, first['saves'])} ({first['saves']} saves per block), {first['rounds']} rounds.",
            "",
            "| saves | block s (min..max) | stall per save s | save call blocks s (median) |",
            "|---|---|---|---|",
        ]
        for row in stall:
            lines.append(
                f"| {row['contender']} | {_s(row['block_s'])} | {row['stall_per_save_s']:+.3f} | "
                f"{row['blocking_s']:.3f} |"
            )
    rows0 = rows[0] if rows else {}
    lines += ["", f"Workload: {rows0.get('workload', '-')}. {conditions}."]
    return "\n".join(lines)


def print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console

    Console(width=200).print(markdown(rows, "python -m benchmarks.run --suite checkpoint", "this run"))


__all__ = ["CASES", "markdown", "print_table", "run_checkpoint_suite"]
