import json
import runpy
import sys

import pytest
import torch

from conftest import REPO_ROOT


@pytest.fixture(autouse=True)
def _thread_count_restored():
    """The script's `--threads` sets torch's thread count for the whole process: later tests that
    compare outputs bit for bit with a fresh process must find the default again."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


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
    assert "full / zformer" in record["markdown"] and not output.with_suffix(".md").exists()
    assert output.with_suffix(".png").stat().st_size > 1000


def test_generation_benchmark_times_steps_after_a_decoder_prefix(tmp_path):
    """--prefill for encoder-decoders: each decoder reads a decoder prefix first; the full decoder's
    KV cache then holds it, and the rows count the tokens generated after it."""
    script = runpy.run_path(str(REPO_ROOT / "scripts" / "benchmark_generation.py"))
    output = tmp_path / "gen"
    rows = script["main"](["--prefill", "40", "--max_length", "8", "--checkpoints", "4,8", "--window", "4", "--layers", "1",
                           "--hidden_size", "32", "--heads", "4", "--batch_size", "2", "--vocab_size", "50",
                           "--output", str(output)])
    assert [r["length"] for r in rows] == [4, 8]
    record = json.loads(output.with_suffix(".json").read_text())
    assert record["state_numel"]["full"] == 2 * 2 * (1 + 40 + 8) * 32  # keys and values of every token read
    assert "40-token decoder prefix" in record["markdown"]


def test_a_stopped_decoding_run_reports_the_checkpoints_it_reached(tmp_path):
    """SIGTERM (the GPU check's step limit) mid-run: the checkpoints every decoder reached are
    reported and written, the table says where it stopped, and the run exits with 130."""
    import os
    import signal

    script = runpy.run_path(str(REPO_ROOT / "scripts" / "benchmark_generation.py"))
    namespace = script["main"].__globals__  # the functions' own globals (run_path returns a copy)
    real_timed, calls = namespace["timed"], []

    def timed(action, synchronize):
        calls.append(1)
        if len(calls) == 3 * 20:  # the 20th token of the third decoder
            os.kill(os.getpid(), signal.SIGTERM)
        return real_timed(action, synchronize)

    namespace["timed"] = timed
    output = tmp_path / "gen"
    with pytest.raises(SystemExit) as stopped:
        script["main"](["--max_length", "32", "--checkpoints", "8,16,32", "--window", "4", "--layers", "1",
                        "--hidden_size", "32", "--heads", "4", "--batch_size", "2", "--vocab_size", "50",
                        "--output", str(output)])
    assert stopped.value.code == 130
    record = json.loads(output.with_suffix(".json").read_text())
    assert [row["length"] for row in record["rows"]] == [8, 16]
    assert record["tokens_timed"] == 19  # the third decoder's 20th step was cut short
    assert "Stopped after 19 of 32 tokens" in record["markdown"]


def test_a_run_stopped_before_decoding_exits_130_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """SIGTERM while the pretrained models load (or their samples run): no token was timed, so the
    run says so in one line, writes no record and exits with 130, without a traceback."""
    import os
    import signal

    import benchmarks

    class LoadingModels:  # stands in for the model processes, stopped while they load
        def __init__(self, *args):
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(benchmarks, "LockstepModels", LoadingModels)
    script = runpy.run_path(str(REPO_ROOT / "scripts" / "benchmark_generation.py"))
    output = tmp_path / "causal"
    with pytest.raises(SystemExit) as stopped:
        script["main"](["--model_name_or_path", str(tmp_path / "a"), str(tmp_path / "b"), "--max_length", "8",
                        "--checkpoints", "4,8", "--window", "2", "--output", str(output)])
    assert stopped.value.code == 130
    assert "stopped outside the decoding loop" in capsys.readouterr().err
    assert not output.with_suffix(".json").exists()


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


def test_pretrained_causal_lms_step_in_lockstep_with_memory_and_samples(tmp_path):
    """--model_name_or_path: a tiny Llama (growing KV cache) against its Hedgehog conversion (fixed
    state), each in its own process; the record holds times, memory per checkpoint and samples."""
    from test_decoder_transfer import _word_tokenizer
    from test_llama_decoder import tiny_llama

    from hf_zformer import convert_pretrained

    tiny_llama().save_pretrained(tmp_path / "llama")
    _word_tokenizer().save_pretrained(tmp_path / "llama")
    convert_pretrained(tmp_path / "llama", "zformer", tmp_path / "linear", zformer_feature_map="hedgehog",
                       attention_window=4)
    script = runpy.run_path(str(REPO_ROOT / "scripts" / "benchmark_generation.py"))
    output = tmp_path / "causal"
    rows = script["main"](["--model_name_or_path", str(tmp_path / "llama"), str(tmp_path / "linear"),
                           "--names", "source,linear", "--prompt", "w5 w6 w7", "--prefill", "10", "--max_length", "24",
                           "--checkpoints", "8,24", "--window", "4", "--threads", "1", "--samples", "3",
                           "--output", str(output)])
    assert [r["length"] for r in rows] == [8, 24] and all(r[k] > 0 for r in rows for k in ("source", "linear"))
    record = json.loads(output.with_suffix(".json").read_text())
    assert not output.with_suffix(".md").exists() and not output.with_suffix(".png").exists()
    memory = record["memory"]
    # the context: the prompt's 3 tokens repeated to 10, then 24 generated
    assert memory["source"]["24"]["cache_tokens"] == 10 + 24 and memory["linear"]["24"]["cache_tokens"] == 10 + 24
    # the source's keys and values grow with every token; the converted model's state does not
    assert memory["source"]["24"]["cache_bytes"] > memory["source"]["8"]["cache_bytes"]
    assert memory["linear"]["24"]["cache_bytes"] == memory["linear"]["8"]["cache_bytes"] > 0
    assert all(m["peak_rss_growth"] >= 0 for model in memory.values() for m in model.values())
    assert record["models"]["linear"]["class"] == "ZformerLlamaForCausalLM"
    assert record["models"]["source"]["prompt_tokens"] == 10
    assert set(record["samples"]) == set(script["PROMPTS"])
    assert all(set(texts) == {"source", "linear"} for texts in record["samples"].values())
    assert "source / linear" in record["markdown"] and "| source |" in record["markdown"]
    # --append: a second run's record joins the first in the same file
    script["main"](["--model_name_or_path", str(tmp_path / "llama"), "--prompt", "w5", "--max_length", "4",
                    "--checkpoints", "4", "--window", "2", "--threads", "1", "--output", str(output), "--append"])
    records = json.loads(output.with_suffix(".json").read_text())
    assert [r["settings"]["max_length"] for r in records] == [24, 4] and records[1]["settings"]["append"]


def test_a_stopped_causal_run_reports_what_every_model_reached(tmp_path, monkeypatch):
    """Stopped from outside as `timeout` or Ctrl-C stop a process group (each model's process gets the
    signal too, one SIGTERM, the other SIGINT): the checkpoints every model reached are reported with
    their memory, the table says where it stopped, and the run exits with 130."""
    import os
    import signal

    from test_decoder_transfer import _word_tokenizer
    from test_llama_decoder import tiny_llama

    import benchmarks

    tiny_llama().save_pretrained(tmp_path / "llama")
    _word_tokenizer().save_pretrained(tmp_path / "llama")
    real_step_all, calls = benchmarks.LockstepModels.step_all, []

    def step_all(models):
        calls.append(1)
        if len(calls) == 10:  # before the 10th token: the group's signal reaches every process
            for process, number in zip(models.processes, (signal.SIGTERM, signal.SIGINT)):
                os.kill(process.pid, number)
                process.join(timeout=30)
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step_all(models)

    monkeypatch.setattr(benchmarks.LockstepModels, "step_all", step_all)
    script = runpy.run_path(str(REPO_ROOT / "scripts" / "benchmark_generation.py"))
    output = tmp_path / "causal"
    with pytest.raises(SystemExit) as stopped:
        script["main"](["--model_name_or_path", str(tmp_path / "llama"), str(tmp_path / "llama"), "--names", "a,b",
                        "--prompt", "w5 w6", "--max_length", "16", "--checkpoints", "4,8,16", "--window", "2",
                        "--threads", "1", "--output", str(output)])
    assert stopped.value.code == 130
    record = json.loads(output.with_suffix(".json").read_text())
    assert [row["length"] for row in record["rows"]] == [4, 8] and record["tokens_timed"] == 9
    assert {name: sorted(states) for name, states in record["memory"].items()} == {"a": ["4", "8"], "b": ["4", "8"]}
    assert "Stopped after 9 of 16 tokens" in record["markdown"] and "| 8 tokens |" in record["markdown"]
    assert "| 16 tokens" not in record["markdown"]


def test_pretrained_causal_lms_need_one_name_each():
    script = runpy.run_path(str(REPO_ROOT / "scripts" / "benchmark_generation.py"))
    with pytest.raises(SystemExit):
        script["parse_args"](["--model_name_or_path", "a", "b", "--names", "one"])


def test_causal_stepper_reads_a_long_context_in_chunks():
    """Chunked reading of the context leaves the cache and the next tokens of one forward over it."""
    from test_decoder_transfer import _word_tokenizer
    from test_llama_decoder import converted, tiny_llama

    import benchmarks

    ids = benchmarks.context_ids(_word_tokenizer(), "w5 w6 w7", 11)
    assert ids.shape == (1, 11) and ids[0, :3].tolist() == ids[0, 3:6].tolist()
    for model in (tiny_llama(), converted("zformer-window")):
        whole, chunked = benchmarks.CausalStepper(model, ids), benchmarks.CausalStepper(model, ids, chunk=4)
        for stepper in (whole, chunked):
            for _ in range(5):
                stepper.step()
        assert whole.cache.get_seq_length() == chunked.cache.get_seq_length() == 16
        assert benchmarks.cache_bytes(whole.cache) == benchmarks.cache_bytes(chunked.cache)
        assert whole.tokens.tolist() == chunked.tokens.tolist()
