"""Hugging Face causal LMs from local files only: a ``from_pretrained`` folder (weights) or a ``config.json``.

``[model] hf = "PATH"`` fine-tunes a folder written by ``save_pretrained``: transformers builds the class its
``config.json`` names (any causal LM that ships with transformers; ``trust_remote_code`` stays off, so no code from
the folder runs, and a ``config.json`` naming the folder's own classes, ``auto_map``, is refused before transformers
reads it) and loads its weights from ``model.safetensors`` (or the shards an index names). Only safetensors
are read: a folder holding only ``pytorch_model.bin`` / ``*.pt`` pickles is refused with the way to convert it,
because unpickling runs code. ``[model] hf_config = "PATH"`` builds the model of a ``config.json`` (or of a
folder holding one) with fresh weights from torch's current random state. Nothing is ever downloaded
(``local_files_only``; a path that does not exist is an error, never a hub name).

Every file of a folder is read inside it (``weight_files``): the shards a ``model.safetensors.index.json`` names
must be plain file names of the folder, and every file read (``config.json``, the index, the weights) a regular
file, not a FIFO or a device (``plait.files``); a symbolic link in the folder is followed only to a file inside it
or, in a snapshot of the Hugging Face hub cache, to the same model's blobs (``plait.hf_folders``: any other link
in the folder is refused before transformers reads it). ``read_config`` checks the sizes of a config.json before
transformers or the planner reads them (``hf_fields``), and every config transformers builds goes through
``hf_config``, so a config transformers refuses is one ``ConfigError`` line too. ``load_safetensors`` /
``read_hf_weights`` read them for plait's own loaders (``plait convert``, ``train.init_from``, ``plait
generate``), a corrupt file being one ``ConfigError`` line.

``[model] num_hidden_layers = N`` (``plait certify --layers N``) builds a depth-N slice of either: the config's
layer count set to N and its per-layer lists cut to the first N layers (``depth_slice``), every width unchanged; a
folder's tensors of the later layers are then not the model's and are not read (as ``from_pretrained`` ignores
unexpected tensors), so the slice holds the folder's embeddings, first N layers, final norm and head.

``check_fits`` refuses data the model cannot read: token ids beyond its embedding table, samples longer than
its positions.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait import files, hf_folders
from plait.errors import ConfigError
from plait.logging import get_logger
from plait.models.hf_fields import LAYER_KEYS, check_fields
from plait.models.hf_moe import fuse_expert_layout

log = get_logger(__name__)
HF_KEYS = ("hf", "hf_config", "attn_implementation", "num_hidden_layers")
"""The ``[model]`` keys of a Hugging Face model (``attn_implementation``: "eager", "sdpa", ...; default sdpa;
``num_hidden_layers``: a depth-N slice, ``depth_slice``)."""
PER_LAYER_KEYS = ("layer_types", "no_rope_layers")
"""config.json lists with one entry per decoder layer (attention kind, RoPE or not): a slice keeps the first N."""
LAYER_INDEX_KEYS = ("mlp_only_layers",)
"""config.json lists of decoder layer indices (Qwen-MoE's dense layers): a slice keeps those below N."""
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "tf_model.h5", "flax_model.msgpack")
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length")
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"


def _require_transformers() -> Any:
    try:
        import transformers
    except ImportError as error:  # pragma: no cover - the test extra installs it
        raise ConfigError(
            "[model] hf / hf_config need the transformers package. Fix: pip install 'plait[hf]'."
        ) from error
    return transformers


def check_weights_folder(folder: Path) -> None:
    """ConfigError unless ``folder`` is a ``save_pretrained`` folder with safetensors weights."""
    if not folder.is_dir():
        raise ConfigError(
            f"model.hf={str(folder)!r} is not a folder. Fix: give a local folder written by save_pretrained "
            f"(plait never downloads; fetch the model first, e.g. with huggingface-cli download)."
        )
    hf_folders.check_links(folder)  # before anything reads the folder: its links lead inside it, or nowhere
    config = files.file_problem(hf_folders.resolve(folder, "config.json"))
    if config == "is missing":
        raise ConfigError(f"{folder} has no config.json, so it is not a save_pretrained folder. Fix: give one.")
    if config is not None:
        raise ConfigError(f"{folder / 'config.json'} {config}: plait reads only regular files. {files.LINK_FIX}")
    read_config(folder, "model.hf")  # its auto_map is refused before transformers reads the folder
    has_safetensors = any(files.file_problem(folder / name) != "is missing" for name in (WEIGHTS, INDEX))
    if not has_safetensors:
        pickles = [name for name in PICKLE_WEIGHTS if (folder / name).exists()]
        what = f"only pickle weights ({', '.join(pickles)})" if pickles else "no model.safetensors"
        raise ConfigError(
            f"{folder} holds {what}. plait loads safetensors only: pickles, which plait does not load, can run code "
            f"when read. Fix: convert it once where you trust it: AutoModelForCausalLM.from_pretrained(PATH)"
            f".save_pretrained(PATH, safe_serialization=True)."
        )
    weight_files(folder)


def weight_files(folder: Path) -> list[str]:
    """The safetensors files of a ``save_pretrained`` folder: ``model.safetensors``, or the shards its index
    names; ConfigError unless each is a plain file name of the folder and a regular file there."""
    index = hf_folders.resolve(folder, INDEX)
    names = [WEIGHTS]
    if files.file_problem(index) != "is missing":
        try:
            content = json.loads(files.read_text(index, "the weights index"))
        except ValueError as error:
            raise ConfigError(
                f"{index} is not valid JSON ({error}). Fix: save the model again with save_pretrained."
            ) from None
        weight_map = content.get("weight_map") if isinstance(content, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConfigError(f"{index} has no weight_map of tensor names to files. Fix: save the model again.")
        names = sorted({files.inside(folder, name, f"{index}'s weight_map").name for name in weight_map.values()})
    for name in names:
        problem = files.file_problem(hf_folders.resolve(folder, name))
        if problem is not None:
            raise ConfigError(
                f"{folder / name} {problem}: plait reads only the regular files of a model folder (a link may lead "
                f"anywhere, a FIFO blocks). Fix: save the model again with save_pretrained(safe_serialization=True), "
                f"or copy the files themselves into the folder (cp -L)."
            )
    return names


@contextlib.contextmanager
def safetensors_file(path: Path) -> Iterator[Any]:
    """``safe_open(path)`` of a regular file (not a link, a FIFO, a device); a file that is not valid safetensors
    (garbage, truncated, a header claiming more than the file holds) is one ConfigError line, raised from inside
    the block too. safetensors maps the file and reads only what is asked for; it never runs code."""
    from safetensors import SafetensorError, safe_open

    problem = files.file_problem(path)
    if problem is not None:
        raise ConfigError(f"{path} {problem}: plait reads only regular files. {files.LINK_FIX}")
    try:
        with safe_open(str(path), framework="pt") as handle:
            yield handle
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(
            f"{path} is not a valid safetensors file ({reason}). Fix: export or save it again (plait convert, "
            f"save_pretrained(safe_serialization=True)), or restore it from a copy."
        ) from None


def load_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and the header's string metadata of the safetensors file ``path`` (``safetensors_file``),
    every tensor whole in this process."""
    with safetensors_file(path) as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}, dict(handle.metadata() or {})


def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a ``save_pretrained`` folder (``check_weights_folder``, then each of ``weight_files``), a
    Mixture-of-Experts family's per-expert tensors stacked into the model's fused ones (``hf_moe.fuse_expert_layout``)."""
    check_weights_folder(folder)
    state: dict[str, torch.Tensor] = {}
    for name in weight_files(folder):
        state.update(load_safetensors(hf_folders.resolve(folder, name))[0])
    return fuse_expert_layout(state, str(read_config(folder, "model.hf")["model_type"]))


def read_config(path: Path, key: str = "model.hf_config") -> dict[str, Any]:
    """The fields of a config.json (or of the one in folder ``path``); ConfigError when unreadable, when it asks
    for the folder's own code (``auto_map`` in any form: plait never runs code from a folder), or when a size
    transformers builds the model from is not one (``hf_fields.check_fields``)."""
    if path.is_dir():
        hf_folders.check_links(path)
        path = hf_folders.resolve(path, "config.json")
    else:
        path = path.resolve()  # a config.json the user named (through a link of theirs, maybe)
    if files.file_problem(path) == "is missing":
        raise ConfigError(f"{key}: {path} does not exist. Fix: give a Hugging Face config.json.")
    try:
        fields = json.loads(files.read_text(path, "config.json"))
    except (ValueError, RecursionError) as error:
        raise ConfigError(f"{key}: {path} is not valid JSON ({error}). Fix: give a config.json.") from None
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise ConfigError(f"{path} names no model_type. Fix: use a config.json written by save_pretrained.")
    hf_folders.refuse_auto_map(
        fields,
        path,
        f"Fix: use a model class transformers has built in ({key}: a model_type it ships, without auto_map).",
    )
    check_fields(fields, f"{key}: {path}")
    return fields


def depth_slice(fields: dict[str, Any], layers: Any, where: str) -> dict[str, Any]:
    """``fields`` (a checked config.json's) cut to its first ``layers`` decoder layers, the widths unchanged: the
    family's layer count (``hf_fields.LAYER_KEYS``: GPT-2's ``n_layer``, Llama's ``num_hidden_layers``, ...) set to
    ``layers``, its per-layer lists cut to their first ``layers`` entries and its lists of layer indices kept below
    ``layers``. ConfigError when ``layers`` is not a whole number from 1 to the model's own depth."""
    key = next((k for k in LAYER_KEYS if fields.get(k) is not None), "num_hidden_layers")
    depth = fields.get(key)
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1 or (depth is not None and layers > depth):
        raise ConfigError(
            f"model.num_hidden_layers={layers!r}: {where} has {depth if depth is not None else 'an unknown number of'} "
            f"layers, and a slice keeps the first N of them. Fix: a whole number from 1 to {depth or 'its depth'}."
        )
    out = {**fields, key: layers}
    for name in PER_LAYER_KEYS:
        if isinstance(out.get(name), list):
            out[name] = out[name][:layers]
    for name in LAYER_INDEX_KEYS:
        if isinstance(out.get(name), list):
            out[name] = [index for index in out[name] if isinstance(index, int) and index < layers]
    return out


def section_fields(section: Mapping[str, Any]) -> tuple[Path, str, dict[str, Any]]:
    """The config.json fields a ``[model]`` section with ``hf`` or ``hf_config`` describes (``read_config``; a
    ``num_hidden_layers`` slice applied), with the path they came from and the key that named it."""
    key = "model.hf" if "hf" in section else "model.hf_config"
    path = Path(str(section["hf"] if "hf" in section else section["hf_config"]))
    fields = read_config(path, key)
    if section.get("num_hidden_layers") is not None:
        fields = depth_slice(fields, section["num_hidden_layers"], f"{key}={str(path)!r}")
    return path, key, fields


def hf_config(transformers: Any, fields: dict[str, Any], where: str) -> Any:
    """The transformers config of the checked ``fields`` (``read_config``); a config transformers refuses (its own
    validation: a wrong type, an inconsistent architecture) is one ConfigError line naming ``where``."""
    fields = dict(fields)
    try:
        return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    except Exception as error:  # transformers' validation raises ValueError, TypeError, huggingface_hub's own
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        reason = " ".join(lines[:3]) if lines else type(error).__name__
        raise ConfigError(
            f"{where}: transformers refuses this config ({reason[:300]}). Fix: correct config.json (or save it again "
            f"with save_pretrained)."
        ) from None


def build_hf_model(section: Mapping[str, Any], weights: bool = True) -> nn.Module:
    """The transformers causal LM that ``section`` (``hf`` or ``hf_config``) describes (module docstring). With
    ``weights=False`` an ``hf`` folder's model is built from its config.json with fresh weights (in float32, as
    ``from_pretrained`` loads it), its weights to be read later (``SafetensorsSource``, ``parallelize(weights=)``)."""
    unknown = sorted(set(section) - set(HF_KEYS))
    if unknown or ("hf" in section) == ("hf_config" in section):
        raise ConfigError(
            f"[model] with a Hugging Face model takes exactly one of hf / hf_config (and attn_implementation, "
            f"num_hidden_layers); got {sorted(section)}. Fix: drop {unknown or ['hf_config']} (the model's sizes "
            f"come from its config)."
        )
    transformers = _require_transformers()
    options: dict[str, Any] = {"attn_implementation": section.get("attn_implementation", "sdpa")}
    if "hf" in section:
        check_weights_folder(Path(str(section["hf"])))
    path, key, fields = section_fields(section)
    config = hf_config(transformers, fields, f"{key}: {path}")
    if "hf" in section and not weights:
        model = transformers.AutoModelForCausalLM.from_config(
            config, trust_remote_code=False, dtype=torch.float32, **options
        )
        log.info("built %s from %s (its weights are read where they are kept)", type(model).__name__, path)
    elif "hf" in section:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path),
            config=config,
            local_files_only=True,
            use_safetensors=True,
            trust_remote_code=False,
            dtype="float32",
            **options,
        )
        log.info("loaded %s from %s", type(model).__name__, path)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=False, **options)
        log.info("built %s from %s (fresh weights)", type(model).__name__, path)
    if section.get("num_hidden_layers") is not None:
        log.info("%s: a slice of its first %s layers (model.num_hidden_layers)", path, section["num_hidden_layers"])
    return model


def model_context(config: Any) -> int | None:
    """The longest sequence a transformers config's positions allow (None when it names no limit)."""
    for key in CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_fits(model: nn.Module, vocab_size: int, seq_len: int) -> None:
    """ConfigError when the data's token ids exceed the model's vocabulary, or its samples its context."""
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and vocab < vocab_size:
        raise ConfigError(
            f"the data's tokenizer has {vocab_size} token ids but the model's vocabulary has {vocab}: ids >= {vocab} "
            f"have no embedding. Fix: prepare the data with the model's own tokenizer (plait data prepare "
            f"--tokenizer MODEL_FOLDER), or use a model with a larger vocabulary."
        )
    context = model_context(config)
    if context is not None and context < seq_len:
        raise ConfigError(
            f"the data's samples have {seq_len} tokens but the model has {context} positions. Fix: set "
            f"data.seq_len <= {context}."
        )


__all__ = [
    "HF_KEYS",
    "build_hf_model",
    "check_fits",
    "check_weights_folder",
    "depth_slice",
    "hf_config",
    "load_safetensors",
    "model_context",
    "read_config",
    "read_hf_weights",
    "safetensors_file",
    "section_fields",
    "weight_files",
]
