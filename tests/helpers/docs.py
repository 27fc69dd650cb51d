"""The docs test harness (tests/test_docs.py, docs/testing.md): every fenced block of README.md and docs/*.md,
found with its page and line, checked without running it, and run page by page in a scratch folder.

Blocks by language: ``bash``/``sh`` are commands, ``python`` a program, ``toml`` a run configuration (or, with the
marker ``hardware``, a planner hardware file); a block without a language is output or a diagram and is not run. A
block may carry a marker in an HTML comment on the line just before its fence::

    <!-- docs-test: ci needs=notes.txt,chats.jsonl -->
    <!-- docs-test: skip (needs 2 nodes with 8 GPUs each) -->

Words of a marker (``KEY=VALUE`` or a flag; a value may be quoted):

- ``ci``: quick; the page's ``ci`` blocks also run in ``make test`` (all blocks run under ``make test-docs``);
- ``skip (REASON)``: never run (hardware this machine lacks); still checked: every flag parses, configs load;
- ``needs=A,B``: files the harness puts in the page's folder first (``docs_fixtures.FIXTURES``: the page says what they are);
- ``given=NAME``: a Python fragment runs after the prelude ``GIVEN[NAME]`` (the names the page says it assumes);
- ``ranks=N``: a Python block runs in N processes under torchrun (gloo);
- ``file=NAME``: a toml block is also written to NAME in the page's folder before the page's blocks run;
- ``hardware``: a toml block is a planner hardware file (``--hardware``), not a run configuration;
- ``scale="OLD => NEW"``: a Python block's text OLD becomes NEW when runs are scaled (``PLAIT_DOCS_SCALE``);
- ``unscaled``: the block runs as written even when runs are scaled (it is quick, and what follows needs it so);
- ``exit=N``: the block ends with status N when it works as the page says (``plait certify`` finding a DIFFERS).

Languages: ``console`` blocks are a transcript: their ``$ `` lines are the commands, the rest is output.

``PLAIT_DOCS_SCALE=ci`` (the default) scales long runs down: ``plait`` in the blocks is a shim (``shim_main``)
that appends ``--set`` overrides to ``plait train`` (``scaled_train``), caps ``plait generate`` and ``plait
calibrate``; ``PLAIT_DOCS_SCALE=full`` runs every block exactly as written.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from helpers.docs_fixtures import FIXTURES

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*docs-test:(.*?)-->\s*$")
SCALE = os.environ.get("PLAIT_DOCS_SCALE", "ci")
"""``ci`` (default): long runs scaled down as ``scaled_train`` says; ``full``: every block as written."""
LANGUAGES = {
    "bash": "bash",
    "sh": "bash",
    "shell": "bash",
    "console": "console",
    "python": "python",
    "toml": "toml",
    "": "text",
}
SHELL_PROGRAMS = {"export", "cd", "mkdir", "ls", "cat", "echo", "tensorboard"}
"""Programs a shell block may run besides plait, torchrun, python and make (not checked further)."""
MARKER_WORDS = {"ci", "skip", "needs", "given", "ranks", "file", "hardware", "scale", "unscaled", "exit"}


class DocsError(AssertionError):
    """A block that fails its check or its run, named by page, line and command."""


@dataclass(frozen=True)
class Marker:
    """What a ``<!-- docs-test: ... -->`` comment says about the block below it."""

    ci: bool = False
    skip: str = ""
    needs: tuple[str, ...] = ()
    given: str = ""
    ranks: int = 1
    file: str = ""
    hardware: bool = False
    scale: tuple[str, str] | None = None
    unscaled: bool = False
    exit: int = 0
    """The exit status the block's last command ends with when it works as the page says (``plait certify``'s 1)."""

    @classmethod
    def parse(cls, text: str, where: str) -> Marker:
        """The marker in ``text`` (the comment's body); ``DocsError`` for an unknown word or a skip without reason."""
        reason = re.search(r"\((.*)\)", text, re.S)
        words = shlex.split(text[: reason.start()] + text[reason.end() :] if reason else text)
        fields: dict = {}
        for word in words:
            key, _, value = word.partition("=")
            if key not in MARKER_WORDS:
                raise DocsError(f"{where}: unknown docs-test marker word {word!r}; known: {sorted(MARKER_WORDS)}")
            if key in ("ci", "hardware", "unscaled"):
                fields[key] = True
            elif key == "skip":
                fields["skip"] = (reason.group(1).strip() if reason else "") or ""
                if not fields["skip"]:
                    raise DocsError(f"{where}: a docs-test skip must give its reason: skip (why it cannot run here)")
            elif key == "needs":
                fields["needs"] = tuple(name for name in value.split(",") if name)
            elif key in ("ranks", "exit"):
                fields[key] = int(value)
            elif key == "scale":
                old, sep, new = value.partition("=>")
                if not sep:
                    raise DocsError(f'{where}: scale="OLD => NEW", got {value!r}')
                fields["scale"] = (old.strip(), new.strip())
            else:
                fields[key] = value
        return cls(**fields)


@dataclass(frozen=True)
class Block:
    """One fenced block: its page (relative to the repository), the line of its opening fence, language, text."""

    page: str
    line: int
    lang: str
    text: str
    marker: Marker = field(default_factory=Marker)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runnable(self) -> bool:
        return self.lang in ("bash", "console", "python") and not self.marker.skip


def pages() -> list[Path]:
    """README.md, then every docs/*.md in name order (a new page is picked up as it is added)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def page_blocks(path: Path) -> list[Block]:
    """The fenced blocks of one page, in order."""
    page = str(path.relative_to(ROOT))
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise DocsError(f"{page}:{i + 1}: a fence that is never closed")
        lang = opening.group(2)
        if lang not in LANGUAGES:
            raise DocsError(
                f"{page}:{i + 1}: fence language {lang!r} is not one the docs test knows: {sorted(LANGUAGES)}"
            )
        comment = MARKER.match(lines[i - 1]) if i else None
        marker = Marker.parse(comment.group(1), f"{page}:{i + 1}") if comment else Marker()
        text = textwrap.dedent("\n".join(lines[i + 1 : end])) + "\n"
        found.append(Block(page, i + 1, LANGUAGES[lang], text, marker))
        i = end + 1
    return found


def all_blocks() -> list[Block]:
    return [block for path in pages() for block in page_blocks(path)]


# ------------------------------------------------------------------------------------------------ commands


@dataclass(frozen=True)
class Command:
    """One command line of a shell block (continuations joined, comments dropped), its leading VAR=value words apart."""

    block: Block
    env: dict[str, str]
    argv: list[str]

    def __str__(self) -> str:
        return shlex.join(self.argv)


def script(block: Block) -> str:
    """A shell block's script: a bash block's text, or a console block's ``$ `` lines without their prompt."""
    if block.lang == "console":
        return "".join(line[2:] + "\n" for line in block.text.splitlines() if line.startswith("$ "))
    return block.text


def commands(block: Block) -> list[Command]:
    """The command lines of a bash or console block."""
    found, pending = [], ""
    for line in script(block).replace("\\\n", " ").splitlines():
        pending += line + "\n"
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quotation goes on over the next line
            continue
        pending = ""
        env = {}
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
            key, _, value = words.pop(0).partition("=")
            env[key] = value
        if words:
            found.append(Command(block, env, words))
    if pending:
        raise DocsError(f"{block.where}: a quotation is never closed: {pending.strip()[:200]!r}")
    return found


def plait_argv(command: Command) -> list[str] | None:
    """The arguments of plait in ``command``: ``plait ARGS``, ``torchrun ... -m plait ARGS``, ``python -m plait``."""
    argv = command.argv
    if argv[0] == "plait":
        return argv[1:]
    if "-m" in argv and argv[argv.index("-m") + 1 : argv.index("-m") + 2] == ["plait"]:
        return argv[argv.index("-m") + 2 :]
    return None


def check_command(command: Command, files: dict[str, str]) -> None:
    """Check one command without running it: plait's flags parse and a ``train``'s configuration loads (its
    ``--config`` from ``files``, the page's toml blocks, when the page writes it there); torchrun's flags parse;
    ``python -m MODULE`` names a module; ``python -c`` code compiles; ``make`` names Makefile targets; any other
    program is refused, so that a new
    kind of command is met here first."""
    where = f"{command.block.where}: `{command}`"
    argv = command.argv
    try:
        if argv[0] == "torchrun":
            from torch.distributed.run import get_args_parser

            get_args_parser().parse_args(argv[1:])
        arguments = plait_argv(command)
        if argv[0] == "make":
            targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M)
            if not set(argv[1:]) <= set(targets):
                raise DocsError(f"the Makefile has no target {sorted(set(argv[1:]) - set(targets))}")
        elif arguments is not None:
            check_plait(arguments, files)
        elif Path(argv[0]).name in ("python", "python3") and argv[1] == "-m":
            import importlib.util

            if importlib.util.find_spec(argv[2]) is None:
                raise DocsError(f"no module {argv[2]}")
        elif Path(argv[0]).name in ("python", "python3") and argv[1] == "-c":
            compile(argv[2], "<python -c>", "exec")
        elif argv[0] not in SHELL_PROGRAMS:
            raise DocsError(f"the docs test does not know the program {argv[0]!r} (tests/helpers/docs.py)")
    except SystemExit as exit_:
        raise DocsError(f"{where}: its arguments do not parse (exit {exit_.code})") from None
    except DocsError as error:
        raise DocsError(f"{where}: {error}") from None
    except Exception as error:  # noqa: BLE001 - any failure is reported with the block that caused it
        raise DocsError(f"{where}: {type(error).__name__}: {error}") from error


def check_plait(arguments: list[str], files: dict[str, str]) -> None:
    """plait's parser accepts ``arguments``; a ``train`` (or ``ps``) loads its configuration."""
    from plait.cli.main import _parser
    from plait.train.config import load_config

    args = _parser().parse_args(arguments)
    if args.command in ("train", "ps"):
        config = args.config if args.config in files else None
        if config:
            import tempfile

            with tempfile.TemporaryDirectory() as folder:
                path = Path(folder) / "run.toml"
                path.write_text(files[args.config])
                load_config(path, getattr(args, "overrides", None), getattr(args, "preset", None))
        else:
            load_config(None, getattr(args, "overrides", None), getattr(args, "preset", None))


def check_toml(block: Block) -> None:
    """A toml block loads: as a run configuration, or with the marker ``hardware`` as a planner hardware file."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "block.toml"
        path.write_text(block.text)
        try:
            if block.marker.hardware:
                from plait.planner.hardware_file import load_hardware_toml

                load_hardware_toml(path)
            else:
                from plait.train.config import load_config

                load_config(path)
        except Exception as error:  # noqa: BLE001 - reported with the block
            raise DocsError(f"{block.where}: this toml does not load: {type(error).__name__}: {error}") from error


def check_block(block: Block, files: dict[str, str]) -> None:
    """The static check of one block (it runs for skipped blocks too)."""
    if block.lang in ("bash", "console"):
        found = commands(block)
        if not found:
            raise DocsError(f"{block.where}: a shell block without a command")
        for command in found:
            check_command(command, files)
    elif block.lang == "python":
        try:
            ast.parse(block.text)
        except SyntaxError as error:
            raise DocsError(f"{block.where}: not valid Python: {error}") from error
    elif block.lang == "toml":
        check_toml(block)


def page_files(blocks: list[Block]) -> dict[str, str]:
    """The files a page's toml blocks write (marker ``file=NAME``): name -> text."""
    return {block.marker.file: block.text for block in blocks if block.marker.file}


# ------------------------------------------------------------------------------------------------ scaling


def scaled_train(arguments: list[str]) -> list[str]:
    """``plait train ARGS`` scaled for the docs test: at most 4 steps (checkpointing at the last one when the run
    checkpoints, evaluating on one batch there when it evaluates), the smallest global batch the layout takes that
    is at least 8 (or the given one if smaller), token windows of at most 64, the stdlib corpus cut to 2 MB."""
    from plait.cli.main import _parser
    from plait.train.config import load_config

    args = _parser().parse_args(arguments)
    try:
        config = load_config(args.config, args.overrides, args.preset)
    except Exception:  # noqa: BLE001 - unscaled: plait train reports the error itself
        return arguments
    train, layout, data = config.train, config.layout, config.data
    steps = min(train.steps, 4)
    extra = {"train.steps": steps}
    if train.save_every:
        extra["train.save_every"] = steps
    if train.eval_every:
        extra |= {"train.eval_every": steps, "train.eval_batches": 1}
    world = args.nproc if not os.environ.get("WORLD_SIZE") else int(os.environ["WORLD_SIZE"])
    others = max(1, layout.tp) * max(1, layout.pp) * max(1, layout.cp)
    dp = layout.dp if layout.dp > 0 else max(1, world // others)
    unit = dp * layout.microbatches
    batch = unit * -(-8 // unit)
    if batch < train.global_batch:
        extra["train.global_batch"] = batch
    if data.name in ("tokens", "bytes", "stdlib") and data.seq_len > 64:
        extra["data.seq_len"] = 64
    if data.name == "stdlib" and not data.corpus_mb:
        extra["data.corpus_mb"] = 2
    return arguments + [word for key, value in extra.items() for word in ("--set", f"{key}={value}")]


def scaled(arguments: list[str]) -> list[str]:
    """plait's ``arguments`` as the docs test runs them (``PLAIT_DOCS_SCALE``)."""
    if SCALE == "full" or not arguments:
        return arguments
    if arguments[0] == "train":
        return scaled_train(arguments)
    if arguments[0] == "ps" and "keygen" not in arguments:
        return arguments + ["--steps", "4"]
    if arguments[0] == "generate":
        return arguments + ["--max-new-tokens", "16"]
    if arguments[0] == "calibrate":
        return arguments + ["--repeats", "1", "--max-mb", "1"]
    return arguments


def shim_main() -> int:
    """The ``plait`` the docs' commands run: this worktree's plait, with ``scaled`` arguments. Its processes too:
    a block's own ``PYTHONPATH=tests`` would otherwise give the forkserver of ``plait.launch`` (which imports
    plait from PYTHONPATH and the installed package, not from its parent's sys.path) another checkout's plait."""
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    from plait.cli.main import main

    return main(scaled(sys.argv[1:]))


def write_shims(folder: Path) -> Path:
    """A bin folder with ``plait`` (``shim_main``) and ``python`` (this interpreter); returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    plait = folder / "plait"
    plait.write_text(
        f"#!{sys.executable}\nimport sys\nsys.path[:0] = [{str(ROOT)!r}, {str(TESTS)!r}]\n"
        "from helpers.docs import shim_main\n\nif __name__ == '__main__':  # the job's processes may import this file\n"
        "    sys.exit(shim_main())\n"
    )
    python = folder / "python"
    python.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    for shim in (plait, python):
        shim.chmod(0o755)
    return folder


# ------------------------------------------------------------------------------------------------ fixtures


def make_fixture(name: str, folder: Path, cache: Path) -> None:
    """Put fixture ``name`` into ``folder`` (built once per session into ``cache``, then copied)."""
    if name not in FIXTURES:
        raise DocsError(f"no docs-test fixture {name!r}; known: {sorted(FIXTURES)} (tests/helpers/docs_fixtures.py)")
    built = cache / name.rstrip("/")
    if not built.exists():
        built.parent.mkdir(parents=True, exist_ok=True)
        FIXTURES[name](built)
    target = folder / name.rstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    if built.is_dir():
        shutil.copytree(built, target, dirs_exist_ok=True)
    else:
        shutil.copy(built, target)


# ------------------------------------------------------------------------------------------------ python preludes

GIVEN: dict[str, str] = {
    "gpt": """
import torch, plait
from plait.models import GPT, GPTConfig, lm_loss
plait.init()
config = GPTConfig(n_layer=4, n_head=4, d_model=64)    # GPTConfig's vocabulary (16) and context (32)
model = GPT(config)
tokens = torch.randint(16, (8, 33), generator=torch.Generator().manual_seed(0))
inputs, targets = batch = (tokens[:, :-1], tokens[:, 1:])   # one dp rank's batch: 8 rows of 32 tokens
loader = batches = [batch] * 3
""",
    "engine": """
import torch, plait
from plait.models import GPT, GPTConfig, lm_loss
from plait.data import AdditionTask, ShardedBatches
task = AdditionTask(digits=2)
model = GPT(GPTConfig(vocab_size=task.vocab_size, seq_len=task.seq_len, n_layer=2, n_head=4, d_model=64))
engine = plait.parallelize(model, plait.Layout(), optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3), loss_fn=lm_loss)
batches = [ShardedBatches(task, global_batch=8, dp_rank=0, dp_size=1).batch_at(step) for step in range(3)]
engine.train_step(batches[0])
""",
    "llama-batch": """
import torch, plait
plait.init()
tokens = torch.randint(64, (8, 17), generator=torch.Generator().manual_seed(0))
input_ids, next_token_ids = tokens[:, :-1], tokens[:, 1:]
""",
}
"""Preludes of Python fragments (marker ``given=NAME``): the names a page says its fragment assumes, after
``plait.init()`` (idempotent: a fragment may call it again)."""


# ------------------------------------------------------------------------------------------------ running


@dataclass
class Ran:
    """A block's run: its standard output and seconds."""

    block: Block
    output: str
    seconds: float


def environment(bin_folder: Path, cache: Path) -> dict[str, str]:
    """The environment of the blocks: the shims first on PATH, this worktree importable, plait's cache apart."""
    env = dict(os.environ)
    env["PATH"] = f"{bin_folder}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["PLAIT_CACHE_DIR"] = str(cache / "plait-cache")
    env["PLAIT_DOCS_SCALE"] = SCALE
    env["OMP_NUM_THREADS"] = "1"
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


def python_program(block: Block) -> str:
    """A Python block as the harness runs it: its prelude (``given``), then its text (scaled where marked)."""
    text = block.text
    if block.marker.scale and SCALE != "full":
        old, new = block.marker.scale
        if old not in text:
            raise DocsError(f"{block.where}: its scale marker's {old!r} is not in the block")
        text = text.replace(old, new)
    if block.marker.given and block.marker.given not in GIVEN:
        raise DocsError(f"{block.where}: no prelude given={block.marker.given!r}; known: {sorted(GIVEN)}")
    return GIVEN.get(block.marker.given, "") + text


RANKS_EPILOGUE = """
import torch.distributed
if torch.distributed.is_initialized():  # every rank has finished before any exits (a program's clean end)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
"""
"""Appended to a Python block run in several processes (marker ``ranks``)."""


def _failure_output(output: str) -> str:
    """What a failed block printed, shortened: its first traceback (a rank's, under torchrun) and its last lines."""
    lines = output.splitlines()
    first = next((i for i, line in enumerate(lines) if "Traceback" in line), len(lines))
    end = next((i + 1 for i in range(first + 1, len(lines)) if lines[i] and not lines[i].startswith(" ")), len(lines))
    head = lines[first : min(end, first + 60)] if first < len(lines) - 30 else []
    native = [line for line in lines if re.search(r"terminate called|what\(\):|Fatal Python error", line)][:10]
    return "\n".join([*native, *head, *(["..."] if native or head else []), *lines[-30:]])


def run_block(block: Block, folder: Path, env: dict[str, str], epilogue: str = "", timeout: float = 1200) -> Ran:
    """Run one bash or Python block in ``folder``; ``DocsError`` naming the block (and its output) if it fails."""
    env = {**env, "HOME": str(folder)} | ({"PLAIT_DOCS_SCALE": "full"} if block.marker.unscaled else {})
    if block.lang in ("bash", "console"):
        argv = ["bash", "-e", "-o", "pipefail", "-c", script(block)]
        shown = block.text.strip()
    else:
        program = folder / f".docs_{Path(block.page).stem}_{block.line}.py"
        program.write_text(python_program(block) + epilogue)
        argv = [sys.executable, str(program)]
        if block.marker.ranks > 1:
            program.write_text(python_program(block) + epilogue + RANKS_EPILOGUE)
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            argv += [f"--nproc-per-node={block.marker.ranks}", str(program)]
        shown = block.text.strip()
    start = time.monotonic()
    try:
        done = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as error:
        raise DocsError(f"{block.where}: ran past {timeout:.0f} s:\n{shown}") from error
    if done.returncode != block.marker.exit:
        tail = _failure_output(done.stdout + done.stderr)
        raise DocsError(f"{block.where}: exit {done.returncode} in {folder}:\n{shown}\n--- output (end) ---\n{tail}")
    return Ran(block, done.stdout, time.monotonic() - start)


def run_page(
    blocks: list[Block], folder: Path, cache: Path, only_ci: bool, epilogues: dict[int, str] | None = None
) -> Iterator[Ran]:
    """Run a page's blocks in order in ``folder`` (its ``ci`` blocks only when ``only_ci``): the page's toml
    ``file=`` blocks written first, each block's ``needs`` made just before it; yields each block's run."""
    env = environment(write_shims(cache / "bin"), cache)
    for name, text in page_files(blocks).items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    for block in blocks:
        if not block.runnable or (only_ci and not block.marker.ci):
            continue
        for name in block.marker.needs:
            make_fixture(name, folder, cache / "fixtures")
        yield run_block(block, folder, env, (epilogues or {}).get(block.line, ""))
