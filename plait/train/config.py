"""``RunConfig``: everything ``plait train`` needs, as typed sections loadable from TOML.

    [layout]   the parallel Layout (plait.layout.Layout)
    [model]    the reference GPT's GPTConfig (vocab_size and seq_len come from the data unless given)
    [data]     which dataset (synthetic "addition" or "bytes" over a text file) and its options
    [train]    steps, batch, optimizer, evaluation, output folder

Any field can be overridden on the command line with ``--set section.key=value``; the value is read as a
TOML value (``--set layout.tp=2``, ``--set train.lr=1e-3``, ``--set layout.recompute=[0,1]``) and falls back to
a plain string (``--set data.path=notes.txt``).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from plait.errors import ConfigError, LayoutError
from plait.layout import Layout, from_mapping

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


@dataclass
class DataConfig:
    """The dataset: ``name`` is "addition" (synthetic, ships with plait) or "bytes" (any text file at ``path``)."""

    name: str = "addition"
    digits: int = 2
    path: str = ""
    seq_len: int = 64
    seed: int = 0

    def dataset_kwargs(self) -> dict[str, Any]:
        if self.name == "addition":
            return {"digits": self.digits, "seed": self.seed}
        if self.name == "bytes":
            if not self.path:
                raise ConfigError("data.name='bytes' needs a text file. Fix: --set data.path=some.txt")
            return {"path": self.path, "seq_len": self.seq_len, "seed": self.seed}
        raise ConfigError(f"data.name={self.name!r} is unknown. Fix: use 'addition' or 'bytes'.")


@dataclass
class TrainConfig:
    """The training loop. ``global_batch`` is in samples, split over dp ranks and micro-batches."""

    steps: int = 1500
    global_batch: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_steps: int = 20
    max_grad_norm: float = 1.0
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
    out: str = ""
    pipeline_trace: str = ""
    """With pp > 1: write the last training step's measured pipeline timeline here (Chrome/Perfetto JSON) and
    its picture next to it (same name, .png); "" turns it off."""

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch", "eval_batches", "log_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"train.{name}={value!r} must be an integer >= 1.")
        for name in ("eval_every", "save_every", "warmup_steps", "keep_checkpoints", "keep_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"train.{name}={value!r} must be an integer >= 0 (0 turns it off).")
        if not self.lr > 0:
            raise ConfigError(f"train.lr={self.lr!r} must be positive.")
        if not isinstance(self.async_save, bool):
            raise ConfigError(f"train.async_save={self.async_save!r} must be true or false.")


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
                model={**cls().model, **data.get("model", {})},
                data=from_mapping(DataConfig, data.get("data", {}), "data", ConfigError),
                train=from_mapping(TrainConfig, data.get("train", {}), "train", ConfigError),
            )
        except TypeError as error:
            raise ConfigError(f"bad configuration value: {error}") from error

    def to_dict(self) -> dict[str, Any]:
        return {
            "layout": self.layout.to_dict(),
            "model": dict(self.model),
            "data": dataclasses.asdict(self.data),
            "train": dataclasses.asdict(self.train),
        }

    def dumps(self) -> str:
        """The configuration as TOML (``plait train --config`` reads it back)."""
        return tomli_w.dumps(self.to_dict())


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


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Defaults, then the TOML file at ``path`` (if any), then the ``--set`` overrides."""
    data: dict[str, Any] = {}
    if path:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist. Fix: give the path of a TOML file.")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"{path} is not valid TOML: {error}") from error
    try:
        return RunConfig.from_dict(apply_overrides(data, overrides or []))
    except LayoutError:
        raise
