"""The README's Python example runs as written (single process) and learns something; the commands of its "Train a
real model" section are accepted as written (their flags parse, their run configurations load)."""

import re
import shlex
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_example_runs(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the example saves ckpt/ in the working directory
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - our own README
    engine = namespace["engine"]
    assert engine.step == 200 and namespace["stats"].loss < 2.0
    printed = float(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0.0 <= printed <= 1.0
    assert (tmp_path / "ckpt" / "latest").is_file()


def test_readme_train_a_real_model_commands_parse_and_load():
    from plait.cli.main import _parser
    from plait.train.config import load_config

    section = README.read_text().split("## Train a real model", 1)[1].split("## Python API", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1).replace("\\\n", " ")
    commands = [shlex.split(line) for line in block.splitlines() if line.startswith("plait ")]
    assert {tuple(c[1:3]) for c in commands} >= {("data", "prepare"), ("train", "--set"), ("generate", "runs/stdlib")}
    configs = []
    for command in commands:
        args = _parser().parse_args(command[1:])  # every flag exists
        if command[1] == "train":
            configs.append(load_config(args.config, args.overrides, args.preset))
    mixture = next(c for c in configs if c.data.sources)
    assert mixture.data.attention == "document" and [s["weight"] for s in mixture.data.sources] == [0.7, 0.3]
    assert mixture.train.loss_chunk == 4096 and mixture.data.dataset_name == "mixture"
    assert any(c.data.attention == "document" and "hf" in c.model for c in configs)
