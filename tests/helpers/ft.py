"""Fault-tolerant jobs for the tests (``plait train --ft``): run one, read what it did, and train one device on
exactly the batches it committed."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from helpers.processes import ENV

from plait.data import IGNORE_INDEX, ShardedBatches, make_dataset
from plait.distributed import World
from plait.engine import Engine, StepStats
from plait.ft.log import ReplayLog, replica_dir
from plait.models import inputs as model_inputs
from plait.train.config import load_config
from plait.train.loop import build

SETTINGS = [
    "layout.dp_replicate=2",
    "layout.zero=3",
    "model.n_layer=4",
    "model.d_model=128",
    "train.eval_every=0",
    "train.samples=0",
    "train.max_grad_norm=0.5",  # clipped: a uniform gradient-scale error would hide under an unclipped Adam
    # SGD with momentum, not Adam: Adam turns the rounding noise of zero-gradient parameters (attention's key biases)
    # into full-size steps, and 160 such steps made a one-device comparison chaotic (1e-7 at step 100, 1e-2 at 160)
    "train.optimizer=sgd",
    "train.lr=0.05",
    "train.momentum=0.9",
]
"""HSDP with two replica groups of 2 ranks, ZeRO-3 inside each; a model big enough that a restarted group comes
back (about 15 s on a busy 2-core machine) while the live group still trains (about 0.2 s per step)."""
FT_ENV = {**ENV, "PLAIT_FT_HEARTBEAT_MS": "2000", "PLAIT_FT_TIMEOUT_S": "30"}


def documents(root: Path) -> Path:
    """A folder of packed instruction documents (``plait data prepare --instruct``, bytes tokenizer) in ``root``:
    300 prompt / response pairs of uneven lengths, half of them mostly prompt (a long question, a word of answer),
    half mostly response, and one in five with no prompt at all (a plain document, whose first target only
    ``eod_mask_loss`` masks). Windows of 32 tokens cut them anywhere, so rows score from 0 to 32 targets and two
    groups of 4 rows score clearly different counts (tens of tokens apart at most steps)."""
    from plait.data import prepare

    rng = random.Random(0)
    words = "the a of to in is it that for on with as was at by be this from or an are not but".split()

    def text(low: int, high: int) -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(low, high)))

    records = []
    for i in range(300):
        long_prompt = i % 2 == 0
        prompt = "" if i % 5 == 4 else text(8, 30) + "? " if long_prompt else text(1, 3) + "? "
        records.append({"prompt": prompt, "response": (text(0, 2) if long_prompt else text(8, 30)) + "."})
    source = root / "pairs.jsonl"
    source.write_text("".join(json.dumps(record) + "\n" for record in records))
    prepare([source], root / "documents", val_fraction=0.05, progress=False, instruct=True)
    return root / "documents"


def document_settings(folder: Path) -> list[str]:
    """The ``--set`` settings that train on ``documents(...)``: document attention, the end-of-document target
    masked, 8 rows of 32 tokens per step (4 per replica group, 2 per rank). Data seed 157: the groups' counts
    differ at each of the first 30 steps, and at step 5 group 0's rows are all prompt (N_0 = 0; group 1: 55).
    After ``SETTINGS`` (a whole list for ``run_ft``'s ``settings``)."""
    return [
        *SETTINGS,
        "data.name=tokens",
        f"data.path='{folder}'",
        "data.seed=157",
        "data.seq_len=32",
        "data.attention=document",
        "data.eod_mask_loss=true",
        "train.global_batch=8",
    ]


def run_ft(
    out: Path,
    steps: int,
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
    timeout: float = 600,
    nproc: int = 4,
    settings: list[str] = SETTINGS,
    fault_tolerant: bool = True,
) -> subprocess.CompletedProcess[str]:
    """``plait train --ft`` on ``nproc`` local processes (2 groups of nproc / 2) into ``out`` (``fault_tolerant=False``:
    the same job as plain HSDP, for a comparison)."""
    command = [sys.executable, "-m", "plait", "train", *(["--ft"] if fault_tolerant else [])]
    command += ["--nproc", str(nproc), "--out", str(out), "--max-restarts", "1"]
    for setting in [*settings, f"train.steps={steps}", f"train.save_every={steps}"]:
        command += ["--set", setting]
    return subprocess.run(
        command + list(extra), env={**FT_ENV, **(env or {})}, capture_output=True, text=True, timeout=timeout
    )


def starts(out: Path, group: int) -> list[dict]:
    """Every start of a rank of ``group`` (rank, pid, attempt)."""
    return [json.loads(line) for line in (replica_dir(out, group) / "starts.jsonl").read_text().splitlines()]


def step_records(out: Path, group: int) -> dict[int, dict]:
    path = replica_dir(out, group) / "metrics.jsonl"
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue  # the line being written
    return {r["step"]: r for r in records if "ft_groups" in r}


def one_device(out: Path, steps: int, weigh: str = "tokens") -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process trained, at each step, on the rows of the global batch that the committed groups read
    (group g of R: rows [g G/R, (g+1) G/R)); returns its parameters and its losses.

    ``weigh="tokens"``: one step on those rows together, the token mean over all their scored tokens (what the
    fault-tolerant run must equal). ``weigh="equal"``: the mutant that weighs every committed group alike,
    G = sum_g G_g / |Q| (each G_g a token mean over its own rows): what a combine ignoring N_g would train."""
    if weigh not in ("tokens", "equal"):
        raise ValueError(f"weigh={weigh!r}: 'tokens' (the run's weighting) or 'equal' (the mutant)")
    if weigh == "tokens":
        engine, records = one_device_steps(out, steps)
        return {name: p.detach().clone() for name, p in engine.module.named_parameters()}, [r.loss for r in records]
    engine, batches, log, share = _reference(out, [])
    losses = []
    for step in range(1, steps + 1):
        inputs, targets = batches.batch_at(step - 1)
        rows = [torch.arange(g * share, (g + 1) * share) for g in log.groups(step)]
        losses.append(_equal_step(engine, [(model_inputs.rows(inputs, r), targets[r]) for r in rows]))
    return {name: p.detach().clone() for name, p in engine.module.named_parameters()}, losses


def _reference(out: Path, overrides: list[str]) -> tuple[Any, ShardedBatches, ReplayLog, int]:
    """One device's engine for the run ``out`` (its config, then ``overrides``), its batches, the run's log and
    the rows of one group's share of the global batch."""
    log = ReplayLog.read(out)
    settings = ["layout.dp=1", "layout.zero=0", "train.out=''", *overrides]
    config = load_config(replica_dir(out, 0) / "config.toml", settings)
    engine, dataset, _ = build(config, World(0, 1, 0, torch.device("cpu"), None))
    global_batch = config.train.global_batch
    return engine, ShardedBatches(dataset, global_batch, 0, 1), log, global_batch // log.group_count


def one_device_steps(out: Path, steps: int, overrides: list[str] = ()) -> tuple[Any, list[StepStats]]:
    """``one_device``'s engine after ``steps`` steps (its config: the run's, then ``overrides``, e.g. layout.ep=1)
    and each step's StepStats (losses, an MoE model's routing statistics)."""
    engine, batches, log, share = _reference(out, list(overrides))
    records = []
    for step in range(1, steps + 1):
        inputs, targets = batches.batch_at(step - 1)
        rows = torch.cat([torch.arange(g * share, (g + 1) * share) for g in log.groups(step)])
        records.append(engine.train_step((model_inputs.rows(inputs, rows), targets[rows])))
    return engine, records


def scored_per_sequence(out: Path, step: int, overrides: list[str] = ()) -> list[float]:
    """Per replica group of the run ``out``: its scored tokens over its sequences at ``step`` (N_g / B_g)."""
    _, batches, log, share = _reference(out, list(overrides))
    scored = (batches.batch_at(step - 1)[1] != IGNORE_INDEX).sum(dim=1).double()
    return [float(scored[g * share : (g + 1) * share].mean()) for g in range(log.group_count)]


def _equal_step(engine: Engine, batches: list[tuple[model_inputs.Inputs, torch.Tensor]]) -> float:
    """One optimizer step whose gradient is the plain mean of the batches' token-mean gradients (the mutant of
    ``one_device``): the gradients of all but the last batch are kept and not committed (no optimizer step, as
    an uncommitted step of --ft), then added to the last one's before it is clipped and stepped."""
    step, kept, losses = engine.step, [], []

    def keep(engine: Engine) -> bool:
        kept.append([grad.clone() for grad in engine.strategy.owned_grads()])
        return False

    def mean(engine: Engine) -> bool:
        for index, grad in enumerate(engine.strategy.owned_grads()):
            grad.add_(sum(grads[index] for grads in kept)).div_(len(kept) + 1)
        return True

    for index, batch in enumerate(batches):
        engine.commit_gradients = mean if index == len(batches) - 1 else keep
        engine.step = step
        losses.append(engine.train_step(batch).loss)
    engine.commit_gradients = None
    return sum(losses) / len(losses)


def group_tokens(out: Path, steps: int) -> dict[int, list[int]]:
    """The scored targets N_g of each replica group's rows at each step 1..``steps`` (all R groups, committed or
    not), read from the run's data as its ranks read it."""
    config = load_config(replica_dir(out, 0) / "config.toml")
    dataset = make_dataset(config.data.dataset_name, **config.data.dataset_kwargs())
    groups = ReplayLog.read(out).group_count
    batches = ShardedBatches(dataset, config.train.global_batch, 0, 1)
    counts = {}
    for step in range(1, steps + 1):
        scored = (batches.batch_at(step - 1)[1] != IGNORE_INDEX).sum(dim=1)
        counts[step] = [int(part.sum()) for part in scored.chunk(groups)]
    return counts


def start_lighthouse() -> tuple[subprocess.Popen[str], str]:
    """``plait lighthouse`` on a free loopback port, and the address it printed."""
    server = subprocess.Popen(
        [sys.executable, "-m", "plait", "lighthouse", "--bind", "127.0.0.1:0", "--heartbeat-ms", "2000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=FT_ENV,
    )
    assert server.stdout is not None
    return server, server.stdout.readline().strip()


def group_command(out: Path, group: int, groups: int, lighthouse: str, steps: int, extra: list[str] = ()) -> list[str]:
    """One replica group of 2 ranks started by hand, as on a cluster node: its own layout (dp=2, no replicate)."""
    settings = [s for s in SETTINGS if not s.startswith("layout.dp_replicate")] + ["layout.dp=2"]
    settings += [f"train.steps={steps}", f"train.save_every={min(5, steps)}"]
    command = ["plait", "train", "--ft-group", str(group), "--ft-groups", str(groups), "--ft-lighthouse", lighthouse]
    command += ["--out", str(replica_dir(out, group))]
    for setting in [*settings, *extra]:
        command += ["--set", setting]
    return command


def torchrun_group(
    out: Path, group: int, groups: int, lighthouse: str, steps: int, port: int, extra: list[str] = ()
) -> list[str]:
    """The same group as a torchrun agent of its own (a node: c10d rendezvous on 127.0.0.1)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
    launcher += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"node{group}"]
    return launcher + ["-m"] + group_command(out, group, groups, lighthouse, steps, extra)


def wait_for_step(out: Path, group: int, step: int, process: subprocess.Popen[str], timeout: float = 300) -> None:
    """Until ``group`` has committed ``step`` (AssertionError when its process ends first or time runs out)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = replica_dir(out, group) / "metrics.jsonl"
        if path.is_file() and max(step_records(out, group), default=0) >= step:
            return
        assert process.poll() is None, f"group {group} ended (exit {process.returncode}) before step {step}"
        time.sleep(0.5)
    raise AssertionError(f"group {group} did not reach step {step} in {timeout} s")


def semisync_one_process(out: Path, steps: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The one-process simulation of a fault-tolerant LocalSGD / DiLoCo run over its committed log (plait.ft.outer):
    R one-device copies, copy g trained on group g's rows of each step's global batch, and after each window the
    papers' outer step (tests/helpers/semisync_reference.py's, torch's Nesterov SGD) over the copies of the groups
    the window committed; every copy then holds theta. A copy that rejoins (committed in a window, not in the one
    before) starts its inner optimizer afresh, as a healed group does. Returns copy 0's parameters and each step's
    loss over the committed groups' tokens (sum N_g L_g / sum N_g)."""
    from helpers.semisync_reference import outer_step

    from plait.ft.combine import group_weight

    log = ReplayLog.read(out)
    overrides = ["layout.dp=1", "layout.zero=0", "layout.dp_replicate=1", "train.sync=sync", "train.out=''"]
    config = load_config(replica_dir(out, 0) / "config.toml", overrides)
    train = load_config(replica_dir(out, 0) / "config.toml").train  # the run's own: its mode and outer settings
    built = [build(config, World(0, 1, 0, torch.device("cpu"), None)) for _ in range(log.group_count)]
    copies = [engine for engine, _, _ in built]
    theta = [p.detach().clone().requires_grad_(True) for p in copies[0].module.parameters()]
    outer = torch.optim.SGD(theta, lr=train.outer_lr, momentum=train.outer_momentum, nesterov=True)
    batches = ShardedBatches(built[0][1], train.global_batch, 0, 1)
    share, losses, every = train.global_batch // log.group_count, [], train.sync_every
    for step in range(1, steps + 1):
        committed = log.groups(step)
        if (step - 1) % every == 0 and step > every:  # a window's first step: rejoining copies start afresh
            for g in set(committed) - set(log.groups(step - 1)):
                copies[g].strategy.optimizer.state.clear()
        inputs, targets = batches.batch_at(step - 1)
        summed = tokens = 0.0
        for g, engine in enumerate(copies):
            rows = torch.arange(g * share, (g + 1) * share)
            engine.train_step((inputs[rows], targets[rows]))
            weight, loss = group_weight(engine)
            if g in committed:
                summed, tokens = summed + weight * float(loss), tokens + weight
        losses.append(summed / tokens)
        if step % every == 0:
            outer_step(train.sync, [copies[g].module for g in committed], theta, outer)
            with torch.no_grad():
                for g in set(range(len(copies))) - set(committed):
                    for param, value in zip(copies[g].module.parameters(), theta):
                        param.copy_(value)
    return {name: p.detach().clone() for name, p in copies[0].module.named_parameters()}, losses
