"""Sharded and data-parallel training on CPU processes (gloo): FSDP2 and FSDP1 training steps equal
one-process steps, sharded and full checkpoints load back, tied embeddings stay tied
(tests/distributed_worker.py, run by torchrun); FSDP refuses 0-d parameters, so no model has any."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO_ROOT
from model_kinds import ATTENTIONS, AUTO_CLASSES, cases, model

WORKER = REPO_ROOT / "tests" / "distributed_worker.py"


def run_workers(tmp_path, pairs, modes=("fsdp2", "fsdp1"), processes=2, timeout=900):
    """Run the worker on `processes` CPU processes for each (kind, attention) of `pairs`; return the
    checks it reports as passed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}", str(WORKER),
        "--workdir", str(tmp_path), "--cases", ",".join(f"{kind}:{attention}" for kind, attention in pairs),
        "--modes", ",".join(modes),
    ]
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"workers failed:\n{result.stdout[-5000:]}\n{result.stderr[-15000:]}"
    lines = (tmp_path / "report.jsonl").read_text().splitlines()
    return {(r["kind"], r["attention"], r["mode"]) for r in map(json.loads, lines)}


@pytest.mark.parametrize("kind,attention", cases())
def test_no_parameter_or_buffer_is_0_d(kind, attention):
    built = model(kind, attention)
    scalars = [name for name, t in [*built.named_parameters(), *built.named_buffers()] if t.dim() == 0]
    assert not scalars, scalars


def test_fsdp2_and_fsdp1_step_and_checkpoints_of_zformer_classifier_and_seq2seq(tmp_path):
    """The representative subset of the matrix below: an encoder and an encoder-decoder (tied embeddings,
    cross-attention, causal decoder), both sharding APIs."""
    pairs = [("classification", "zformer"), ("seq2seq", "zformer")]
    passed = run_workers(tmp_path, pairs)
    assert passed == {(kind, attention, mode) for kind, attention in pairs for mode in ("fsdp2", "fsdp1")}


def test_ddp_with_gradient_checkpointing_equals_one_process(tmp_path):
    """DDP over two processes with gradient checkpointing, through the tied-embedding lookups of a
    seq2seq and a causal LM: the step of one process on the whole batch."""
    pairs = [("seq2seq", "zformer"), ("causal", "fastformer")]
    assert run_workers(tmp_path, pairs, modes=("ddp-gc",)) == {(kind, attention, "ddp-gc") for kind, attention in pairs}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(AUTO_CLASSES))
def test_fsdp_matrix_every_attention_type(tmp_path, kind):
    """Every attention type (hybrid: a different type per layer) of one model kind, FSDP2 and FSDP1."""
    pairs = [pair for pair in cases() if pair[0] == kind]
    assert {attention for _, attention in pairs} <= set(ATTENTIONS)
    passed = run_workers(tmp_path, pairs)
    assert passed == {(k, attention, mode) for k, attention in pairs for mode in ("fsdp2", "fsdp1")}
