"""Move whole-model weights between plait checkpoints and the safetensors world (``plait convert``).

- export: a checkpoint (any layout, any world size: read whole in one process) -> one ``.safetensors`` file with
  the single-device parameter names, or, for a Hugging Face model, a folder ``from_pretrained`` opens
  (``config.json`` + ``model.safetensors``, written by transformers' own ``save_pretrained``);
- import: a ``.safetensors`` file or an HF folder -> a model-only checkpoint that ``engine.load`` accepts under any
  layout (the optimizer then starts fresh) and ``plait train --out RUN`` resumes from when written to ``RUN/ckpt``.

safetensors is a flat header (JSON) plus raw little-endian tensor bytes: reading one never runs code, unlike a
pickle. Every file is written to a temporary name and renamed into place, so a crash leaves no half file.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, cast

import torch

from plait.checkpoint import load_full_state, save_model_state
from plait.errors import ConfigError
from plait.logging import get_logger

log = get_logger(__name__)
HF_MODEL_KEY = "hf"
"""``meta["model"]["hf"]``: the transformers config (``config.to_dict()``) of a checkpointed HF model."""
SAFETENSORS_META = "plait"
"""The safetensors header's ``__metadata__`` key holding the checkpoint's plait.json (string values only)."""


def _atomic_file(path: Path) -> Path:
    """A temporary sibling of ``path`` (renamed onto it once complete)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def export_safetensors(checkpoint: str | Path, out: str | Path) -> Path:
    """Write the latest checkpoint under ``checkpoint`` as one safetensors file of whole tensors by name."""
    from safetensors.torch import save_file

    state, meta = load_full_state(checkpoint)
    out = Path(out)
    tmp = _atomic_file(out)
    save_file(
        {name: tensor.contiguous() for name, tensor in state.items()},
        str(tmp),
        metadata={SAFETENSORS_META: json.dumps(meta)},
    )
    os.replace(tmp, out)
    log.info("exported %d tensors (step %s) to %s", len(state), meta.get("step"), out)
    return out


def _hf_config(meta: dict[str, Any], hf_config: str | Path | None) -> dict[str, Any]:
    """The transformers config of the checkpointed model: from ``hf_config`` (a config.json or a folder holding
    one) when given, else from the checkpoint's metadata."""
    if hf_config is not None:
        path = Path(hf_config)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ConfigError(
                f"--hf-config {hf_config}: no such config.json. Fix: give the model's config.json "
                f"(or the folder holding it)."
            )
        return json.loads(path.read_text())
    config = (meta.get("model") or {}).get(HF_MODEL_KEY)
    if config is None:
        raise ConfigError(
            "this checkpoint does not record a Hugging Face model config, so it cannot be written as "
            "an HF folder. Fix: export a single file (OUT ending in .safetensors), or pass "
            "--hf-config config.json of the model that was trained."
        )
    return dict(config)


def build_hf_model(config: dict[str, Any]) -> torch.nn.Module:
    """An untrained transformers causal LM of ``config`` (a ``config.to_dict()``), weights to be loaded."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(config)
    model_type = fields.pop("model_type", None)
    if model_type is None:
        raise ConfigError(
            "the Hugging Face config has no model_type. Fix: use the config.json the model was saved "
            'with (it names model_type, e.g. "llama").'
        )
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields), trust_remote_code=False)


def export_hf(checkpoint: str | Path, out: str | Path, hf_config: str | Path | None = None) -> Path:
    """Write the latest checkpoint under ``checkpoint`` as a Hugging Face folder (``from_pretrained`` opens it)."""
    state, meta = load_full_state(checkpoint)
    model = build_hf_model(_hf_config(meta, hf_config))
    expected = set(model.state_dict())
    tied = expected - {name for name, _ in model.named_parameters()} - {name for name, _ in model.named_buffers()}
    missing, unexpected = expected - set(state) - tied, set(state) - expected
    if missing or unexpected:
        raise ConfigError(
            f"the checkpoint's tensors do not fit this Hugging Face model: missing "
            f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}. Fix: pass the --hf-config "
            f"of the model that was trained."
        )
    model.load_state_dict(state, strict=False)  # tied names (lm_head -> embed_tokens) share the loaded tensor
    out = Path(out)
    tmp = _atomic_file(out)
    shutil.rmtree(tmp, ignore_errors=True)
    cast(Any, model).save_pretrained(str(tmp), safe_serialization=True)  # a transformers PreTrainedModel
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    log.info("exported %s (step %s) as a Hugging Face folder %s", type(model).__name__, meta.get("step"), out)
    return out


def _read_hf_folder(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors of an HF folder (model.safetensors, or the shards its index names) and its config."""
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    index = folder / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    )
    state: dict[str, torch.Tensor] = {}
    for name in files:
        if not (folder / name).is_file():
            raise ConfigError(
                f"{folder} has no {name}. Fix: save the model with save_pretrained(safe_serialization="
                f"True) (pytorch_model.bin files are pickles, which plait does not load)."
            )
        state.update(load_file(str(folder / name)))
    return state, {"step": 0, "model": {HF_MODEL_KEY: config}}


def import_weights(source: str | Path, checkpoint: str | Path) -> Path:
    """Write a model-only checkpoint under ``checkpoint`` from a safetensors file or an HF folder."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    source = Path(source)
    if source.is_dir():
        if not (source / "config.json").is_file():
            raise ConfigError(
                f"{source} is a folder without config.json, so not a Hugging Face model folder. Fix: "
                f"give a .safetensors file or a save_pretrained folder."
            )
        state, meta = _read_hf_folder(source)
    elif source.suffix == ".safetensors" and source.is_file():
        state = load_file(str(source))
        with safe_open(str(source), framework="pt") as handle:
            header = handle.metadata() or {}
        meta = json.loads(header[SAFETENSORS_META]) if SAFETENSORS_META in header else {"step": 0}
    else:
        raise ConfigError(f"{source}: not a .safetensors file or a Hugging Face folder. Fix: give one of those.")
    # a starting point, not a resumed run: step 0 (the lr schedule starts over); the source's step is kept as a note
    meta = {"step": 0, "model": meta.get("model"), "imported_from": str(source), "source_step": meta.get("step", 0)}
    folder = save_model_state(checkpoint, state, meta)
    log.info("imported %d tensors from %s into %s", len(state), source, folder)
    return folder


def convert(source: str | Path, out: str | Path, hf_config: str | Path | None = None) -> Path:
    """``plait convert SOURCE OUT``: the direction follows from the paths (module docstring)."""
    source, out = Path(source), Path(out)
    if not source.exists():
        raise ConfigError(
            f"{source} does not exist. Fix: give a checkpoint folder, a .safetensors file or an HF folder."
        )
    is_checkpoint = (source / "latest").is_file() or (source / "plait.json").is_file()
    if is_checkpoint:
        if out.suffix == ".safetensors":
            if hf_config is not None:
                raise ConfigError(
                    "--hf-config is for exporting a Hugging Face folder, but OUT ends in .safetensors. "
                    "Fix: drop --hf-config, or give OUT as a folder."
                )
            return export_safetensors(source, out)
        return export_hf(source, out, hf_config)
    if out.suffix == ".safetensors":
        raise ConfigError(
            f"{source} is not a plait checkpoint (no 'latest' pointer or plait.json), so it cannot be "
            f"exported. Fix: give a checkpoint folder written by engine.save (e.g. runs/<id>/ckpt)."
        )
    return import_weights(source, out)


__all__ = ["build_hf_model", "convert", "export_hf", "export_safetensors", "import_weights"]
