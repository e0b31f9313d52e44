"""A new user's first hour: the README's Install and Quickstart blocks, and what happens without network.

`-m slow`: the Install block and the Quickstart's local-data block, run as written from a fresh
copy of the repository with `../shared` beside it (virtual environment, install, training run).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import datasets
import pytest
import warm_scripts
from conftest import REPO_ROOT

from hf_zformer import data
from hf_zformer.data import sources


def section_blocks(title: str) -> list[str]:
    """The bash blocks of README.md's section `## {title}`, in order."""
    readme = (REPO_ROOT / "README.md").read_text()
    start = readme.index(f"\n## {title}\n")
    end = readme.find("\n## ", start + 1)
    return re.findall(r"```bash\n(.*?)```", readme[start : end if end > 0 else None], flags=re.S)


def install_block() -> str:
    return section_blocks("Install")[0]


def quickstart_blocks() -> list[str]:
    """The Quickstart's run from the local data folder, and the same run from the Hub: the block
    with the flags the text names swapped (`--dataset_name stanfordnlp/imdb` for `--data_dir` and
    `--label_names`)."""
    local = section_blocks("Quickstart")[0]
    hub = re.sub(r"--data_dir \S+", "--dataset_name stanfordnlp/imdb", local)
    return [re.sub(r" --label_names \S+", "", hub), local]


def test_install_then_quickstart_then_tests():
    install = install_block()
    assert "python3 -m venv" in install and "pip install torch==" in install
    assert install.index("pip install torch==") < install.index("pip install -e .")  # torch pinned first
    hub, local = quickstart_blocks()
    readme = (REPO_ROOT / "README.md").read_text()
    quickstart = readme[readme.index("\n## Quickstart\n") :]
    assert "`--dataset_name stanfordnlp/imdb` instead of\n`--data_dir` and `--label_names`" in quickstart
    assert "--dataset_name stanfordnlp/imdb" in hub and "--data_dir" not in hub  # works without our data folder
    assert "--data_dir ../shared/data/imdb" in local and "--dataset_name" not in local
    # the same run apart from the data source
    def words(block, source, extra=()):
        return [w for w in block.replace(source, "").split() if w != "\\" and w not in extra]

    assert words(hub, "--dataset_name stanfordnlp/imdb") == words(
        local, "--data_dir ../shared/data/imdb", extra=("--label_names", "negative,positive"))
    ci_command = re.search(r"<!-- test-command -->\n```bash\n(.*)\n", readme).group(1)
    assert "pytest" in ci_command and ".[dev]" in ci_command  # .ci/run reads the line two after the marker
    assert ci_command in section_blocks("Development")[0]


def test_hub_dataset_without_network_fails_at_once(monkeypatch):
    """No retries for half a minute, one error that names --data_dir, load_dataset never called."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    for name in sources.PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")  # nothing listens on port 9

    def must_not_run(*args, **kwargs):
        raise AssertionError("load_dataset called although the Hub is unreachable")

    monkeypatch.setattr(datasets, "load_dataset", must_not_run)
    started = time.perf_counter()
    for load in (data.load_classification_dataset, data.load_translation_dataset):
        with pytest.raises(ConnectionError, match=r"stanfordnlp/imdb.*cannot be reached.*--data_dir"):
            load("stanfordnlp/imdb")
    assert time.perf_counter() - started < 10


def test_hub_check_defers_to_offline_mode_and_proxies(monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", *sources.PROXY_VARIABLES):
        monkeypatch.delenv(name, raising=False)
    assert "127.0.0.1:9" in data.hub_unreachable()
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # datasets then reads its cache: not our call
    assert data.hub_unreachable() is None
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")  # a direct connection proves nothing
    assert data.hub_unreachable() is None


def test_library_warnings_are_printed_once():
    """The scripts' logging setup: a Hub or datasets warning appears once, not once per handler
    (in a fresh interpreter: pytest's own capture replaces the handlers' streams)."""
    code = (
        "import logging; from types import SimpleNamespace\n"
        "from hf_zformer.training.feedback import setup_logging\n"
        "setup_logging(SimpleNamespace(is_local_main_process=True))\n"
        "logging.getLogger('huggingface_hub.utils._http').warning('hub-warning-marker')\n"
        "logging.getLogger('datasets.load').warning('datasets-warning-marker')\n"
    )
    result = warm_scripts.run_code(code, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("hub-warning-marker") == 1, result.stderr
    assert result.stderr.count("datasets-warning-marker") == 1, result.stderr


def _copy_checkout(destination):
    """The files a fresh clone of this checkout would have (tracked and untracked, not ignored)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO_ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO_ROOT / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)


@pytest.mark.slow
def test_install_and_quickstart_local_block_run_from_a_fresh_copy(tmp_path):
    shared = REPO_ROOT.parent / "shared"
    if not (shared / "data" / "imdb").is_dir():
        pytest.skip(f"{shared}/data/imdb not found (CI keeps ../shared beside the clone)")
    checkout = tmp_path / "hf_zformer"
    _copy_checkout(checkout)
    (tmp_path / "shared").symlink_to(shared)
    # A user's shell: no virtual environment active, no PYTHONPATH, the Hub unreachable anyway.
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not p.startswith(sys.prefix))
    started = time.perf_counter()
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", install_block() + quickstart_blocks()[1]],
        cwd=checkout, env=env, capture_output=True, text=True, timeout=1800,
    )
    minutes = (time.perf_counter() - started) / 60
    assert result.returncode == 0, f"Install + Quickstart failed after {minutes:.1f} min:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    run = checkout / "runs" / "imdb-fastformer"
    results = json.loads((run / "all_results.json").read_text())
    assert 0.5 < results["eval_accuracy"] <= 1.0
    assert (run / "model.safetensors").is_file() and (run / "README.md").is_file()
    assert "eval_accuracy" in result.stdout + result.stderr  # the metric is printed
    print(f"Install + Quickstart blocks: {minutes:.1f} minutes, eval_accuracy {results['eval_accuracy']}")
