"""Hostile and faulty checkpoints, weight files and model folders (issue 30, docs/security.md): each case asserts
that nothing is lost (the user's files byte-identical after), nothing runs (no sentinel file, no class changed)
and that the user gets one line naming the problem and the fix.

Defects covered: 1 (convert deleting folders), 3 (class mutation through .metadata, unkeyed seals), 5 (FIFO
hang), 6 (resume with another model), 7 + 14 (full disk, async and sync), 11 (reads outside the folder), 14
(tracebacks: corrupt safetensors, malformed plait.json, torch's unpickling advice), 15 (a self-contradicting size
message). Issue 39: N2 (a step copied under another step's name, a checkpoint of another run), N3 (a bad key
found only at the first save), N9 (key file and keygen tracebacks), N11 (a step of 10**30).
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
from helpers.hostile_checkpoints import engine, fill, no_hang, one_line, reseal, small_disk, snapshot, step, trained
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata

from plait import Layout
from plait.checkpoint import Checkpointer, latest, load_full_state, storage
from plait.checkpoint.convert import convert
from plait.cli.main import main
from plait.errors import CheckpointError, ConfigError, PlaitError
from plait.train.weights import read_weights

pytestmark = [pytest.mark.adversarial]
KEY = "a-checkpoint-key-of-the-user"


class _RunsCode:
    def __init__(self, marker: str, padding: int = 0) -> None:
        self.marker, self.padding = marker, padding

    def __reduce__(self):  # noqa: ANN204 - pickle protocol
        return os.system, (f"touch {self.marker}" + " " * self.padding,)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()  # only what the command prints
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


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
            code, _out, err = _cli(capsys, "convert", str(run / "ckpt"), str(out), *flag)
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
    code, out, _err = _cli(capsys, "checkpoint", "verify", str(folder))
    assert code == 1 and "not signed" in out
    monkeypatch.delenv("PLAIT_CHECKPOINT_KEY")
    code, out, _err = _cli(capsys, "checkpoint", "verify", str(folder))
    assert code == 0 and "detect accidents, not tampering" in out  # without a key: accidents only, and it says so
    monkeypatch.setenv("PLAIT_CHECKPOINT_KEY", "another-key-of-16-chars")
    code, out, _err = _cli(capsys, "checkpoint", "sign", str(folder))
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
        code, _out, err = _cli(capsys, "convert", str(tmp_path / "ckpt"), str(tmp_path / "m.safetensors"))
        assert code == 2 and "pipe" in err
        code, out, _err = _cli(capsys, "checkpoint", "verify", str(folder))
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
    code, out, _err = _cli(capsys, "checkpoint", "verify", str(folder))
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
    code, out, _err = _cli(capsys, "checkpoint", "verify", str(folder))
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
    code, out, _err = _cli(capsys, "checkpoint", "verify", str(folder))
    assert code == 1 and named in out


def test_a_size_recorded_as_text_is_not_a_self_contradicting_message(tmp_path, capsys):
    _engine, folder = trained(tmp_path / "ckpt")
    size = (folder / "__0_0.distcp").stat().st_size
    reseal(folder, lambda m: m["files"]["__0_0.distcp"].update(bytes=str(size)))
    code, out, _err = _cli(capsys, "checkpoint", "verify", str(folder))
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
        code, _out, err = _cli(capsys, "convert", str(path), str(tmp_path / f"ckpt-{name}"))
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


# ----------------------------------------------------------------- issue 39: a checkpoint's step, run and key
def _two_steps(root: Path) -> tuple[Path, Path]:
    """A root with the checkpoints of steps 1 and 2 of one run."""
    built = engine()
    step(built)
    first = built.save(root)
    step(built)
    return first, built.save(root)


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
def test_a_step_copied_under_a_newer_steps_name_is_damaged(tmp_path, monkeypatch, capsys, signed):
    """N2: step 1's folder copied as step 5 (a `cp -r`, or someone replaying a signed checkpoint): its plait.json
    and signature still check out, so it was resumed as step 5, from step 1's weights."""
    if signed:
        monkeypatch.setenv("PLAIT_CHECKPOINT_KEY", KEY)
    first, _second = _two_steps(tmp_path / "ckpt")
    copied = tmp_path / "ckpt" / "step-00000005"
    shutil.copytree(first, copied)
    assert engine().load(tmp_path / "ckpt") == 2  # the newest intact step of the run, not "step 5"
    with pytest.raises(CheckpointError) as refused:
        engine().load(copied)  # named directly: refused, not loaded as step 1 or 5
    one_line(str(refused.value), "recorded step 1 in folder step-00000005", "copied or renamed")
    code, out, _err = _cli(capsys, "checkpoint", "verify", str(tmp_path / "ckpt"))
    assert code == 1 and "step-00000005: recorded step 1 in folder step-00000005" in out
    if signed:
        code, _out, err = _cli(capsys, "checkpoint", "sign", str(copied))
        assert code == 1 and "recorded step 1" in err  # and `sign` does not bless it


@pytest.mark.parametrize(
    ("value", "named"),
    [(10**30, "step is 1000000000000000000000000000000,"), (-1, "step is -1"), ("2", "step is '2'"), (2.5, "2.5")],
    ids=["10**30", "negative", "text", "fraction"],
)
def test_a_step_out_of_range_is_damaged_and_resume_falls_back(tmp_path, capsys, value, named):
    """N11: a step of 10**30 was accepted (a whole number >= 0) and ended in TensorBoard's ValueError (and any
    other 64-bit counter); each of these makes the checkpoint damaged, named in one line."""
    _first, second = _two_steps(tmp_path / "ckpt")
    reseal(second, lambda meta: meta.update(step=value))
    assert engine().load(tmp_path / "ckpt") == 1
    with pytest.raises(CheckpointError) as refused:
        engine().load(second)
    one_line(str(refused.value), "malformed", named)
    code, out, _err = _cli(capsys, "checkpoint", "verify", str(second))
    assert code == 1 and named in out and len(out.strip().splitlines()) == 1


def test_a_checkpoint_of_another_run_is_refused_on_resume_but_loads_by_name(tmp_path, monkeypatch, capsys):
    """A signed checkpoint of another run (same user, same key) copied into this run's folder was resumed.
    Weights-only uses of the copied folder (init_from, generate, convert) still work: they name it."""
    monkeypatch.setenv("PLAIT_CHECKPOINT_KEY", KEY)
    _first, other = _two_steps(tmp_path / "other" / "ckpt")
    trained(tmp_path / "run" / "ckpt")  # this run: step 1
    copied = tmp_path / "run" / "ckpt" / other.name
    shutil.copytree(other, copied)
    before = snapshot(tmp_path)
    assert engine().load(tmp_path / "run" / "ckpt") == 1  # was 2: the other run's
    run_ids = {(tmp_path / name / "ckpt" / "run-id").read_text().strip() for name in ("run", "other")}
    assert len(run_ids) == 2 and all(len(run) == 32 for run in run_ids)
    code, out, _err = _cli(capsys, "checkpoint", "verify", str(tmp_path / "run"))
    assert code == 1 and "step-00000002: it is from another run" in out and "run-id names" in out
    assert engine().load(copied) == 2  # named directly: the user chose it
    state, meta = load_full_state(copied)
    assert meta["step"] == 2 and state
    assert snapshot(tmp_path) == before
    (tmp_path / "run" / "ckpt" / "step-00000001").rename(tmp_path / "run" / "step-1")
    with pytest.raises(CheckpointError) as refused:
        engine().load(tmp_path / "run" / "ckpt")  # nothing of this run left: refused, nothing deleted
    one_line(str(refused.value), "no intact checkpoint", "from another run", "back where it came from")


def test_a_resumed_root_without_a_run_id_keeps_the_run_it_resumed(tmp_path):
    """A root whose run-id is gone (or a root assembled by hand) takes the run of the checkpoint resumed from at
    its next save, so an older checkpoint of that run stays a fallback; a malformed run-id is one line."""
    _first, second = _two_steps(tmp_path / "ckpt")
    run = (tmp_path / "ckpt" / "run-id").read_text().strip()
    (tmp_path / "ckpt" / "run-id").unlink()
    resumed = engine()
    assert resumed.load(tmp_path / "ckpt") == 2
    step(resumed)
    resumed.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "run-id").read_text().strip() == run
    assert json.loads((tmp_path / "ckpt" / "step-00000003" / "plait.json").read_text())["run"] == run
    (tmp_path / "ckpt" / "run-id").write_text("not a run id\n")
    with pytest.raises(CheckpointError) as refused:
        engine().load(tmp_path / "ckpt")
    one_line(str(refused.value), "run-id holds 'not a run id'", "32 hex digits")


def _resume_over_copies(out: str, key: str) -> dict[str, object]:
    """Train 6 steps (saving at 2, 4, 6), copy step 2 as step 8 and another run's step 10 in, resume to step 7 (saved
    as the last step): which step it resumed from and the records before and after."""
    from plait.train.config import load_config
    from plait.train.loop import run

    if key:
        os.environ["PLAIT_CHECKPOINT_KEY"] = key
    settings = ["train.global_batch=8", "train.eval_every=0", "train.save_every=2", "train.keep_checkpoints=0"]
    settings += ["model.n_layer=2", "model.n_head=4", "model.d_model=16"]
    other = ["train.steps=10", "train.save_every=10", f"train.out={json.dumps(out + '-other')}"]
    run(load_config(None, [*settings, *other]))
    run(load_config(None, [*settings, "train.steps=6", f"train.out={json.dumps(out)}"]))
    ckpt = Path(out) / "ckpt"
    shutil.copytree(ckpt / "step-00000002", ckpt / "step-00000008")
    shutil.copytree(Path(out + "-other") / "ckpt" / "step-00000010", ckpt / "step-00000010")
    before = (Path(out) / "metrics.jsonl").read_text().splitlines()
    summary = run(load_config(None, [*settings, "train.steps=7", f"train.out={json.dumps(out)}"]))
    after = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return {"steps": summary.steps, "before": before, "after": after}


@pytest.mark.parametrize("key", ["", pytest.param(KEY, marks=pytest.mark.long)], ids=["unsigned", "signed"])
def test_plait_train_resumes_from_its_own_newest_step_and_keeps_the_records(tmp_path, key):
    """N2 as a user met it: `plait train` resumed a step-2 checkpoint copied as step 8 and deleted the metrics
    records of steps 3-6; with another run's checkpoint copied in, it resumed that run."""
    from plait.checkpoint import catalog

    (result,) = run_distributed(_resume_over_copies, 1, str(tmp_path / "run"), key, timeout=180)
    assert result["steps"] == 7
    assert result["after"][: len(result["before"])] == result["before"]  # steps 1-6: kept, not written again
    assert [json.loads(line)["step"] for line in result["after"]] == [1, 2, 3, 4, 5, 6, 6, 7, 7]
    folder, skipped = catalog.choose(tmp_path / "run" / "ckpt")
    assert folder.name == "step-00000007", skipped  # the resumed run's last step, saved (and nothing newer taken)
    assert "step-00000010 is damaged: it is from another run" in skipped[0]
    assert "step-00000008 is damaged: recorded step 2 in folder step-00000008" in skipped[1]


# ----------------------------------------------------------------- N3 + N9: a bad key, at once, in one line
def _bad_key(kind: str, folder: Path) -> dict[str, str]:
    """The environment of an unusable checkpoint key of ``kind`` (files made under ``folder``)."""
    if kind == "short":
        return {"PLAIT_CHECKPOINT_KEY": "too-short"}
    path = folder / f"{kind}.key"
    if kind == "folder":
        path.mkdir()
    elif kind != "deleted":
        path.write_text("a-key-that-is-long-enough-for-plait\n")
        path.chmod(0o644)
    return {"PLAIT_CHECKPOINT_KEY_FILE": str(path)}


BAD_KEYS = {
    "mode-644": r"PLAIT_CHECKPOINT_KEY_FILE: key file .* has mode 644: others may read it.*chmod 600",
    "folder": r"PLAIT_CHECKPOINT_KEY_FILE: key file .* is a folder, not a key file",
    "deleted": r"PLAIT_CHECKPOINT_KEY_FILE: key file .* does not exist",
    "short": r"PLAIT_CHECKPOINT_KEY has 9 characters, fewer than 16",
}


def _train_with_bad_keys(base: str) -> dict[str, tuple[str, str, bool, bool]]:
    """For each bad key: plait train's error (type, message), and whether a step ran or anything was saved."""
    from plait.train.config import load_config
    from plait.train.loop import run

    settings = ["train.steps=2", "train.global_batch=8", "train.eval_every=0", "train.save_every=1"]
    settings += ["model.n_layer=1", "model.n_head=2", "model.d_model=8"]
    found = {}
    for kind in BAD_KEYS:
        out = Path(base) / kind
        out.mkdir(parents=True)
        os.environ.update(_bad_key(kind, Path(base)))
        try:
            run(load_config(None, [*settings, f"train.out={json.dumps(str(out))}"]))
            error = ("none", "trained")
        except PlaitError as failure:
            error = (type(failure).__name__, str(failure))
        finally:
            os.environ.pop("PLAIT_CHECKPOINT_KEY", None)
            os.environ.pop("PLAIT_CHECKPOINT_KEY_FILE", None)
        found[kind] = (*error, (out / "metrics.jsonl").exists(), (out / "ckpt").exists())
    return found


def test_a_bad_checkpoint_key_stops_plait_train_before_its_first_step(tmp_path):
    """N3: a bad key was found at the first save, `save_every` steps of work later, and no checkpoint was written
    (a folder: a traceback). Now every rank reads it first of all: one line naming the variable and the fix."""
    (found,) = run_distributed(_train_with_bad_keys, 1, str(tmp_path), timeout=180)
    for kind, named in BAD_KEYS.items():
        kind_name, message, stepped, saved = found[kind]
        assert kind_name == "ConfigError", (kind, found[kind])
        one_line(message, named)
        assert not stepped and not saved, kind  # refused before the model was built: no record, no ckpt/


@pytest.mark.cli
def test_plait_train_with_a_key_folder_is_one_line_and_exits_before_training(tmp_path):
    env = {**os.environ, **_bad_key("folder", tmp_path), "PYTHONPATH": os.pathsep.join(sys.path)}
    settings = ["train.steps=2", "train.global_batch=8", "train.save_every=1", "model.n_layer=1", "model.d_model=8"]
    sets = [arg for setting in settings for arg in ("--set", setting)]
    result = subprocess.run(
        [sys.executable, "-m", "plait", "train", "--nproc", "1", "--out", str(tmp_path / "run"), *sets],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    one_line(errors[0], "PLAIT_CHECKPOINT_KEY_FILE", "is a folder")
    assert not (tmp_path / "run" / "ckpt").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_key_files_and_keygen_fail_in_one_line(tmp_path, monkeypatch, capsys):
    """N9: a key file that is a folder and `keygen` into a missing folder ended in tracebacks."""
    _engine, folder = trained(tmp_path / "ckpt")
    for kind, named in BAD_KEYS.items():
        for name in ("PLAIT_CHECKPOINT_KEY", "PLAIT_CHECKPOINT_KEY_FILE"):
            monkeypatch.delenv(name, raising=False)
        for name, value in _bad_key(kind, tmp_path).items():
            monkeypatch.setenv(name, value)
        for action in ("verify", "sign"):
            code, _out, err = _cli(capsys, "checkpoint", action, str(folder))
            assert code == 2, (kind, action, err)
            one_line(err, named)
    before = snapshot(tmp_path)
    for path, named in [
        (tmp_path / "missing" / "deeper" / "ckpt.key", r"missing/deeper does not exist.*mkdir -p -m 700"),
        (tmp_path / "folder.key" / "inner" / "ckpt.key", "does not exist"),
        (tmp_path / "mode-644.key" / "ckpt.key", "mode-644.key is not a folder"),
        (tmp_path / "folder.key", r"exists \(a folder\); keygen never overwrites"),
    ]:
        code, _out, err = _cli(capsys, "checkpoint", "keygen", str(path))
        assert code == 2, (path, err)
        one_line(err, named)
    assert snapshot(tmp_path) == before  # no folder invented, nothing overwritten
