"""Weights from any of the places a run may start from (``train.init_from``, ``model.hf``, ``plait generate``).

``open_weights(PATH)`` gives them as a ``WeightSource`` (``plait.parallel.materialize``) that each rank reads
only its rectangles of, and ``read_weights(PATH)`` as whole tensors in this one process, from:

- a plait checkpoint saved under any layout and world size (a checkpoint root with ``latest``, or one
  ``step-N`` folder; DCP pieces of the global tensors, no pickle: ``plait.checkpoint.slices``);
- a ``.safetensors`` file (``plait convert`` writes one; a flat header and raw tensors, no code);
- a Hugging Face ``save_pretrained`` folder (its ``model.safetensors`` or the shards its index names; a folder
  with only pickle weights is refused with the way to convert it).

A starting point, not a resumed run: no optimizer state. ``check_fits`` refuses tensors that are not the
model's, name for name and shape for shape, naming the first one that is not (in the model's own order) in the
``ConfigError``; a name the file lacks because the model ties it to another (GPT-2's ``lm_head.weight`` is
``transformer.wte.weight``) is read through the tie. ``plait train`` checks a model built on the meta device and
hands the source to ``parallelize(weights=...)``; ``load_weights(model, state)`` copies whole tensors into a
model built on a device; ``model_from_checkpoint`` builds on meta and fills the model tensor by tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait.errors import ConfigError
from plait.logging import get_logger
from plait.parallel.materialize import WeightSource, deferred_init, materialize_module

log = get_logger(__name__)


def _is_checkpoint(path: Path) -> bool:
    return (path / "latest").is_file() or (path / "plait.json").is_file()


def _existing(path: str | Path) -> Path:
    path = Path(path)
    if not path.exists():
        raise ConfigError(
            f"{path} does not exist. Fix: give a plait checkpoint folder (e.g. runs/<id>/ckpt), a .safetensors "
            f"file or a Hugging Face save_pretrained folder."
        )
    return path


def read_weights(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Whole tensors by name and what is known of the model that wrote them (``{"model": ...}``, module docstring)."""
    from plait.checkpoint.convert import header_meta
    from plait.models.hf_load import load_safetensors, read_config, read_hf_weights

    path = _existing(path)
    if path.is_dir() and _is_checkpoint(path):
        from plait.checkpoint import load_full_state

        return load_full_state(path)
    if path.is_dir():
        state = read_hf_weights(path)
        return state, {"model": {"hf": read_config(path)}}
    if path.suffix == ".safetensors":
        state, header = load_safetensors(path)
        return state, header_meta(path, header)
    raise ConfigError(
        f"{path} is neither a plait checkpoint, a .safetensors file nor a Hugging Face folder. Fix: give one of those."
    )


def open_weights(path: str | Path) -> tuple[WeightSource, dict[str, Any]]:
    """The tensors of ``path`` (module docstring) as a ``WeightSource`` that reads rectangles, and what is known of
    the model that wrote them: nothing is read but headers and metadata until a rank asks for its share."""
    from plait.checkpoint.convert import header_meta
    from plait.checkpoint.slices import CheckpointSource
    from plait.models.hf_load import read_config
    from plait.models.safetensors_source import SafetensorsSource

    path = _existing(path)
    if path.is_dir() and _is_checkpoint(path):
        source = CheckpointSource(path)
        return source, source.meta
    if path.is_dir():
        return SafetensorsSource.of_folder(path), {"model": {"hf": read_config(path)}}
    if path.suffix == ".safetensors":
        file = SafetensorsSource([path], str(path))
        return file, header_meta(path, file.header)
    raise ConfigError(
        f"{path} is neither a plait checkpoint, a .safetensors file nor a Hugging Face folder. Fix: give one of those."
    )


def _tied_sources(model: nn.Module) -> dict[str, str]:
    """State dict key -> the first key holding the same tensor (tied weights), for every key."""
    first: dict[int, str] = {}
    return {key: first.setdefault(id(value), key) for key, value in model.state_dict(keep_vars=True).items()}


def check_fits(
    model: nn.Module, shapes: dict[str, tuple[int, ...]], source: str = "the weights", strict: bool = True
) -> dict[str, str]:
    """ConfigError naming the first mismatch unless the tensors of ``shapes`` (name -> shape) are the model's,
    name for name and shape for shape (module docstring; the model may be on the meta device). Returns, for each
    of the model's state dict keys found, the name to read it from (itself, or the name it is tied to).
    ``strict=False`` (as ``from_pretrained``): a missing tensor is left out of the result and an extra one ignored;
    shapes must still agree."""
    expected = model.state_dict()
    tied = _tied_sources(model)
    found: dict[str, str] = {}
    for key, current in expected.items():
        name = key if key in shapes else (tied[key] if tied[key] != key and tied[key] in shapes else None)
        if name is None and not strict:
            continue
        if name is None:
            others = [other for other, shape in shapes.items() if tuple(shape) == tuple(current.shape)]
            hint = f" (a tensor of that shape is named {others[0]!r} there)" if others else ""
            raise ConfigError(
                f"{source} do not fit this model: the model's tensor {key!r} {tuple(current.shape)} is missing"
                f"{hint}; {len(shapes)} tensors there, {len(expected)} in the model. Fix: start from a checkpoint of "
                f"this model, or set [model] to the model that was trained."
            )
        if tuple(shapes[name]) != tuple(current.shape):
            raise ConfigError(
                f"{source} do not fit this model: tensor {key!r} has shape {tuple(shapes[name])} there and "
                f"{tuple(current.shape)} in the model. Fix: set [model] to the model that was trained (its sizes, "
                f"vocab_size and seq_len), or start from a checkpoint of this model."
            )
        found[key] = name
    unexpected = [key for key in shapes if key not in expected]  # in the file's order: the first one is named
    if unexpected and strict:
        raise ConfigError(
            f"{source} do not fit this model: tensor {unexpected[0]!r} is not the model's ({len(unexpected)} such). "
            f"Fix: start from a checkpoint of this model, or set [model] to the model that was trained."
        )
    return found


def load_weights(model: nn.Module, state: dict[str, torch.Tensor], source: str = "the weights") -> None:
    """Copy ``state`` into ``model`` in place (module docstring); ConfigError naming the first mismatch."""
    names = check_fits(model, {name: tuple(tensor.shape) for name, tensor in state.items()}, source)
    tied = _tied_sources(model)
    with torch.no_grad():
        for key, tensor in model.state_dict(keep_vars=True).items():
            if tied[key] == key:
                tensor.copy_(state[names[key]].to(tensor.dtype))
    log.info("loaded %d tensors from %s", len(names), source)


def _checkpoint_root(path: Path) -> Path | None:
    """The checkpoint under ``path``: a run folder's ``ckpt``, a checkpoint root, or a step folder."""
    for candidate in (path / "ckpt", path):
        if _is_checkpoint(candidate):
            return candidate
    return None


def find_run(path: str | Path) -> tuple[Path, Path | None]:
    """(checkpoint, the run's config.toml or None) for a run folder, a checkpoint root or one step folder."""
    path = Path(path)
    checkpoint = _checkpoint_root(path) if path.is_dir() else None
    if checkpoint is None:
        raise ConfigError(
            f"{path} holds no plait checkpoint (no ckpt/latest, latest or plait.json). Fix: give a run folder "
            f"trained with train.save_every > 0, its ckpt folder, or one ckpt/step-N folder."
        )
    for folder in (checkpoint, *checkpoint.parents[:3]):
        if (folder / "config.toml").is_file():
            return checkpoint, folder / "config.toml"
    return checkpoint, None


def model_from_checkpoint(checkpoint: Path, section: dict[str, Any] | None, vocab: int, seq: int) -> nn.Module:
    """The model a checkpoint holds, built on the meta device from its recorded config (plait GPT fields or an HF
    config) or else from the run's ``[model]`` ``section``, then filled tensor by tensor from the checkpoint in
    this one process (``materialize_module``: the weights are never held twice)."""
    from plait.models import GPT, GPTConfig

    source, meta = open_weights(checkpoint)
    recorded = meta.get("model") or {}
    if not isinstance(recorded, dict):
        raise ConfigError(
            f"{checkpoint} records its model as a {type(recorded).__name__}, not an object. Fix: give the run folder."
        )
    if "config" in recorded:
        try:
            config = GPTConfig.from_dict(recorded["config"])
        except (TypeError, ValueError, AttributeError) as error:
            raise ConfigError(
                f"{checkpoint} records a model config plait cannot build ({error}). Fix: give the run folder (its "
                f"config.toml), or a checkpoint written by plait."
            ) from None
        model = deferred_init(GPT, config)
    elif "hf" in recorded:
        from plait.checkpoint.convert import build_hf_model

        model = deferred_init(build_hf_model, recorded["hf"])
    elif section is not None:
        from plait.models.build import build_model

        model = deferred_init(build_model, section, vocab, seq, weights=False)
    else:
        raise ConfigError(
            f"{checkpoint} does not record its model and no run config.toml was found next to it. Fix: give the "
            f"run folder (it has config.toml)."
        )
    check_fits(model, source.shapes(), str(checkpoint))
    materialize_module(model, source)
    log.info("loaded %s from %s", type(model).__name__, checkpoint)
    return model


__all__ = ["check_fits", "find_run", "load_weights", "model_from_checkpoint", "open_weights", "read_weights"]
