"""Inputs as people have them (issue 27, ``plait.data.discover``): a folder of text files without a known suffix
(LICENSE, COPYING, README, man pages) is read by content; binary, non-UTF-8, empty, FIFO and linked entries are
skipped with their reason, listed in meta.json and by the CLI; ``--include`` / ``--exclude`` choose the files;
a folder left with nothing is one line naming why; nothing blocks on a FIFO.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from plait.cli.main import main
from plait.data import TokenFolder, prepare
from plait.data.discover import describe_skipped, not_text, walk
from plait.errors import DataError

LICENSE = "Permission is hereby granted, free of charge, to any person obtaining a copy.\n"
MAN = ".TH LS 1\n.SH NAME\nls \\- list directory contents\n"


@pytest.fixture
def corpus(tmp_path) -> Path:  # noqa: ANN001
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "LICENSE").write_text(LICENSE)
    (root / "COPYING").write_text("GNU GENERAL PUBLIC LICENSE\nVersion 3, 29 June 2007 — ünïcode\n")
    (root / "README").write_text("A project. Read me.\n")
    (root / "sub" / "ls.1").write_text(MAN)
    (root / "notes.txt").write_text("known suffix\n")
    (root / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    (root / "latin1.txt.orig").write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1"))
    (root / "empty").write_bytes(b"")
    os.mkfifo(root / "pipe")  # opening it would block: it must never be opened
    (root / "link").symlink_to(root / "README")
    (root / "linked-dir").symlink_to(root / "sub")
    return root


def test_text_files_without_a_known_suffix_are_read_and_the_rest_skipped_with_reasons(corpus, tmp_path, capsys) -> None:  # noqa: ANN001
    meta = prepare([corpus], tmp_path / "out", val_fraction=0.0, progress=False)
    inputs = [json.loads(line)["path"] for line in (tmp_path / "out" / "inputs.jsonl").read_text().splitlines()]
    assert [Path(p).relative_to(corpus).as_posix() for p in inputs] == [
        "COPYING",
        "LICENSE",
        "README",
        "notes.txt",
        "sub/ls.1",
    ]
    reasons = {Path(e["path"]).name: e["reason"] for e in meta["skipped"]["list"]}
    assert meta["skipped"]["files"] == len(reasons) == 6
    assert reasons["logo.png"] == "binary (a NUL byte at byte 8)"
    assert reasons["latin1.txt.orig"] == "not UTF-8 text (byte 3)"
    assert reasons["empty"] == "empty" and reasons["pipe"] == "not a regular file"
    assert reasons["link"].startswith("a symbolic link") and reasons["linked-dir"].startswith("a symbolic link")
    text = TokenFolder(tmp_path / "out").codec.decode(TokenFolder(tmp_path / "out").tokens("train").tolist())
    assert LICENSE in text and MAN in text and "PNG" not in text
    assert main(["data", "info", str(tmp_path / "out")]) == 0
    shown = capsys.readouterr().out
    assert "skipped 6 input file(s):" in shown and "logo.png: binary (a NUL byte at byte 8)" in shown


def test_include_and_exclude_choose_among_the_folders_files(corpus, tmp_path) -> None:  # noqa: ANN001
    found, skipped = walk(corpus, include=["LICENSE", "*.1"])
    assert [p.name for p in found] == ["LICENSE", "ls.1"]
    assert {Path(s.path).name: s.reason for s in skipped}["README"] == "not matched by --include LICENSE *.1"
    found, skipped = walk(corpus, exclude=["sub/*", "COPY*"])
    assert [p.relative_to(corpus).as_posix() for p in found] == ["LICENSE", "README", "notes.txt"]
    assert {Path(s.path).name for s in skipped if s.reason == "matched by --exclude"} == {"COPYING", "ls.1"}
    out = tmp_path / "cli"
    code = main(["data", "prepare", str(corpus), "--out", str(out), "--include", "*.1", "--val-fraction", "0"])
    assert code == 0 and json.loads((out / "meta.json").read_text())["documents"] == 1
    named = main(["data", "prepare", str(corpus / "README"), "--out", str(tmp_path / "n"), "--exclude", "README",
                  "--val-fraction", "0"])  # fmt: skip
    assert named == 0  # a file named on the command line is read whatever the patterns say


def test_a_folder_left_with_nothing_is_one_line_naming_why(tmp_path) -> None:  # noqa: ANN001
    folder = tmp_path / "binaries"
    folder.mkdir()
    (folder / "a.bin").write_bytes(b"\0\1\2")
    (folder / "b").write_bytes(b"\xff\xfe")
    with pytest.raises(DataError) as caught:
        prepare([folder], tmp_path / "out", val_fraction=0.0, progress=False)
    message = str(caught.value)
    assert "holds no input file (skipped 2 file(s) (1 binary, 1 not UTF-8 text)" in message and "Fix:" in message
    assert "\n" not in message and not (tmp_path / "out").exists()
    with pytest.raises(DataError, match="--include takes a non-empty glob pattern"):
        prepare([folder], tmp_path / "out", include=[""], progress=False)


def test_content_checks_read_whole_files_in_blocks(tmp_path) -> None:  # noqa: ANN001
    late = tmp_path / "late"
    late.write_bytes(b"x" * 200_000 + "é".encode()[:1])  # valid for 200 kB, then cut inside a character
    assert not_text(late) == "not UTF-8 text (ends inside a character at byte 200001)"
    split = tmp_path / "split"
    split.write_bytes(b"a" * 65_535 + "é".encode())  # a character across the first block's edge is fine
    assert not_text(split) is None
    nul = tmp_path / "nul"
    nul.write_bytes(b"a" * 70_000 + b"\0")
    assert not_text(nul) == "binary (a NUL byte at byte 70000)"
    assert describe_skipped([]) == ""


def test_an_empty_file_with_a_known_suffix_in_a_folder_is_skipped_not_fatal(tmp_path) -> None:  # noqa: ANN001
    """Every Python package has an empty ``__init__.py``: the folder is still prepared, the file listed as skipped
    (issue 37); the same file named on the command line stays an error (test_data_prepare)."""
    package = tmp_path / "code" / "pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_bytes(b"")
    (package / "module.py").write_text("def answer():\n    return 42\n")
    meta = prepare([tmp_path / "code"], tmp_path / "out", val_fraction=0.0, progress=False)
    assert [(Path(e["path"]).name, e["reason"]) for e in meta["skipped"]["list"]] == [("__init__.py", "empty")]
    assert "return 42" in TokenFolder(tmp_path / "out").codec.decode(
        TokenFolder(tmp_path / "out").tokens("train").tolist()
    )


def test_the_cli_lists_skipped_files_once_and_info_says_what_it_checked(tmp_path, capfd) -> None:  # noqa: ANN001
    """prepare logs the skipped files; its summary then gives only their count (issue 37: they were listed
    twice); ``data info`` says what it checked (it printed nothing of the check on success)."""
    package = tmp_path / "code" / "pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_bytes(b"")
    for name in ("a.py", "b.py"):
        (package / name).write_text(f"def {name[0]}():\n    return 1\n")
    out = tmp_path / "out"
    assert main(["data", "prepare", str(tmp_path / "code"), "--out", str(out)]) == 0
    shown = capfd.readouterr().out  # the log (stderr) has the list; the summary only the count
    assert "__init__.py: empty" not in shown and "skipped 1 input file(s), listed above" in shown
    assert main(["data", "info", str(out)]) == 0
    assert "checked: every file's size (--verify: SHA-256 too) matches meta.json" in capfd.readouterr().out
    assert main(["data", "info", str(out), "--verify"]) == 0
    assert "checked: every file's size and SHA-256 matches meta.json" in capfd.readouterr().out
