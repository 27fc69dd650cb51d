"""Docs that cannot drift (issue 37): every fenced block of README.md and docs/*.md is found, checked and run
(tests/helpers/docs.py; docs/testing.md).

- every bash, Python and toml block is checked in CI without running it: plait's flags parse, ``plait train``'s
  configuration loads, torchrun's flags parse, modules named by ``python -m`` exist, Python compiles, toml loads;
- every page runs its blocks in order in a scratch folder of its own: its ``ci`` blocks in CI (``make test``),
  all of them under ``make test-docs`` (markers ``docs`` and ``long``), scaled down by ``PLAIT_DOCS_SCALE``;
- blocks marked ``skip (reason)`` (hardware this machine lacks) are listed, and there are at most MAX_SKIPPED.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from helpers.docs import (
    FIXTURES,
    GIVEN,
    ROOT,
    SCALE,
    Block,
    all_blocks,
    check_block,
    commands,
    make_fixture,
    page_blocks,
    page_files,
    pages,
    plait_argv,
    run_page,
)

BLOCKS = all_blocks()
MAX_SKIPPED = 13
"""Skips are for hardware this machine lacks (several nodes, GPUs): raising this is a decision, not a habit.
13: docs/fault_tolerance.md's cluster launch (a quorum service and a replica group per node) joined the others."""
README_EXAMPLE = 'engine.save("ckpt/")'
"""The README's Python example (its text contains this); it must learn, as the epilogue below asserts."""
README_EXAMPLE_CHECK = """
import os
assert engine.step == 200 and stats.loss < 2.0, (engine.step, stats.loss)
assert os.path.isfile(os.path.join("ckpt", "latest"))
"""


def test_every_page_is_found_and_every_block_accounted_for(capsys) -> None:
    found = {str(path.relative_to(ROOT)) for path in pages()}
    assert "README.md" in found and {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")} <= found
    kinds = {lang: [b for b in BLOCKS if b.lang == lang] for lang in ("bash", "console", "python", "toml", "text")}
    assert sum(map(len, kinds.values())) == len(BLOCKS) and kinds["bash"] and kinds["python"] and kinds["toml"]
    skipped = [block for block in BLOCKS if block.marker.skip]
    with capsys.disabled():
        print(f"\ndocs blocks: {len(BLOCKS)} ({', '.join(f'{k} {len(v)}' for k, v in kinds.items())}); skipped:")
        for block in skipped:
            print(f"  {block.where} [{block.lang}]: {block.marker.skip}")
    assert len(skipped) <= MAX_SKIPPED, [block.where for block in skipped]
    assert all(block.lang in ("bash", "console", "python") for block in skipped), "only runnable blocks are skipped"
    for block in BLOCKS:
        assert set(block.marker.needs) <= set(FIXTURES), f"{block.where}: needs {block.marker.needs}"
        assert not block.marker.given or block.marker.given in GIVEN, f"{block.where}: given={block.marker.given}"
        assert block.marker.ranks == 1 or block.lang == "python", f"{block.where}: ranks= is for Python blocks"
        assert not (block.marker.file or block.marker.hardware) or block.lang == "toml", block.where
    for block in kinds["text"]:  # output and diagrams: a command there would never run
        first = block.text.lstrip().split("\n", 1)[0]
        command = first.startswith(("plait ", "python ", "torchrun ", "$ ")) and not ("[" in first or "..." in first)
        assert not command, f"{block.where}: a command in a block without a language: mark it bash (or console)"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang != "text"], ids=lambda b: b.where)
def test_block_parses_and_its_configurations_load(
    block: Block, tmp_path: Path, docs_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without running it, in a folder holding what its marker says it needs (as the page's run does)."""
    for name in block.marker.needs:
        make_fixture(name, tmp_path, docs_cache / "fixtures")
    monkeypatch.chdir(tmp_path)
    check_block(block, page_files(page_blocks(ROOT / block.page)))


def test_readme_train_a_real_model_commands_configure_what_they_say() -> None:
    """Beyond parsing: the README's mixture and fine-tuning commands configure what its comments say."""
    from plait.cli.main import _parser
    from plait.train.config import load_config

    readme = page_blocks(ROOT / "README.md")
    section = (ROOT / "README.md").read_text().split("## Train a real model", 1)[1].split("\n## ", 1)[0]
    block = next(b for b in readme if b.lang == "bash" and b.text.strip() in section)
    found = [argv for argv in map(plait_argv, commands(block)) if argv]
    assert {tuple(argv[:2]) for argv in found} >= {("data", "prepare"), ("train", "--set"), ("generate", "runs/stdlib")}
    configs = []
    for argv in found:
        args = _parser().parse_args(argv)
        if args.command == "train":
            configs.append(load_config(None, args.overrides, args.preset))
    mixture = next(c for c in configs if c.data.sources)
    assert mixture.data.attention == "document" and [s["weight"] for s in mixture.data.sources] == [0.7, 0.3]
    assert mixture.train.loss_chunk == 4096 and mixture.data.dataset_name == "mixture"
    assert any(c.data.attention == "document" and "hf" in c.model for c in configs)


def _page_runs() -> list:
    """One CI run per page with ``ci`` blocks, one full run (marked long) per page with other runnable blocks."""
    params = []
    for path in pages():
        runnable = [block for block in page_blocks(path) if block.runnable]
        name = str(path.relative_to(ROOT))
        if any(block.marker.ci for block in runnable):
            params.append(pytest.param(path, True, id=f"{name}-ci", marks=pytest.mark.docs))
        if any(not block.marker.ci for block in runnable):
            marks = [pytest.mark.docs, pytest.mark.long, pytest.mark.timeout(3600)]
            params.append(pytest.param(path, False, id=f"{name}-all", marks=marks))
    return params


@pytest.fixture(scope="session")
def docs_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shared by the page runs: the shims, the fixtures built once, plait's cache (the stdlib corpus)."""
    return tmp_path_factory.mktemp("docs-cache")


@pytest.mark.parametrize(("page", "only_ci"), _page_runs())
def test_page_runs_as_written(page: Path, only_ci: bool, tmp_path: Path, docs_cache: Path, capsys) -> None:
    blocks = page_blocks(page)
    expected = [block for block in blocks if block.runnable and (block.marker.ci or not only_ci)]
    example = [b for b in blocks if b.lang == "python" and README_EXAMPLE in b.text and b.page == "README.md"]
    epilogues = {block.line: README_EXAMPLE_CHECK for block in example}
    ran = []
    for result in run_page(blocks, tmp_path, docs_cache, only_ci, epilogues):
        ran.append(result)
        if result.block in example:  # the README example prints its held-out accuracy last
            assert 0.0 <= float(result.output.strip().splitlines()[-1]) <= 1.0, result.output[-500:]
    with capsys.disabled():
        times = ", ".join(f"{r.block.line}: {r.seconds:.0f} s" for r in ran)
        print(f"\n{page.name} ({'ci blocks' if only_ci else 'all blocks'}, PLAIT_DOCS_SCALE={SCALE}): {times}")
    assert [r.block for r in ran] == expected  # every block meant to run ran, none more
    assert ran, f"{page}: no block ran"


def test_scaled_train_appends_documented_overrides() -> None:
    from helpers.docs import scaled_train

    argv = shlex.split("train --preset stdlib-lm --nproc 2 --out runs/x")
    added = " ".join(scaled_train(argv)[len(argv) :])
    for override in ("train.steps=4", "train.save_every=4", "train.eval_every=4", "data.corpus_mb=2"):
        assert override in added
    assert "train.global_batch=8" in added and "data.seq_len=64" in added
    plain = shlex.split("train --set train.steps=2 --nproc 1 --set train.global_batch=4")
    added = " ".join(scaled_train(plain)[len(plain) :])
    assert "train.steps=2" in added and "global_batch" not in added and "save_every" not in added
