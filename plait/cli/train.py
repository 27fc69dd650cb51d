"""``plait train``: on a laptop, launch ``--nproc`` local processes; inside torchrun, be the training program.

``plait train`` launches ``--nproc`` local processes through torchrun's own launcher (``torch.distributed.run``,
on plait's loopback rendezvous: ``plait.rendezvous``) running ``python -m plait train`` again; inside a torchrun
worker (LOCAL_RANK set) it is the training program itself (``plait.train.loop``). So on a cluster the same program runs under
``torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m plait train``.
``--max-restarts N`` is torchrun's: the agent restarts every worker when one fails, and each resumes from the
last checkpoint (``plait/train/fault.py``, docs/launching.md). SIGTERM or Ctrl-C stops every rank after a saved
step and exits with 128 + the signal's number; a second signal stops at once (``_LauncherSignals``,
``plait.train.stop``).

One job per run folder, and no rank outlives its launcher: the launcher locks the run folder before it starts any
worker and holds the lock until it exits (``RunFolderLock``; without plait's launcher, rank 0 takes it), and every
worker dies with the process that started it (``plait.launch.die_with_parent``), so a launcher killed with
SIGKILL leaves nothing running that could write into the folder a resumed job then uses.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Any

from plait.cli.ft import add_ft_arguments, set_group_environment
from plait.errors import ConfigError, PlaitError

if TYPE_CHECKING:
    from types import FrameType

    from plait.train.config import RunConfig
    from plait.train.fault import RunFolderLock

DEFAULT_STOP_GRACE_S = 60
"""How long plait's launcher gives its workers to finish their step and save it after SIGTERM / SIGINT."""


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
        "--stop-grace",
        type=int,
        default=DEFAULT_STOP_GRACE_S,
        metavar="S",
        help="on SIGTERM or Ctrl-C the workers finish their step and save it; after S seconds without that they "
        f"are killed (default {DEFAULT_STOP_GRACE_S}); a second signal stops at once",
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
    add_deterministic_flag(train, "training")
    add_ft_arguments(train)
    train.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default=None,
        help="torch.distributed backend (default: nccl with CUDA GPUs, gloo otherwise); gloo lets several ranks "
        "share one GPU (for tests)",
    )


def _launch_fault_tolerant(args: argparse.Namespace) -> int:
    """``--ft`` / ``--ft-replay``: the quorum service and one torchrun job per replica group (``plait.ft.launch``)."""
    from plait.ft.launch import run

    return run(args, _check_before_launch(args).layout)


def add_deterministic_flag(parser: Any, what: str) -> None:
    """``--deterministic`` (``train.deterministic``; ``plait.determinism``), for plait train and plait certify."""
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help=f"bitwise repeatable {what}, CUDA included: torch's deterministic algorithms, cuBLAS workspace "
        ":4096:8, cuDNN deterministic, NCCL_ALGO=Ring / NCCL_PROTO=Simple on every rank (train.deterministic; "
        "slower on GPUs: docs/certify.md)",
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


def resume_args(args: argparse.Namespace, out: str) -> list[str]:
    """The ``plait`` command line that runs this launch again on the same run folder (which resumes it)."""
    forwarded = worker_args(args, out)
    restarts = ["--max-restarts", str(args.max_restarts)] if args.max_restarts else []
    grace = ["--stop-grace", str(args.stop_grace)] if args.stop_grace != DEFAULT_STOP_GRACE_S else []
    return ["plait", forwarded[0], "--nproc", str(args.nproc), *restarts, *grace, *forwarded[1:]]


def _launch(args: argparse.Namespace, config: RunConfig) -> int:
    """Re-run this command in ``args.nproc`` processes under torchrun's launcher, holding the run folder's lock;
    returns the exit code. With ``train.deterministic`` the workers inherit ``plait.determinism``'s environment
    (NCCL reads it when their process group starts)."""
    import shlex

    from plait.launch import LAUNCHER_PID_ENV
    from plait.train.announce import JOB_STARTED_ENV
    from plait.train.fault import RunFolderLock
    from plait.train.stop import RESUME_COMMAND_ENV

    out = launch_out(args)
    forwarded = worker_args(args, out)
    lock = RunFolderLock.acquire(out)  # held until the job ends, or this process dies, however it dies
    env = {
        LAUNCHER_PID_ENV: str(os.getpid()),  # the workers' parent: they die with it
        RESUME_COMMAND_ENV: shlex.join(resume_args(args, out)),  # what rank 0 names when a signal stops the run
        JOB_STARTED_ENV: str(time.time()),  # a restarted attempt reports the job's whole time too
    }
    if config.train.deterministic:
        from plait.determinism import DETERMINISTIC_ENV

        env.update(DETERMINISTIC_ENV)
    previous = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        return _run_torchrun(args, forwarded)
    finally:
        lock.release()
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


_QUIET_WHEN_STOPPING = {
    "torch.distributed.elastic.agent.server.api": "Received %s death signal, shutting down workers",
    "torch.distributed.elastic.multiprocessing.api": "Sending process %s closing signal %s",
}
"""torchrun's routine lines about a stop it was asked for (rank 0 says where it stopped, in one line)."""


def _drop_routine_stop_lines(record: logging.LogRecord) -> bool:
    return record.msg != _QUIET_WHEN_STOPPING.get(record.name)


class _LauncherSignals:
    """SIGTERM and SIGINT in plait's launcher (torchrun's agent, in this process, handles neither:
    ``--signals-to-handle``). The first becomes the agent's own ``SignalException``: the agent stops watching
    (so no restart follows, whatever ``--max-restarts`` says), forwards the signal to every worker and gives
    them ``--stop-grace`` seconds to finish their step and save it (``plait.train.stop``) before it kills them.
    The second ends the launcher at once, and its workers die with it (``plait.launch.die_with_parent``)."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, Any] = {}

    def install(self) -> _LauncherSignals:
        from plait.train.stop import STOP_SIGNALS

        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        for name in _QUIET_WHEN_STOPPING:
            logging.getLogger(name).removeFilter(_drop_routine_stop_lines)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        from plait.train.stop import signal_name, stop_exit_code

        name = signal_name(signum)
        if self.signum:  # os.write: a signal handler must not re-enter a Python stream
            os.write(2, f"plait: second {name}: stopping at once; the workers are killed unsaved.\n".encode())
            os._exit(stop_exit_code(signum))
        self.signum = signum
        for logger in _QUIET_WHEN_STOPPING:
            logging.getLogger(logger).addFilter(_drop_routine_stop_lines)
        raise SignalException(f"plait train got {name}", sigval=signal.Signals(signum))


def _loopback_interface() -> str | None:
    """The loopback network interface's name (Linux "lo", macOS "lo0"), where the system lists one."""
    import socket

    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((name for name in ("lo", "lo0") if name in names), None)


def _run_torchrun(args: argparse.Namespace, forwarded: list[str]) -> int:
    """torchrun's launcher, in this process, running ``forwarded`` on ``args.nproc`` workers; the exit code
    (``plait.train.stop.stop_exit_code`` after SIGTERM / SIGINT).

    The rendezvous is plait's loopback one (``plait.rendezvous``): nothing of it listens beyond 127.0.0.1, and
    gloo's own connections between the workers use the loopback interface (``GLOO_SOCKET_IFNAME``, unless set)."""
    import uuid

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from plait.rendezvous import register_loopback_backend
    from plait.threads import THREADS_ENV, per_rank_default
    from plait.train.stop import stop_exit_code

    os.environ.setdefault(THREADS_ENV, str(per_rank_default(args.nproc)))  # torchrun's own default would be 1
    loopback = _loopback_interface()
    if loopback:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
    parser = get_args_parser()
    parser.allow_abbrev = False  # the worker's own flags (--nproc, --out) must not match torchrun's by prefix
    options = {option for action in parser._actions for option in action.option_strings}
    grace = [f"--shutdown-timeout={args.stop_grace}"] if "--shutdown-timeout" in options else []  # else 30 s
    torchrun_args = parser.parse_args(
        [
            "--nnodes=1",
            f"--rdzv-backend={register_loopback_backend()}",
            f"--rdzv-id={uuid.uuid4().hex}",
            f"--nproc-per-node={args.nproc}",
            f"--max-restarts={args.max_restarts}",
            "--signals-to-handle=SIGHUP,SIGQUIT",  # SIGTERM and SIGINT are _LauncherSignals'
            *grace,
            "--module",
            "plait",
            *forwarded,
        ]
    )
    signals = _LauncherSignals().install()
    try:
        run(torchrun_args)
    except SignalException as stopped:  # the workers have stopped (rank 0 said where) or were killed
        return stop_exit_code(stopped.sigval)
    except ChildFailedError as error:
        from plait.train.fault import describe_exit

        failed = ", ".join(f"rank {rank} ({describe_exit(f.exitcode)})" for rank, f in sorted(error.failures.items()))
        print(f"plait: error: training failed on {failed}; see that rank's error above.", file=sys.stderr)  # noqa: T201
        return 1
    finally:
        signals.restore()
    return 0


def _check_before_launch(args: argparse.Namespace) -> RunConfig:
    """Raise the error a worker would raise for bad input, before any process is started; the configuration."""
    from plait.data import make_dataset
    from plait.train.config import check_model_fits_data, load_config
    from plait.train.fault import RankGuard

    config = load_config(args.config, args.overrides, args.preset)
    config.layout.resolve(args.nproc).check_batch(config.train.global_batch)
    from plait.checkpoint.signing import check_key

    check_key()  # a checkpoint key set but unusable: one line here, not one per rank after the launch
    fault = RankGuard.from_env(0).fault  # PLAIT_WATCHDOG_S and PLAIT_FAULT_INJECT read as every worker will
    if fault is not None and fault.rank >= args.nproc:
        raise ConfigError(
            f"PLAIT_FAULT_INJECT names rank {fault.rank}, but the job has ranks 0..{args.nproc - 1}. "
            f"Fix: name one of them, or unset PLAIT_FAULT_INJECT."
        )
    heals = args.ft or args.ft_replay or args.ft_group is not None or "PLAIT_FT_GROUPS" in os.environ  # plait.ft
    if args.max_restarts > 0 and not config.train.save_every and not heals:  # --ft: a restarted group heals
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
    return config


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
    """Train on this rank; 0, or 128 + the signal's number when SIGTERM / SIGINT stopped it (``plait.train.stop``)."""
    from plait.distributed import init, shutdown
    from plait.train.config import load_config
    from plait.train.loop import run
    from plait.train.stop import StopRequest, stop_exit_code

    overrides = list(args.overrides) + ([f"train.out={args.out!r}".replace("'", '"')] if args.out else [])
    _start_rank()
    stop = StopRequest(lone=not _in_torchrun()).install()  # a signal from here on: stop after a saved step
    try:
        config = load_config(args.config, overrides, args.preset)
        if config.train.deterministic:  # before the process group and CUDA start (plait.determinism)
            from plait.determinism import make_deterministic

            make_deterministic()
        lock = _lock_run_folder(config)
        try:
            summary = run(
                config, world=init(backend=args.backend), trace=args.trace, trace_steps=args.trace_steps, stop=stop
            )
        except BaseException:
            shutdown(wait_for_peers=False)
            raise
        finally:
            if lock is not None:
                lock.release()
        shutdown()
    finally:
        stop.restore()
    return stop_exit_code(summary.stopped_by) if summary.stopped_by else 0


def run_train(args: argparse.Namespace) -> int:
    """``plait train``: launch local workers, or (inside torchrun) train on this rank."""
    if args.nproc < 1:
        raise PlaitError(f"--nproc {args.nproc} must be at least 1.")
    if args.trace is not None and args.trace_steps < 1:
        raise ConfigError(f"--trace-steps {args.trace_steps} must be at least 1. Fix: e.g. --trace-steps 5.")
    if args.stop_grace < 0:
        raise ConfigError(f"--stop-grace {args.stop_grace} must be >= 0 seconds. Fix: e.g. --stop-grace 120.")
    if args.deterministic:
        args.overrides = [*args.overrides, "train.deterministic=true"]  # the workers get it through --set
    if args.max_restarts < 0:
        raise ConfigError(
            f"--max-restarts {args.max_restarts} must be >= 0. Fix: 0 (a failed rank fails the "
            f"job) or N > 0 (restart all workers up to N times, resuming from the checkpoint)."
        )
    if not _in_torchrun():
        check_backend(args.backend, args.nproc)
    if args.ft_spares and not (args.ft or args.ft_replay or args.ft_group is not None):
        raise ConfigError(
            f"--ft-spares {args.ft_spares} without --ft: spare replica groups serve a fault-tolerant job. Fix: add --ft "
            f"(or --ft-group G on a cluster)."
        )
    if not _in_torchrun() and (args.ft or args.ft_replay):
        return _launch_fault_tolerant(args)
    if args.ft_group is not None:
        set_group_environment(args)
    if not _in_torchrun() and (args.nproc > 1 or args.max_restarts > 0):
        return _launch(args, _check_before_launch(args))
    agent_restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if _in_torchrun() and args.max_restarts not in (0, agent_restarts):
        note = (
            f"plait: warning: --max-restarts {args.max_restarts} has no effect inside torchrun (its agent "
            f"allows {agent_restarts}); pass --max-restarts to torchrun instead."
        )
        print(note, file=sys.stderr)  # noqa: T201 - CLI output
    return _train(args)


__all__ = ["add_deterministic_flag", "add_train_command", "check_backend", "run_train"]
