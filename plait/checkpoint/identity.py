"""Is this checkpoint of this model? Compared on resume, before anything is read.

DCP reads what overlaps: a checkpoint of a 3-layer model loads into a 2-layer one (the third layer is simply not
asked for), and one of ``n_head=4`` into ``n_head=2`` (same shapes, other attention), and training goes on from
the wrong weights with exit code 0. So ``load`` first compares

- the tensors: every model tensor's single-device name and whole shape. plait.json records them
  (``model_tensors``, from DCP's metadata of the save: the whole model whatever the layout); the engine's are
  gathered over its ranks (a pipeline stage holds only its own). A name only the checkpoint has, a name only the
  model has (unless it is tied to one the checkpoint has: an imported GPT-2 has no ``lm_head.weight``), or a shape
  that differs is a difference;
- the model config, where plait knows both (``model_meta``): a dataclass config (plait's GPT) field by field, but
  not ``dropout`` and ``init_std`` (they do not change what the weights compute) and not a field that is None on
  one side (it defaults from others, and the shapes decide); a Hugging Face config by its architecture fields
  (``HF_FIELDS``), not by bookkeeping such as ``transformers_version``.

Any difference is a ``CheckpointError`` on every rank naming the differences and the fix.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from plait.checkpoint import extras
from plait.checkpoint.canonical import MODEL, EngineState
from plait.errors import CheckpointError

if TYPE_CHECKING:
    from plait.engine import Engine

IGNORED_FIELDS = ("dropout", "init_std")
"""Fields of a dataclass model config that do not change what the trained weights compute."""
HF_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "n_embd",
    "intermediate_size",
    "n_inner",
    "num_hidden_layers",
    "n_layer",
    "num_attention_heads",
    "n_head",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "n_positions",
    "hidden_act",
    "activation_function",
    "rms_norm_eps",
    "layer_norm_epsilon",
    "rope_theta",
    "rope_scaling",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
)
"""The fields of a Hugging Face config that define its architecture (compared where both configs have them)."""
SHOWN = 4
Gather = Callable[[bytes], list[bytes]]


def model_meta(engine: Engine) -> dict[str, Any] | None:
    """What model was trained, for plait.json: ``{"hf": config}`` for a Hugging Face model (its
    ``config.to_dict()`` as JSON), ``{"config": fields}`` for a model with a dataclass ``config`` (plait's GPT)."""
    for module in (engine.model, engine.strategy.model):
        found = describe_model(module)
        if found is not None:
            return found
    return None


def describe_model(module: Any) -> dict[str, Any] | None:
    """``model_meta`` of one module (None when it has no config plait knows)."""
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "to_json_string") and hasattr(config, "model_type"):
        return {"hf": json.loads(config.to_json_string(use_diff=False))}
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        try:
            return {"config": extras.to_json(dataclasses.asdict(config))}
        except TypeError:
            return None
    return None


def saved_tensors(meta: dict[str, Any], metadata: Metadata) -> dict[str, list[int]]:
    """The checkpoint's model tensors and shapes: plait.json's record, or DCP's metadata for older checkpoints."""
    recorded = meta.get("model_tensors")
    if isinstance(recorded, dict):
        return recorded
    return {
        fqn[len(MODEL) :]: list(stored.size)
        for fqn, stored in metadata.state_dict_metadata.items()
        if fqn.startswith(MODEL) and isinstance(stored, TensorStorageMetadata)
    }


def engine_tensors(engine: Engine, gather: Gather) -> tuple[dict[str, list[int]], dict[str, str]]:
    """The model's tensors by single-device name with whole shapes, over all ranks, and the names tied to
    another name (tied weights, a pipeline's copy of a tied weight) -> that name."""
    state = EngineState(engine)
    state.add_model()
    mine = {
        "tensors": {key[len(MODEL) :]: list(value.size()) for key, value in state.entries.items()},
        "tied": {**{k: v for k, v in state.aliases.items() if k != v}, **state.tied_copies},
    }
    tensors: dict[str, list[int]] = {}
    tied: dict[str, str] = {}
    for payload in gather(json.dumps(mine).encode()):
        other = json.loads(payload.decode())
        tensors.update(other["tensors"])
        tied.update(other["tied"])
    return tensors, tied


def _names(names: list[str]) -> str:
    more = f", ... ({len(names)} in all)" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def tensor_differences(saved: dict[str, list[int]], current: dict[str, list[int]], tied: dict[str, str]) -> list[str]:
    """What differs between the checkpoint's tensors (``saved``) and the model's (``current``)."""
    found = []
    extra = sorted(set(saved) - set(current))
    if extra:
        found.append(f"tensors only the checkpoint has: {_names(extra)}")
    missing = sorted(name for name in set(current) - set(saved) if tied.get(name) not in saved)
    if missing:
        found.append(f"tensors only this model has: {_names(missing)}")
    shapes = sorted(name for name in set(saved) & set(current) if list(saved[name]) != list(current[name]))
    for name in shapes[:SHOWN]:
        found.append(f"{name} is {tuple(saved[name])} there, {tuple(current[name])} here")
    if len(shapes) > SHOWN:
        found.append(f"{len(shapes) - SHOWN} more tensors of other shapes")
    return found


def config_differences(saved: Any, current: Any) -> list[str]:
    """What differs between the checkpoint's recorded model (``saved``, plait.json's ``model``) and this one's."""
    if not isinstance(saved, dict) or not isinstance(current, dict):
        return []
    if isinstance(saved.get("config"), dict) and isinstance(current.get("config"), dict):
        before, now = saved["config"], current["config"]
        keys = sorted((set(before) | set(now)) - set(IGNORED_FIELDS))
    elif isinstance(saved.get("hf"), dict) and isinstance(current.get("hf"), dict):
        before, now = saved["hf"], current["hf"]
        keys = [key for key in HF_FIELDS if key in before and key in now]
    else:
        kinds = [("a Hugging Face model" if "hf" in m else "a model of plait's config") for m in (saved, current)]
        return [f"the checkpoint holds {kinds[0]}, this run trains {kinds[1]}"] if kinds[0] != kinds[1] else []
    return [
        f"{key} {before.get(key)!r} there, {now.get(key)!r} here"
        for key in keys
        if before.get(key) is not None and now.get(key) is not None and before.get(key) != now.get(key)
    ]


def check(engine: Engine, folder: Any, meta: dict[str, Any], metadata: Metadata, gather: Gather) -> None:
    """Refuse (on every rank: the same gathered data everywhere) a checkpoint of another model (module docstring)."""
    current, tied = engine_tensors(engine, gather)
    found = config_differences(meta.get("model"), model_meta(engine))
    found += tensor_differences(saved_tensors(meta, metadata), current, tied)
    if found:
        raise CheckpointError(
            f"checkpoint {folder} was saved from another model than this one: {'; '.join(found)}. Fix: resume with "
            f"the model it was trained with (plait train: [model] as in the run's config.toml), or start a fresh "
            f"run in another folder (another --out / checkpoint root)."
        )


__all__ = ["check", "config_differences", "engine_tensors", "model_meta", "saved_tensors", "tensor_differences"]
