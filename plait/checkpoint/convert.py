"""Move whole-model weights between plait checkpoints and the safetensors world (``plait convert``).

- export: a checkpoint (any layout, any world size) -> one ``.safetensors`` file with the single-device parameter
  names, or, for a Hugging Face model, a folder ``from_pretrained`` opens (``config.json`` + ``model.safetensors``,
  or shards and an index past ``HF_SHARD_BYTES``), and plait's own GPT as the transformers family that computes
  it (``export_gpt``: GPT-2, Llama, Mixtral, Qwen2-MoE or GLM-4-MoE). Exports stream: each tensor is read from
  the checkpoint (DCP, ``slices.CheckpointSource``) and appended to a file whose header was written first
  (``safetensors_writer``), so one process never holds more than a few tensors of the model, whatever its size;
- import: a ``.safetensors`` file or an HF folder -> a model-only checkpoint that ``engine.load`` accepts under any
  layout (the optimizer then starts fresh) and ``plait train --out RUN`` resumes from when written to ``RUN/ckpt``.

safetensors is a flat header (JSON) plus raw little-endian tensor bytes: reading one never runs code, unlike a
pickle. Every output is written to a temporary sibling and renamed into place, so a crash leaves no half file,
and an existing OUT is replaced only with ``overwrite`` and only when it is an earlier output of plait; never the
checkpoint being converted nor anything else of the user's (``outputs``).
"""

from __future__ import annotations

import json
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, cast

import torch

from plait import files
from plait.checkpoint import outputs, save_model_state
from plait.checkpoint import safetensors_writer as writer
from plait.checkpoint.export_gpt import export_gpt, recorded_gpt_config
from plait.checkpoint.outputs import MARKER
from plait.checkpoint.slices import CheckpointSource
from plait.errors import ConfigError
from plait.logging import get_logger
from plait.models.hf_fields import check_fields
from plait.models.hf_load import hf_config, load_safetensors, read_config, read_hf_weights
from plait.models.hf_moe import unfuse_expert_layout

log = get_logger(__name__)
HF_MODEL_KEY = "hf"
"""``meta["model"]["hf"]``: the transformers config (``config.to_dict()``) of a checkpointed HF model."""
SAFETENSORS_META = "plait"
"""The safetensors header's ``__metadata__`` key holding the checkpoint's plait.json (string values only)."""
HF_SHARD_BYTES = 5 << 30
"""An exported HF folder's weights go into shards of at most this size (with an index) past it, as
``save_pretrained`` shards them."""


def header_meta(path: Path, header: dict[str, str]) -> dict[str, Any]:
    """The plait.json that ``plait convert`` stored in a safetensors header (``{}`` when there is none)."""
    if SAFETENSORS_META not in header:
        return {}
    try:
        meta = json.loads(header[SAFETENSORS_META])
    except (ValueError, RecursionError):
        meta = None
    if not isinstance(meta, dict):
        raise ConfigError(
            f"{path}'s header holds a malformed 'plait' entry (not a JSON object). Fix: export the file again with "
            f"plait convert, or remove that entry."
        )
    return meta


def _writing(out: Path) -> AbstractContextManager[None]:
    """A failure of the disk while writing ``out`` as one ``ConfigError`` line naming its folder and the fix
    (``plait.files.disk_errors``); used around ``outputs.staged``, which has removed the partial output by then."""
    return files.disk_errors(
        out.parent, f"plait convert to {out}", f"{out.name} is as it was, and the partial output is removed."
    )


def _is_plait_export(path: Path) -> bool:
    """Whether the safetensors file ``path`` is one ``export_safetensors`` wrote (its header has plait's entry)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            return SAFETENSORS_META in (handle.metadata() or {})
    except (SafetensorError, OSError, ValueError):
        return False


def export_safetensors(checkpoint: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    """Write the latest checkpoint under ``checkpoint`` as one safetensors file of whole tensors by name, one
    tensor at a time (``safetensors_writer``: the header first, then each tensor's bytes as it is read)."""
    out = Path(out)
    outputs.protect(Path(checkpoint), out)
    outputs.check_file_out(out, overwrite, _is_plait_export)
    source = CheckpointSource(checkpoint)
    specs = {name: (source.dtype(name), shape) for name, shape in source.shapes().items()}
    with _writing(out), outputs.staged(out) as tmp:
        writer.write(tmp, specs, source.whole, {SAFETENSORS_META: json.dumps(source.meta)})
    log.info("exported %d tensors (step %s) to %s", len(specs), source.meta.get("step"), out)
    return out


def _hf_config(meta: dict[str, Any], hf_config: str | Path | None) -> dict[str, Any]:
    """The transformers config of the checkpointed model: from ``hf_config`` (a config.json or a folder holding
    one) when given, else from the checkpoint's metadata."""
    if hf_config is not None:
        return read_config(Path(hf_config))
    recorded = meta.get("model")
    config = recorded.get(HF_MODEL_KEY) if isinstance(recorded, dict) else None
    if not isinstance(config, dict):
        raise ConfigError(
            "this checkpoint does not record a Hugging Face model config, so it cannot be written as "
            "an HF folder. Fix: export a single file (OUT ending in .safetensors), or pass "
            "--hf-config config.json of the model that was trained."
        )
    return dict(config)


def build_hf_model(config: dict[str, Any]) -> torch.nn.Module:
    """An untrained transformers causal LM of ``config`` (a ``config.to_dict()``), weights to be loaded; its sizes
    checked as a config.json's (``hf_fields.check_fields``: a checkpoint's metadata is data someone may have
    written)."""
    import transformers

    fields = dict(config)
    if fields.get("model_type") is None:
        raise ConfigError(
            "the Hugging Face config has no model_type. Fix: use the config.json the model was saved "
            'with (it names model_type, e.g. "llama").'
        )
    where = "the recorded Hugging Face config"
    check_fields(fields, where)
    built = hf_config(transformers, fields, where)
    try:
        return transformers.AutoModelForCausalLM.from_config(built, trust_remote_code=False)
    except (ValueError, TypeError, KeyError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(
            f"transformers cannot build the recorded model ({reason}). Fix: pass --hf-config with the config.json "
            f"of the model that was trained."
        ) from None


def export_hf(
    checkpoint: str | Path, out: str | Path, hf_config: str | Path | None = None, overwrite: bool = False
) -> Path:
    """Write the latest checkpoint under ``checkpoint`` as a Hugging Face folder (``from_pretrained`` opens it):
    its config.json (and generation_config.json), and the weights ``save_pretrained`` would write (tied copies left
    out), streamed tensor by tensor into ``model.safetensors`` or, past ``HF_SHARD_BYTES``, shards with an index;
    with plait's marker (``outputs``) listing the files written. The model is only built on the meta device,
    for its names, ties and config."""
    out = Path(out)
    outputs.protect(Path(checkpoint), out)
    outputs.check_folder_out(out, overwrite, outputs.marked_files)
    source = CheckpointSource(checkpoint)
    meta, shapes = source.meta, source.shapes()
    gpt = recorded_gpt_config(meta) if hf_config is None else None
    if gpt is not None:  # plait's own GPT: written as the transformers family that computes it
        return export_gpt(source, checkpoint, out, gpt, HF_SHARD_BYTES)
    with torch.device("meta"):
        model = build_hf_model(_hf_config(meta, hf_config))
    expected = model.state_dict()
    tied = set(expected) - {name for name, _ in model.named_parameters()} - {name for name, _ in model.named_buffers()}
    missing, unexpected = set(expected) - set(shapes) - tied, set(shapes) - set(expected)
    if missing or unexpected:
        raise ConfigError(
            f"the checkpoint's tensors do not fit this Hugging Face model: missing "
            f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}. Fix: pass the --hf-config "
            f"of the model that was trained."
        )
    wrong = [name for name in expected if name not in tied and tuple(expected[name].shape) != shapes[name]]
    if wrong:
        raise ConfigError(
            f"the checkpoint's {wrong[0]!r} has shape {shapes[wrong[0]]}, the Hugging Face model's "
            f"{tuple(expected[wrong[0]].shape)}. Fix: pass the --hf-config of the model that was trained."
        )
    specs = {name: (source.dtype(name), shapes[name]) for name in expected if name not in tied}
    config = cast(Any, model).config
    # an MoE family's experts in the per-expert layout save_pretrained writes (what from_pretrained reads back)
    specs, read = unfuse_expert_layout(specs, source.whole, str(getattr(config, "model_type", "")))
    config.architectures = [type(model).__name__]
    with _writing(out), outputs.staged(out) as tmp:
        tmp.mkdir()
        config.save_pretrained(str(tmp))
        if getattr(model, "generation_config", None) is not None and cast(Any, model).can_generate():
            cast(Any, model).generation_config.save_pretrained(str(tmp))
        writer.write_sharded(tmp, specs, read, HF_SHARD_BYTES, {"format": "pt"})
        written = sorted(entry.name for entry in tmp.iterdir())
        marker = {"written_by": "plait convert", "source": str(checkpoint), "step": meta.get("step"), "files": written}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2))
    log.info("exported %s (step %s) as a Hugging Face folder %s", type(model).__name__, meta.get("step"), out)
    return out


def _imported(root: Path) -> set[str] | None:
    """What an earlier ``import_weights`` wrote in ``root`` (``latest`` and step 0), or None if not one."""
    from plait.checkpoint.integrity import read_meta

    meta, _problems = read_meta(root / "step-00000000") if (root / "step-00000000").is_dir() else (None, [])
    return {"latest", "step-00000000"} if meta is not None and "imported_from" in meta else None


def import_weights(source: str | Path, checkpoint: str | Path, overwrite: bool = False) -> Path:
    """Write a model-only checkpoint under ``checkpoint`` from a safetensors file or an HF folder."""
    source, root = Path(source), Path(checkpoint)
    outputs.protect(source, root)
    outputs.check_folder_out(root, overwrite, _imported)
    if source.is_dir():
        if not (source / "config.json").exists():
            raise ConfigError(
                f"{source} is a folder without config.json, so not a Hugging Face model folder. Fix: "
                f"give a .safetensors file or a save_pretrained folder."
            )
        state, meta = read_hf_weights(source), {"step": 0, "model": {HF_MODEL_KEY: read_config(source)}}
    elif source.suffix == ".safetensors":
        state, header = load_safetensors(source)
        meta = header_meta(source, header) or {"step": 0}
    else:
        raise ConfigError(f"{source}: not a .safetensors file or a Hugging Face folder. Fix: give one of those.")
    # a starting point, not a resumed run: step 0 (the lr schedule starts over); the source's step is kept as a note
    step = meta.get("step", 0)
    model = meta.get("model") if isinstance(meta.get("model"), dict) else None
    meta = {"step": 0, "model": model, "imported_from": str(source), "source_step": step if type(step) is int else None}
    with _writing(root), outputs.staged(root) as tmp:
        folder = save_model_state(tmp, state, meta)
    log.info("imported %d tensors from %s into %s", len(state), source, root / folder.name)
    return root / folder.name


def convert(source: str | Path, out: str | Path, hf_config: str | Path | None = None, overwrite: bool = False) -> Path:
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
            return export_safetensors(source, out, overwrite)
        return export_hf(source, out, hf_config, overwrite)
    if out.suffix == ".safetensors":
        raise ConfigError(
            f"{source} is not a plait checkpoint (no 'latest' pointer or plait.json), so it cannot be "
            f"exported. Fix: give a checkpoint folder written by engine.save (e.g. runs/<id>/ckpt)."
        )
    return import_weights(source, out, overwrite)


__all__ = ["build_hf_model", "convert", "export_hf", "export_safetensors", "header_meta", "import_weights"]
