"""tests/transformers_sdist.py: what it takes from an sdist, and a failed download as a reason to skip."""

import io
import os
import tarfile

import pytest
import transformers_sdist


def _sdist(path, names):
    with tarfile.open(path, "w:gz") as tar:
        for name in names:
            data = f"# {name}\n".encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_extract_takes_the_common_test_files_of_the_top_tests_folder(tmp_path):
    archive = tmp_path / "transformers-9.9.9.tar.gz"
    _sdist(archive, ["transformers-9.9.9/tests/test_modeling_common.py",
                     "transformers-9.9.9/tests/test_training_mixin.py",
                     "transformers-9.9.9/tests/test_pipeline_mixin.py",
                     "transformers-9.9.9/src/transformers/tests/test_configuration_common.py"])
    out = tmp_path / "out"
    out.mkdir()
    transformers_sdist.extract(archive, out)
    assert sorted(p.name for p in out.iterdir()) == ["test_modeling_common.py", "test_training_mixin.py"]
    assert (out / "test_training_mixin.py").read_text() == "# transformers-9.9.9/tests/test_training_mixin.py\n"


def test_an_sdist_without_the_files_is_unavailable(tmp_path):
    archive = tmp_path / "transformers-9.9.9.tar.gz"
    _sdist(archive, ["transformers-9.9.9/README.md"])
    with pytest.raises(transformers_sdist.SdistUnavailable, match="holds none of"):
        transformers_sdist.extract(archive, tmp_path)


def test_a_failed_download_is_unavailable_with_pip_s_reason(tmp_path, monkeypatch):
    # pip looks in an empty local index only: no network needed
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", (tmp_path / "no-index").as_uri())
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    with pytest.raises(transformers_sdist.SdistUnavailable, match="pip download. of the transformers 9.9.9 sdist"):
        transformers_sdist.sdist_tests("9.9.9", cache_root=tmp_path / "cache")
    assert not (tmp_path / "cache" / "9.9.9" / "tests" / ".complete").exists()  # the next run tries again
