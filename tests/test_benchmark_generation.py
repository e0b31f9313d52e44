import json
import runpy
import sys

import pytest
import torch

from conftest import REPO_ROOT


def test_generation_benchmark_runs_and_writes_results(tmp_path, monkeypatch):
    script = runpy.run_path(str(REPO_ROOT / "scripts" / "benchmark_generation.py"))
    output = tmp_path / "gen"
    rows = script["main"](["--max_length", "32", "--window", "4", "--layers", "1", "--hidden_size", "32",
                           "--heads", "4", "--batch_size", "2", "--vocab_size", "50", "--output", str(output)])
    assert [r["length"] for r in rows] == [16, 32]
    assert all(r[k] > 0 for r in rows for k in ("full", "zformer", "fastformer"))
    record = json.loads(output.with_suffix(".json").read_text())
    # the linear decoders' state is fixed-size and smaller than the full decoder's KV cache at 32 tokens
    assert record["state_numel"]["fastformer"] < record["state_numel"]["zformer"] < record["state_numel"]["full"]
    assert "full / zformer" in output.with_suffix(".md").read_text()
    assert output.with_suffix(".png").stat().st_size > 1000


def test_generation_benchmark_rejects_bad_checkpoints():
    script = runpy.run_path(str(REPO_ROOT / "scripts" / "benchmark_generation.py"))
    with pytest.raises(SystemExit, match="--checkpoints"):
        script["parse_args"](["--max_length", "64", "--checkpoints", "8,128"])


def test_generation_benchmark_graphs_need_cuda(capsys):
    script = runpy.run_path(str(REPO_ROOT / "scripts" / "benchmark_generation.py"))
    with pytest.raises(SystemExit):
        script["parse_args"](["--cuda_graphs", "--device", "cpu"])
    assert "--cuda_graphs needs --device cuda, not cpu" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_generation_benchmark_with_graphs_on_cuda(tmp_path):
    script = runpy.run_path(str(REPO_ROOT / "scripts" / "benchmark_generation.py"))
    rows = script["main"](["--max_length", "32", "--window", "4", "--layers", "1", "--hidden_size", "32",
                           "--heads", "4", "--batch_size", "2", "--vocab_size", "50", "--device", "cuda",
                           "--cuda_graphs", "--output", str(tmp_path / "gen")])
    assert all(r[k] > 0 for r in rows for k in ("full", "zformer", "fastformer"))
