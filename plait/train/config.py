"""``RunConfig``: everything ``plait train`` needs, as typed sections loadable from TOML.

    [layout]   the parallel Layout (plait.layout.Layout)
    [model]    the reference GPT's GPTConfig fields, optionally on a ``preset`` (vocab_size and seq_len come
               from the data unless given), or a Hugging Face model: ``hf`` / ``hf_config`` (plait.models.build)
    [data]     which dataset ("addition", "bytes" of a text file, "tokens" of a prepared folder, "stdlib") and options
    [train]    steps, batch, optimizer, evaluation, output folder

Any field can be overridden on the command line with ``--set section.key=value``; the value is read as a
TOML value (``--set layout.tp=2``, ``--set train.lr=1e-3``, ``--set layout.recompute=[0,1]``) and falls back to
a plain string (``--set data.path=notes.txt``).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from plait.data.mixture import check_sources
from plait.data.text import check_text_file
from plait.data.tokens import ATTENTION_KINDS
from plait.errors import ConfigError, DataError, LayoutError
from plait.layout import Layout, from_mapping
from plait.parallel.semisync import SemiSync

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

FLOAT32_MAX = 3.4028234663852886e38
"""``torch.finfo(torch.float32).max``: the weights and optimizer states are float32 (master weights under every
precision), and torch turns each real setting into a float32 scalar at the step, failing mid-step beyond it."""
FLOAT32_TINY = 1.1754943508222875e-38
"""``torch.finfo(torch.float32).tiny``: a positive lr or eps below it rounds to 0 (or a denormal that hardware
flushes to 0) in float32: no training, or Adam's 0 / 0 for a weight whose gradient is 0."""


@dataclass
class DataConfig:
    """The dataset (docs/data.md):

    * ``name = "addition"``: synthetic addition (ships with plait; ``digits``);
    * ``name = "bytes"``: next-byte prediction on the text file at ``path``;
    * ``name = "tokens"``: packed windows of ``seq_len`` tokens from the folder ``path`` written by
      ``plait data prepare`` (``verify``: check every file's sha256, not only sizes; cheap folders always are);
    * ``name = "stdlib"``: the Python standard library's source, tokenized with a byte-level BPE of ``vocab``
      tokens, prepared on first use and cached (``corpus_mb`` > 0: only the first files holding that many MB).

    Token folders and the stdlib corpus hold documents: ``attention = "document"`` keeps attention inside each
    document of a packed window (positions restart at each one; default "causal": GPT-2 style), and
    ``eod_mask_loss`` ignores the target at each end-of-document token (``plait.data.tokens``).

    ``name = "tokens"`` with ``sources = [{path = "data/web", weight = 0.7}, {path = "data/code", weight = 0.3}]``
    (instead of ``path``) mixes several token folders by weight (``plait.data.mixture``; each may have a ``name``).
    """

    name: str = "addition"
    digits: int = 2
    path: str = ""
    seq_len: int = 64
    seed: int = 0
    vocab: int = 4096
    corpus_mb: float = 0.0
    verify: bool = False
    attention: str = "causal"
    eod_mask_loss: bool = False
    sources: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        """Every field checked whatever the dataset (``seq_len`` too, which the addition task takes from
        ``digits``), so a bad value is refused rather than ignored."""
        for name in ("digits", "seq_len", "vocab"):
            _integer(f"data.{name}", getattr(self, name), 1)
        _integer("data.seed", self.seed, 0)
        _number("data.corpus_mb", self.corpus_mb, lambda v: v >= 0, "be >= 0 (0: the whole corpus)", "1")
        if not isinstance(self.name, str) or not isinstance(self.path, str):
            raise ConfigError(
                f"data.name={self.name!r} and data.path={self.path!r} must be strings. Fix: quote them in TOML."
            )
        if not isinstance(self.verify, bool):
            raise ConfigError(f"data.verify={self.verify!r} must be true or false. Fix: data.verify=true.")
        if self.attention not in ATTENTION_KINDS:
            raise ConfigError(
                f"data.attention={self.attention!r} is unknown. Fix: 'causal' (documents run into each other) or "
                f"'document' (attention stays inside each document)."
            )
        if not isinstance(self.eod_mask_loss, bool):
            raise ConfigError(
                f"data.eod_mask_loss={self.eod_mask_loss!r} must be true or false. Fix: data.eod_mask_loss=true."
            )
        if self.sources:
            self._check_sources()
        if self.name == "bytes" and self.path:
            try:
                check_text_file(self.path, self.seq_len)  # before any work (a run folder, a launch)
            except DataError as error:
                raise ConfigError(str(error)) from None
        if (self.attention != "causal" or self.eod_mask_loss) and self.name in ("addition", "bytes"):
            raise ConfigError(
                f"data.attention={self.attention!r} / data.eod_mask_loss={self.eod_mask_loss} need documents, but "
                f"data.name={self.name!r} has none. Fix: data.name='tokens' (plait data prepare) or 'stdlib', or "
                f"leave them at 'causal' / false."
            )

    def _check_sources(self) -> None:
        """A mixture: ``name = "tokens"`` and no ``path``; every entry a folder with a positive weight."""
        if self.name != "tokens" or self.path:
            raise ConfigError(
                f"data.sources mixes token folders, but data.name={self.name!r} and data.path={self.path!r}. Fix: "
                f"data.name='tokens' and the folders in data.sources only (data.path='')."
            )
        try:
            self.sources = check_sources(self.sources)
        except DataError as error:
            raise ConfigError(str(error)) from error

    @property
    def dataset_name(self) -> str:
        """The dataset ``make_dataset`` builds: ``name``, or "mixture" for several token folders."""
        return "mixture" if self.sources else self.name

    def dataset_kwargs(self) -> dict[str, Any]:
        if self.sources:
            return {
                "sources": self.sources,
                "seq_len": self.seq_len,
                "seed": self.seed,
                "verify": self.verify,
                **self._docs(),
            }
        if self.name == "addition":
            return {"digits": self.digits, "seed": self.seed}
        if self.name == "bytes":
            if not self.path:
                raise ConfigError("data.name='bytes' needs a text file. Fix: --set data.path=some.txt")
            return {"path": self.path, "seq_len": self.seq_len, "seed": self.seed}
        if self.name == "tokens":
            if not self.path:
                raise ConfigError(
                    "data.name='tokens' needs a folder written by plait data prepare. Fix: plait data prepare "
                    "INPUT... --out DIR, then --set data.path=DIR"
                )
            return {
                "path": self.path,
                "seq_len": self.seq_len,
                "seed": self.seed,
                "verify": self.verify,
                **self._docs(),
            }
        if self.name == "stdlib":
            return {
                "seq_len": self.seq_len,
                "seed": self.seed,
                "vocab": self.vocab,
                "corpus_mb": self.corpus_mb,
                "verify": self.verify,
                **self._docs(),
            }
        raise ConfigError(f"data.name={self.name!r} is unknown. Fix: use 'addition', 'bytes', 'tokens' or 'stdlib'.")

    def _docs(self) -> dict[str, Any]:
        return {"attention": self.attention, "eod_mask_loss": self.eod_mask_loss}


@dataclass
class TrainConfig:
    """The training loop. ``global_batch`` is in samples, split over dp ranks and micro-batches. The optimizer,
    its schedule and weight-decay groups: ``plait.train.optim``."""

    steps: int = 1500
    global_batch: int = 64
    lr: float = 3e-3
    optimizer: str = "adamw"
    """adamw, adam, sgd, nadam, radam, adamax, rmsprop or adagrad (torch.optim's, elementwise: ZeRO runs all), or
    muon: torch.optim.Muon on the hidden matrices, AdamW (lr, betas, eps, weight_decay) on the rest, under every
    layout (``plait.train.optim``, docs/optimizers.md)."""
    muon_lr: float | None = None
    """Muon's lr (default: lr; Muon's update is scaled to AdamW's RMS, Moonlight's "match_rms_adamw")."""
    muon_momentum: float = 0.95
    """Muon's Nesterov momentum (Keller Jordan's, Moonlight's and torch's default)."""
    muon_weight_decay: float | None = None
    """Muon's decoupled weight decay (default: weight_decay, as Moonlight)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    momentum: float = 0.0
    """sgd and rmsprop."""
    weight_decay: float = 0.01
    weight_decay_skip: list[str] = field(default_factory=lambda: ["norms", "biases"])
    """Parameter kinds without weight decay: any of "norms", "biases", "embeddings" ([] decays everything)."""
    warmup_steps: int = 20
    lr_schedule: str = "cosine"
    """After the warm-up: "cosine" or "linear" decay to min_lr at the last step, or "constant"."""
    min_lr: float | None = None
    """The floor of the decay (default lr / 10)."""
    max_grad_norm: float = 1.0
    loss_chunk: int = 0
    """Chunked cross-entropy: the LM head and the loss over this many tokens at a time, so that the whole logits
    never exist (``plait.models.loss.ChunkedCrossEntropy``; 0: whole logits)."""
    init_from: str = ""
    """Start from these weights with a fresh optimizer: a plait checkpoint (any layout), a .safetensors file or a
    Hugging Face folder (plait.train.weights); "" starts from fresh weights."""
    seed: int = 0
    eval_every: int = 300
    eval_batches: int = 4
    log_every: int = 10
    save_every: int = 0
    keep_checkpoints: int = 3
    """Retention: keep the newest N checkpoints (0 keeps all); older ones go once a newer one is published and
    checked, never the only intact one (docs/checkpoints.md)."""
    keep_every: int = 0
    """Retention also keeps every step that is a multiple of K, for the record (0: none)."""
    async_save: bool = False
    """Write checkpoints in the background while training goes on (host copies; one save in flight at most)."""
    deterministic: bool = False
    """Bitwise repeatable reruns, CUDA included (``plait.determinism``: torch's deterministic algorithms, cuBLAS's
    workspace, cuDNN, NCCL_ALGO=Ring / NCCL_PROTO=Simple), set on every rank before any work; ``--deterministic``."""
    out: str = ""
    tensorboard: bool | None = None
    """TensorBoard event files beside metrics.jsonl (default: when the tensorboard package is installed)."""
    samples: int = 2
    """Continuations of evaluation prompts written to samples.jsonl at each evaluation (0: none)."""
    sample_tokens: int = 32
    sample_temperature: float = 0.8
    straggler_every: int = 50
    """Straggler detection every N steps (``plait.observe.stragglers``): the slowest rank by compute time, its lag
    over the median, per rank compute / comm / wait seconds, in the log, metrics.jsonl and TensorBoard (0: off)."""
    straggler_lag: float = 0.2
    """A rank is slow when its compute is this fraction above its peers' median (0.2: 20 %)."""
    straggler_windows: int = 3
    """A rank the slowest with lag above ``straggler_lag`` for this many windows in a row is warned about."""
    pipeline_trace: str = ""
    """With pp > 1: write the last training step's measured pipeline timeline here (Chrome/Perfetto JSON) and
    its picture next to it (same name, .png); "" turns it off."""
    sync: str = "sync"
    """How HSDP's replica groups (layout.dp_replicate) keep together: "sync" (every step), or semi-synchronously
    "localsgd" / "diloco": sync_every inner steps per group, then an outer step (``plait.parallel.semisync``)."""
    sync_every: int = 0
    """H, the inner steps per outer step of localsgd / diloco (required by them; save_every must be a multiple)."""
    outer_lr: float = 0.7
    """DiLoCo's outer learning rate (the paper's 0.7)."""
    outer_momentum: float = 0.9
    """DiLoCo's outer Nesterov momentum (the paper's 0.9)."""

    def __post_init__(self) -> None:
        """Every number checked before anything runs: integers in range, and every real hyper-parameter finite
        (``--set train.lr=inf`` is a valid TOML float: it would train NaNs) and in its range."""
        for name in ("steps", "global_batch", "eval_batches", "log_every", "straggler_windows"):
            _integer(f"train.{name}", getattr(self, name), 1)
        for name in (
            "eval_every",
            "save_every",
            "warmup_steps",
            "keep_checkpoints",
            "keep_every",
            "samples",
            "sample_tokens",
            "loss_chunk",
            "straggler_every",
        ):
            _integer(f"train.{name}", getattr(self, name), 0, " (0 turns it off)")
        _integer("train.seed", self.seed, 0)
        _number("train.lr", self.lr, lambda v: v >= FLOAT32_TINY, f"be at least {FLOAT32_TINY:.3g}", "3e-4")
        _number("train.eps", self.eps, lambda v: v >= FLOAT32_TINY, f"be at least {FLOAT32_TINY:.3g}", "1e-8")
        _number("train.momentum", self.momentum, lambda v: 0 <= v < 1, "be in [0, 1)", "0.9")
        _number("train.weight_decay", self.weight_decay, lambda v: v >= 0, "be >= 0", "0.1")
        _number("train.max_grad_norm", self.max_grad_norm, lambda v: v >= 0, "be >= 0 (0: no clipping)", "1.0")
        _number("train.straggler_lag", self.straggler_lag, lambda v: v >= 0, "be >= 0 (0.2: 20 % slower)", "0.2")
        _number("train.sample_temperature", self.sample_temperature, lambda v: v >= 0, "be >= 0 (0: greedy)", "0.8")
        _number("train.muon_momentum", self.muon_momentum, lambda v: 0 <= v < 1, "be in [0, 1)", "0.95")
        if self.muon_lr is not None:
            _number("train.muon_lr", self.muon_lr, lambda v: v >= FLOAT32_TINY, "be positive (or unset: lr)", "0.02")
        if self.muon_weight_decay is not None:
            _number("train.muon_weight_decay", self.muon_weight_decay, lambda v: v >= 0, "be >= 0 (or unset)", "0.1")
        if self.min_lr is not None:
            _number(
                "train.min_lr",
                self.min_lr,
                lambda v: 0 <= v <= self.lr,
                f"lie in [0, lr={self.lr}]",
                f"{self.lr / 10:g}",
            )
        betas = self.betas
        if not (isinstance(betas, (list, tuple)) and len(betas) == 2 and all(_real(b) and 0 <= b < 1 for b in betas)):
            raise ConfigError(
                f"train.betas={betas!r} must be two numbers in [0, 1). Fix: e.g. train.betas=[0.9, 0.95]."
            )
        for name in ("async_save", "deterministic", "tensorboard"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (name == "tensorboard" and value is None):
                raise ConfigError(f"train.{name}={value!r} must be true or false. Fix: train.{name}=true.")
        self._check_sync()
        from plait.train.optim import check_optim_config

        check_optim_config(self)

    def _check_sync(self) -> None:
        """train.sync and its settings; saves at outer-step boundaries only (where every replica group holds the
        same parameters)."""
        modes = ("sync", "localsgd", "diloco")
        if self.sync not in modes:
            raise ConfigError(f"train.sync={self.sync!r} is unknown. Fix: use one of {list(modes)}.")
        _integer("train.sync_every", self.sync_every, 0, " (0: unset)")
        if self.sync == "sync":
            return
        if self.sync_every < 1:
            raise ConfigError(
                f"train.sync={self.sync!r} needs train.sync_every=H, the inner steps between outer steps. Fix: e.g. "
                f"--set train.sync_every=100 (the DiLoCo paper: 500)."
            )
        _number("train.outer_lr", self.outer_lr, lambda v: v > 0, "be positive", "0.7")
        _number("train.outer_momentum", self.outer_momentum, lambda v: 0 <= v < 1, "be in [0, 1)", "0.9")
        if self.save_every % self.sync_every:
            raise ConfigError(
                f"train.save_every={self.save_every} is not a multiple of train.sync_every={self.sync_every}: under "
                f"train.sync={self.sync!r} checkpoints are written at outer-step boundaries only (mid-window the "
                f"replica groups hold different parameters). Fix: --set train.save_every="
                f"{max(self.sync_every, self.save_every // self.sync_every * self.sync_every)}."
            )

    def semisync(self) -> SemiSync | None:
        """The ``SemiSync`` of ``sync`` (None for "sync")."""
        if self.sync == "sync":
            return None
        return SemiSync(self.sync, self.sync_every, self.outer_lr, self.outer_momentum)


def _integer(where: str, value: Any, low: int, note: str = "") -> None:
    """ConfigError unless ``value`` is an integer >= ``low`` (TOML's 1e8 is a float: refused too)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{where}={value!r} must be an integer >= {low}{note}. Fix: e.g. {where}={max(low, 1)}.")


def _real(value: Any) -> bool:
    """Whether ``value`` is a finite real number (not a bool, NaN or infinity) inside float32's range."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and abs(value) <= FLOAT32_MAX
    )


def _number(where: str, value: Any, ok: Any, rule: str, example: str) -> None:
    """ConfigError unless ``value`` is a finite real number inside float32's range (``FLOAT32_MAX``: the dtype it
    becomes at the step) for which ``ok(value)`` holds."""
    if not (_real(value) and ok(value)):
        raise ConfigError(
            f"{where}={value!r} must {rule} (a finite number, at most {FLOAT32_MAX:.3g} in size: float32's range). "
            f"Fix: e.g. {where}={example}."
        )


@dataclass
class RunConfig:
    """A whole training run."""

    layout: Layout = field(default_factory=Layout)
    model: dict[str, Any] = field(default_factory=lambda: {"n_layer": 2, "n_head": 4, "d_model": 64})
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        unknown = sorted(set(data) - {"layout", "model", "data", "train"})
        if unknown:
            raise ConfigError(f"unknown section(s) {unknown}. Fix: use [layout], [model], [data] and [train].")
        try:
            return cls(
                layout=Layout.from_dict(data.get("layout", {})),
                model=_model_section(data.get("model", {}), cls().model),
                data=from_mapping(DataConfig, data.get("data", {}), "data", ConfigError),
                train=from_mapping(TrainConfig, data.get("train", {}), "train", ConfigError),
            )
        except TypeError as error:
            raise ConfigError(f"bad configuration value: {error}") from error

    def to_dict(self) -> dict[str, Any]:
        """Plain values (None, "the default", is left out: TOML has no null)."""
        return {
            "layout": self.layout.to_dict(),
            "model": dict(self.model),
            "data": dataclasses.asdict(self.data),
            "train": {k: v for k, v in dataclasses.asdict(self.train).items() if v is not None},
        }

    def dumps(self) -> str:
        """The configuration as TOML (``plait train --config`` reads it back)."""
        return tomli_w.dumps(self.to_dict())


def _model_section(given: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The [model] section: ``given`` on top of the tiny default GPT, unless it names a preset or an HF model
    (whose fields then come from there)."""
    if any(key in given for key in ("preset", "hf", "hf_config")):
        return dict(given)
    return {**defaults, **given}


def parse_value(text: str) -> Any:
    """Read ``text`` as a TOML value (number, bool, array, quoted string); otherwise keep it as a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides to a nested mapping (a copy)."""
    result = {section: dict(values) for section, values in data.items()}
    for item in overrides:
        key, sep, value = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not name:
            raise ConfigError(f"--set {item!r} is not section.key=value. Fix: e.g. --set layout.tp=2")
        result.setdefault(section, {})[name] = parse_value(value.strip())
    return result


def merge_sections(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top``'s keys over ``base``'s, section by section (a copy)."""
    result = {section: dict(values) for section, values in base.items()}
    for section, values in top.items():
        if isinstance(values, dict) and isinstance(result.get(section), dict):
            result[section].update(values)
        else:
            result[section] = values
    return result


def read_toml(path: Path) -> dict[str, Any]:
    """The tables of the TOML file ``path``; ConfigError (one line, with the fix) for a file that is not UTF-8
    TOML text: a binary file, a syntax error, nesting deeper than the parser's recursion, an unreadable file."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{path} is not a text file (byte {error.start} is not UTF-8). Fix: give a TOML run configuration "
            f"(plait train writes one as <run>/config.toml)."
        ) from error
    except OSError as error:
        raise ConfigError(f"cannot read {path} ({error.strerror or error}). Fix: give a readable TOML file.") from error
    try:
        tables = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError) as error:
        raise ConfigError(f"{path} is not valid TOML: {type(error).__name__}: {error}. Fix: correct it.") from error
    keys = sorted(key for key, value in tables.items() if not isinstance(value, dict))
    if keys:
        raise ConfigError(
            f"{path} sets {keys} outside a section. Fix: put every setting in a section: [layout], [model], [data] "
            f"or [train]."
        )
    return tables


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, preset: str | None = None
) -> RunConfig:
    """Defaults, then the run preset ``preset`` (plait.train.presets), then the TOML file at ``path`` (if any), then
    the ``--set`` overrides."""
    data: dict[str, Any] = {}
    if preset:
        from plait.train.presets import preset as preset_sections

        data = preset_sections(preset)
    if path:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist. Fix: give the path of a TOML file.")
        data = merge_sections(data, read_toml(path))
    try:
        return RunConfig.from_dict(apply_overrides(data, overrides or []))
    except LayoutError:
        raise


def check_model_fits_data(model: dict[str, Any], vocab_size: int, seq_len: int, data: str = "the data") -> None:
    """Refuse a ``[model]`` section whose explicit ``vocab_size`` or ``seq_len`` is below the data's (before any
    weight is built), naming the fix."""
    given_vocab, given_seq = model.get("vocab_size"), model.get("seq_len")
    if isinstance(given_vocab, int) and given_vocab < vocab_size:
        raise ConfigError(
            f"the tokenizer of {data} has {vocab_size} tokens, but model.vocab_size={given_vocab}: ids >= "
            f"{given_vocab} would have no embedding. Fix: drop model.vocab_size (it is taken from the data), set it "
            f">= {vocab_size}, or prepare the data with a smaller tokenizer (e.g. --tokenizer bpe:{given_vocab})."
        )
    if isinstance(given_seq, int) and given_seq < seq_len:
        raise ConfigError(
            f"data.seq_len={seq_len} is above the model's context model.seq_len={given_seq}. Fix: --set "
            f"data.seq_len={given_seq} (or less), or drop model.seq_len (it is taken from the data)."
        )
