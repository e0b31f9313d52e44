"""The release: one version string, a dated CHANGELOG section and CITATION.cff under it, and a wheel
that installs into a fresh virtual environment and runs a quickstart there.

The wheel is built from a copy of the files the package needs (`python -m build --wheel
--no-isolation`, so nothing is downloaded) and installed with `pip --no-deps --no-index` into a new
virtual environment that reaches torch and transformers through a path entry to this environment's
site-packages (whose editable hf_zformer is then not on the path: the import must come from the wheel).
"""

import configparser
import datetime
import importlib.util
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile

import pytest
from conftest import REPO_ROOT

import hf_zformer


def _cff_field(name: str) -> str:
    match = re.search(rf"^{name}:\s*\"?([^\"\n]+)\"?\s*$", (REPO_ROOT / "CITATION.cff").read_text(), flags=re.M)
    assert match, f"CITATION.cff has no {name}"
    return match.group(1).strip()


def test_one_version_everywhere():
    config = configparser.ConfigParser()
    config.read(REPO_ROOT / "setup.cfg")
    assert config["metadata"]["version"] == "attr: hf_zformer.__version__"  # the one string is in the package
    version = hf_zformer.__version__
    changelog = (REPO_ROOT / "CHANGELOG.md").read_text()
    released = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$", changelog, flags=re.M)
    assert released and released[0][0] == version, f"the CHANGELOG's latest release is not {version}"
    datetime.date.fromisoformat(released[0][1])
    assert _cff_field("version") == version and _cff_field("date-released") == released[0][1]
    wheels = re.findall(r"hf_zformer-(\d+\.\d+\.\d+)-py3", (REPO_ROOT / "README.md").read_text())
    assert wheels and set(wheels) == {version}, f"README installs wheel versions {wheels}, the package is {version}"
    # every "saved before X" / "since X" names a version that is released
    known = {v for v, _ in released}
    texts = [REPO_ROOT / "README.md", REPO_ROOT / "CHANGELOG.md", *(REPO_ROOT / "docs").glob("*.md"),
             *(REPO_ROOT / "hf_zformer").rglob("*.py")]
    for path in texts:
        for named in re.findall(r"(?:before|since|after|in) (\d+\.\d+\.\d+)\b", path.read_text()):
            assert named in known, f"{path.relative_to(REPO_ROOT)} names version {named}, which is not released"


@pytest.mark.skipif(importlib.util.find_spec("build") is None, reason="needs the `build` package (the dev extra)")
def test_wheel_installs_in_a_fresh_environment_and_runs(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO_ROOT / name, source / name)
    shutil.copytree(REPO_ROOT / "hf_zformer", source / "hf_zformer", ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", tmp_path / "dist"],
                           cwd=source, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    assert wheel.name.startswith(f"hf_zformer-{hf_zformer.__version__}-")
    names = zipfile.ZipFile(wheel).namelist()
    assert "hf_zformer/modeling/attention.py" in names and "hf_zformer/metrics/sacrebleu/sacrebleu.py" in names
    assert not [n for n in names if n.startswith(("benchmarks/", "hf_zformer/benchmark/"))], "the benchmark harness is in the wheel"

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=300)
    python = venv / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (venv / purelib.split(str(venv) + "/", 1)[1] / "dependencies.pth").write_text("\n".join(sorted(ours)) + "\n")
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
                                "--quiet", wheel], capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stderr[-3000:]
    quickstart = textwrap.dedent(f"""
        import importlib.util, pathlib, torch, hf_zformer
        from transformers import AutoConfig, AutoModelForSequenceClassification
        assert pathlib.Path(hf_zformer.__file__).is_relative_to({str(venv)!r}), hf_zformer.__file__
        assert hf_zformer.__version__ == {hf_zformer.__version__!r}
        assert importlib.util.find_spec("hf_zformer.benchmark") is None and importlib.util.find_spec("benchmarks") is None
        config = AutoConfig.for_model("zformer", attention_type="fastformer", vocab_size=100, hidden_size=32,
                                      num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, num_labels=2)
        model = AutoModelForSequenceClassification.from_config(config)
        ids = torch.randint(5, 100, (2, 8))
        print(model(input_ids=ids, labels=torch.tensor([0, 1])).loss.item())
        model.save_pretrained("saved")
        AutoModelForSequenceClassification.from_pretrained("saved", trust_remote_code=True)
        print("quickstart ok")
    """)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([python, "-c", quickstart], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "quickstart ok" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
