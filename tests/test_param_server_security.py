"""The parameter server's safety (plait/param_server/wire.py, keys.py, service.py): no key, no non-loopback bind;
keys from a 0600 file or the environment, never a default; the handshake refuses a wrong key; no pickle anywhere;
a fuzzer throwing truncated, oversized, wrong-typed, forged, replayed and random messages at a live server while a
real worker trains (the server keeps serving and loses no update), and hostile replies at a worker (refused).
Servers run in threads of this process (fast); every wait has a timeout."""

from __future__ import annotations

import json
import os
import random
import socket
import struct
import threading
import time
from pathlib import Path

import pytest
import torch

from plait.cli.main import main
from plait.errors import ConfigError
from plait.param_server import AdditionGPT, Consistency, OptimizerSpec, PSWorker, ServerSettings, ShardServer
from plait.param_server.keys import check_bind, generate_key_file, read_key_file, resolve_key
from plait.param_server.service import Service
from plait.param_server.transport import connect
from plait.param_server.wire import (
    MAC_BYTES,
    MAGIC,
    PREFIX,
    Channel,
    ProtocolError,
    SharedBuffer,
    client_handshake,
    server_handshake,
)

TASK = AdditionGPT()
KEY = b"0123456789abcdef-test-key"
PACKAGE = Path(__file__).resolve().parent.parent / "plait" / "param_server"


def _serve(settings: ServerSettings, key: bytes | None = KEY) -> Service:
    service = Service(ShardServer(TASK.build_model(), settings), log_every_s=0, key=key)
    threading.Thread(target=service.serve_forever, daemon=True).start()
    return service


def _stop(service: Service) -> None:
    service.stopped.set()


# ----------------------------------------------------------------- keys and binds
def test_no_key_is_refused_on_0_0_0_0_and_loopback_is_the_default(monkeypatch, capsys):
    monkeypatch.delenv("PLAIT_PS_AUTHKEY", raising=False)
    monkeypatch.delenv("PLAIT_PS_KEY_FILE", raising=False)
    with pytest.raises(ConfigError, match="refusing to listen on 0.0.0.0 without a key.*plait ps keygen"):
        Service(ShardServer(TASK.build_model(), ServerSettings()), host="0.0.0.0", key=None)
    check_bind("127.0.0.1", None)  # loopback needs no key
    check_bind("0.0.0.0", b"x" * 32)  # any address with a key the user set
    assert main(["ps", "--role", "server", "--bind", "0.0.0.0:0"]) == 2
    err = capsys.readouterr().err
    assert "refusing to listen on 0.0.0.0 without a key" in err and "Traceback" not in err
    from plait.cli.main import _parser

    assert _parser().parse_args(["ps"]).bind == "127.0.0.1:29600"


def test_keys_come_from_a_private_file_or_the_environment_never_a_default(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("PLAIT_PS_AUTHKEY", raising=False)
    monkeypatch.delenv("PLAIT_PS_KEY_FILE", raising=False)
    assert resolve_key() is None
    assert main(["ps", "keygen", str(tmp_path / "ps.key")]) == 0
    path = tmp_path / "ps.key"
    assert (path.stat().st_mode & 0o777) == 0o600 and len(read_key_file(path)) == 64
    assert resolve_key(str(path)) == read_key_file(path)
    with pytest.raises(ConfigError, match="never overwrites"):
        generate_key_file(path)
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="mode 644: others may read it. Fix: chmod 600"):
        read_key_file(path)
    monkeypatch.setenv("PLAIT_PS_AUTHKEY", "short")
    with pytest.raises(ConfigError, match="fewer than 16"):
        resolve_key()
    monkeypatch.setenv("PLAIT_PS_AUTHKEY", "a-long-enough-secret")
    assert resolve_key() == b"a-long-enough-secret"


def test_no_pickle_in_the_parameter_server_and_checkpoints_load_weights_only():
    for path in PACKAGE.glob("*.py"):
        text = path.read_text()
        assert "pickle" not in text.lower(), path
        for line in text.splitlines():
            if "torch.load(" in line:
                assert "weights_only=True" in line, (path, line)


@pytest.mark.timeout(30)
def test_a_wrong_or_missing_key_is_refused_and_the_server_keeps_serving():
    service = _serve(ServerSettings())
    try:
        with pytest.raises(ConfigError, match="key differs.*Fix: use the same PLAIT_PS_AUTHKEY"):
            connect(service.address, b"another-key-of-16+chars", 5, 0)
        with pytest.raises(ConfigError, match="key differs"):
            connect(service.address, None, 5, 0)
        worker = PSWorker([service.address], TASK.build_model(), "good", key=KEY, timeout_s=10)
        assert worker.pull() == [0]
        worker.close()
        assert service.refused == 2
    finally:
        _stop(service)


# ----------------------------------------------------------------- fuzzing a live server
def _handshaken(address: tuple[str, int]) -> tuple[socket.socket, bytes]:
    sock = socket.create_connection(address, timeout=5)
    return sock, client_handshake(sock, KEY)


def _frame(session: bytes, counter: int, header: bytes, payload: bytes = b"", prefix: bytes | None = None) -> bytes:
    import hashlib
    import hmac

    prefix = prefix or PREFIX.pack(MAGIC, len(header), len(payload))
    mac = hmac.new(session, b"C" + counter.to_bytes(8, "big") + prefix + header + payload, hashlib.sha256).digest()
    return prefix + header + payload + mac


def _closed_by_server(sock: socket.socket) -> bool:
    """The server closed this connection (EOF) within 5 s, without replying anything usable."""
    sock.settimeout(5)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    finally:
        sock.close()


def _hostile_messages(shard: dict[str, torch.Tensor]) -> list[tuple[str, object]]:
    """(what, bytes-or-callable) for each attack: bytes are sent before the handshake, callables (sock, session)
    after it."""
    name, value = next(iter(shard.items()))
    nbytes = value.numel() * 4

    def push(meta: list, payload: bytes, args: dict | None = None) -> bytes:
        header = {"op": "push", "args": args or {"wid": "fuzz", "seq": 0, "version": 0, "pull": False}, "t": meta}
        return json.dumps(header).encode(), payload

    join = {"wid": "fuzz", "name": "fuzz", "spec": [], "settings": None}
    evil = b"cos\nsystem\n(S'touch /tmp/plait-ps-pwned'\ntR."  # a pickle that would run a command if unpickled
    attacks: list[tuple[str, object]] = [
        ("pickle instead of the handshake", evil * 2),
        ("random bytes instead of the handshake", bytes(random.Random(1).randbytes(300))),
    ]
    raw = [
        ("oversized payload length", PREFIX.pack(MAGIC, 10, 2**40) + b"x" * 10),
        ("oversized header length", PREFIX.pack(MAGIC, 2**31, 0)),
        ("empty header", PREFIX.pack(MAGIC, 0, 0)),
        ("wrong magic", PREFIX.pack(b"EVIL", 2, 0) + b"{}" + b"\0" * MAC_BYTES),
        ("forged MAC", PREFIX.pack(MAGIC, 2, 0) + b"{}" + b"\0" * MAC_BYTES),
    ]
    for what, data in raw:
        attacks.append((what, lambda sock, session, d=data: sock.sendall(d)))
    signed = [
        ("header not JSON", b"\xff\xfe not json", b""),
        ("header a JSON list", b"[1, 2, 3]", b""),
        ("unknown op", json.dumps({"op": "exec", "args": {"code": "import os"}}).encode(), b""),
        ("join with wrong types", json.dumps({"op": "join", "args": {**join, "wid": 1}}).encode(), b""),
        (
            "join with a bad spec",
            json.dumps({"op": "join", "args": {**join, "spec": [["x", [-5], "os.system"]]}}).encode(),
            b"",
        ),
        ("join with bad settings", json.dumps({"op": "join", "args": {**join, "settings": {"mode": 1}}}).encode(), b""),
        ("extra argument", json.dumps({"op": "report", "args": {"x": 1}}).encode(), b""),
        ("pickle as payload", *push([[name, "float32", list(value.shape), 0, len(evil)]], evil)),
        ("unknown tensor", *push([["evil", "float32", list(value.shape), 0, nbytes]], b"\0" * nbytes)),
        ("wrong dtype", *push([[name, "int64", list(value.shape), 0, nbytes * 2]], b"\0" * nbytes * 2)),
        ("wrong shape", *push([[name, "float32", [1, 2, 3], 0, 24]], b"\0" * 24)),
        ("bytes outside the payload", *push([[name, "float32", list(value.shape), 64, nbytes]], b"\0" * nbytes)),
        ("negative offset", *push([[name, "float32", list(value.shape), -64, nbytes]], b"\0" * nbytes)),
        ("byte count lies", *push([[name, "float32", list(value.shape), 0, 4]], b"\0" * 4)),
        ("shm flag without shm", json.dumps({"op": "report", "args": {}, "shm": True, "t": []}).encode(), b""),
        ("tensors on a request without any", json.dumps({"op": "report", "args": {}, "t": [[name]]}).encode(), b""),
    ]
    for what, header, payload in signed:
        attacks.append((what, lambda sock, session, h=header, p=payload: sock.sendall(_frame(session, 0, h, p))))

    def replay(sock: socket.socket, session: bytes) -> None:
        frame = _frame(session, 0, b'{"op":"report","args":{}}')
        sock.sendall(frame)
        channel_reply = sock.recv(65536)
        assert channel_reply  # the genuine request was answered
        sock.sendall(frame)  # the same frame again: its counter is stale

    attacks.append(("replayed frame", replay))
    return attacks


@pytest.mark.timeout(90)
def test_fuzzed_server_keeps_serving_and_loses_no_update():
    if os.path.exists("/tmp/plait-ps-pwned"):
        os.unlink("/tmp/plait-ps-pwned")
    service = _serve(ServerSettings(consistency=Consistency("asp"), optimizer=OptimizerSpec("SGD", {"lr": 0.1})))
    server = service.server
    worker = PSWorker([service.address], TASK.build_model(), "honest", key=KEY, timeout_s=20)
    rng = random.Random(0)
    steps = 0
    try:
        attacks = _hostile_messages({n: p.detach() for n, p in server.params.items()})
        for what, attack in attacks:
            sock = socket.create_connection(service.address, timeout=5)
            if callable(attack):
                session = client_handshake(sock, KEY)
                attack(sock, session)
            else:
                sock.sendall(attack)
            assert _closed_by_server(sock), f"the server kept a connection open after: {what}"
            worker.step(steps, lambda model: TASK.loss(model, TASK.batch_of(0, steps)))  # noqa: B023
            steps += 1
        refused = service.refused
        for _ in range(2):  # a truncated frame: the sender gives up half-way
            sock, session = _handshaken(service.address)
            sock.sendall(_frame(session, 0, b'{"op":"report","args":{}}')[:-5])
            sock.shutdown(socket.SHUT_WR)
            assert _closed_by_server(sock)
        for trial in range(60):  # random frames: random sizes, random bytes, signed or not
            sock, session = _handshaken(service.address)
            header = rng.randbytes(rng.randint(1, 200))
            payload = rng.randbytes(rng.randint(0, 200))
            frame = _frame(session, 0, header, payload)
            if trial % 3 == 1:
                frame = frame[: rng.randint(1, len(frame) - 1)]
            elif trial % 3 == 2:
                frame = bytearray(frame)
                frame[rng.randrange(len(frame))] ^= 0xFF
                frame = bytes(frame)
            sock.sendall(frame)
            sock.shutdown(socket.SHUT_WR)  # a truncated or length-corrupted frame would otherwise wait for more
            assert _closed_by_server(sock)
        for _ in range(3):
            worker.step(steps, lambda model: TASK.loss(model, TASK.batch_of(0, steps)))  # noqa: B023
            steps += 1
        report = server.report()
    finally:
        worker.close()
        _stop(service)
    assert not os.path.exists("/tmp/plait-ps-pwned"), "something received was executed"
    # every honest push was applied exactly once, nothing else was
    assert report["applied_by_worker"] == {"honest": steps} and report["pushes_applied"] == steps == report["version"]
    assert all(torch.isfinite(p).all() for p in server.params.values())
    assert refused == len(attacks)  # every attack was refused (logged), not merely ended
    assert service.refused >= refused + 20  # at least the 20 signed random headers (not JSON objects)


# ----------------------------------------------------------------- hostile replies at a worker
def _fake_server(replies: list) -> tuple[tuple[str, int], threading.Thread]:
    """A listener that answers a worker's join (valid) and then its pull with each reply in ``replies``."""
    listener = socket.create_server(("127.0.0.1", 0))
    spec = [n for n, p in TASK.build_model().named_parameters()]

    def run() -> None:
        for reply in replies:
            sock, _ = listener.accept()
            try:
                channel = Channel(sock, server_handshake(sock, KEY), "server", 1 << 20, "worker")
                channel.receive(5)
                channel.send({"ok": True, "value": {"names": spec, "version": 0, "clock": 0, "index": 0, "servers": 1}})
                channel.receive(5)
                reply(channel, sock)
                time.sleep(0.5)
            except (OSError, EOFError, ProtocolError):
                pass
            finally:
                sock.close()
        listener.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return listener.getsockname()[:2], thread


@pytest.mark.timeout(60)
def test_a_worker_refuses_hostile_replies():
    name = next(iter(TASK.build_model().named_parameters()))[0]

    def wrong_shape(channel: Channel, sock: socket.socket) -> None:
        staged = channel.stage([(name, torch.zeros(3))])
        channel.send({"ok": True, "value": {"version": 1, "unchanged": False}}, staged)

    def garbage(channel: Channel, sock: socket.socket) -> None:
        sock.sendall(random.Random(2).randbytes(500))

    def oversized(channel: Channel, sock: socket.socket) -> None:
        sock.sendall(PREFIX.pack(MAGIC, 2, 2**50))

    def error_kind(channel: Channel, sock: socket.socket) -> None:
        channel.send({"ok": False, "error": "__import__('os').system", "message": "x"})

    cases = [
        (wrong_shape, ProtocolError, "has shape"),
        (garbage, ProtocolError, "not a plait-ps frame|authentication"),
        (oversized, ProtocolError, "exceeds"),
        (error_kind, RuntimeError, "x"),
    ]
    address, thread = _fake_server([case[0] for case in cases])
    for _, error, match in cases:
        worker = PSWorker(
            [address], TASK.build_model(), "w", key=KEY, timeout_s=10, retries=0, shm=False, heartbeat_s=60
        )
        with pytest.raises(error, match=match):
            worker.pull()
        worker.close()
    thread.join(timeout=10)


# ----------------------------------------------------------------- shared memory
def test_shared_memory_is_mapped_only_when_private_to_this_user(tmp_path):
    if not SharedBuffer.available():
        pytest.skip("no /dev/shm")
    with pytest.raises(ProtocolError, match="not plait's"):
        SharedBuffer.attach("../../etc/passwd", 8, 64)
    with pytest.raises(ProtocolError, match="outside"):
        SharedBuffer.attach("plait-ps-" + "0" * 32, 10**9, 64)
    shared = SharedBuffer.create(64)
    path = Path("/dev/shm") / shared.name
    path.chmod(0o644)
    with pytest.raises(ProtocolError, match="private"):
        SharedBuffer.attach(shared.name, 64, 64)
    path.chmod(0o600)
    if os.getuid() == 0:
        os.chown(path, 65534, -1)  # another user's segment
        with pytest.raises(ProtocolError, match="private"):
            SharedBuffer.attach(shared.name, 64, 64)
        os.chown(path, 0, -1)
    with pytest.raises(ProtocolError, match="holds 64 bytes"):
        SharedBuffer.attach(shared.name, 32, 64)
    link = Path("/dev/shm") / ("plait-ps-" + "1" * 32)
    link.symlink_to(path)
    try:
        with pytest.raises(ProtocolError, match="cannot open"):
            SharedBuffer.attach(link.name, 64, 64)
    finally:
        link.unlink()
    attached = SharedBuffer.attach(shared.name, 64, 64)
    assert not path.exists()  # unlinked once mapped: nothing is left behind in /dev/shm
    shared.bytes[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert attached.bytes[:4].tolist() == [1, 2, 3, 4]


@pytest.mark.timeout(30)
def test_same_host_workers_use_shared_memory_and_get_the_same_parameters():
    service = _serve(ServerSettings(consistency=Consistency("asp")))
    try:
        results = {}
        for shm in (True, False):
            worker = PSWorker([service.address], TASK.build_model(), f"shm{shm}", key=KEY, timeout_s=10, shm=shm)
            worker.pull()
            assert (worker.channels[0].shm_in is not None) is shm
            results[shm] = {n: p.detach().clone() for n, p in worker.params.items()}
            worker.close()
        assert all(torch.equal(results[True][n], results[False][n]) for n in results[True])
        assert not [name for name in os.listdir("/dev/shm") if name.startswith("plait-ps-")]
    finally:
        _stop(service)


def test_frames_carry_their_sizes_before_any_allocation():
    left, right = socket.socketpair()
    try:
        session = b"k" * 32
        sender, receiver = Channel(left, session, "client", 0, "a"), Channel(right, session, "server", 100, "b")
        sender.send({"op": "report", "args": {}}, sender.stage([("x", torch.zeros(100))]))  # 400 bytes > 100
        with pytest.raises(ProtocolError, match="payload of 448 bytes exceeds the 100"):
            receiver.receive(5)
        assert struct.calcsize("!4sIQ") == PREFIX.size
    finally:
        left.close()
        right.close()
