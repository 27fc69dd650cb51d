"""Healing's network transfer: a live rank sends its state to the same rank of a healing replica group over the
quorum's process group (torchft's ``CheckpointTransport`` interface, plait's own encoding).

torchft's own transports unpickle what they receive (its HTTP transport loads with ``weights_only=False``, its
process-group transport ``pickle.loads`` the metadata); plait's never does: a message is ``plait.ft.wire``'s
safetensors buffer, sent as its length (one int64) and its bytes. The ``metadata`` every group publishes through
the quorum is the job's fingerprint (model, data, optimizer and layout, ``plait.ft.session``): a healing group
compares it with its own before loading anything, and refuses a peer that trains something else.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from typing import Any

import torch
from torchft.checkpointing.transport import CheckpointTransport

from plait.errors import ConfigError
from plait.ft import wire
from plait.logging import get_logger

log = get_logger(__name__)
TAG = 7


class PeerTransport(CheckpointTransport[Any]):
    """Sends and receives one replica group rank's state over ``pg`` (torchft's reconfigurable process group)."""

    def __init__(self, pg: Any, fingerprint: dict[str, Any], die_while_serving: bool = False) -> None:
        self.pg = pg
        self.fingerprint = fingerprint
        self.die_while_serving = die_while_serving
        self.refused: ConfigError | None = None
        """Set when a peer's fingerprint differed: the session raises it in the main thread."""
        self.sent_bytes = 0
        self.received_bytes = 0

    def metadata(self) -> str:
        return json.dumps(self.fingerprint, sort_keys=True)

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        payload = torch.frombuffer(bytearray(wire.dumps(state_dict)), dtype=torch.uint8)
        for dst in dst_ranks:
            self.pg.send([torch.tensor([payload.numel()], dtype=torch.int64)], dst, TAG).wait()
            if self.die_while_serving:  # PLAIT_FT_FAULT=where=heal: the healing peer dies mid-transfer
                log.error("PLAIT_FT_FAULT: dying while sending step %d to replica rank %d", step, dst)
                os._exit(9)
            self.pg.send([payload], dst, TAG).wait()
            self.sent_bytes += payload.numel()
        log.info("sent step %d's state (%.1f MB) to replica rank(s) %s", step, payload.numel() / 1e6, dst_ranks)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        length = torch.zeros(1, dtype=torch.int64)
        self.pg.recv([length], src_rank, TAG).wait()
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
        self.pg.recv([payload], src_rank, TAG).wait()
        self.received_bytes += payload.numel()
        theirs = json.loads(metadata) if metadata else {}
        differences = sorted(
            key for key in set(theirs) | set(self.fingerprint) if theirs.get(key) != self.fingerprint.get(key)
        )
        if differences:
            self.refused = ConfigError(
                f"the live replica group trains another job: its {', '.join(differences)} differ from this group's "
                f"(this group: {json.dumps({k: self.fingerprint.get(k) for k in differences})}; the live one: "
                f"{json.dumps({k: theirs.get(k) for k in differences})}). Fix: start every replica group with the "
                f"same configuration."
            )
            raise self.refused
        log.info("received step %d's state (%.1f MB) from replica rank %d", step, payload.numel() / 1e6, src_rank)
        return wire.loads(payload.numpy().tobytes())

    def disallow_checkpoint(self) -> None:
        """Nothing is staged between steps: a state is encoded when a peer asks for it."""


__all__ = ["PeerTransport"]
