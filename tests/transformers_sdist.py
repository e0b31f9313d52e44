"""transformers' own common test modules, taken from the source distribution that matches the installed
transformers: `tests/test_modeling_common.py` (ModelTesterMixin), `tests/test_configuration_common.py`
(ConfigTester) and `tests/test_training_mixin.py` (TrainingTesterMixin).

The sdist is fetched once with `pip download` and the three files are extracted into the pytest cache
folder (`.pytest_cache/d/transformers-sdist/<version>/`), so later runs read them from there. They are
imported as the submodules of a package made here, whose other submodules (the ones the sdist lacks and
the three files import: the generation tester, the export tester and the common config kwargs) are the
modules passed to `load()`. Nothing of transformers' test code is copied into this repository.
"""

import importlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import types
from pathlib import Path

import transformers
from filelock import FileLock

SDIST_FILES = ("test_modeling_common.py", "test_configuration_common.py", "test_training_mixin.py")
PACKAGE = "transformers_sdist_tests"
CACHE_ROOT = Path(__file__).resolve().parents[1] / ".pytest_cache" / "d" / "transformers-sdist"


class SdistUnavailable(RuntimeError):
    """The sdist could not be downloaded or holds none of the test modules."""


def sdist_tests(version=transformers.__version__, cache_root=CACHE_ROOT, timeout=300):
    """The folder holding the sdist's common test files for `version`, downloaded on first use."""
    folder = Path(cache_root) / version / "tests"
    done = folder / ".complete"
    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder.parent / "download.lock")):  # parallel workers download once
        if done.exists():
            return folder
        with tempfile.TemporaryDirectory() as tmp:
            command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                       "--dest", tmp, f"transformers=={version}"]
            try:
                result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
            except subprocess.TimeoutExpired:
                raise SdistUnavailable(f"`pip download transformers=={version}` took over {timeout} s") from None
            archives = sorted(Path(tmp).glob("transformers-*.tar.gz"))
            if result.returncode or not archives:
                last = (result.stderr.strip().splitlines() or ["no output"])[-1]
                raise SdistUnavailable(f"`pip download` of the transformers {version} sdist failed: {last}")
            extract(archives[0], folder)
        # test_configuration_common executes its folder's __init__.py (transformers' `tests/__init__.py`,
        # empty and left out of the sdist) to reach the transformers module.
        (folder / "__init__.py").touch()
        done.touch()
    return folder


def extract(archive, folder):
    """Write the archive's `<top>/tests/<name>` for each name of SDIST_FILES into `folder`."""
    with tarfile.open(archive) as tar:
        members = {Path(m.name).name: m for m in tar.getmembers()
                   if m.isfile() and Path(m.name).parent.name == "tests" and len(Path(m.name).parts) == 3}
        found = [name for name in SDIST_FILES if name in members]
        if not found:
            raise SdistUnavailable(f"{Path(archive).name} holds none of {', '.join(SDIST_FILES)} under tests/")
        for name in found:
            with tar.extractfile(members[name]) as source, open(folder / name, "wb") as target:
                shutil.copyfileobj(source, target)


def load(folder, standins):
    """Import the sdist's test files in `folder` as `transformers_sdist_tests.<name>`.

    `standins` maps the dotted names they import from their own package and the sdist lacks
    (e.g. "generation.test_utils") to the modules that take their place. Returns {file stem: module}
    for the files present.
    """
    package = types.ModuleType(PACKAGE)
    package.__path__ = [str(folder)]
    package.__package__ = PACKAGE
    sys.modules[PACKAGE] = package
    for dotted, module in standins.items():
        parent = PACKAGE
        for part in dotted.split(".")[:-1]:  # the intermediate packages (e.g. transformers_sdist_tests.generation)
            name = f"{parent}.{part}"
            if name not in sys.modules:
                sub = types.ModuleType(name)
                sub.__path__ = []
                sys.modules[name] = sub
                setattr(sys.modules[parent], part, sub)
            parent = name
        sys.modules[f"{PACKAGE}.{dotted}"] = module
        setattr(sys.modules[parent], dotted.split(".")[-1], module)
    return {Path(name).stem: importlib.import_module(f"{PACKAGE}.{Path(name).stem}")
            for name in SDIST_FILES if (Path(folder) / name).exists()}


def required():
    """Whether a missing sdist is an error rather than a skip (CI sets HF_ZFORMER_COMMON_TESTS=required)."""
    return os.environ.get("HF_ZFORMER_COMMON_TESTS") == "required"
