"""Two machines, simulated on one: `torchrun --nnodes 2 --node_rank 0/1 --nproc_per_node 1` with a c10d
rendezvous trains the same model through scripts/run_translation.py and run_classification.py (DDP over
gloo) as one machine with two processes (`torchrun --nproc_per_node 2`)."""

import json
import socket
import subprocess
import sys

import pytest
from safetensors.torch import load_file
from test_scripts import REPO_ROOT, SCRIPTS, TINY_CLF, TINY_MT, _env, tiny_data  # noqa: F401  (fixture)

RUNS = {
    "run_classification.py": lambda data: ["--data_dir", data / "clf", "--attention_type", "zformer",
                                           "--config_overrides", TINY_CLF, "--vocab_size", 120,
                                           "--per_device_train_batch_size", 8, "--max_train_steps", 3],
    "run_translation.py": lambda data: ["--data_dir", data / "mt", "--attention_type", "zformer",
                                        "--config_overrides", TINY_MT, "--vocab_size", 120, "--max_target_length", 16,
                                        "--per_device_train_batch_size", 8, "--max_train_steps", 3],
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*options):
    return [sys.executable, "-m", "torch.distributed.run", *map(str, options)]


def _check(processes, what):
    for process in processes:
        out, err = process.communicate(timeout=900)
        assert process.returncode == 0, f"{what} failed:\n{out[-3000:]}\n{err[-8000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("script", list(RUNS))
def test_two_nodes_train_what_one_node_with_two_processes_trains(tiny_data, tmp_path, script):  # noqa: F811
    args = [str(a) for a in RUNS[script](tiny_data)]
    env = {**_env(), "OMP_NUM_THREADS": "1"}
    popen = dict(cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    one = subprocess.Popen(_torchrun("--standalone", "--nproc_per_node", 2, SCRIPTS / script, *args,
                                     "--output_dir", tmp_path / "one_node"), **popen)
    _check([one], "one node")
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [subprocess.Popen(_torchrun("--nnodes", 2, "--node_rank", rank, "--nproc_per_node", 1,
                                        "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint,
                                        SCRIPTS / script, *args, "--output_dir", tmp_path / "two_nodes"), **popen)
             for rank in (0, 1)]
    _check(nodes, "two nodes")
    results = {run: json.loads((tmp_path / run / "all_results.json").read_text()) for run in ("one_node", "two_nodes")}
    assert results["one_node"]["num_processes"] == results["two_nodes"]["num_processes"] == 2
    for key, value in results["one_node"].items():
        timing = "runtime" in key or "second" in key or key.endswith("_s")
        if isinstance(value, float) and not timing:
            assert results["two_nodes"][key] == pytest.approx(value, rel=1e-6, abs=1e-6), key
    weights = {run: load_file(tmp_path / run / "model.safetensors") for run in ("one_node", "two_nodes")}
    assert weights["one_node"].keys() == weights["two_nodes"].keys()
    for name, tensor in weights["one_node"].items():
        assert (weights["two_nodes"][name] - tensor).abs().max() <= 1e-6, name
