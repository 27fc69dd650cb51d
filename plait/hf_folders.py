"""Hugging Face model and tokenizer folders written by someone else: no code from them, no file from elsewhere.

- **No code** (``refuse_auto_map``): a ``config.json`` or ``tokenizer_config.json`` that holds ``auto_map`` names
  classes of the folder's own Python files, which transformers would import. It is refused before transformers
  reads the folder, whatever form the value takes: a mapping (``{"AutoModelForCausalLM": "mod.Class"}``), a
  tokenizer's list ``[slow, fast]`` (a form transformers accepts), a string, a number, even an empty value
  (plait has no use for any of them, and a check that reads the value could be fooled by one it did not expect).
- **Links** (``check_links``, ``resolve``): the folder the user names is the user's own path and is followed
  when it is a link. Inside it, a symbolic link was written by the folder's author and may lead anywhere: to
  ``~/.ssh/id_rsa`` as ``model.safetensors``, whose bytes ``plait convert`` would then put into an export the user
  shares. A link is followed only when it leads to a file inside the folder, or when the folder is a snapshot of
  the Hugging Face hub cache (``.../models--ORG--NAME/snapshots/REVISION/``, whose files are links to
  ``../../blobs/SHA``) and the link leads to a regular file in the same model's ``blobs`` folder. Any other link
  is refused, naming it; ``cp -rL`` makes a folder of plain files.
"""

from __future__ import annotations

import os
import reprlib
import stat
from pathlib import Path
from typing import Any

from plait.errors import ConfigError, PlaitError

HUB_SNAPSHOTS = "snapshots"
HUB_BLOBS = "blobs"
HUB_REPO_PREFIX = "models--"
LINK_FIX = (
    "Fix: copy the folder with its files themselves (cp -rL FOLDER COPY), or download it with "
    "huggingface-cli download --local-dir."
)
_SHORT = reprlib.Repr()
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict = 40, 40, 3, 3


def _hub_blobs(folder: Path) -> Path | None:
    """The ``blobs`` folder of the hub-cache repository whose snapshot ``folder`` (resolved) is, else None."""
    snapshots = folder.parent
    repo = snapshots.parent
    if snapshots.name == HUB_SNAPSHOTS and repo.name.startswith(HUB_REPO_PREFIX):
        return repo / HUB_BLOBS
    return None


def link_problem(folder: Path, entry: Path) -> str | None:
    """Why plait does not follow the symbolic link ``entry`` of ``folder`` (None when it does, or when ``entry``
    is no link): it leads outside the folder and outside the same hub-cache model's blobs, or nowhere."""
    if not entry.is_symlink():
        return None
    real = folder.resolve()
    try:
        target = entry.resolve(strict=True)
    except (OSError, RuntimeError):  # a dangling link, or a loop
        return f"{entry} is a symbolic link that leads nowhere"
    if target == real or real in target.parents:
        return None
    blobs = _hub_blobs(real)
    if blobs is not None and target.parent == blobs and stat.S_ISREG(os.stat(target).st_mode):
        return None
    return (
        f"{entry} is a symbolic link to {target}, outside the folder (a link in a folder is followed only to a file "
        f"inside it, or to the blobs of the same Hugging Face cache model): refused, since it could make plait read "
        f"any file of yours"
    )


def check_links(folder: Path, error: type[PlaitError] = ConfigError) -> None:
    """``error`` naming the first link among the entries of ``folder`` that plait does not follow (module
    docstring), checked before anything (transformers included) reads the folder."""
    try:
        entries = sorted(folder.iterdir())
    except OSError as failure:
        raise error(f"cannot list {folder}: {failure.strerror}. Fix: give a readable folder.") from None
    for entry in entries:
        problem = link_problem(folder, entry)
        if problem is not None:
            raise error(f"{problem}. {LINK_FIX}")


def resolve(folder: Path, name: str) -> Path:
    """The path to read for the file ``name`` of ``folder``: the target of a link plait follows (``link_problem``),
    else ``folder / name`` itself (a link there is then refused by ``plait.files``' readers, which follow none)."""
    entry = folder / name
    return entry.resolve() if entry.is_symlink() and link_problem(folder, entry) is None else entry


def describe(value: Any) -> str:
    """A short one-line picture of an ``auto_map`` value, whatever its type (for the message)."""
    if isinstance(value, dict):
        return _SHORT.repr(sorted(str(key) for key in value))
    return _SHORT.repr(value)


def refuse_auto_map(fields: Any, file: Path, fix: str, error: type[PlaitError] = ConfigError) -> None:
    """``error`` when the JSON object ``fields`` read from ``file`` holds ``auto_map`` in any form (module
    docstring); ``fix`` ends the message."""
    if isinstance(fields, dict) and "auto_map" in fields:
        raise error(
            f"{file} asks for the folder's own Python code (auto_map {describe(fields['auto_map'])}); plait never "
            f"runs code from a folder. {fix}"
        )


__all__ = ["LINK_FIX", "check_links", "describe", "link_problem", "refuse_auto_map", "resolve"]
