"""Rectangles of a checkpoint's model tensors, read without ever holding a whole model (``CheckpointSource``).

A plait checkpoint stores every model tensor as its single-device (global) tensor, cut into the pieces the
saving ranks held (``chunks``). ``CheckpointSource(root).read(requests)`` asks DCP for exactly the rectangles a
rank keeps (``plait.parallel.materialize.share``): one ``Chunked`` per tensor whose pieces are the destination
views, so DCP reads each overlapping saved piece and copies the overlap (at most one saved piece in memory at a
time, besides the destinations). It is the ``WeightSource`` of ``train.init_from`` / ``plait generate`` with a
checkpoint, and what ``plait convert`` streams tensor by tensor.

The checkpoint is chosen and checked as for ``load_full_state`` (the newest intact one, every file against
plait.json's size and SHA-256: read in a stream, never whole); ``.metadata`` is read as plain data and every file
inside the folder (``storage``), so opening a source runs no code from the checkpoint. A tensor whose pieces
hold fewer bytes than its shape claims is refused before anything is allocated for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from plait.checkpoint import storage
from plait.checkpoint.canonical import MODEL
from plait.checkpoint.chunks import Chunked, Piece
from plait.errors import CheckpointError

Request = tuple[str, tuple[slice, ...], torch.Tensor]


class CheckpointSource:
    """The model tensors of the newest intact checkpoint under ``root`` (or of the step folder ``root``)."""

    def __init__(self, root: str | Path) -> None:
        from plait.checkpoint import _choose, _read_meta

        self.folder = _choose(root)
        self.meta: dict[str, Any] = _read_meta(self.folder)
        self.description = f"checkpoint {self.folder}"
        metadata = storage.read_metadata(self.folder)
        stored_bytes: dict[str, int] = {}
        for index, info in (metadata.storage_data or {}).items():
            stored_bytes[index.fqn] = stored_bytes.get(index.fqn, 0) + info.length
        self._stored: dict[str, TensorStorageMetadata] = {}
        for key, stored in metadata.state_dict_metadata.items():
            if not key.startswith(MODEL):
                continue
            if not isinstance(stored, TensorStorageMetadata):
                raise CheckpointError(f"checkpoint entry {key!r} is not a tensor: refusing to load it.")
            need = stored.size.numel() * stored.properties.dtype.itemsize
            if need > stored_bytes.get(key, 0):  # before allocating what a crafted .metadata may claim
                raise CheckpointError(
                    f"checkpoint entry {key!r} claims shape {tuple(stored.size)} ({need} bytes) but its pieces hold "
                    f"{stored_bytes.get(key, 0)} bytes: the .metadata is malformed. Fix: restore it from a copy."
                )
            self._stored[key[len(MODEL) :]] = stored

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(stored.size) for name, stored in self._stored.items()}

    def dtype(self, name: str) -> torch.dtype:
        return self._stored[name].properties.dtype

    def whole(self, name: str) -> torch.Tensor:
        """One whole tensor (its pieces read by DCP into one new tensor)."""
        shape = self.shapes()[name]
        out = torch.empty(shape, dtype=self.dtype(name))
        self.read([(name, tuple(slice(0, size) for size in shape), out)])
        return out

    def read(self, requests: list[Request]) -> None:
        """Fill each request's tensor with its rectangle of the named tensor (one DCP read per round; a rectangle
        asked for twice goes to a second round, since DCP finds pieces by their offsets). A destination of
        another dtype than the checkpoint's, or not contiguous, is read through a host buffer."""
        rounds: list[dict[str, list[Piece]]] = []
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, index, out in requests:
            offsets = tuple(piece.start or 0 for piece in index)
            view = out
            if out.dtype != self.dtype(name) or not out.is_contiguous():
                view = torch.empty(out.shape, dtype=self.dtype(name))
                copies.append((out, view))
            for pending in rounds:
                pieces = pending.setdefault(name, [])
                if all(other.offsets != offsets for other in pieces):
                    pieces.append(Piece(offsets, view))
                    break
            else:
                rounds.append({name: [Piece(offsets, view)]})
        for pending in rounds:
            state = {
                MODEL + name: Chunked(self._stored[name].size, pieces) for name, pieces in pending.items() if pieces
            }
            storage.read(state, self.folder, no_dist=True)
        for out, view in copies:
            out.copy_(view)


__all__ = ["CheckpointSource"]
