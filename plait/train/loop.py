"""The program ``plait train`` runs on every rank: data, reference GPT, parallelize, train, evaluate, report.

Rank 0 shows progress (a live bar in a terminal, log lines otherwise), writes ``metrics.jsonl`` (and the same
scalars as TensorBoard event files, ``plait.train.tensorboard``), ``config.toml`` (the resolved configuration:
``plait train --config`` reruns it), ``samples.jsonl`` (what the model writes at each evaluation,
``plait.train.samples``), ``summary.json`` and ``loss.png`` to the run folder. The model is built by
``plait.models.build`` (reference GPT, preset or Hugging Face), optionally from ``train.init_from``'s weights
(``plait.train.weights``); the optimizer, schedule and decay groups by ``plait.train.optim``. With ``train.save_every`` it checkpoints into ``<run>/ckpt`` and resumes
from there when restarted on the same folder (by hand, or by torchrun's agent under ``--max-restarts``);
``plait.train.fault`` watches for hangs.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from plait.checkpoint import Checkpointer, check_key, has_checkpoints
from plait.checkpoint.identity import config_differences, describe_model
from plait.data import ShardedBatches, make_dataset
from plait.determinism import check_group, describe_state, make_deterministic
from plait.determinism import state as determinism_state
from plait.distributed import World, init
from plait.engine import Engine, StepStats
from plait.errors import ConfigError
from plait.logging import get_logger, job_warning
from plait.models import lm_loss
from plait.models.build import build_model
from plait.models.loss import ChunkedCrossEntropy
from plait.observe.stragglers import StragglerMeter
from plait.parallel.materialize import WeightSource, deferred_init
from plait.parallelize import parallelize
from plait.train import announce, replicas
from plait.train.config import RunConfig, check_model_fits_data
from plait.train.evaluation import (
    EVAL_OFFSET,
    eval_text,
    evaluate_sources,
    evaluation_batches,
    evaluation_record,
    source_batches,
)
from plait.train.fault import RankGuard, resume_metrics
from plait.train.fits import check_run_fits, local_world_size
from plait.train.metrics import MetricsWriter, StepMeter, check_step, dumps, plot_metrics, step_record
from plait.train.optim import decay_groups, lr_scheduler_factory, optimizer_factory
from plait.train.samples import write_samples
from plait.train.stop import StopRequest, resume_command, signal_name
from plait.train.tensorboard import open_tensorboard
from plait.train.weights import check_fits, open_weights

log = get_logger(__name__)


@dataclass
class Summary:
    """The outcome of a run (identical on every rank)."""

    run_dir: str
    steps: int
    final_loss: float
    eval_loss: float
    accuracy: float
    tokens_per_s: float
    """Training throughput after warm-up: the tokens of this run's steps after its first, over those steps'
    own seconds (the first step, which grows the allocator and builds lazy state, is left out; a run of one
    step reports that step)."""
    seconds: float
    world_size: int
    layout: str
    stopped_by: int = 0
    """The signal that stopped the run after ``steps`` (``plait.train.stop``); 0 when it ran to its end."""


@dataclass
class Throughput:
    """Tokens per second of a run's steps after its first: the first step grows the allocator and builds lazy
    state (warm-up), so it is counted apart and used only when it is the only step."""

    steps: int = 0
    first_tokens: int = 0
    first_seconds: float = 0.0
    tokens: int = 0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        """Count one step of ``tokens`` tokens that took ``seconds``."""
        if self.steps == 0:
            self.first_tokens, self.first_seconds = tokens, seconds
        else:
            self.tokens, self.seconds = self.tokens + tokens, self.seconds + seconds
        self.steps += 1

    @property
    def tokens_per_s(self) -> float:
        if self.seconds > 0:
            return self.tokens / self.seconds
        return self.first_tokens / self.first_seconds if self.first_seconds > 0 else 0.0


def default_run_dir() -> Path:
    """``runs/<id>``: the launcher's id when there is one (the same on every rank), else a timestamp."""
    run_id = os.environ.get("PLAIT_RUN_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / run_id


def build(config: RunConfig, world: World, optimizer: Any = None) -> tuple[Engine, Any, Any]:
    """Dataset, model and engine for ``config`` (validated before any collective). ``optimizer``: a factory for
    ``plait.parallelize`` in place of ``train.optimizer``'s (``plait certify --optimizer``)."""
    layout = config.layout.resolve(world.world_size)
    layout.check_batch(config.train.global_batch)
    if config.train.pipeline_trace and layout.pp == 1:
        raise ConfigError(
            f"train.pipeline_trace={config.train.pipeline_trace!r} needs pipeline parallelism, but "
            f"the layout has pp=1. Fix: set layout.pp > 1 (e.g. --set layout.pp=2), or drop it."
        )
    dataset = make_dataset(config.data.dataset_name, **config.data.dataset_kwargs())
    check_model_fits_data(config.model, dataset.vocab_size, dataset.seq_len, config.data.path or config.data.name)
    check_run_fits(config, layout, dataset, world.device, local_world_size())  # before any weight is allocated
    torch.manual_seed(config.train.seed)
    train = config.train
    model, weights = build_on_meta(config, dataset.vocab_size, dataset.seq_len)
    model_config = model.config  # what the run's FLOP count reads
    groups = decay_groups(model, train.weight_decay_skip) if train.weight_decay else None
    engine = parallelize(
        model,
        layout,
        optimizer=optimizer if optimizer is not None else optimizer_factory(train, world.device),
        loss_fn=ChunkedCrossEntropy(train.loss_chunk) if train.loss_chunk else lm_loss,
        max_grad_norm=train.max_grad_norm or None,
        lr_scheduler=lr_scheduler_factory(train),
        device=world.device,
        param_groups=groups,
        weights=weights,
        sync=replicas.engine_sync(train),  # under --ft the quorum runs the outer step (plait.ft.outer)
    )
    return engine, dataset, model_config


def build_on_meta(config: RunConfig, vocab_size: int, seq_len: int) -> tuple[Any, WeightSource | None]:
    """The run's model on the meta device (its construction recorded: ``parallelize`` materialises each rank's
    share, bitwise what building it whole gives under the seed) and where its weights are read from, if anywhere:
    ``train.init_from`` (checked to fit, before any collective), else a ``model.hf`` folder (as ``from_pretrained``:
    a tensor the folder lacks is initialised, with a warning)."""
    model = deferred_init(build_model, config.model, vocab_size, seq_len, weights=False)
    source: WeightSource | None = None
    if config.train.init_from:
        source, meta = open_weights(config.train.init_from)
        where = f"train.init_from={config.train.init_from!r}"
        check_fits(model, source.shapes(), where)
        announce.starting_weights(source.description, "train.init_from")
        differences = config_differences(meta.get("model"), describe_model(model)) if isinstance(meta, dict) else []
        if differences:  # same names and shapes, another model (e.g. n_head): its weights would compute otherwise
            raise ConfigError(
                f"{where} holds another model: {'; '.join(differences)}. Fix: set [model] to the model that was "
                f"trained, or start from weights of this model."
            )
    elif "hf" in config.model:
        source, _meta = open_weights(str(config.model["hf"]))
        found = check_fits(model, source.shapes(), source.description, strict=False)
        announce.starting_weights(source.description, "model.hf")
        missing = [name for name in model.state_dict() if name not in found]
        if missing:
            job_warning(log, "%s has no %s: initialised as the model's own code does", source.description, missing[:5])
    return model, source


def _samples(engine: Engine, dataset: Any, train: Any, step: int, run_dir: Path | None) -> None:
    """Append ``train.samples`` continuations of evaluation prompts to samples.jsonl (a collective; rank 0
    writes): prompts from the validation split when the data has one, else fresh samples from ``EVAL_OFFSET`` on."""
    if not train.samples:
        return
    held_out = dataset.validation_split() if callable(getattr(dataset, "validation_split", None)) else None
    source, offset = (held_out, 0) if held_out is not None else (dataset, EVAL_OFFSET)  # prompts never trained on
    records = write_samples(
        engine, source, step, train.samples, train.sample_tokens, train.sample_temperature, train.seed, offset
    )
    if run_dir is not None:
        with open(run_dir / "samples.jsonl", "a") as handle:
            for record in records:
                handle.write(json.dumps(record) + "\n")
        log.info("step %d sample: %r -> %r", step, records[0]["prompt"], records[0]["completion"])


def _data_ranks(engine: Engine) -> tuple[int, int]:
    return engine.mesh.index("dp"), engine.mesh.size("dp")


def _note_restart(attempt: int, step: int, save_every: int, heals: bool = False) -> None:
    """Log a restart by torchrun's agent (and warn when there is no checkpoint to resume from, unless the group
    ``heals`` from a live replica group: ``plait.ft``)."""
    max_restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if attempt:
        where = "healing from a live replica group" if heals else f"resuming at step {step}"
        log.info("restart %d of %d: %s", attempt, max_restarts, where)
    if max_restarts and not save_every and not heals:
        log.warning(
            "the launcher may restart this job %d time(s), but train.save_every=0: a restart starts over "
            "from step 0. Fix: --set train.save_every=N.",
            max_restarts,
        )


def progress_bar(console: Any) -> Any:
    """rich's Progress for the training loop: a short bar, the step counter and the time never cut, and the
    step's figures (loss, tok/s, the last evaluation) wrapped onto more lines rather than cut at the terminal's
    width (at 80 columns they were cut mid-word)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Column

    return Progress(
        TextColumn("[bold]train", table_column=Column(no_wrap=True)),
        BarColumn(bar_width=20),
        MofNCompleteColumn(table_column=Column(no_wrap=True)),
        TimeElapsedColumn(table_column=Column(no_wrap=True)),
        TextColumn("{task.fields[info]}", table_column=Column(ratio=1, overflow="fold")),
        console=console,
        expand=True,
    )


class _Progress:
    """A rich progress bar in a terminal; periodic log lines otherwise (CI, files). Rank 0 only."""

    def __init__(self, enabled: bool, total: int, start: int, log_every: int) -> None:
        self.enabled, self.log_every, self.bar = enabled, log_every, None
        if enabled:
            from rich.console import Console

            console = Console(stderr=True)
            if console.is_terminal:
                self.bar = progress_bar(console)
                self.task = self.bar.add_task("train", total=total, completed=start, info="")
                self.bar.start()

    def update(self, step: int, info: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)
        elif self.enabled and step % self.log_every == 0:
            log.info("step %d %s", step, info)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def runs_ahead(device: torch.device) -> bool:
    """Whether the host queues work ahead of ``device`` (an accelerator), so that reading a result waits."""
    return device.type != "cpu"


class _Records:
    """Rank 0's step records. On an accelerator they are written in batches: a step's loss and gradient norm stay
    on the device until its record is written (``StepStats.loss``), so the host never waits for the device
    between steps; the loop flushes every ``log_every`` steps, before an evaluation, a checkpoint or the end, and
    when the run fails (a rank killed outright loses at most the records since the last flush, steps that a
    restart from the last checkpoint trains and records again). On the CPU reading a loss waits for nothing, so
    every step's record is written at once, as before. Every rank keeps the records and reads their losses at the
    same flushes (rank 0 also writes them): a loss that is not finite stops every rank there, at the same step
    (``plait.train.metrics.check_step``), after its record is written."""

    def __init__(self, writer: MetricsWriter | None) -> None:
        self.writer = writer
        self.pending: list[tuple[StepStats, float, dict[str, Any]]] = []
        self.info = ""
        """The progress line of the last flushed step."""

    def add(self, stats: StepStats, lr: float, observed: dict[str, Any]) -> None:
        self.pending.append((stats, lr, observed))

    def flush_after_failure(self) -> None:
        """Write what can still be written when the run is failing (a device error may make a loss unreadable)."""
        try:
            self.flush()
        except Exception as error:  # noqa: BLE001 - the run's own error is the one to report
            log.warning("could not write the last %d step record(s): %s", len(self.pending), error)

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        if self.writer is not None:
            for stats, lr, observed in pending:
                self.writer.write({**step_record(stats, lr), **observed})
        if pending:
            stats, _, observed = pending[-1]
            mfu = f"  MFU {100 * observed['mfu']:.1f}%" if observed["mfu"] is not None else ""
            moe = f"  experts max/mean {max(stats.moe.imbalance):.2f}" if stats.moe is not None else ""
            self.info = f"loss {stats.loss:.4f}  {stats.tokens_per_s:,.0f} tok/s{mfu}{moe}"
        for stats, _, _ in pending:
            check_step(stats)


def _stopped(
    signum: int,
    engine: Engine,
    run_dir: Path,
    writer: MetricsWriter | None,
    stats: StepStats | None,
    throughput: Throughput,
    seconds: float,
    world: World,
) -> Summary:
    """End a run a signal stopped (its last step saved): no final evaluation, trace or summary.json; rank 0 logs
    the one line that says where it stopped and how to resume."""
    if writer:
        writer.close()
        log.warning(
            "stopped by %s at step %d (checkpoint saved in %s); resume with: %s",
            signal_name(signum),
            engine.step,
            run_dir / "ckpt",
            resume_command(str(run_dir)),
        )
    nan = float("nan")
    return Summary(
        run_dir=str(run_dir),
        steps=engine.step,
        final_loss=stats.loss if stats else nan,
        eval_loss=nan,
        accuracy=nan,
        tokens_per_s=throughput.tokens_per_s,
        seconds=seconds,
        world_size=world.world_size,
        layout=engine.layout.short(),
        stopped_by=signum,
    )


def run(
    config: RunConfig,
    world: World | None = None,
    trace: str | None = None,
    trace_steps: int = 10,
    stop: StopRequest | None = None,
) -> Summary:
    """Train as ``config`` says on this rank; returns the summary (rank 0 also writes the run folder).

    A hang watchdog and the test-only injected fault (``plait.train.fault``) watch the whole run. With ``trace`` (a
    path; "" for ``<run>/trace.json``) the last ``trace_steps`` steps are traced on every rank
    (``plait.observe.trace.Tracer``) and merged into that file, its ``.summary.json`` and its ``.png``. With
    ``stop`` (the CLI's SIGTERM / SIGINT record, ``plait.train.stop``) a signal to any rank stops every rank after
    the same step, which is saved; the summary then has ``stopped_by`` set and no final evaluation. With
    ``train.deterministic`` deterministic mode (``plait.determinism``) is set before anything else runs."""
    if config.train.deterministic:
        check_group(world.backend if world is not None else None)  # NCCL read its environment when it started
        make_deterministic()
    world = world or init()
    if config.train.deterministic and world.rank == 0:
        log.info("deterministic mode: %s", describe_state(determinism_state()))
    with RankGuard.from_env(world.rank) as guard:
        return _run(config, world, guard, trace, trace_steps, stop)


def _run(
    config: RunConfig,
    world: World,
    guard: RankGuard,
    trace: str | None = None,
    trace_steps: int = 10,
    stop: StopRequest | None = None,
) -> Summary:
    if trace is not None and trace_steps < 1:  # before any collective, on every rank
        raise ConfigError(f"--trace-steps {trace_steps} must be at least 1. Fix: e.g. --trace-steps 5.")
    check_key()  # a checkpoint key set but unusable: one line on every rank, before any work
    guard.beat("building the model", timed=False)  # unbounded for a large model; collectives time out on their own
    engine, dataset, model_config = build(config, world)
    train = config.train
    run_dir = Path(train.out) if train.out else default_run_dir()
    ckpt = run_dir / "ckpt"
    previous = (run_dir / "config.toml").read_text() if (run_dir / "config.toml").is_file() else None
    if has_checkpoints(ckpt):  # newest intact; refuses if none is (a replica group too: if every group was lost)
        guard.beat("loading the checkpoint", timed=False)
        engine.load(ckpt)
        if world.rank == 0:
            announce.resumed(run_dir, engine.step, train.steps, previous, config.to_dict())
    saver = Checkpointer(
        engine, ckpt, train.keep_checkpoints, train.keep_every, train.async_save and train.save_every > 0
    )
    lead = world.rank == 0
    ft = replicas.start(config, engine, world, run_dir)  # per-step fault tolerance (plait.ft), when launched so
    if lead:
        _note_restart(guard.attempt, engine.step, train.save_every, heals=ft is not None)
        # a resumed step is recorded once (a replica group's later steps are in the live groups' records)
        resume_metrics(run_dir / "metrics.jsonl", engine.step, train.steps)
    writer = MetricsWriter(run_dir, open_tensorboard(run_dir, train.tensorboard, engine.step)) if lead else None
    if lead:
        (run_dir / "config.toml").write_text(config.dumps())
        log.info(
            "%s | %.2fM parameters in this rank's layers, %.2fM stored on it | %s",
            engine.mesh,
            engine.strategy.parameter_count() / 1e6,  # whole, also under ZeRO-3 (its module tensors are empty)
            engine.strategy.held_parameter_count() / 1e6,  # ZeRO-3: this rank's shards
            run_dir,
        )
    loader = ShardedBatches(dataset, train.global_batch, *_data_ranks(engine), start_step=engine.step)
    slots = None  # under plait.ft a group reads the data slot the quorum gives it at each step
    if ft is not None:
        slots = replicas.SlotBatches(dataset, train.global_batch, *_data_ranks(engine), ft.options.groups, engine.step)
    dp_rank, dp_size = _data_ranks(engine)  # evaluation: each replica group evaluates the whole held-out batches
    eval_batches, held_out = evaluation_batches(dataset, train.global_batch, train.eval_batches, dp_rank, dp_size)
    per_source = source_batches(dataset, train.global_batch, train.eval_batches, dp_rank, dp_size)  # a mixture's
    tokens_seen = getattr(dataset, "tokens_seen", None)  # a mixture: tokens of each source so far, for the records
    progress = _Progress(lead, train.steps, engine.step, train.log_every)
    stragglers = StragglerMeter.start(engine, train.straggler_every, train.straggler_lag, train.straggler_windows)
    meter = StepMeter(engine, model_config, dataset.seq_len, stragglers)  # stragglers ride its all-gather
    if ft is not None:  # the cross-group exchange's bytes, per rank, as the group's own axes
        meter.axes.append("replicate")
    tracer, trace_from = None, max(engine.step, train.steps - trace_steps)
    started, stats, last_eval = time.perf_counter(), None, ""
    throughput = Throughput()
    records = _Records(writer)
    record_every_step = not runs_ahead(engine.device)  # CPU: nothing to wait for, write each record at once
    stopped_by = 0
    try:
        for batch in guard.batches(loader if ft is None else itertools.repeat(None), engine):  # ft: by step
            if engine.step >= train.steps:
                break
            if trace is not None and tracer is None and engine.step >= trace_from:
                from plait.observe.trace import Tracer

                tracer = Tracer(engine).start()
            meter.before_step()
            stats, quorum = ft.train_step(slots) if ft is not None else (engine.train_step(batch), None)
            throughput.add(stats.tokens, stats.seconds)
            lr = engine.optimizer.param_groups[0]["lr"]
            observed = meter.measure(stats, stop.signum if stop is not None else 0)  # a collective: every rank
            if quorum is not None:
                observed.update(quorum)  # the replica groups committed at this step (plait.ft.log)
            stopped_by = meter.stop_signal  # the same on every rank: all stop after this step, saved
            if tokens_seen is not None:  # pure in the step: a resumed run records what the uninterrupted one would
                observed["tokens_by_source"] = tokens_seen(stats.step * train.global_batch)
            records.add(stats, lr, observed)
            last = stats.step >= train.steps
            evaluate = train.eval_every and stats.step % train.eval_every == 0 and not last and not stopped_by
            # the last step is saved too (generate, convert and a longer resume start from it), and a stop's step
            save = (train.save_every and (stats.step % train.save_every == 0 or last)) or stopped_by
            if save and train.sync != "sync" and stats.step % train.sync_every:  # mid-window: groups differ
                save = False
                if lead:
                    log.warning("step %d: not saved, inside an outer-step window of train.sync_every=%d (the "
                                "last checkpoint is the last boundary's)", stats.step, train.sync_every)  # fmt: skip
            if record_every_step or evaluate or save or stats.step % train.log_every == 0 or last:
                records.flush()  # reads the losses: on a GPU a host sync once per log interval, not per step
            if evaluate:
                guard.beat(f"step {stats.step}: evaluate")
                result = engine.evaluate(eval_batches, metric=dataset.accuracy_counts)
                sources = evaluate_sources(engine, per_source)
                last_eval = f"  {eval_text(result, held_out)} (step {stats.step})"
                if writer:
                    writer.write(evaluation_record(stats.step, result, held_out, sources))
                _samples(engine, dataset, train, stats.step, run_dir if lead else None)
            if save:
                guard.beat(f"step {stats.step}: save the checkpoint", timed=False)
                saver.save()  # train.async_save: waits for the previous save, stages a host copy, returns
                if lead and last and train.save_every and stats.step % train.save_every:
                    log.info("step %d: the last step, saved although train.save_every=%d", stats.step, train.save_every)
            progress.update(stats.step, records.info + last_eval)
            if stopped_by:
                break
    except BaseException:
        records.flush_after_failure()
        raise
    else:
        records.flush()
    finally:
        progress.close()
        if ft is not None:
            ft.close()
    guard.beat("waiting for the last checkpoint save", timed=False)
    saver.wait()  # the job ends with its last checkpoint published
    seconds = time.perf_counter() - started
    if stopped_by:
        return _stopped(stopped_by, engine, run_dir, writer, stats, throughput, seconds, world)
    guard.beat("writing traces after the last step", timed=False)
    if tracer is not None:  # a collective: every rank gathers its spans to rank 0
        tracer.save(Path(trace) if trace else run_dir / "trace.json")
    if train.pipeline_trace and stats is not None:  # the last training step, before evaluation runs the stages
        pipeline_trace = Path(train.pipeline_trace)
        timeline = engine.save_pipeline_trace(pipeline_trace, png=pipeline_trace.with_suffix(".png"))
        if lead:
            log.info(
                "pipeline timeline of step %d: bubble %.1f%% -> %s, %s",
                engine.step,
                100 * timeline.bubble_fraction,
                pipeline_trace,
                pipeline_trace.with_suffix(".png"),
            )
    guard.beat("final evaluation")
    result = engine.evaluate(eval_batches, metric=dataset.accuracy_counts)
    sources = evaluate_sources(engine, per_source)
    _samples(engine, dataset, train, engine.step, run_dir if lead else None)
    guard.beat("writing the run folder", timed=False)
    summary = Summary(
        run_dir=str(run_dir),
        steps=engine.step,
        final_loss=stats.loss if stats else float("nan"),
        eval_loss=result.loss,
        accuracy=result.accuracy,
        tokens_per_s=throughput.tokens_per_s,
        seconds=seconds,
        world_size=world.world_size,
        layout=engine.layout.short(),
    )
    if writer:
        writer.write(evaluation_record(engine.step, result, held_out, sources))
        writer.close()
        (run_dir / "summary.json").write_text(dumps(summary.__dict__, indent=2))  # NaN as null: strict JSON
        plot_metrics(
            writer.path, run_dir / "loss.png", f"plait train: {engine.layout.short()}, {world.world_size} ranks"
        )
        job = announce.job_seconds() if guard.attempt else None  # restarted: this attempt is not the whole job
        log.info(
            "done: %d steps in %.1f s%s, final loss %.4f, %s, %s tok/s -> %s",
            engine.step,
            seconds,
            f" (this attempt; {job:.1f} s since the job started, {guard.attempt} restart(s))" if job else "",
            summary.final_loss,
            eval_text(result, held_out, final=True),
            f"{summary.tokens_per_s:,.0f}",
            run_dir,
        )
        announce.next_steps(run_dir, saved=bool(train.save_every))
    return summary
