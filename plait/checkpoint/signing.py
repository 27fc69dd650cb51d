"""plait.json's seal: its own SHA-256 (accidents), and an HMAC-SHA256 with the user's key (tampering).

plait.json records every file of a checkpoint with its size and SHA-256, and ``checksum``, the SHA-256 of its own
other content. A checksum has no secret: anyone who can write the folder can change a file, record its new digest
and recompute the checksum, and the checkpoint checks out. **Without a key, checksums detect accidents only**
(truncation, a flipped bit, a file from another save).

With a key (``PLAIT_CHECKPOINT_KEY_FILE``: a file of this user with mode 0600, ``plait checkpoint keygen FILE``
writes one; or ``PLAIT_CHECKPOINT_KEY``, at least 16 characters), the same content is also signed:
``signature = {"hmac-sha256": HMAC(key, content), "key_id": ...}``. Since the manifest records every file's digest,
the signature covers every byte of the checkpoint. When a key is set, a checkpoint counts as intact only if its
signature is valid under that key: an unsigned one, one signed with another key or one whose content changed is
refused like a damaged one (``plait checkpoint sign DIR`` signs one you trust). With no key set, signatures are
not checked (and cannot be).

The key is read the way the parameter server reads its own (``plait.files``: a regular file of this user, no
group/other permission bits), from environment variables of its own. ``plait train`` reads it first of all, on
every rank (``check_key``): a key set but unusable stops the job before any work.

What the signature binds: plait.json's whole content, so also the step it records (which must be its folder's,
``integrity.step_problem``) and the run it records (which must be its root's, ``catalog``): a signed checkpoint
copied or renamed to another step's folder, or into another run's folder, is refused like a damaged one.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

from plait import files

KEY_ENV = "PLAIT_CHECKPOINT_KEY"
KEY_FILE_ENV = "PLAIT_CHECKPOINT_KEY_FILE"
KEY_FIX = (
    f"Fix: run `plait checkpoint keygen ckpt.key` once and export {KEY_FILE_ENV}=ckpt.key (mode 0600) on every "
    f"host, or export {KEY_ENV}=<a secret of at least {files.MIN_KEY_CHARS} characters>."
)
SEALS = ("checksum", "signature")
"""plait.json's keys that seal the rest (not part of what they seal)."""
ALGORITHM = "hmac-sha256"


def key() -> bytes | None:
    """The checkpoint key the user set (module docstring), or None."""
    return files.resolve_key(None, KEY_FILE_ENV, KEY_ENV, KEY_FIX)


def check_key() -> None:
    """Read and check the checkpoint key the user set, if any: what a job runs first, on every rank, before any
    work (building the model, a step), so that a key file that is missing, a folder, readable by others or too
    short (or a ``KEY_ENV`` too short) fails the job at once with one ``ConfigError`` line naming the variable,
    the problem and the fix, not at the first save ``save_every`` steps later. The key is read again where it is
    used (a key file replaced during the run fails that save or load alike)."""
    key()


def key_id(secret: bytes) -> str:
    """A short public name of ``secret`` (to say *which* key signed), not enough to recover it."""
    return hashlib.sha256(b"plait checkpoint key id\0" + secret).hexdigest()[:16]


def canonical(meta: dict[str, Any]) -> bytes:
    """plait.json's content without its seals, as canonical JSON (sorted keys, no spaces)."""
    body = {name: value for name, value in meta.items() if name not in SEALS}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def seal(meta: dict[str, Any], secret: bytes | None = None) -> dict[str, Any]:
    """``meta`` with ``checksum`` (always) and, with a key (``secret``, else the user's), ``signature``."""
    secret = secret if secret is not None else key()
    body = canonical(meta)
    sealed = {name: value for name, value in meta.items() if name not in SEALS}
    sealed["checksum"] = hashlib.sha256(body).hexdigest()
    if secret is not None:
        digest = hmac.new(secret, body, hashlib.sha256).hexdigest()
        sealed["signature"] = {ALGORITHM: digest, "key_id": key_id(secret)}
    return sealed


def problem(meta: dict[str, Any], secret: bytes | None) -> str | None:
    """What is wrong with plait.json's seals (None when they hold): its checksum, and under a key its signature."""
    body = canonical(meta)
    if "checksum" in meta and hashlib.sha256(body).hexdigest() != meta["checksum"]:
        return "plait.json (written by rank 0) does not match its own checksum: it was changed or damaged"
    if secret is None:
        return None
    signature = meta.get("signature")
    source = f"the checkpoint key ({KEY_FILE_ENV} / {KEY_ENV})"
    if not isinstance(signature, dict) or not isinstance(signature.get(ALGORITHM), str):
        return (
            f"plait.json is not signed, but {source} is set: anyone who can write the folder could have written "
            f"it (if you trust it, sign it once with `plait checkpoint sign DIR`)"
        )
    if signature.get("key_id") != key_id(secret):
        return (
            f"plait.json is signed with another key (key id {signature.get('key_id')!r}, {source} has "
            f"{key_id(secret)!r}): set the key it was signed with"
        )
    if not hmac.compare_digest(hmac.new(secret, body, hashlib.sha256).hexdigest(), signature[ALGORITHM]):
        return f"plait.json's signature does not match its content under {source}: it was changed after signing"
    return None


__all__ = ["KEY_ENV", "KEY_FILE_ENV", "canonical", "check_key", "key", "key_id", "problem", "seal"]
