"""The README's Python examples run as written."""

import re

import pytest
from conftest import REPO_ROOT

# Blocks that load a folder written by a training run (`runs/...`) are covered by tests/test_scripts.py.
BLOCKS = [
    block
    for block in re.findall(r"```python\n(.*?)```", (REPO_ROOT / "README.md").read_text(), flags=re.S)
    if "runs/" not in block
]


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_example_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples may save folders into the working directory
    exec(compile(BLOCKS[index], f"README.md python block {index}", "exec"), {})


def test_readme_has_examples():
    assert len(BLOCKS) >= 2
