"""The README's Python example runs as written (single process) and learns something."""

import re
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
