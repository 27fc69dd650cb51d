"""The parameter server's wire format: authenticated frames of a JSON header plus raw tensor bytes.

Nothing received is ever executed: a message is a small JSON object (ops, ids, versions, the tensors' names,
dtypes, shapes and offsets) followed by the tensors' raw bytes, which become tensors through ``torch.frombuffer``
only after their names, dtypes and shapes have been checked against what the receiver expects.

Frame (each direction)::

    prefix   "PLP1" | header bytes (u32) | payload bytes (u64)        16 bytes, sizes checked before any allocation
    header   JSON object, at most MAX_HEADER bytes                     {"op": ..., "args": ..., "t": [tensor metas]}
    payload  the tensors' bytes, each at a 64-byte aligned offset      at most the connection's max_payload
    mac      HMAC-SHA256(session key, direction | counter | prefix | header | payload)

Threat model. The adversary can reach the port and read, inject, drop, replay or reorder bytes on the network,
but does not hold the job's key. Then:
- Connect: a mutual challenge-response (each side sends a 32-byte random nonce; the client proves it holds the key
  with HMAC(key, "client" | nonce_s | nonce_c), the server with HMAC(key, "server" | nonce_c | nonce_s)) and a
  per-connection session key HMAC(key, "session" | nonce_s | nonce_c). A peer without the key is refused before
  any message is parsed; a relayed handshake gives no session key.
- Every message: its MAC under the session key covers the header and the payload, with a direction byte and a
  per-direction counter, so a modified, injected, replayed (from this or another connection), reflected or
  reordered message fails verification; the connection is closed. The MAC is checked before the JSON is parsed.
- Everything a peer says is bounded (header size, payload size against what the receiver owns, tensor count)
  and checked (names, dtypes, shapes, offsets inside the payload) before use; a bad message costs the sender its
  own connection (ProtocolError), never the server.
- Not covered: confidentiality (parameters travel in clear; use a private network or a tunnel for secret
  models) and a peer that holds the key (it is a member of the job and may push any gradient).
There is no keyless mode: a loopback job started without a key uses this user's local key (keys.py), and an
empty key is refused on both sides.

Same-host transfers (shm): over a loopback connection the client may offer two shared-memory segments it created
in /dev/shm with mode 0600 and a random 128-bit name; the server maps them only if they are regular files owned
by its own user with no group/other permission bits, then unlinks them. Tensor bytes then travel through the
mappings (one copy per side, no MAC over them); headers still travel, MAC'd, on the socket. Only processes of the
same user (who could read or write either process's memory anyway) can touch those pages.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import mmap
import os
import re
import secrets
import select
import socket
import stat
import struct
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

MAGIC = b"PLP1"
PREFIX = struct.Struct("!4sIQ")
MAC_BYTES = 32
MAX_HEADER = 1 << 20
"""Largest JSON header accepted (1 MiB: a model of ~10k tensors' metadata)."""
MAX_TENSORS = 65536
ALIGN = 64
HELLO = b"plait-ps/1".ljust(16, b"\0")
HANDSHAKE_TIMEOUT_S = 5.0
BODY_TIMEOUT_S = 60.0
"""A message whose first byte arrived must be complete within this time (a stalled sender loses its connection)."""
SMALL_FRAME = 256 * 1024
SHM_DIR = "/dev/shm"
SHM_NAME = re.compile(r"plait-ps-[0-9a-f]{32}")
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
"""The dtypes a tensor on the wire may have (by name; nothing else is looked up)."""


class ProtocolError(Exception):
    """A malformed, oversized, unauthenticated or unexpected message: the connection that carried it is closed."""


class AuthenticationError(ProtocolError):
    """The peer does not hold the job's key (or the keys differ)."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _aligned(size: int) -> int:
    return (size + ALIGN - 1) // ALIGN * ALIGN


def _recv_exactly(sock: socket.socket, view: memoryview, deadline: float) -> None:
    got = 0
    while got < len(view):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"the peer sent {got} of {len(view)} bytes in time")
        sock.settimeout(remaining)
        count = sock.recv_into(view[got:])
        if count == 0:
            raise EOFError("the peer closed the connection")
        got += count


def _recv_bytes(sock: socket.socket, size: int, deadline: float) -> bytes:
    buffer = bytearray(size)
    _recv_exactly(sock, memoryview(buffer), deadline)
    return bytes(buffer)


def _tag(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _secret(key: bytes) -> bytes:
    if not key:
        raise AuthenticationError("an empty key authenticates nothing; plait never uses one (keys.py)")
    return key


def server_handshake(sock: socket.socket, key: bytes) -> bytes:
    """Prove and check the key (module docstring); the session key. AuthenticationError on a wrong or no key."""
    secret = _secret(key)
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
    nonce_s = secrets.token_bytes(32)
    sock.sendall(HELLO + nonce_s)
    reply = _recv_bytes(sock, 64, deadline)
    nonce_c, proof = reply[:32], reply[32:]
    if not hmac.compare_digest(proof, _tag(secret, b"client", nonce_s, nonce_c)):
        raise AuthenticationError("the client failed authentication (it does not hold this job's key)")
    sock.sendall(_tag(secret, b"server", nonce_c, nonce_s))
    return _tag(secret, b"session", nonce_s, nonce_c)


def client_handshake(sock: socket.socket, key: bytes) -> bytes:
    """The client's half of the handshake; the session key."""
    secret = _secret(key)
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
    hello = _recv_bytes(sock, len(HELLO) + 32, deadline)
    if hello[: len(HELLO)] != HELLO:
        raise ProtocolError("the peer is not a plait parameter server (wrong greeting)")
    nonce_s, nonce_c = hello[len(HELLO) :], secrets.token_bytes(32)
    sock.sendall(nonce_c + _tag(secret, b"client", nonce_s, nonce_c))
    try:
        proof = _recv_bytes(sock, MAC_BYTES, deadline)
    except EOFError:
        raise AuthenticationError(
            "the server closed the connection during authentication: its key differs from this process's. "
            "Fix: use the same PLAIT_PS_AUTHKEY / --key-file on every server and worker."
        ) from None
    if not hmac.compare_digest(proof, _tag(secret, b"server", nonce_c, nonce_s)):
        raise AuthenticationError("the server failed authentication: its key differs from this process's.")
    return _tag(secret, b"session", nonce_s, nonce_c)


class SharedBuffer:
    """A /dev/shm segment mapped into this process (module docstring: who may create and map one)."""

    def __init__(self, name: str, size: int, memory: mmap.mmap) -> None:
        self.name, self.size, self.memory = name, size, memory
        self.bytes = torch.frombuffer(memory, dtype=torch.uint8)

    @staticmethod
    def available() -> bool:
        return os.path.isdir(SHM_DIR) and hasattr(os, "getuid")

    @classmethod
    def create(cls, size: int) -> SharedBuffer:
        name = f"plait-ps-{secrets.token_hex(16)}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, size)
            memory = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(name, size, memory)

    @classmethod
    def attach(cls, name: Any, size: Any, limit: int) -> SharedBuffer:
        """Map a peer's segment after checking its name, size, type, owner and mode; then unlink it."""
        if not isinstance(name, str) or not SHM_NAME.fullmatch(name):
            raise ProtocolError(f"shared-memory name {str(name)[:80]!r} is not plait's")
        if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= limit:
            raise ProtocolError(f"shared-memory size {size!r} is outside (0, {limit}]")
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as error:
            raise ProtocolError(f"cannot open shared memory {name}: {error}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
                raise ProtocolError(f"shared memory {name} is not a private (0600) file of this user")
            if info.st_size != size:
                raise ProtocolError(f"shared memory {name} holds {info.st_size} bytes, not the {size} announced")
            memory = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        cls.unlink(name)
        return cls(name, size, memory)

    @staticmethod
    def unlink(name: str) -> None:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass


@dataclass
class Staged:
    """Tensors copied into a send buffer: their metadata and where the bytes are."""

    metas: list[list[Any]]
    size: int
    in_shm: bool
    source: Tensor
    """The staged bytes (a view of the buffer they were copied into)."""


@dataclass
class Message:
    header: dict[str, Any]
    payload: memoryview
    in_shm: bool


class Channel:
    """One authenticated connection (either side); not thread-safe: one request/reply at a time."""

    def __init__(self, sock: socket.socket, session_key: bytes, side: str, max_payload: int, peer: str) -> None:
        self.sock, self.key, self.peer, self.max_payload = sock, session_key, peer, max_payload
        self.out_dir, self.in_dir = (b"C", b"S") if side == "client" else (b"S", b"C")
        self.sent = self.received = 0
        self.shm_out: SharedBuffer | None = None
        self.shm_in: SharedBuffer | None = None
        self._send = torch.empty(0, dtype=torch.uint8)
        self._recv = bytearray()

    # ---- sending --------------------------------------------------------------------------------------------
    def stage(self, tensors: Iterable[tuple[str, Tensor]], wire_dtype: torch.dtype | None = None) -> Staged:
        """Copy ``tensors`` (cast to ``wire_dtype`` when given, e.g. bf16 push compression) into the send buffer:
        the shared segment when there is one and they fit, else this channel's own buffer."""
        items = [(name, tensor.detach()) for name, tensor in tensors]
        dtypes = [wire_dtype or tensor.dtype for _, tensor in items]
        sizes = [tensor.numel() * dtype.itemsize for (_, tensor), dtype in zip(items, dtypes)]
        offsets, total = [], 0
        for size in sizes:
            offsets.append(total)
            total = _aligned(total + size)
        in_shm = self.shm_out is not None and 0 < total <= self.shm_out.size
        if in_shm:
            assert self.shm_out is not None
            target = self.shm_out.bytes
        else:
            if self._send.numel() < total:
                self._send = torch.empty(total, dtype=torch.uint8)
            target = self._send
        metas = []
        for (name, tensor), dtype, offset, size in zip(items, dtypes, offsets, sizes):
            if size:
                target[offset : offset + size].view(dtype).view(tensor.shape).copy_(tensor)
            metas.append([name, dtype_name(dtype), list(tensor.shape), offset, size])
        return Staged(metas, total, in_shm, target[:total])

    def restage(self, staged: Staged) -> Staged:
        """The same bytes staged on this channel (a re-send after reconnecting: the old buffers may be gone)."""
        in_shm = self.shm_out is not None and 0 < staged.size <= self.shm_out.size
        if in_shm:
            assert self.shm_out is not None
            target = self.shm_out.bytes
        else:
            if self._send.numel() < staged.size:
                self._send = torch.empty(staged.size, dtype=torch.uint8)
            target = self._send
        target[: staged.size].copy_(staged.source[: staged.size])
        return Staged(staged.metas, staged.size, in_shm, target[: staged.size])

    def send(self, header: Mapping[str, Any], staged: Staged | None = None) -> None:
        body = dict(header)
        payload = memoryview(b"")
        if staged is not None and staged.metas:
            body["t"], body["shm"] = staged.metas, staged.in_shm
            if not staged.in_shm:
                payload = memoryview(self._send.numpy().data)[: staged.size]  # the buffer's bytes (uint8 tensor)
        head = json.dumps(body, separators=(",", ":")).encode()
        if len(head) > MAX_HEADER:
            raise ValueError(f"message header of {len(head)} bytes exceeds {MAX_HEADER}")
        prefix = PREFIX.pack(MAGIC, len(head), len(payload))
        mac = self._mac(self.out_dir, self.sent, prefix, head, payload)
        self.sent += 1
        self.sock.settimeout(BODY_TIMEOUT_S)  # a whole frame must leave within this (not a receive's leftover)
        if len(payload) <= SMALL_FRAME:
            self.sock.sendall(b"".join((prefix, head, payload, mac)))
        else:
            self.sock.sendall(prefix + head)
            self.sock.sendall(payload)
            self.sock.sendall(mac)

    def _mac(self, direction: bytes, counter: int, prefix: bytes, head: bytes | bytearray, payload: Any) -> bytes:
        digest = hmac.new(self.key, direction + counter.to_bytes(8, "big") + prefix, hashlib.sha256)
        digest.update(head)
        digest.update(payload)
        return digest.digest()

    # ---- receiving ------------------------------------------------------------------------------------------
    def readable(self, timeout_s: float) -> bool:
        """Whether a message has started arriving (or the peer closed) within ``timeout_s``."""
        ready, _, _ = select.select([self.sock], [], [], timeout_s)
        return bool(ready)

    def receive(self, timeout_s: float) -> Message:
        """The next message, authenticated and bounded; TimeoutError when none starts within ``timeout_s``,
        EOFError when the peer closed, ProtocolError when it is malformed (then close the channel)."""
        if not self.readable(timeout_s):
            raise TimeoutError(f"no message from {self.peer} within {timeout_s:g} s")
        deadline = time.monotonic() + BODY_TIMEOUT_S
        prefix = _recv_bytes(self.sock, PREFIX.size, deadline)
        magic, head_size, payload_size = PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise ProtocolError(f"not a plait-ps frame (starts with {magic!r})")
        if not 0 < head_size <= MAX_HEADER:
            raise ProtocolError(f"header of {head_size} bytes is outside (0, {MAX_HEADER}]")
        if payload_size > self.max_payload:
            raise ProtocolError(
                f"payload of {payload_size} bytes exceeds the {self.max_payload} this connection accepts"
            )
        head = _recv_bytes(self.sock, head_size, deadline)
        if len(self._recv) < payload_size:
            self._recv = bytearray(payload_size)
        payload = memoryview(self._recv)[:payload_size]
        _recv_exactly(self.sock, payload, deadline)
        mac = _recv_bytes(self.sock, MAC_BYTES, deadline)
        if not hmac.compare_digest(mac, self._mac(self.in_dir, self.received, prefix, head, payload)):
            raise ProtocolError("message authentication failed (modified, replayed or sent without the key)")
        self.received += 1
        try:
            header = json.loads(head.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as error:
            raise ProtocolError(f"header is not JSON: {error}") from None
        if not isinstance(header, dict):
            raise ProtocolError(f"header is a JSON {type(header).__name__}, not an object")
        in_shm = header.get("shm", False)
        if in_shm not in (True, False):
            raise ProtocolError("header field 'shm' must be true or false")
        if in_shm and (self.shm_in is None or payload_size):
            raise ProtocolError("a shared-memory message on a connection without shared memory")
        if in_shm:
            assert self.shm_in is not None
            payload = memoryview(self.shm_in.memory)
        return Message(header, payload, bool(in_shm))

    def tensors(
        self, message: Message, expected: Mapping[str, tuple[tuple[int, ...], Sequence[str]]], exact: bool = True
    ) -> dict[str, Tensor]:
        """The message's tensors as views of its payload, after checking each against ``expected`` (name ->
        (shape, allowed dtype names)); with ``exact`` every expected name must be present."""
        metas = message.header.get("t", [])
        if not isinstance(metas, list) or len(metas) > MAX_TENSORS:
            raise ProtocolError(f"tensor list 't' must be a list of at most {MAX_TENSORS} entries")
        buffer, found = message.payload, {}
        for meta in metas:
            if not (isinstance(meta, list) and len(meta) == 5):
                raise ProtocolError("a tensor entry must be [name, dtype, shape, offset, nbytes]")
            name, dtype, shape, offset, nbytes = meta
            if not isinstance(name, str) or name not in expected or name in found:
                raise ProtocolError(f"unexpected or repeated tensor {str(name)[:80]!r}")
            want_shape, dtypes = expected[name]
            if dtype not in dtypes or dtype not in DTYPES:
                raise ProtocolError(f"tensor {name!r} has dtype {str(dtype)[:20]!r}, expected one of {list(dtypes)}")
            if shape != list(want_shape):
                raise ProtocolError(f"tensor {name!r} has shape {str(shape)[:80]}, expected {list(want_shape)}")
            torch_dtype = DTYPES[dtype]
            numel = 1
            for size in want_shape:
                numel *= size
            if not (_is_int(offset) and _is_int(nbytes)) or nbytes != numel * torch_dtype.itemsize:
                raise ProtocolError(f"tensor {name!r}: byte count {str(nbytes)[:20]} does not match its shape")
            if offset < 0 or offset % ALIGN or offset + nbytes > len(buffer):
                raise ProtocolError(f"tensor {name!r}: bytes [{offset}, +{nbytes}) lie outside the payload")
            if numel == 0:
                found[name] = torch.empty(want_shape, dtype=torch_dtype)
            else:
                found[name] = torch.frombuffer(buffer, dtype=torch_dtype, count=numel, offset=offset).view(want_shape)
        if exact and len(found) != len(expected):
            missing = sorted(set(expected) - set(found))
            raise ProtocolError(f"tensors missing from the message: {missing[:3]}")
        return found

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def shard_bytes(shapes: Iterable[tuple[tuple[int, ...], torch.dtype]]) -> int:
    """Bytes a staged message of tensors of these shapes and dtypes needs (with alignment)."""
    total = 0
    for shape, dtype in shapes:
        numel = 1
        for size in shape:
            numel *= size
        total = _aligned(total + numel * dtype.itemsize)
    return total


__all__ = [
    "DTYPES",
    "AuthenticationError",
    "Channel",
    "Message",
    "ProtocolError",
    "SharedBuffer",
    "Staged",
    "client_handshake",
    "dtype_name",
    "server_handshake",
    "shard_bytes",
]
