"""Hostile and faulty checkpoints, weight files and model folders (issue 30, docs/security.md): each case asserts
that nothing is lost (the user's files byte-identical after), nothing runs (no sentinel file, no class changed)
and that the user gets one line naming the problem and the fix.

Defects covered: 1 (convert deleting folders), 3 (class mutation through .metadata, unkeyed seals), 5 (FIFO
hang), 6 (resume with another model), 7 + 14 (full disk, async and sync), 11 (reads outside the folder), 14
(tracebacks: corrupt safetensors, malformed plait.json, torch's unpickling advice), 15 (a self-contradicting size
message). Issue 39's identity and key cases are in test_adversarial_checkpoint_identity.py.
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import pickle
import shutil
import struct
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from helpers.harness import run_distributed
from helpers.hostile_checkpoints import (
    KEY,
    cli,
    engine,
    fill,
    no_hang,
    one_line,
    reseal,
    small_disk,
    snapshot,
    step,
    trained,
)
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata

from plait import Layout
from plait.checkpoint import Checkpointer, latest, load_full_state, storage
from plait.checkpoint.convert import convert
from plait.errors import CheckpointError, ConfigError, PlaitError
from plait.train.weights import read_weights

pytestmark = [pytest.mark.adversarial]


class _RunsCode:
    def __init__(self, marker: str, padding: int = 0) -> None:
        self.marker, self.padding = marker, padding

    def __reduce__(self):  # noqa: ANN204 - pickle protocol
        return os.system, (f"touch {self.marker}" + " " * self.padding,)


def _tiny_gpt2(root: Path) -> Path:
    """A checkpoint of a tiny Hugging Face GPT-2 under ``root`` (its plait.json records the HF config)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import plait

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8, bos_token_id=0, eos_token_id=0)
    )
    plait.parallelize(model, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3)).save(root)
    return root


# ----------------------------------------------------------------- 1: convert never deletes what it did not write
def test_convert_never_replaces_the_run_folder_or_a_users_folder(tmp_path, capsys):
    run = tmp_path / "run"
    _tiny_gpt2(run / "ckpt")
    (run / "config.toml").write_text("[model]\n")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("my notes")
    before = snapshot(tmp_path)
    for out in (run, run / "ckpt", tmp_path / "mine"):
        for flag in ([], ["--overwrite"]):
            code, _out, err = cli(capsys, "convert", str(run / "ckpt"), str(out), *flag)
            assert code == 2
            one_line(err, "plait never replaces|holds what is being converted|not empty", "OUT")
    assert snapshot(tmp_path) == before  # the defect: OUT (even the run folder) was removed with shutil.rmtree


def test_overwrite_replaces_only_plaits_own_exports(tmp_path):
    ckpt = _tiny_gpt2(tmp_path / "ckpt")
    out = tmp_path / "hf"
    convert(ckpt, out)
    assert (out / "plait-export.json").is_file() and (out / "model.safetensors").is_file()
    with pytest.raises(ConfigError) as refused:
        convert(ckpt, out)  # an existing OUT is never replaced without --overwrite
    one_line(str(refused.value), "exists", "--overwrite")
    convert(ckpt, out, overwrite=True)  # an earlier export of plait: replaced
    (out / "tokenizer.json").write_text("{}")  # the user adds a file to the export
    user_file = tmp_path / "weights.safetensors"
    user_file.write_bytes(b"the user's own file")
    before = snapshot(tmp_path)
    with pytest.raises(ConfigError) as refused:
        convert(ckpt, out, overwrite=True)
    one_line(str(refused.value), "tokenizer.json", "did not write")
    with pytest.raises(ConfigError) as refused:
        convert(ckpt, user_file, overwrite=True)  # not a file plait exported
    one_line(str(refused.value), "not a file plait exported")
    assert snapshot(tmp_path) == before
    convert(ckpt, tmp_path / "m.safetensors")
    convert(ckpt, tmp_path / "m.safetensors", overwrite=True)  # plait's own export (its header says so)
    with pytest.raises(ConfigError):
        convert(tmp_path / "m.safetensors", ckpt)  # importing into the checkpoint it came from
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temporary sibling left behind


# ----------------------------------------------------------------- 3: .metadata cannot change classes
def _build_on(module: str, name: str, attribute: str) -> bytes:
    """Pickle opcodes: push the global module.name, BUILD (None, {attribute: "ran"}) on it, pop it."""

    def text(value: str) -> bytes:
        return b"X" + struct.pack("<I", len(value.encode())) + value.encode()

    return f"c{module}\n{name}\n".encode() + b"N}" + text(attribute) + text("ran") + b"s\x86b0"


@pytest.mark.parametrize(
    ("module", "name"),
    [("pathlib", "PurePosixPath"), ("torch.distributed.checkpoint.metadata", "Metadata")],
)
def test_metadata_cannot_change_a_class(tmp_path, module, name):
    _engine, folder = trained(tmp_path / "ckpt")
    real = (folder / ".metadata").read_bytes()
    (folder / ".metadata").write_bytes(real[:2] + _build_on(module, name, "plait_hostile") + real[2:])
    reseal(folder)  # past the checksums: anyone can re-seal without a key
    target = getattr(pathlib, name) if module == "pathlib" else Metadata
    try:
        with pytest.raises(CheckpointError) as refused:
            engine().load(tmp_path / "ckpt")
        one_line(str(refused.value), "malformed|refusing")
        with pytest.raises(CheckpointError):
            load_full_state(tmp_path / "ckpt")
        assert "plait_hostile" not in vars(target)  # the defect: BUILD set it on the class, for the whole process
        assert str(pathlib.PurePosixPath("/a/b")) == "/a/b"
    finally:
        if "plait_hostile" in vars(target):
            delattr(target, "plait_hostile")


def test_metadata_naming_code_is_refused_and_real_metadata_round_trips(tmp_path):
    _engine, folder = trained(tmp_path / "ckpt")
    metadata = storage.read_metadata(folder)
    assert metadata.state_dict_metadata and all(
        i.relative_path == "__0_0.distcp" for i in metadata.storage_data.values()
    )
    marker = tmp_path / "ran"
    (folder / ".metadata").write_bytes(pickle.dumps(_RunsCode(str(marker))))
    reseal(folder)
    with pytest.raises(CheckpointError) as refused:
        engine().load(tmp_path / "ckpt")
    one_line(str(refused.value), r"system.*refusing")
    assert not marker.exists()


def test_a_checkpoint_key_signs_plait_json_and_refuses_a_resealed_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PLAIT_CHECKPOINT_KEY", KEY)
    _engine, folder = trained(tmp_path / "ckpt")
    assert "signature" in json.loads((folder / "plait.json").read_text())
    assert engine().load(tmp_path / "ckpt") == 1
    data = bytearray((folder / "__0_0.distcp").read_bytes())
    data[-100] ^= 1
    (folder / "__0_0.distcp").write_bytes(bytes(data))
    reseal(folder)  # the attacker records the new digest and checksum, but has no key
    with pytest.raises(CheckpointError) as refused:
        engine().load(tmp_path / "ckpt")
    one_line(str(refused.value), "not signed", "plait checkpoint sign")
    code, out, _err = cli(capsys, "checkpoint", "verify", str(folder))
    assert code == 1 and "not signed" in out
    monkeypatch.delenv("PLAIT_CHECKPOINT_KEY")
    code, out, _err = cli(capsys, "checkpoint", "verify", str(folder))
    assert code == 0 and "detect accidents, not tampering" in out  # without a key: accidents only, and it says so
    monkeypatch.setenv("PLAIT_CHECKPOINT_KEY", "another-key-of-16-chars")
    code, out, _err = cli(capsys, "checkpoint", "sign", str(folder))
    assert code == 0 and "signed" in out
    monkeypatch.setenv("PLAIT_CHECKPOINT_KEY", KEY)
    with pytest.raises(CheckpointError) as refused:
        engine().load(tmp_path / "ckpt")
    one_line(str(refused.value), "another key")


# ----------------------------------------------------------------- 5: FIFOs and devices never block a read
def _point_pieces_at(folder: Path, name: str) -> None:
    """Rewrite .metadata so that every piece is read from ``name`` (with DCP's own pickling), then re-seal."""
    metadata = storage.read_metadata(folder)
    metadata.storage_data = {
        index: _StorageInfo(name, info.offset, info.length) for index, info in metadata.storage_data.items()
    }
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(folder)


@pytest.mark.parametrize("recorded", [False, True], ids=["unrecorded", "recorded-in-plait-json"])
def test_a_fifo_named_by_metadata_is_refused_not_hung(tmp_path, recorded, capsys):
    _engine, folder = trained(tmp_path / "ckpt")
    os.mkfifo(folder / "pipe")
    _point_pieces_at(folder, "pipe")
    if recorded:
        reseal(folder, lambda m: m["files"].update(pipe={"rank": 0, "bytes": 0, "sha256": "0" * 64}))
    before = snapshot(tmp_path)
    with no_hang():
        with pytest.raises(CheckpointError) as refused:
            engine().load(tmp_path / "ckpt")
        one_line(str(refused.value), "pipe")
        code, _out, err = cli(capsys, "convert", str(tmp_path / "ckpt"), str(tmp_path / "m.safetensors"))
        assert code == 2 and "pipe" in err
        code, out, _err = cli(capsys, "checkpoint", "verify", str(folder))
        assert code == (1 if recorded else 0)
    assert snapshot(tmp_path) == before


def test_fifos_in_place_of_checkpoint_and_model_files_are_refused_not_hung(tmp_path):
    _engine, folder = trained(tmp_path / "ckpt")
    shutil.copytree(folder, tmp_path / "plain", symlinks=True)
    os.unlink(tmp_path / "plain" / ".metadata")
    os.mkfifo(tmp_path / "plain" / ".metadata")
    reseal(tmp_path / "plain", lambda m: [m.pop("files"), m.pop("checksum")])  # an unverified checkpoint
    (tmp_path / "ckpt" / "latest").unlink()
    os.mkfifo(tmp_path / "ckpt" / "latest")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    os.mkfifo(hf / "model.safetensors")
    with no_hang():
        for call in (lambda: engine().load(tmp_path / "plain"), lambda: latest(tmp_path / "ckpt")):
            with pytest.raises(CheckpointError) as refused:
                call()
            one_line(str(refused.value), "FIFO|regular file|step folder")
        with pytest.raises(ConfigError) as refused:
            read_weights(hf)
        one_line(str(refused.value), "FIFO")
        assert engine().load(tmp_path / "ckpt") == 1  # a FIFO `latest` is ignored: the step folders are found


# ----------------------------------------------------------------- 6: resuming another model
@pytest.mark.parametrize(
    ("changed", "named"),
    [
        ({"n_layer": 1}, r"n_layer 2 there, 1 here.*only the checkpoint has: blocks\.1"),
        ({"n_head": 2}, "n_head 4 there, 2 here"),
    ],
)
def test_resuming_with_another_model_is_refused(tmp_path, changed, named):
    trained(tmp_path / "ckpt")
    before = snapshot(tmp_path)
    other = engine(**changed)
    at_start = {name: p.detach().clone() for name, p in other.model.named_parameters()}
    with pytest.raises(CheckpointError) as refused:
        other.load(tmp_path / "ckpt")
    one_line(str(refused.value), "another model", named)
    assert other.step == 0 and all(torch.equal(p, at_start[n]) for n, p in other.model.named_parameters())
    assert snapshot(tmp_path) == before
    assert engine().load(tmp_path / "ckpt") == 1  # the model it was trained with still resumes


def _train_then_resume_with(out: str, *changed: str) -> str:
    from plait.train.config import load_config
    from plait.train.loop import run

    settings = ["train.steps=2", "train.global_batch=8", "train.eval_every=0", "train.save_every=2"]
    settings += ["model.n_layer=2", "model.n_head=4", "model.d_model=16", f"train.out={json.dumps(out)}"]
    run(load_config(None, settings))
    before = snapshot(Path(out))
    try:
        run(load_config(None, [*settings, "train.steps=4", *changed]))
    except CheckpointError as error:
        assert snapshot(Path(out)) == before  # config.toml, metrics.jsonl, the checkpoint: untouched
        return str(error)
    return "resumed"


def test_plait_train_refuses_to_resume_its_run_with_another_model(tmp_path):
    (message,) = run_distributed(_train_then_resume_with, 1, str(tmp_path / "run"), "model.n_head=2", timeout=120)
    one_line(message, "another model", "n_head 4 there, 2 here", r"\[model\] as in the run's config.toml")


def _train_then_start_from(out: str, *changed: str) -> str:
    from plait.train.config import load_config
    from plait.train.loop import run

    settings = ["train.steps=2", "train.global_batch=8", "train.eval_every=0", "train.save_every=2"]
    settings += ["model.n_layer=2", "model.n_head=4", "model.d_model=16"]
    run(load_config(None, [*settings, f"train.out={json.dumps(out)}"]))
    try:
        run(load_config(None, [*settings, f"train.init_from={json.dumps(out + '/ckpt')}", *changed]))
    except ConfigError as error:
        return str(error)
    return "started"


def test_init_from_another_models_checkpoint_is_refused(tmp_path):
    """The same names and shapes (n_head only regroups a d_model-wide projection) but another model: starting
    from it would silently compute something else; the recorded config says so."""
    (message,) = run_distributed(_train_then_start_from, 1, str(tmp_path / "run"), "model.n_head=2", timeout=120)
    one_line(message, "another model", "n_head 4 there, 2 here", r"\[model\] to the model that was trained")


# ----------------------------------------------------------------- 7 + 14: a full disk
@contextmanager
def _full_disk(tmp_path: Path, leave: int):
    """A device with ``leave`` bytes free after one save: a small tmpfs where mounting works, else a fault
    injected at DCP's storage writer (every data file write fails with ENOSPC)."""
    with small_disk(tmp_path / "disk") as disk:
        if disk is not None:
            yield disk, lambda: fill(disk, leave)
            return
        real = FileSystem.create_stream

        @contextmanager
        def no_space(self, path, mode):  # noqa: ANN001, ANN202
            if "w" in mode:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            with real(self, path, mode) as stream:
                yield stream

        def inject() -> None:
            FileSystem.create_stream = no_space  # type: ignore[method-assign]

        try:
            yield tmp_path / "disk", inject
        finally:
            FileSystem.create_stream = real  # type: ignore[method-assign]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("leave", [4_000, 20_000, 60_000, 100_000])
def test_a_full_disk_is_named_and_the_previous_checkpoint_kept(tmp_path, asynchronous, leave):
    """The free space left decides where the save fails (rng file, DCP's data file -- as an errno or as torch's
    zip writer's "unexpected pos" --, plait.json): every time one line saying the disk is full."""
    with _full_disk(tmp_path, leave) as (disk, fill_it):
        built = engine()
        saver = Checkpointer(built, disk / "ckpt", async_save=asynchronous)
        saver.save()
        saver.wait()
        fill_it()
        built.step = 2
        with pytest.raises(CheckpointError) as refused:
            saver.save()
            saver.wait()
        one_line(str(refused.value), "no space left on device", "free space")
        assert sorted(p.name for p in (disk / "ckpt").iterdir()) == ["latest", "run-id", "step-00000000"]  # no .partial
        assert latest(disk / "ckpt").name == "step-00000000"
        assert engine().load(disk / "ckpt") == 0


@contextmanager
def _failing(phase: str, rank: int):
    """ENOSPC injected below plait on one rank: rank 1's small files (safetensors' writer), rank 1's data file
    (DCP's file writer), or rank 0's plait.json (its rename into place)."""
    import safetensors.torch

    def no_space(*_args: object, **_kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    real_file, real_stream, real_replace = safetensors.torch.save_file, FileSystem.create_stream, os.replace

    @contextmanager
    def stream(self, path, mode):  # noqa: ANN001, ANN202
        if "w" in mode:
            no_space()
        with real_stream(self, path, mode) as opened:
            yield opened

    def replace(source: str, target: str) -> None:
        if str(target).endswith("plait.json"):
            no_space()
        real_replace(source, target)

    if phase == "files" and rank == 1:
        safetensors.torch.save_file = no_space
    if phase == "data" and rank == 1:
        FileSystem.create_stream = stream  # type: ignore[method-assign]
    if phase == "publish" and rank == 0:
        os.replace = replace
    try:
        yield
    finally:
        safetensors.torch.save_file, os.replace = real_file, real_replace
        FileSystem.create_stream = real_stream  # type: ignore[method-assign]


def _saves_failing_on_one_rank(root: str) -> tuple[list[str], list[str]]:
    built = engine(Layout(dp=2))
    saver = Checkpointer(built, root)
    step(built)
    saver.save()
    messages = []
    for phase in ("files", "data", "publish"):
        built.step += 1
        with _failing(phase, built.mesh.rank):
            try:
                saver.save()
                messages.append("saved")
            except CheckpointError as error:
                messages.append(str(error))
    return messages, sorted(os.listdir(root))


@pytest.mark.distributed
def test_a_save_failing_on_one_rank_fails_on_every_rank_without_a_hang(tmp_path):
    """Before, a rank whose small files failed left the others waiting in DCP's collective, and one whose
    plait.json failed left them at a barrier (until the timeout)."""
    for rank, (messages, names) in enumerate(run_distributed(_saves_failing_on_one_rank, 2, str(tmp_path), timeout=90)):
        assert names == ["latest", "run-id", "step-00000001"], names  # no .partial left, nothing published
        for phase, message in zip(("files", "data", "publish"), messages):
            failed_here = (phase == "publish") == (rank == 0) or phase == "data"
            one_line(message, "no space left on device" if failed_here else "another rank's save")
    assert latest(tmp_path).name == "step-00000001" and engine().load(tmp_path) == 1


# ----------------------------------------------------------------- 11: every read stays inside its folder
@pytest.mark.parametrize("where", ["../outside.distcp", "ABSOLUTE"])
def test_metadata_paths_outside_the_folder_are_refused(tmp_path, where):
    _engine, folder = trained(tmp_path / "ckpt")
    shutil.copy(folder / "__0_0.distcp", tmp_path / "ckpt" / "outside.distcp")
    _point_pieces_at(folder, str(tmp_path / "ckpt" / "outside.distcp") if where == "ABSOLUTE" else where)
    with pytest.raises(CheckpointError) as refused:
        engine().load(tmp_path / "ckpt")
    one_line(str(refused.value), "not a plain file name")


def test_plait_json_entries_outside_the_folder_are_no_oracle(tmp_path, capsys):
    _engine, folder = trained(tmp_path / "ckpt")
    secret = tmp_path / "secret.txt"
    secret.write_text("x" * 12345)
    reseal(folder, lambda m: m["files"].update({"../../secret.txt": {"rank": 0, "bytes": 1, "sha256": "0" * 64}}))
    code, out, _err = cli(capsys, "checkpoint", "verify", str(folder))
    assert code == 1 and "not a plain file name" in out and "12345" not in out  # was: "has 12345 bytes, ..."
    with pytest.raises(CheckpointError) as refused:
        engine().load(folder)
    one_line(str(refused.value), "malformed", r"\.\./\.\./secret")


def test_a_symlinked_shard_is_refused(tmp_path, capsys):
    _engine, folder = trained(tmp_path / "ckpt")
    shutil.move(folder / "__0_0.distcp", tmp_path / "elsewhere.distcp")
    (folder / "__0_0.distcp").symlink_to(tmp_path / "elsewhere.distcp")  # same bytes: every digest still matches
    with pytest.raises(CheckpointError) as refused:
        engine().load(folder)
    one_line(str(refused.value), "symbolic link")
    code, out, _err = cli(capsys, "checkpoint", "verify", str(folder))
    assert code == 1 and "symbolic link" in out


def test_hf_index_entries_outside_the_folder_are_refused(tmp_path):
    from safetensors.torch import save_file

    from plait.models.build import build_model

    outside = {"transformer.wte.weight": torch.zeros(16, 8)}
    save_file(outside, str(tmp_path / "outside.safetensors"))
    hf = tmp_path / "hf"
    convert(_tiny_gpt2(tmp_path / "ckpt"), hf)
    index = {"metadata": {}, "weight_map": {"transformer.wte.weight": "../outside.safetensors"}}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    (hf / "model.safetensors").unlink()
    before = snapshot(tmp_path)
    calls = (
        lambda: read_weights(hf),
        lambda: convert(hf, tmp_path / "imported"),
        lambda: build_model({"hf": str(hf)}, 16, 8),
    )
    for call in calls:
        with pytest.raises(ConfigError) as refused:
            call()
        one_line(str(refused.value), r"weight_map.*not a plain file name")
    assert snapshot(tmp_path) == before


# ----------------------------------------------------------------- 14 + 15: one line, never a traceback
@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda m: m.update(step="3"), "step is '3'"),
        (lambda m: m.update(step=-1), "step is -1"),
        (lambda m: m.update(files=[1, 2]), "files is a list"),
        (lambda m: m["files"][".metadata"].update(bytes=-5), "bytes is -5"),
        (lambda m: m["files"][".metadata"].update(sha256=7), "sha256 is '7'"),
        (lambda m: m.update(optimizer="adam"), "optimizer"),
        (lambda m: m.update(layout=[1]), "layout is a list"),
        (lambda m: m.update(model_tensors={"w": [-1]}), "model_tensors"),
    ],
)
def test_malformed_plait_json_values_are_one_line(tmp_path, capsys, edit, named):
    _engine, folder = trained(tmp_path / "ckpt")
    reseal(folder, edit)
    with pytest.raises(CheckpointError) as refused:
        engine().load(folder)
    one_line(str(refused.value), "malformed", named)
    code, out, _err = cli(capsys, "checkpoint", "verify", str(folder))
    assert code == 1 and named in out


def test_a_size_recorded_as_text_is_not_a_self_contradicting_message(tmp_path, capsys):
    _engine, folder = trained(tmp_path / "ckpt")
    size = (folder / "__0_0.distcp").stat().st_size
    reseal(folder, lambda m: m["files"]["__0_0.distcp"].update(bytes=str(size)))
    code, out, _err = cli(capsys, "checkpoint", "verify", str(folder))
    assert code == 1 and f"has {size} bytes, plait.json records {size}" not in out
    assert f"bytes is '{size}'" in out


def test_corrupt_safetensors_are_one_line(tmp_path, capsys):
    good = tmp_path / "good.safetensors"
    trained(tmp_path / "ckpt")
    convert(tmp_path / "ckpt", good)
    cases = {
        "garbage": b"\xff" * 64,
        "truncated": good.read_bytes()[:-40],
        "huge-header": struct.pack("<Q", 2**40) + b"{}",
    }
    for name, data in cases.items():
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(data)
        with pytest.raises(ConfigError) as refused:
            read_weights(path)
        one_line(str(refused.value), "not a valid safetensors file")
        code, _out, err = cli(capsys, "convert", str(path), str(tmp_path / f"ckpt-{name}"))
        assert code == 2 and "not a valid safetensors file" in err and len(err.strip().splitlines()) == 1
        assert not (tmp_path / f"ckpt-{name}").exists()


def test_torch_advice_to_unpickle_never_reaches_the_user(tmp_path):
    """A data file holding a pickle with code: torch's weights_only loader refuses it, and its message (which
    advises weights_only=False) is replaced by what it means."""
    _engine, folder = trained(tmp_path / "ckpt")
    marker = tmp_path / "ran"
    metadata = storage.read_metadata(folder)
    torch.save(_RunsCode(str(marker), padding=8192), folder / "__0_0.distcp")  # as long as the largest tensor
    length = (folder / "__0_0.distcp").stat().st_size
    metadata.storage_data = {index: _StorageInfo("__0_0.distcp", 0, length) for index in metadata.storage_data}
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(folder)
    for call in (lambda: engine().load(folder), lambda: load_full_state(folder)):
        with pytest.raises(PlaitError) as refused:
            call()
        one_line(str(refused.value), "pickled object.*refused", "system")
    assert not marker.exists()


@pytest.mark.cli
def test_plait_convert_into_the_run_folder_is_refused_by_the_command(tmp_path):
    """The defect as a user met it: exporting a Hugging Face model's checkpoint into its own run folder."""
    run = tmp_path / "run"
    _tiny_gpt2(run / "ckpt")
    (run / "metrics.jsonl").write_text("{}\n")
    before = snapshot(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "plait", "convert", str(run / "ckpt"), str(run)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    one_line(result.stderr, "holds what is being converted")
    assert snapshot(tmp_path) == before
