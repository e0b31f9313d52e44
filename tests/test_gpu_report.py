"""`scripts/gpu_report.py`: a GPU check's folder read against the fused kernels' bars, on made-up
results whose answers are known: speed-ups at the acceptance shape only, folded forms compared
only where they are taken, decoding by context with prefixes, training rates, and the bundle."""

import json
import subprocess
import sys

from conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "gpu_report.py"


def _row(attention_type, mode, length, time_ms, batch=40, width=512, executed=None):
    return {"attention_type": attention_type, "mode": mode, "length": length, "batch": batch, "width": width,
            "heads": 8, "dtype": "bf16", "status": "ok", "time_ms": time_ms,
            "executed_flops": executed if executed is not None else 100}


def _grid(rows):
    """The grid's JSON, each row's speed-up over `full` of the same shape set as the benchmark does."""
    def shape(row):
        return tuple(row[key] for key in ("mode", "length", "batch", "width", "heads", "dtype"))

    full = {shape(r): r["time_ms"] for r in rows if r["attention_type"] == "full" and r["status"] == "ok"}
    rows = [{**r, "speedup_vs_full": full[shape(r)] / r["time_ms"] if shape(r) in full else None} for r in rows]
    return {"metadata": {"commit": "0123456789abcdef", "gpu": "NVIDIA H200", "date": "2026-11-29"}, "results": rows}


def _acceptance_grid():
    rows = []
    for mode, length, full in (("forward", 512, 1.0), ("forward", 2048, 4.0), ("train", 2048, 9.0)):
        rows.append(_row("full", mode, length, full))
        rows.append(_row("zformer", mode, length, full / 2.5))  # 2.5x: every bar met
        rows.append(_row("fastformer", mode, length, full / (0.8 if length == 512 else 2.2)))  # misses 512 only
        # the folded form: taken at 2,048 only (its executed FLOPs differ there), faster there
        rows.append(_row("fastformer_folded", mode, length, full / (0.8 if length == 512 else 2.5),
                         executed=50 if length == 2048 else 100))
    rows.append(_row("fastformer", "forward", 1024, 0.1, batch=8))  # another shape: not a bar
    rows.append({**_row("zformer", "forward", 4096, 1.0), "status": "failed"})
    return rows


def _run(folder, *args):
    return subprocess.run([sys.executable, str(SCRIPT), str(folder), *args], capture_output=True, text=True,
                          timeout=60)


def test_bars_folded_forms_decoding_and_training_read_from_a_check(tmp_path):
    (tmp_path / "attention_grid_bf16_graphs.json").write_text(json.dumps(_grid(_acceptance_grid())))
    module_rows = [r for r in _acceptance_grid() if r["attention_type"] != "fastformer_folded"]
    module_rows.append(_row("fastformer_folded", "forward", 2048, 4.0 / 2.0, executed=50))  # slower than plain
    (tmp_path / "module_grid_bf16_graphs.json").write_text(json.dumps(_grid(module_rows)))
    (tmp_path / "decoding.json").write_text(json.dumps({"settings": {"prefill": 0}, "rows": [
        {"length": 512, "full": 40.0, "zformer": 0.8, "fastformer": 0.9},
        {"length": 1024, "full": 44.0, "zformer": 0.8, "fastformer": 1.5}]}))
    (tmp_path / "decoding_prefill_4096.json").write_text(json.dumps({"settings": {"prefill": 4096}, "rows": [
        {"length": 64, "full": 46.0, "zformer": 0.82, "fastformer": 0.9}]}))
    (tmp_path / "training_records.json").write_text(json.dumps([
        {"task": "imdb", "attention": "full", "tokens_per_s": 1000.0},
        {"task": "imdb", "attention": "zformer", "tokens_per_s": 1500.0},
        {"task": "imdb", "attention": "fastformer", "tokens_per_s": None}]))

    result = _run(tmp_path, "--bundle", str(tmp_path / "out" / "bundle.json"))
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "acceptance.json").read_text())
    bars = {(b["type"], b["mode"], b["length"]): b for b in summary["bars"]["attention_grid_bf16_graphs"]}
    assert bars[("zformer", "forward", 2048)]["speedup"] == 2.5 and all(
        b["meets"] for key, b in bars.items() if key[0] == "zformer")
    assert bars[("fastformer", "forward", 512)]["meets"] is False and bars[("fastformer", "train", 2048)]["meets"]
    assert {key[0] for key in bars} == {"zformer", "fastformer", "fastformer_folded"}
    # folded against plain only at 2,048 tokens: faster in the attention grid, slower among modules
    compared = summary["folded"]["comparisons"]
    assert {(c["mode"], c["length"]) for c in compared["attention_grid_bf16_graphs"]} == {
        ("forward", 2048), ("train", 2048)}
    assert summary["folded"]["verdicts"] == {"zformer": "not measured", "fastformer": "mixed: keep the plain form"}
    # decoding: contexts after the prefix; fastformer's 1.5 ms against 0.9 is not flat
    assert summary["decoding"]["zformer"]["flat"] and summary["decoding"]["zformer"]["beats_full_from"]
    assert not summary["decoding"]["fastformer"]["flat"]
    text = (tmp_path / "acceptance.md").read_text()
    assert "| 4,160 | 46.000 | 0.820 (56.1x) | 0.900 (51.1x) |" in text
    assert "| zformer | 2.50x meets | 2.50x meets | 2.50x meets | yes |" in text
    assert "| fastformer | 0.80x misses | 2.20x meets | 2.20x meets | no |" in text
    assert "Commit `0123456`, NVIDIA H200, 2026-11-29" in text
    assert summary["training"] == [{"task": "imdb", "attention": "full", "tokens_per_s": 1000.0, "vs_full": 1.0},
                                   {"task": "imdb", "attention": "zformer", "tokens_per_s": 1500.0, "vs_full": 1.5}]
    bundle = json.loads((tmp_path / "out" / "bundle.json").read_text())
    assert bundle["commit"] == "0123456789abcdef" and bundle["device"] == "NVIDIA H200"
    assert set(bundle["runs"]) == {"attention_grid_bf16_graphs", "module_grid_bf16_graphs", "decoding",
                                   "decoding_prefill_4096", "training_records"}


def test_a_folded_form_faster_wherever_taken_is_the_one_to_ship(tmp_path):
    rows = [_row("full", "forward", 2048, 4.0), _row("zformer", "forward", 2048, 2.0),
            _row("zformer_folded", "forward", 2048, 1.0, executed=50)]
    (tmp_path / "attention_grid_bf16_graphs.json").write_text(json.dumps(_grid(rows)))
    assert _run(tmp_path).returncode == 0
    summary = json.loads((tmp_path / "acceptance.json").read_text())
    assert summary["folded"]["verdicts"]["zformer"].startswith('faster wherever it is taken: add "cuda"')


def test_an_empty_or_half_written_check_still_reports(tmp_path):
    """After the first steps, or with a grid cut off mid-write: every section says what is missing."""
    (tmp_path / "attention_grid_bf16_graphs.json").write_text('{"metadata": {"commit": "ab')
    result = _run(tmp_path)
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "acceptance.md").read_text()
    assert text.count("Not run.") == 2 and "Commit `unknown`" in text
    assert _run(tmp_path / "missing").returncode == 2


def test_a_bundle_is_written_over_but_no_other_file(tmp_path):
    check, mine = tmp_path / "check", tmp_path / "mine.json"
    check.mkdir()
    mine.write_text("[1, 2]")
    result = _run(check, "--bundle", str(mine))
    assert result.returncode == 2 and "mine.json" in result.stderr and mine.read_text() == "[1, 2]"
    bundle = tmp_path / "bundle.json"
    for _ in range(2):  # a bundle of an earlier run of the report is replaced
        assert _run(check, "--bundle", str(bundle)).returncode == 0
    assert json.loads(bundle.read_text())["written_by"] == "scripts/gpu_check.sh"


def _ab(rows, graphs=True):
    return {"metadata": {"commit": "0123456789abcdef", "device": "cuda"}, "baseline": "shipped",
            "settings": {"batch": 40, "width": 512, "graphs": graphs}, "rows": rows, "bf16_errors": []}


def test_the_fused_product_ships_where_the_ab_finds_it_faster_everywhere(tmp_path):
    """The A/B's medians as speed against the shipped form; a fused-product plan faster at every
    length and mode is the one to take, one slower anywhere is not; a CPU's A/B decides nothing."""
    rows = [{"length": length, "mode": mode,
             "ms": {"shipped": 1.0, "fused_product": 0.9, "fused_product_n64": 0.8 if mode == "forward" else 1.2,
                    "folded": 2.0}}
            for length in (512, 2048) for mode in ("forward", "train")]
    (tmp_path / "ab_fastformer.json").write_text(json.dumps(_ab(rows)))
    assert _run(tmp_path).returncode == 0
    summary = json.loads((tmp_path / "acceptance.json").read_text())
    verdicts = summary["variants"]["verdicts"]
    assert verdicts["fused_product"] == 'faster wherever it was timed: add "cuda" to the policy\'s fused_product'
    assert verdicts["fused_product_n64"].startswith("mixed: keep")
    first = summary["variants"]["rows"][0]
    assert first["faster"]["folded"] == 0.5 and abs(first["faster"]["fused_product"] - 1 / 0.9) < 1e-12
    text = (tmp_path / "acceptance.md").read_text()
    assert "| 2,048 | train | 1.00 | 1.11 | 0.83 | 0.50 |" in text and "CUDA-graph replays" in text
    (tmp_path / "ab_fastformer.json").write_text(json.dumps(_ab(rows, graphs=False)))
    assert _run(tmp_path).returncode == 0
    summary = json.loads((tmp_path / "acceptance.json").read_text())
    assert set(summary["variants"]["verdicts"].values()) == {"not timed on a GPU (the kernel runs on CUDA only)"}
