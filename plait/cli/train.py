"""``plait train``: on a laptop, launch ``--nproc`` local processes; inside torchrun, be the training program.

``plait train`` launches ``--nproc`` local processes through torchrun's own launcher (``torch.distributed.run``,
standalone rendezvous) running ``python -m plait train`` again; inside a torchrun worker (LOCAL_RANK set) it is
the training program itself (``plait.train.loop``). So on a cluster the same program runs under
``torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m plait train``.
``--max-restarts N`` is torchrun's: the agent restarts every worker when one fails, and each resumes from the
last checkpoint (``plait/train/fault.py``, docs/launching.md).

One job per run folder, and no rank outlives its launcher: the launcher locks the run folder before it starts any
worker and holds the lock until it exits (``RunFolderLock``; without plait's launcher, rank 0 takes it), and every
worker dies with the process that started it (``plait.launch.die_with_parent``), so a launcher killed with
SIGKILL leaves nothing running that could write into the folder a resumed job then uses.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from plait.errors import ConfigError, PlaitError

if TYPE_CHECKING:
    from plait.train.config import RunConfig
    from plait.train.fault import RunFolderLock


def add_train_command(commands: Any) -> None:
    """Register ``plait train`` on the ``plait`` parser's subcommands."""
    from plait.train.presets import DESCRIPTIONS

    train = commands.add_parser(
        "train",
        help="train plait's GPT (dense or MoE) or a local Hugging Face model under any layout (default: synthetic "
        "addition, 4 local CPU processes)",
        description="Train plait's GPT (dense or MoE) or a local Hugging Face model (--set model.hf=FOLDER) on "
        "synthetic tasks, text or prepared token folders, under any layout ([layout]: dp, tp, pp, cp, ep, ZeRO). "
        "Without torchrun around it, launches --nproc local processes; under torchrun it is the training program.",
    )
    train.add_argument("--config", help="a TOML run configuration ([layout], [model], [data], [train])")
    train.add_argument(
        "--preset",
        metavar="NAME",
        help="start from a named run configuration ("
        + "; ".join(f"{name}: {text}" for name, text in DESCRIPTIONS.items())
        + "); --config and --set apply on top",
    )
    train.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one setting, e.g. --set layout.dp=2 --set train.steps=100 (repeatable)",
    )
    train.add_argument("--nproc", type=int, default=4, help="local processes to launch (default 4)")
    train.add_argument("--out", help="run folder for metrics, plot and checkpoints (default runs/<id>)")
    train.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="restart all workers up to N times when one fails; each restart resumes from the last "
        "checkpoint, so it needs train.save_every (default 0: a failed rank fails the job)",
    )
    train.add_argument(
        "--trace",
        nargs="?",
        const="",
        default=None,
        metavar="PATH",
        help="trace the last --trace-steps steps of every rank into one Chrome/Perfetto timeline "
        "(default PATH <run>/trace.json; also .summary.json and .png beside it)",
    )
    train.add_argument("--trace-steps", type=int, default=10, metavar="N", help="steps to trace (default 10)")
    train.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default=None,
        help="torch.distributed backend (default: nccl with CUDA GPUs, gloo otherwise); gloo lets several ranks "
        "share one GPU (for tests)",
    )


def _in_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "RANK" in os.environ


def launch_out(args: argparse.Namespace) -> str:
    """The run folder a launch writes: --out, else ``runs/<time>``."""
    return str(args.out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S")))


def worker_args(args: argparse.Namespace, out: str | None = None) -> list[str]:
    """The ``plait train`` arguments each launched worker runs with (inside torchrun, plait train is the worker
    whatever --nproc says): the run folder, the preset and configuration, tracing and the backend."""
    forwarded = ["train", "--out", out or launch_out(args)]
    if args.preset:
        forwarded += ["--preset", args.preset]
    if args.config:
        forwarded += ["--config", args.config]
    for item in args.overrides:
        forwarded += ["--set", item]
    if args.trace is not None:
        forwarded += [f"--trace={args.trace}", f"--trace-steps={args.trace_steps}"]
    if args.backend:
        forwarded += [f"--backend={args.backend}"]
    return forwarded


def _launch(args: argparse.Namespace) -> int:
    """Re-run this command in ``args.nproc`` processes under torchrun's launcher, holding the run folder's lock;
    returns the exit code."""
    from plait.launch import LAUNCHER_PID_ENV
    from plait.train.fault import RunFolderLock

    out = launch_out(args)
    forwarded = worker_args(args, out)
    lock = RunFolderLock.acquire(out)  # held until the job ends, or this process dies, however it dies
    previous = os.environ.get(LAUNCHER_PID_ENV)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # the workers' parent: they die with it
    try:
        return _run_torchrun(args, forwarded)
    finally:
        lock.release()
        if previous is None:
            os.environ.pop(LAUNCHER_PID_ENV, None)
        else:
            os.environ[LAUNCHER_PID_ENV] = previous


def _run_torchrun(args: argparse.Namespace, forwarded: list[str]) -> int:
    """torchrun's launcher, in this process, running ``forwarded`` on ``args.nproc`` workers; the exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from plait.threads import THREADS_ENV, per_rank_default

    os.environ.setdefault(THREADS_ENV, str(per_rank_default(args.nproc)))  # torchrun's own default would be 1
    if args.max_restarts:  # a restart must not read the last attempt's addresses (pytorch/pytorch#135712)
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    parser = get_args_parser()
    parser.allow_abbrev = False  # the worker's own flags (--nproc, --out) must not match torchrun's by prefix
    torchrun_args = parser.parse_args(
        [
            "--standalone",
            f"--nproc-per-node={args.nproc}",
            f"--max-restarts={args.max_restarts}",
            "--module",
            "plait",
            *forwarded,
        ]
    )
    try:
        run(torchrun_args)
    except ChildFailedError as error:
        from plait.train.fault import describe_exit

        failed = ", ".join(f"rank {rank} ({describe_exit(f.exitcode)})" for rank, f in sorted(error.failures.items()))
        print(f"plait: error: training failed on {failed}; see that rank's error above.", file=sys.stderr)  # noqa: T201
        return 1
    return 0


def _check_before_launch(args: argparse.Namespace) -> None:
    """Raise the error a worker would raise for bad input, before any process is started."""
    from plait.data import make_dataset
    from plait.train.config import check_model_fits_data, load_config
    from plait.train.fault import RankGuard

    config = load_config(args.config, args.overrides, args.preset)
    config.layout.resolve(args.nproc).check_batch(config.train.global_batch)
    fault = RankGuard.from_env(0).fault  # PLAIT_WATCHDOG_S and PLAIT_FAULT_INJECT read as every worker will
    if fault is not None and fault.rank >= args.nproc:
        raise ConfigError(
            f"PLAIT_FAULT_INJECT names rank {fault.rank}, but the job has ranks 0..{args.nproc - 1}. "
            f"Fix: name one of them, or unset PLAIT_FAULT_INJECT."
        )
    if args.max_restarts > 0 and not config.train.save_every:
        raise ConfigError(
            f"--max-restarts {args.max_restarts} restarts the workers from the last checkpoint, but train.save_every "
            f"is 0 (no checkpoints), so every restart would start over from step 0. Fix: checkpoint, e.g. "
            f"--set train.save_every=100 (checkpoints go to <run>/ckpt), or drop --max-restarts."
        )
    try:
        dataset = make_dataset(
            config.data.dataset_name, **config.data.dataset_kwargs()
        )  # prepares the stdlib corpus once
    except PlaitError:
        raise
    except ValueError as error:
        raise ConfigError(f"[data] section: {error}") from error
    check_model_fits_data(config.model, dataset.vocab_size, dataset.seq_len, config.data.path or config.data.name)
    from plait.models.build import check_model_section

    check_model_section(config.model, dataset.vocab_size, dataset.seq_len)
    import torch

    from plait.train.fits import check_run_fits

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    check_run_fits(config, config.layout.resolve(args.nproc), dataset, device, args.nproc)
    if config.train.init_from and not os.path.exists(config.train.init_from):
        raise ConfigError(
            f"train.init_from={config.train.init_from!r} does not exist. Fix: give a plait checkpoint folder, a "
            f".safetensors file or a Hugging Face folder."
        )


def check_backend(backend: str | None, nproc: int) -> str:
    """The backend ``nproc`` local workers will use (``--backend``, or the default for this machine), refused
    before any process starts as each worker would refuse it (``plait.distributed``: NCCL without a GPU, or
    more NCCL ranks than GPUs)."""
    import torch

    from plait.distributed import check_gpu_sharing, choose_backend, gpu_of_local_ranks

    cuda = torch.cuda.is_available()
    chosen = choose_backend(backend, "cuda" if cuda else "cpu")
    check_gpu_sharing(chosen, gpu_of_local_ranks(nproc, torch.cuda.device_count() if cuda else 0))
    return chosen


def _start_rank() -> None:
    """A torchrun worker's first act: die with the process that started it (plait's launcher, whose pid it was
    handed, or torchrun's agent)."""
    from plait.launch import die_with_parent, launcher_pid

    if _in_torchrun():
        die_with_parent(f"rank {os.environ.get('RANK', '?')}", launcher_pid())


def _lock_run_folder(config: RunConfig) -> RunFolderLock | None:
    """The run folder's lock, where this process must hold it: plait's launcher holds it for its workers;
    otherwise rank 0 (of a job torchrun started, or a lone process) does. The folder is fixed here, once."""
    from plait.launch import launcher_pid
    from plait.train.fault import RunFolderLock
    from plait.train.loop import default_run_dir

    config.train.out = config.train.out or str(default_run_dir())  # the folder locked is the folder written
    if (_in_torchrun() and launcher_pid() == os.getppid()) or os.environ.get("RANK", "0") not in ("", "0"):
        return None
    return RunFolderLock.acquire(config.train.out)


def _train(args: argparse.Namespace) -> int:
    from plait.distributed import init, shutdown
    from plait.train.config import load_config
    from plait.train.loop import run

    overrides = list(args.overrides) + ([f"train.out={args.out!r}".replace("'", '"')] if args.out else [])
    _start_rank()
    config = load_config(args.config, overrides, args.preset)
    lock = _lock_run_folder(config)
    try:
        run(config, world=init(backend=args.backend), trace=args.trace, trace_steps=args.trace_steps)
    except BaseException:
        shutdown(wait_for_peers=False)
        raise
    finally:
        if lock is not None:
            lock.release()
    shutdown()
    return 0


def run_train(args: argparse.Namespace) -> int:
    """``plait train``: launch local workers, or (inside torchrun) train on this rank."""
    if args.nproc < 1:
        raise PlaitError(f"--nproc {args.nproc} must be at least 1.")
    if args.trace is not None and args.trace_steps < 1:
        raise ConfigError(f"--trace-steps {args.trace_steps} must be at least 1. Fix: e.g. --trace-steps 5.")
    if args.max_restarts < 0:
        raise ConfigError(
            f"--max-restarts {args.max_restarts} must be >= 0. Fix: 0 (a failed rank fails the "
            f"job) or N > 0 (restart all workers up to N times, resuming from the checkpoint)."
        )
    if not _in_torchrun():
        check_backend(args.backend, args.nproc)
    if not _in_torchrun() and (args.nproc > 1 or args.max_restarts > 0):
        _check_before_launch(args)
        return _launch(args)
    agent_restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if _in_torchrun() and args.max_restarts not in (0, agent_restarts):
        note = (
            f"plait: warning: --max-restarts {args.max_restarts} has no effect inside torchrun (its agent "
            f"allows {agent_restarts}); pass --max-restarts to torchrun instead."
        )
        print(note, file=sys.stderr)  # noqa: T201 - CLI output
    return _train(args)


__all__ = ["add_train_command", "check_backend", "run_train"]
