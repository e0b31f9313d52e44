"""The benchmark script runs end to end on a tiny size and writes sane reports (no timing assertions)."""

import csv
import importlib.util
import json
from pathlib import Path

import pytest
import torch

import benchmarks

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "benchmark_attention.py"
TINY = ["--matmul_size", "256", "--lengths", "16", "32", "--widths", "32", "--heads", "4", "--batch", "2", "--repeats", "1",
        "--no_progress"]


def load_script():
    spec = importlib.util.spec_from_file_location("benchmark_attention", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_csv(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_script_writes_csv_json_markdown_png(tmp_path):
    prefix = tmp_path / "bench" / "tiny"
    load_script().main(TINY + ["--modes", "forward", "train", "--output", str(prefix)])

    rows = read_csv(f"{prefix}.csv")
    assert len(rows) == 2 * 2 * len(benchmarks.DEFAULT_TYPES)  # modes x lengths x types
    assert {r["attention_type"] for r in rows} == set(benchmarks.DEFAULT_TYPES)
    for row in rows:
        assert row["status"] == "ok", row
        assert float(row["time_ms"]) > 0
        assert float(row["peak_memory_mb"]) >= 0
        assert 0 < float(row["flops_fraction"]) and 0 < float(row["executed_fraction"])
        assert int(row["flops"]) > 0 and int(row["executed_flops"]) > 0
        assert int(row["operations"]) > 0 and int(row["bytes"]) > 0 and 0 < float(row["bandwidth_fraction"])
        assert len(row["times_ms"].split()) >= 1
    for row in rows:
        if row["attention_type"] == "full":
            assert float(row["speedup_vs_full"]) == pytest.approx(1.0)
        else:
            assert float(row["speedup_vs_full"]) > 0

    data = json.loads(Path(f"{prefix}.json").read_text())
    assert data["metadata"]["matmul"]["flops"] > 0 and data["metadata"]["bandwidth"]["bytes_per_s"] > 0
    assert data["metadata"]["torch"]
    assert len(data["results"]) == len(rows)

    markdown = Path(f"{prefix}.md").read_text()
    assert "| n | full | full_eager | zformer | xformer | fastformer |" in markdown
    assert "attention, train" in markdown and "attention, forward" in markdown
    assert "(the 100% of the bandwidth column, bw)" in markdown and " · bw " in markdown
    assert Path(f"{prefix}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_model_level_with_mask(tmp_path):
    prefix = tmp_path / "model"
    load_script().main(TINY + ["--level", "model", "--mask", "--types", "full", "zformer", "fastformer",
                               "--no_plot", "--no_memory", "--output", str(prefix)])
    rows = read_csv(f"{prefix}.csv")
    assert {r["level"] for r in rows} == {"model"}
    assert all(r["status"] == "ok" and r["mask"] == "True" for r in rows)
    assert not Path(f"{prefix}.png").exists()


def test_module_level_keeps_the_output_projection(tmp_path, monkeypatch):
    """--level module times the whole attention module: the output projection is there (fastformer
    from N >= D takes its pooled output at both levels, merging W_r's bias into W_o's here and, at
    level attention, without W_o, adding it to r, or to q's bias where the projections are stacked)
    and its 2 B N D^2 FLOPs are counted."""
    from hf_zformer.modeling.attention import FastformerAttention

    pooled = []
    original = FastformerAttention._pooled_output
    monkeypatch.setattr(FastformerAttention, "_pooled_output",
                        lambda self, *args: pooled.append(args[0].shape[1]) or original(self, *args))
    rows, pooled_at = {}, {}
    for level in ("attention", "module"):
        pooled.clear()
        prefix = tmp_path / level
        load_script().main(TINY + ["--level", level, "--dtype", "bf16", "--types", "full", "fastformer_plain",
                                   "--no_plot", "--no_memory", "--warmup", "0", "--output", str(prefix)])
        rows[level] = {(r["attention_type"], int(r["length"])): r for r in read_csv(f"{prefix}.csv")}
        assert {r["level"] for r in rows[level].values()} == {level}
        assert all(r["status"] == "ok" for r in rows[level].values())
        assert f"**{level}, forward" in Path(f"{prefix}.md").read_text()
        pooled_at[level] = set(pooled)
    assert pooled_at == {"attention": {32}, "module": {32}}  # width 32: from 32 tokens, at both levels
    for key, row in rows["module"].items():
        projection = 2 * 2 * key[1] * 32 * 32  # 2 B N D^2
        assert int(row["flops"]) - int(rows["attention"][key]["flops"]) == projection
        assert int(row["executed_flops"]) - int(rows["attention"][key]["executed_flops"]) == projection


def test_module_flops_count_a_merged_output_projection_once_per_call():
    """Executed, a folded form that merges W_o (fastformer: W_o W_q and W_o W_r once per call, from
    B N >= 2 D) counts 4 D^3 for it instead of 2 B N D^2; the one-layer model adds its FFN to the same."""
    b, n, d, h = 2, 1024, 512, 8

    def counts(level, attention_type, dtype="fp32"):
        return benchmarks.case_flops(benchmarks.BenchCase(level, attention_type, "forward", b, n, d, h, dtype, "cpu", False))

    nominal, executed = counts("module", "fastformer")
    attention_nominal, attention_executed = counts("attention", "fastformer")
    assert nominal == attention_nominal + 2 * b * n * d * d
    assert executed == attention_executed + 4 * d**3
    assert counts("module", "full") == tuple(c + 2 * b * n * d * d for c in counts("attention", "full"))
    config = benchmarks.make_config("fastformer", n, d, h)
    assert benchmarks.model_flops("fastformer", b, n, d, h, config, executed=True) == (
        executed + 4 * b * n * d * config.intermediate_size)


def test_seq2seq_level_compares_with_bart(tmp_path):
    prefix = tmp_path / "seq2seq"
    load_script().main(["--level", "seq2seq", "--widths", "32", "--heads", "4", "--layers", "1", "--ffn", "64",
                        "--vocab", "50", "--batch", "2", "--source_length", "6", "--target_length", "4",
                        "--repeats", "1", "--no_progress", "--output", str(prefix)])
    rows = {r["model"]: r for r in read_csv(f"{prefix}.csv")}
    assert set(rows) == set(benchmarks.SEQ2SEQ_DEFAULT_MODELS)
    assert float(rows["bart"]["train_speedup_vs_bart"]) == pytest.approx(1.0)
    for row in rows.values():
        assert float(row["train_tokens_per_s"]) > 0 and float(row["sentences_per_s"]) > 0
    # identical size: BART and our full-attention model differ only in small per-layer extras
    # (final LayerNorms, BART's embedding LayerNorm and learned positions)
    assert abs(int(rows["full"]["parameters"]) - int(rows["bart"]["parameters"])) < 0.1 * int(rows["bart"]["parameters"])
    assert "BartForConditionalGeneration" in Path(f"{prefix}.md").read_text()


def test_causal_level_compares_with_gpt2(tmp_path):
    prefix = tmp_path / "causal"
    width, layers, positions = 32, 2, 32
    load_script().main(["--level", "causal", "--widths", str(width), "--heads", "4", "--layers", str(layers), "--ffn",
                        "64", "--vocab", "50", "--batch", "2", "--lengths", "16", str(positions), "--repeats", "1",
                        "--no_progress", "--output", str(prefix)])
    rows = read_csv(f"{prefix}.csv")
    assert {(r["model"], r["kind"], int(r["length"])) for r in rows} == {
        (m, k, n) for m in benchmarks.CAUSAL_MODELS for k in benchmarks.CAUSAL_KINDS for n in (16, 32)}
    for row in rows:
        assert 0 < float(row["tokens_per_s"]) < float("inf") and float(row["time_ms"]) > 0 and int(row["flops"]) > 0
        assert float(row["speedup_vs_gpt2"]) > 0 and float(row["flops_ratio_vs_gpt2"]) > 0
        if row["kind"] == "generate":
            assert float(row["cache_mb"]) > 0 and int(row["new_tokens"]) == int(row["length"]) // 2
        if row["model"] == "gpt2":
            assert float(row["speedup_vs_gpt2"]) == pytest.approx(1.0) and float(row["flops_ratio_vs_gpt2"]) == 1.0
    cache = {(r["model"], int(r["length"])): float(r["cache_mb"]) for r in rows if r["kind"] == "generate"}
    assert cache["full", 32] == pytest.approx(cache["gpt2", 32])  # the same keys and values
    assert cache["gpt2", 32] == pytest.approx(2 * cache["gpt2", 16], rel=0.1)  # grows with the text
    assert cache["zformer", 32] == cache["zformer", 16] and cache["fastformer", 32] == cache["fastformer", 16]
    # identical size, up to the known differences (benchmarks.build_causal): GPT-2's learned positions,
    # zformer's scale, fastformer's W_r and pooling vectors
    params = {r["model"]: int(r["parameters"]) for r in rows}
    assert params["gpt2"] - params["full"] == positions * width
    assert params["zformer"] - params["full"] == layers
    assert params["fastformer"] - params["full"] == layers * (width * width + width + 2 * width)
    markdown = Path(f"{prefix}.md").read_text()
    assert "GPT2LMHeadModel" in markdown and "| n | gpt2 | full | zformer | fastformer |" in markdown


def test_causal_flops_follow_the_attention_formulas():
    shape = benchmarks.CausalShape(batch=2, lengths=(8,), width=32, layers=2, heads=4, ffn=64, vocab=50)
    b, d, n, i, v = 2, 32, 8, 64, 50
    layer = benchmarks.attention_flops("full", b, n, d, 4) + 2 * b * n * d * d + 4 * b * n * d * i
    assert benchmarks.causal_flops("gpt2", "train", n, shape) == 3 * (2 * layer + 2 * b * n * d * v)
    assert benchmarks.causal_flops("full", "generate", n, shape) == benchmarks.causal_flops("gpt2", "generate", n, shape)
    # generation: linear attention's token steps do not grow with the context, full attention's do
    long = benchmarks.CausalShape(batch=1, lengths=(4096,), width=32, layers=1, heads=4, ffn=64, vocab=50)
    assert benchmarks.causal_flops("zformer", "generate", 4096, long) < 0.5 * benchmarks.causal_flops(
        "gpt2", "generate", 4096, long)


def test_slow_and_memory_hungry_configurations_are_skipped(tmp_path):
    prefix = tmp_path / "skip"
    load_script().main(TINY + ["--types", "full", "full_eager", "--max_seconds", "0", "--max_memory_gb", "0",
                               "--no_plot", "--output", str(prefix)])
    rows = {(r["attention_type"], int(r["length"])): r for r in read_csv(f"{prefix}.csv")}
    # full ran at the first length, then exceeded the (zero) time budget: the longer length is skipped
    assert rows[("full", 16)]["status"] == "ok"
    assert rows[("full", 32)]["status"] == "skipped" and "max_seconds" in rows[("full", 32)]["note"]
    # eager full attention's N x N matrices exceed the (zero) memory guard
    assert rows[("full_eager", 16)]["status"] == "skipped" and "memory guard" in rows[("full_eager", 16)]["note"]
    assert rows[("full", 32)]["speedup_vs_full"] == ""


def test_a_failing_case_is_reported_and_the_grid_goes_on(tmp_path, monkeypatch, capsys):
    from benchmarks import harness

    real_build = harness.build_module

    def build(attention_type, *args, **kwargs):
        if attention_type == "zformer":
            raise ValueError("kernel did not compile\nsecond line")
        return real_build(attention_type, *args, **kwargs)

    monkeypatch.setattr(harness, "build_module", build)
    prefix = tmp_path / "failing"
    load_script().main(TINY + ["--types", "full", "zformer", "fastformer", "--no_plot", "--output", str(prefix)])
    rows = {(r["attention_type"], int(r["length"])): r for r in read_csv(f"{prefix}.csv")}
    for length in (16, 32):
        assert rows[("zformer", length)]["status"] == "error"
        assert rows[("zformer", length)]["note"] == "ValueError: kernel did not compile"
        assert rows[("full", length)]["status"] == rows[("fastformer", length)]["status"] == "ok"
    assert "kernel did not compile" in capsys.readouterr().err  # the traceback is printed


def test_a_stopped_grid_writes_what_it_measured(tmp_path, monkeypatch):
    """SIGTERM mid-grid (`timeout`, the GPU check's step limit; Ctrl-C alike): the groups measured
    are written, the rest recorded as not measured, and the run exits with 130."""
    import os
    import signal

    from benchmarks import harness

    real_run_cases, calls = harness.run_cases, []

    def run_cases(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # while the second length is measured
            os.kill(os.getpid(), signal.SIGTERM)
        return real_run_cases(*args, **kwargs)

    monkeypatch.setattr(harness, "run_cases", run_cases)
    handler = signal.getsignal(signal.SIGTERM)
    prefix = tmp_path / "stopped"
    with pytest.raises(SystemExit) as stopped:
        load_script().main(TINY + ["--lengths", "16", "32", "64", "--types", "full", "zformer", "--no_plot",
                                   "--output", str(prefix)])
    assert stopped.value.code == 130
    assert signal.getsignal(signal.SIGTERM) is handler  # the handlers before the grid are back
    record = json.loads(Path(f"{prefix}.json").read_text())
    assert record["metadata"]["interrupted"] and "matmul_end" not in record["metadata"]
    rows = {(r["attention_type"], r["length"]): r for r in record["results"]}
    assert all(rows[(t, 16)]["status"] == "ok" and rows[(t, 16)]["time_ms"] > 0 for t in ("full", "zformer"))
    for key in [(t, n) for t in ("full", "zformer") for n in (32, 64)]:
        assert (rows[key]["status"], rows[key]["note"]) == ("skipped", benchmarks.INTERRUPTED)
    assert benchmarks.INTERRUPTED in Path(f"{prefix}.md").read_text()


def test_a_grid_stopped_from_outside_writes_what_it_measured(tmp_path):
    """The same with a real SIGTERM from another process, as `timeout` sends it, in a process whose
    SIGTERM handler is the default: the script itself turns it into a stop that writes."""
    import signal
    import subprocess
    import sys
    import time

    prefix = tmp_path / "grid"
    lengths = [str(2**k) for k in range(4, 17)]  # far more than is measured before the signal
    command = [sys.executable, str(SCRIPT), *TINY, "--lengths", *lengths, "--types", "full", "zformer",
               "--no_plot", "--no_memory", "--output", str(prefix)]
    with open(tmp_path / "err.log", "w") as err:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + 120
        while "matmul:" not in (tmp_path / "err.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 130, (tmp_path / "err.log").read_text()
    results = json.loads(Path(f"{prefix}.json").read_text())["results"]
    assert results[-1]["note"] == benchmarks.INTERRUPTED
    assert {r["status"] for r in results} <= {"ok", "skipped"}


@pytest.mark.parametrize("attention_type,overrides", [
    ("zformer", {}), ("zformer", {"zformer_feature_map": "hedgehog"}), ("fastformer", {}),
    ("fastformer", {"fastformer_share_qv": True}), ("full", {}),
])
def test_executed_flop_counts_fold_where_the_module_folds(monkeypatch, attention_type, overrides):
    """The executed counts' two folding decisions are the module's own, shape by shape: whether the
    folded form runs, and whether it merges the output projection (W_o never applied per token)."""
    from torch.nn import Linear

    from hf_zformer.modeling.attention import ATTENTION_CLASSES

    d, h = 16, 2
    per_token_outputs = []
    linear_forward = Linear.forward

    def spy(self, x, *args, **kwargs):
        if self is attention.output and x.dim() == 3:
            per_token_outputs.append(x.shape)
        return linear_forward(self, x, *args, **kwargs)

    monkeypatch.setattr(Linear, "forward", spy)
    cls = ATTENTION_CLASSES[attention_type]
    folded_calls = []
    if hasattr(cls, "_folded"):
        folded_form = cls._folded
        monkeypatch.setattr(cls, "_folded", lambda self, *a: folded_calls.append(1) or folded_form(self, *a))
    seen = set()
    for batch, length in [(1, 4), (1, 6), (2, 7), (1, 16), (1, 20), (2, 8), (3, 12), (1, 40)]:
        config = benchmarks.make_config(attention_type, length, d, h, **overrides)
        attention = cls(config).eval()
        folded_calls.clear(), per_token_outputs.clear()
        with torch.no_grad():
            attention(torch.randn(batch, length, d))
        folds = benchmarks.flops.folded(attention_type, length, d, config)
        assert folds == bool(folded_calls), (batch, length)
        merges = folds and cls.folds_output_projection(batch, length, d)
        assert merges == (not per_token_outputs), (batch, length)
        seen.add((folds, merges))
    expected = {"full": {(False, False)}, "zformer": {(False, False), (True, True)},
                "fastformer": {(False, False), (True, False), (True, True)}}[attention_type]
    if overrides.get("zformer_feature_map") == "hedgehog":
        expected = {(False, False)}
    assert seen == expected  # the shapes reach every case the type has


def test_flop_counts_follow_the_documented_formulas():
    b, n, d, h = 2, 64, 32, 4
    assert benchmarks.attention_flops("full", b, n, d, h) == 6 * b * n * d * d + 4 * b * n * n * d
    assert benchmarks.attention_flops("zformer", b, n, d, h) == 6 * b * n * d * d + 4 * b * n * d * (d // h)
    config = benchmarks.make_config("xformer", n, d, h)
    k = -(-n // config.xformer_beta)
    q = d // config.xformer_alpha
    assert benchmarks.attention_flops("xformer", b, n, d, h) == 2 * b * n * d * q + 2 * b * k * n * (2 * q + 2 * d)
    assert benchmarks.attention_flops("fastformer", b, n, d, h) == 8 * b * n * d * d + 11 * b * n * d
    assert benchmarks.step_flops(10, "train") == 30
    # executed counts: the folded zformer/fastformer forms (fp32, long sequences) do less work
    long = 4 * d
    for attention_type in ("zformer", "fastformer"):
        assert benchmarks.executed_attention_flops(attention_type, b, long, d, h) < benchmarks.attention_flops(
            attention_type, b, long, d, h
        )
        assert benchmarks.executed_attention_flops(attention_type, b, long, d, h, dtype="bf16") == (
            benchmarks.attention_flops(attention_type, b, long, d, h)
        )
    assert benchmarks.executed_attention_flops("full", b, n, d, h) == benchmarks.attention_flops("full", b, n, d, h)
    # model level: a folded form absorbs the output projection, zformer's for 2 B D^3 when N > D,
    # fastformer's for 4 D^3 (W_o W_q and W_o W_r, once per call) when B N >= 2 D; else 2 B N D^2
    for attention_type, length in (("zformer", long), ("fastformer", long), ("full", long), ("fastformer", d),
                                   ("zformer", d)):
        config = benchmarks.make_config(attention_type, length, d, h)
        nominal = benchmarks.model_flops(attention_type, b, length, d, h, config)
        assert nominal == benchmarks.attention_flops(attention_type, b, length, d, h, config) + 2 * b * length * d * d + (
            4 * b * length * d * config.intermediate_size
        )
        projection = {"zformer": 2 * b * d**3 if length > d else None,
                      "fastformer": 4 * d**3 if b * length >= 2 * d else None}.get(attention_type) or 2 * b * length * d * d
        assert benchmarks.model_flops(attention_type, b, length, d, h, config, executed=True) == (
            benchmarks.executed_attention_flops(attention_type, b, length, d, h, config)
            + projection
            + 4 * b * length * d * config.intermediate_size
        )


TINY_MODEL = ["--widths", "16", "--heads", "2", "--ffn", "32", "--vocab", "50", "--batch", "2", "--repeats", "1",
              "--warmup", "0", "--no_progress"]


def test_seq2seq_flops_follow_the_formulas():
    b, s, t, d, h, i, v = 1, 2, 2, 4, 2, 8, 10
    shape = benchmarks.Seq2SeqShape(batch=b, source_length=s, target_length=t, width=d, layers=1, heads=h, ffn=i,
                                   vocab=v)
    encoder = 6 * b * s * d * d + 4 * b * s * s * d + 2 * b * s * d * d + 4 * b * s * d * i  # attention, W_o, FFN
    memory = 4 * b * s * d * d  # cross-attention keys and values of the memory
    cross = 2 * b * t * d * d + 4 * b * t * s * d + 2 * b * t * d * d  # queries, scores + values, W_o
    decoder = 6 * b * t * d * d + 4 * b * t * t * d + 2 * b * t * d * d + 4 * b * t * d * i + memory + cross
    forward = encoder + decoder + 2 * b * t * d * v
    assert forward == 1632  # by hand
    assert benchmarks.seq2seq_flops("bart", "train", shape) == 3 * forward
    # generation: the encoder once, the memory once, then per token k = 1..t a step attending to k tokens
    step = sum(6 * d * d + 4 * k * d + 2 * d * d + 4 * d * i + (2 * d * d + 4 * s * d + 2 * d * d) + 2 * d * v
               for k in range(1, t + 1))
    assert benchmarks.seq2seq_flops("bart", "generate", shape) == encoder + memory + b * step == 1616
    for kind in ("train", "generate"):
        assert benchmarks.seq2seq_flops("full", kind, shape) == benchmarks.seq2seq_flops("bart", kind, shape)


def test_fastformer_qv_shares_the_query_projection():
    """`fastformer-qv` is fastformer with `fastformer_share_qv`: no value projections, and one D x D
    product per token and self-attention layer fewer in the FLOP count (encoder and decoder)."""
    shape = benchmarks.Seq2SeqShape(batch=2, source_length=6, target_length=4, width=16, layers=2, heads=2, ffn=32,
                                   vocab=50)
    plain, _ = benchmarks.build_seq2seq("fastformer", shape)
    shared, description = benchmarks.build_seq2seq("fastformer-qv", shape)
    assert shared.config.fastformer_share_qv and not plain.config.fastformer_share_qv
    assert "shared as value" in description
    attentions = [layer.attention for layer in shared.encoder.encoder.layers] + [
        layer.self_attention for layer in shared.decoder.layers]
    assert len(attentions) == 2 * shape.layers and all(attention.value is None for attention in attentions)
    d = shape.width
    assert plain.num_parameters() - shared.num_parameters() == len(attentions) * (d * d + d)
    b, s, t = shape.batch, shape.source_length, shape.target_length
    saved_forward = shape.layers * 2 * b * (s + t) * d * d
    assert benchmarks.seq2seq_flops("fastformer", "train", shape) - benchmarks.seq2seq_flops(
        "fastformer-qv", "train", shape) == 3 * saved_forward
    assert benchmarks.seq2seq_flops("fastformer", "generate", shape) - benchmarks.seq2seq_flops(
        "fastformer-qv", "generate", shape) == shape.layers * 2 * b * (s + t) * d * d


@pytest.mark.parametrize("kind", ["train", "generate"])
def test_seq2seq_flops_grow_quadratically_for_full_and_linearly_for_zformer(kind):
    def flops(model, n):
        shape = benchmarks.Seq2SeqShape(batch=2, source_length=n, target_length=n, width=8, layers=2, heads=2, ffn=16,
                                       vocab=30)
        return benchmarks.seq2seq_flops(model, kind, shape)

    n = 64
    for model in ("bart", "full"):  # A n^2 + B n with A > 0
        quadratic = flops(model, 2 * n) - 2 * flops(model, n)
        assert quadratic > 0 and flops(model, 4 * n) - 2 * flops(model, 2 * n) == 4 * quadratic
    assert flops("zformer", 2 * n) == 2 * flops("zformer", n)  # every term proportional to n
    assert flops("zformer", 1024) < 0.5 * flops("bart", 1024)


def test_classification_flops_follow_the_formulas():
    shape = benchmarks.ClassificationShape(batch=2, lengths=(8, 64), width=16, layers=2, heads=2, ffn=32, vocab=50)
    b, d, i, n = 2, 16, 32, 64
    layer = benchmarks.attention_flops("full", b, n, d, 2) + 2 * b * n * d * d + 4 * b * n * d * i
    forward = 2 * layer + 2 * b * d * d + 2 * b * d * 2  # layers, pooler, classifier
    assert benchmarks.classification_flops("bert", "forward", n, shape) == forward
    for model in benchmarks.CLASSIFICATION_MODELS:
        assert benchmarks.classification_flops(model, "train", n, shape) == 3 * benchmarks.classification_flops(
            model, "forward", n, shape)
    assert benchmarks.classification_flops("full", "train", n, shape) == benchmarks.classification_flops(
        "bert", "train", n, shape)
    # executed: the same for full attention, fewer for the folded zformer/fastformer forms (fp32, n > d)
    assert benchmarks.classification_flops("bert", "forward", n, shape, executed=True) == forward
    for model in ("zformer", "fastformer"):
        assert benchmarks.classification_flops(model, "forward", n, shape, executed=True) < (
            benchmarks.classification_flops(model, "forward", n, shape))
        # under bf16 autocast both fold on CPUs only
        assert benchmarks.classification_flops(model, "forward", n, shape, executed=True, dtype="bf16",
                                               device="cuda") == benchmarks.classification_flops(model, "forward", n, shape)
        assert benchmarks.classification_flops(model, "forward", n, shape, executed=True, dtype="bf16") == (
            benchmarks.classification_flops(model, "forward", n, shape, executed=True))
    # the hedgehog map: two d_h x d_h maps per head, sums over 2 d_h features against [V, 1]; no folded form
    h = 8  # d_h
    assert (benchmarks.classification_flops("zformer-hedgehog", "forward", n, shape)
            - benchmarks.classification_flops("zformer", "forward", n, shape)) == 2 * 8 * b * n * d * (h + 1)
    assert benchmarks.classification_flops("zformer-hedgehog", "forward", n, shape, executed=True) == (
        benchmarks.classification_flops("zformer-hedgehog", "forward", n, shape))
    short = 8  # n < 2 d_h: (phi(Q) phi(K)^T) [V, 1]
    quadratic = 4 * b * short * short * d + 2 * b * short * short * (d + 2)
    linear = 8 * b * short * d * (h + 1)
    assert (benchmarks.classification_flops("zformer-hedgehog", "forward", short, shape, executed=True)
            - benchmarks.classification_flops("zformer-hedgehog", "forward", short, shape)) == 2 * (quadratic - linear)
    # fastformer with a 5-tap input convolution: 2 B N D 5 per layer, nominal and executed
    for executed in (False, True):
        assert (benchmarks.classification_flops("fastformer-conv5", "forward", n, shape, executed=executed)
                - benchmarks.classification_flops("fastformer", "forward", n, shape, executed=executed)) == 2 * 2 * b * n * d * 5


def test_seq2seq_sweep_over_lengths(tmp_path):
    prefix = tmp_path / "sweep" / "seq2seq"
    load_script().main(["--level", "seq2seq", "--layers", "1", "--seq2seq_lengths", "4", "8", "--output", str(prefix)]
                       + TINY_MODEL)
    rows = read_csv(f"{prefix}.csv")
    assert {(r["model"], int(r["source_length"]), int(r["target_length"])) for r in rows} == {
        (m, n, n) for m in benchmarks.SEQ2SEQ_DEFAULT_MODELS for n in (4, 8)}
    ratios = ("train_speedup_vs_bart", "generate_speedup_vs_bart", "train_flops_ratio_vs_bart",
              "generate_flops_ratio_vs_bart")
    for row in rows:
        assert float(row["train_tokens_per_s"]) > 0 and float(row["sentences_per_s"]) > 0
        assert int(row["train_flops"]) > 0 and int(row["generate_flops"]) > 0
        assert all(float(row[key]) > 0 for key in ratios)
        if row["model"] in ("bart", "full"):  # the same nominal FLOPs
            assert float(row["train_flops_ratio_vs_bart"]) == float(row["generate_flops_ratio_vs_bart"]) == 1.0
    markdown = Path(f"{prefix}.md").read_text()
    assert markdown.count("| n | bart | full | zformer | fastformer |") == 2  # training and generation tables
    assert "| 4 | " in markdown and "| 8 | " in markdown
    assert Path(f"{prefix}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_classification_level_compares_with_bert(tmp_path):
    prefix = tmp_path / "classification"
    load_script().main(["--level", "classification", "--layers", "1", "--lengths", "8", "16", "--classification_models",
                        *benchmarks.CLASSIFICATION_MODELS, "--output", str(prefix)] + TINY_MODEL)
    rows = read_csv(f"{prefix}.csv")
    assert {(r["model"], r["kind"], int(r["length"])) for r in rows} == {
        (m, k, n) for m in benchmarks.CLASSIFICATION_MODELS for k in benchmarks.CLASSIFICATION_KINDS for n in (8, 16)}
    for row in rows:
        assert 0 < float(row["tokens_per_s"]) < float("inf") and float(row["time_ms"]) > 0
        for key in ("speedup_vs_bert", "flops_ratio_vs_bert", "executed_flops_ratio_vs_bert"):
            assert float(row[key]) > 0
        if row["model"] == "bert":
            assert float(row["speedup_vs_bert"]) == pytest.approx(1.0) and float(row["flops_ratio_vs_bert"]) == 1.0
    # BERT's architecture around our full attention: the same parameters, one for one; the hedgehog maps
    # add two d_h x d_h matrices and biases per head and layer to zformer (which has a scale per head)
    params = {r["model"]: int(r["parameters"]) for r in rows}
    assert params["full"] == params["bert"]
    assert params["zformer-hedgehog"] > params["zformer"]
    # one layer of width 16: the convolution, 5 taps per channel (no bias)
    assert params["fastformer-conv5"] - params["fastformer"] == 5 * 16
    markdown = Path(f"{prefix}.md").read_text()
    header = "| n | bert | full | zformer | zformer-hedgehog | xformer | fastformer | fastformer-conv5 |"
    assert markdown.count(header) == 2  # inference, training
    assert "BertForSequenceClassification" in markdown
    assert Path(f"{prefix}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, message", [
    (["--level", "classification", "--lengths", "0", "16"], "'0' is not a positive integer"),
    (["--level", "seq2seq", "--seq2seq_lengths", "8", "-4"], "'-4' is not a positive integer"),
    (["--level", "seq2seq", "--seq2seq_lengths", "8", "--source_length", "8"], "not both"),
    (["--level", "classification", "--seq2seq_lengths", "8"], "option of --level seq2seq"),
    (["--level", "classification", "--widths", "30", "--heads", "4"], "multiple of the number of heads"),
    (["--level", "classification", "--repeats", "0"], "'0' is not a positive integer"),
    (["--level", "classification", "--warmup", "-1"], "'-1' is not an integer >= 0"),
    (["--level", "classification", "--classification_models", "gpt2"], "invalid choice"),
    (["--cuda_graphs", "--device", "cpu"], "--cuda_graphs needs --level attention, module or model on a CUDA device"),
    (["--cuda_graphs", "--level", "seq2seq", "--device", "cuda"], "not --level seq2seq"),
    (["--compile", "default", "--level", "seq2seq"], "--compile needs --level attention, module or model"),
    (["--compile", "reduce-overhead", "--cuda_graphs", "--device", "cuda"], "not --level attention with --cuda_graphs"),
    (["--compile", "fast"], "invalid choice"),
])
def test_bad_arguments_give_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as error:
        load_script().parse_args(argv)
    assert error.value.code == 2
    assert message in capsys.readouterr().err


def test_compiled_modules_are_timed_and_labelled(monkeypatch):
    """--compile: each case's module under torch.compile (inductor), the kernels' operators inside it
    (`zformer_kernels`, through triton's interpreter here), called before its warm-up so that the
    timed calls run compiled code; the results and their table say so."""
    compiled = []
    monkeypatch.setattr(benchmarks.harness, "compile_module",
                        lambda module, mode, _compile=benchmarks.harness.compile_module: compiled.append(mode)
                        or _compile(module, mode))
    from hf_zformer.modeling import triton_ops

    kernels = "zformer_kernels" if triton_ops.RUNNABLE else "zformer"
    results = benchmarks.sweep(["full", kernels], [16], widths=[32], heads=[2], batch=2, modes=["train"],
                               repeats=1, measure_memory=False, progress=False, compiled="default")
    assert [(r.status, r.compiled) for r in results] == [("ok", "default")] * 2, [r.note for r in results]
    assert compiled == ["default", "default"] and results[1].speedup_vs_full > 0
    assert "torch.compile(mode='default')" in benchmarks.markdown_table(results)


def test_cuda_graphs_need_a_cuda_device():
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device, not cpu"):
        benchmarks.harness.capture_graph(lambda: None, torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("mode", ["forward", "train"])
def test_cuda_graph_replays_time_every_type(mode):
    types = ["full", "zformer", "fastformer", "fastformer_folded"]  # 64 tokens: the folded form under autocast
    results = benchmarks.sweep(types, [64], widths=[64], heads=[4], batch=2, modes=[mode], device="cuda", dtype="bf16",
                               repeats=2, measure_memory=False, progress=False, graphs=True)
    assert [(r.status, r.graphs) for r in results] == [("ok", True)] * len(types), [r.note for r in results]
    assert all(r.time_ms > 0 for r in results)


def test_classification_defaults():
    args = load_script().parse_args(["--level", "classification"])
    assert args.batch == 8 and args.lengths == [128, 256, 512, 1024, 2048, 4096]
    assert args.modes == ["forward", "train"] and "xformer" not in args.classification_models
    assert load_script().parse_args([]).batch == 4


def test_profile_script_prints_operator_tables(capsys):
    spec = importlib.util.spec_from_file_location("profile_models", SCRIPT.parent / "profile_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--models", "bart", "fastformer", "--batch", "2", "--source_length", "4", "--target_length", "3",
                 "--width", "16", "--layers", "1", "--heads", "2", "--ffn", "32", "--vocab", "40", "--steps", "1",
                 "--top", "3"])
    out = capsys.readouterr().out
    for name in ("bart", "fastformer"):
        for kind in ("train", "generate"):
            assert f"## {name} {kind}:" in out
    assert out.count("| operator | self ms / call | share | calls / call |") == 4
    calls = [int(line.split(", ")[-1].split()[0]) for line in out.splitlines() if line.startswith("per call:")]
    assert len(calls) == 4 and all(c > 0 for c in calls)
    with pytest.raises(SystemExit):
        module.parse_args(["--steps", "0"])


def test_linear_script_times_both_forms_and_marks_the_plain_cells(tmp_path, capsys, few_row_form):
    spec = importlib.util.spec_from_file_location("benchmark_linear", SCRIPT.parent / "benchmark_linear.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    output = tmp_path / "linear.md"
    module.main(["--shapes", "16x32", "32x16", "--rows", "1", "4", "5", "--repeats", "1", "--weights_mb", "0.01",
                 "--output", str(output)])  # no --threads: it would change the thread count of later tests
    table = output.read_text().splitlines()
    assert capsys.readouterr().out.startswith(table[0])
    rows = {line.split(" | ")[0]: line.split(" | ")[1:] for line in table if line.startswith(("| 16 x", "| 32 x"))}
    # the transposed form for 1-4 rows where in <= out; `=` where Linear itself runs the plain form
    assert [cell.endswith("=") or cell.endswith("= |") for cell in rows["| 16 x 32"]] == [False, False, True]
    assert all(cell.endswith("=") or cell.endswith("= |") for cell in rows["| 32 x 16"])
    for cells in rows.values():
        for cell in cells:
            plain, ours = (float(v) for v in cell.split(" (")[0].split(" / "))
            assert plain > 0 and ours > 0
    module.main(["--shapes", "32x16", "--rows", "5", "--repeats", "1", "--weights_mb", "0.01",
                 "--form", "transposed", "--output", str(output)])
    assert "transposed product in every cell" in output.read_text() and "=" not in output.read_text().splitlines()[-1]
    assert module.parse_args([]).shapes == [(512, 512), (512, 2048), (2048, 512), (512, 8000)]
    for bad in (["--shapes", "16x"], ["--rows", "0"], ["--repeats", "0"], ["--weights_mb", "0"]):
        with pytest.raises(SystemExit):
            module.parse_args(bad)


def test_cpu_allocator_retain_is_applied_and_recorded(tmp_path):
    """In a subprocess: mallopt is process-wide. Applied, the report says so; where it cannot apply
    (the user set a MALLOC_* variable, which wins) the script stops instead of timing something else."""
    import os
    import subprocess
    import sys

    prefix = tmp_path / "seq2seq"
    argv = [sys.executable, str(SCRIPT), "--level", "seq2seq", "--widths", "32", "--heads", "4", "--layers", "1",
            "--ffn", "64", "--vocab", "50", "--batch", "2", "--source_length", "6", "--target_length", "4",
            "--seq2seq_models", "bart", "zformer", "--repeats", "1", "--no_progress", "--no_plot",
            "--cpu_allocator", "retain", "--output", str(prefix)]
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    subprocess.run(argv, check=True, env=environment, capture_output=True)
    header = Path(f"{prefix}.md").read_text()
    assert "C allocator retains freed memory (--cpu_allocator retain)" in header
    assert json.loads(Path(f"{prefix}.json").read_text())["metadata"]["args"]["cpu_allocator"] == "retain"
    refused = subprocess.run(argv, env={**environment, "MALLOC_TRIM_THRESHOLD_": "0"}, capture_output=True, text=True)
    assert refused.returncode != 0 and "--cpu_allocator retain: not applied" in refused.stderr


def test_paired_ratio_interval_pairs_rounds():
    base = [10.0, 12.0, 30.0, 11.0, 10.5, 13.0]  # round 3 ran under load: both calls slow
    other = [5.0, 6.0, 15.0, 5.5, 5.25, 6.5]  # twice as fast in every round
    assert benchmarks.paired_ratio_interval(base, other) == (2.0, 2.0, 2.0)
    # the same times give the same interval (fixed seed), and the interval holds the median
    mixed = [9.0, 12.5, 29.0, 11.5, 10.0, 14.0]
    first = benchmarks.paired_ratio_interval(base, mixed)
    assert first == benchmarks.paired_ratio_interval(base, mixed)
    median, low, high = first
    assert low <= median <= high and low < high
    ratios = sorted(b / m for b, m in zip(base, mixed))
    assert median == pytest.approx((ratios[2] + ratios[3]) / 2)  # six rounds: the middle two


@pytest.mark.parametrize("base, other, confidence, message", [
    ([1.0, 2.0], [1.0], 0.95, "one call per round"),
    ([], [], 0.95, "empty"),
    ([1.0], [1.0], 1.5, "confidence must be between 0 and 1; got 1.5"),
    ([1.0, 0.0], [1.0, 1.0], 0.95, "positive"),
])
def test_paired_ratio_interval_refuses_bad_input(base, other, confidence, message):
    with pytest.raises(ValueError, match=message):
        benchmarks.paired_ratio_interval(base, other, confidence=confidence)


def test_seq2seq_report_shows_paired_ratios(tmp_path):
    def result(model, train, generate):
        return benchmarks.Seq2SeqResult(
            model=model, description=model, parameters=10, batch=1, source_length=4, target_length=4, width=8,
            layers=1, heads=2, ffn=16, vocab=20, dtype="fp32", device="cpu", train_step_ms=train[0],
            train_tokens_per_s=1.0, generate_ms=generate[0], sentences_per_s=1.0, train_flops=1, generate_flops=1,
            train_times_ms=train, generate_times_ms=generate)
    rounds = [10.0, 11.0, 30.0, 10.5, 12.0]
    bart = result("bart", rounds, [2 * t for t in rounds])
    ours = result("zformer", [t / 1.25 for t in rounds], [2 * t / 0.8 for t in rounds])
    text = benchmarks.seq2seq_markdown([bart, ours])
    assert "Paired per round (5 rounds)" in text
    assert "| zformer | 1.250x [1.250, 1.250] | 0.800x [0.800, 0.800] |" in text
    # too few rounds for an interval: no paired table
    short = [result("bart", rounds[:2], rounds[:2]), result("zformer", rounds[:2], rounds[:2])]
    assert "Paired" not in benchmarks.seq2seq_markdown(short)


def test_executed_flops_follow_the_form_each_precision_runs():
    """fp32 folds zformer at N > D; under bf16 autocast it folds on CPUs only (and as `<type>_folded` everywhere)."""
    def executed(attention_type, device, dtype="bf16"):
        case = benchmarks.BenchCase("attention", attention_type, "forward", 2, 1024, 512, 8, dtype, device, False)
        return benchmarks.case_flops(case)[1]

    b, n, d = 2, 1024, 512
    folded = 4 * b * n * d * d + 2 * b * d * (d + 1) ** 2 + 4 * b * d * (d + 1) * (d // 8)
    plain = 6 * b * n * d * d + 4 * b * n * d * (d // 8)
    assert executed("zformer", "cuda", "fp32") == executed("zformer", "cpu", "fp32") == folded
    assert executed("zformer", "cuda") == executed("zformer_kernels", "cuda") == executed("zformer_plain", "cpu") == plain
    assert executed("zformer_folded", "cuda") == executed("zformer", "cpu") == folded  # CPUs fold under autocast
    assert executed("zformer_plain", "cpu", "fp32") == folded  # the suffixes only speak of autocast
    assert benchmarks.cases.attention_of("fastformer_kernels") == "fastformer"
    assert benchmarks.cases.kernel_backend_of("fastformer_kernels") == "triton"
    # fastformer_folded: the folded form under bf16 autocast too: 2 scores and 2 poolings, the map, its product
    assert benchmarks.cases.attention_of("fastformer_folded") == "fastformer"
    assert benchmarks.cases.kernel_backend_of("fastformer_folded") == "auto"
    fastformer_folded = 8 * b * 8 * n * d + 2 * b * d**3 + 2 * b * n * d * d
    assert executed("fastformer_folded", "cuda") == executed("fastformer", "cpu", "fp32") == fastformer_folded
    # the class's default: the folded form under CPU autocast, the plain form under CUDA's
    assert executed("fastformer", "cpu") == fastformer_folded
    assert executed("fastformer", "cuda") == executed("fastformer_plain", "cpu") == (
        benchmarks.attention_flops("fastformer", b, n, d, 8))
    assert benchmarks.cases.folds_under_autocast("fastformer_plain", "cpu") is False


def test_fastformer_gpu_ab_checks_its_variants_and_times_them(capsys):
    """The A/B script of fastformer's GPU remedies, dry-run on the CPU (48 tokens >= width 32: the
    pooled context runs): every variant gives the older form's output (the script stops otherwise)
    and gets a time, SDPA's module beside them."""
    spec = importlib.util.spec_from_file_location(
        "fastformer_gpu", Path(__file__).resolve().parents[1] / "docs" / "bench" / "ab" / "fastformer_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--batch", "2", "--width", "32", "--heads", "4", "--lengths", "48", "--rounds", "1"])
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith("| 48 |")]
    assert [row.split(" | ")[1] for row in rows] == ["forward", "train"]
    assert all(row.count("x)") == 2 + len(module.VARIANTS) for row in rows)
    errors = [line for line in lines if line.startswith("bf16 error against fp32 at n=48")]
    assert len(errors) == 1
    values = {item.split()[0]: float(item.split()[1]) for item in errors[0].split(": ", 1)[1].split(", ")}
    assert set(values) == set(module.VARIANTS) and all(0 < value < 0.02 for value in values.values())
