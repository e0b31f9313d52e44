"""scripts/run_clm.py, the causal language-model script: documents grouped into blocks, exact resume,
perplexity = exp(validation loss), result records, --save_best keeping the lowest perplexity, and a
saved folder that loads with AutoModelForCausalLM and pipeline("text-generation"); the library
pieces it uses (load_text_dataset, group_into_blocks, perplexity_ci). Tiny runs on generated text."""

import json
import math
import random

import pytest
from conftest import SHARED_DATA, run_isolated
from test_scripts import _strict_json, load_script, run_script

TINY_LM = "hidden_size=32,num_hidden_layers=2,num_attention_heads=2,intermediate_size=64"


@pytest.fixture(scope="module")
def lm_data(tmp_path_factory):
    """120 short reviews of 30 movies (``text``, ``movie``) in train.jsonl, and the same as .txt."""
    root = tmp_path_factory.mktemp("lm")
    rng = random.Random(0)
    words = "the a movie film plot actor scene story music ending was good bad long".split()
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 25))) for _ in range(120)]
    with open(root / "train.jsonl", "w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"text": text, "id": f"unsup_{i}", "movie": f"tt{i % 30}"}) + "\n")
    (root / "train.txt").write_text("\n".join(texts) + "\n\n")
    return root


def _common(lm_data, *extra):
    return ["--train_file", lm_data / "train.jsonl", "--config_overrides", f"{TINY_LM},attention_type=zformer|full",
            "--attention_type", "zformer", "--vocab_size", 60, "--block_size", 16, "--per_device_train_batch_size", 8,
            "--per_device_eval_batch_size", 16, "--validation_split_percentage", 10, *extra]


@pytest.fixture(scope="module")
def lm_run(lm_data, tmp_path_factory):
    """Uninterrupted run of 8 steps with a checkpoint at step 4, validation every 4 steps, the best
    model kept, records written."""
    out = tmp_path_factory.mktemp("lm-run") / "out"
    results_file = out.parent / "results.json"
    run_script("run_clm.py", *_common(lm_data, "--max_train_steps", 8, "--checkpointing_steps", 4, "--eval_steps", 4,
                                      "--save_best", "--results_file", results_file, "--output_dir", out))
    return out, results_file


def assert_resume_matches(script, common, out, tmp_path):
    """``script`` resumed from ``out``'s step-4 checkpoint of an 8-step run ends where ``out`` did."""
    from safetensors.torch import load_file

    run_script(script, *common("--max_train_steps", 8, "--eval_steps", 4, "--save_best",
                               "--resume_from_checkpoint", out / "step_4", "--output_dir", tmp_path / "b"))
    a, b = load_file(out / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    results_a, results_b = _strict_json(out / "all_results.json"), _strict_json(tmp_path / "b" / "all_results.json")
    assert results_b["eval_perplexity"] == results_a["eval_perplexity"]
    assert results_b["train_loss"] == pytest.approx(results_a["train_loss"], rel=1e-6)


def test_clm_resume_matches_uninterrupted_run(lm_run, lm_data, tmp_path):
    assert_resume_matches("run_clm.py", lambda *extra: _common(lm_data, *extra), lm_run[0], tmp_path)


def test_clm_perplexity_history_and_best(lm_run):
    out, _ = lm_run
    results = _strict_json(out / "all_results.json")
    assert math.isfinite(results["eval_perplexity"]) and results["eval_perplexity"] > 1
    assert results["eval_perplexity"] == pytest.approx(math.exp(results["eval_loss"]), rel=1e-12)
    assert results["train_steps"] == 8 and results["block_size"] == 16 and results["eval_tokens"] > 0
    history = [json.loads(line) for line in (out / "eval_history.jsonl").read_text().splitlines()]
    assert [r["step"] for r in history] == [4, 8]
    best = min(history, key=lambda r: r["perplexity"])  # lower perplexity is better
    assert results["best_step"] == best["step"] and results["eval_perplexity"] == best["perplexity"]
    assert json.loads((out / "best" / "best_state.json").read_text())["greater_is_better"] is False


def test_clm_results_records_and_card(lm_run, lm_data):
    out, results_file = lm_run
    (record,) = json.loads(results_file.read_text())
    assert record["metric"] == "perplexity" and record["split"] == "validation" and record["task"] == f"{lm_data.name}-train"
    assert record["attention"] == "zformer|full" and record["max_length"] == 16 and record["beams"] is None
    assert isinstance(record["train_examples"], int) and record["train_examples"] > 0  # blocks of 16 tokens
    assert record["value"] == _strict_json(out / "all_results.json")["eval_perplexity"]
    low, high = record["ci95"]
    assert low <= record["value"] <= high and record["samples"] > 0
    card = (out / "README.md").read_text()
    assert "pipeline_tag: text-generation" in card and "type: perplexity" in card and "2 decoder layers" in card


def test_clm_saved_folder_generates(lm_run, tmp_path):
    """The folder loads with AutoModelForCausalLM and pipeline("text-generation") in a clean
    process (no hf_zformer: the model code ships with it), and generates."""
    out, _ = lm_run
    code = f"""
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
model = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained({str(out)!r})
assert type(model).__name__ == "ZformerForCausalLM", type(model)
ids = tokenizer(["the movie was"], add_special_tokens=False, return_tensors="pt").input_ids
generated = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False)
assert generated.shape[1] == ids.shape[1] + 5, generated.shape
generate = pipeline("text-generation", model={str(out)!r}, tokenizer=tokenizer, trust_remote_code=True)
text = generate("the movie was", max_new_tokens=5, do_sample=False)[0]["generated_text"]
assert text.startswith("the movie was"), text
print("OK")
"""
    assert run_isolated(code, cwd=tmp_path).stdout.strip().endswith("OK")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--train_file", "{data}/train.jsonl", "--data_dir", "{data}", "--attention_type", "full"], "exclusive"),
        (["--attention_type", "full"], "--train_file (local file)"),
        (["--train_file", "{data}/nope.jsonl", "--attention_type", "full"], "is not a file"),
        (["--train_file", "{data}/train.jsonl", "--attention_type", "xformer"], "has no causal form"),
        (["--train_file", "{data}/train.jsonl", "--attention_type", "full", "--config_overrides",
          "attention_type=full|xformer"], "'xformer' has no causal form"),
        (["--train_file", "{data}/train.jsonl", "--attention_type", "full", "--block_size", "1"], "--block_size"),
        (["--train_file", "{data}/train.jsonl", "--attention_type", "full", "--validation_split_percentage", "0"],
         "--validation_split_percentage"),
        (["--data_dir", "{data}", "--attention_type", "full", "--validation_file", "{data}/train.txt"],
         "--validation_file goes with --train_file"),
    ],
)
def test_clm_bad_arguments_fail_before_training(extra, message, lm_data, tmp_path, capsys):
    argv = [a.format(data=lm_data) for a in extra] + ["--output_dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as error:
        load_script("run_clm.py").parse_args(argv)
    assert error.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_clm_too_little_text_fails_before_training(lm_data, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:  # a data problem: one error line, exit code 2 (as a bad argument)
        load_script("run_clm.py").main([str(a) for a in _common(lm_data, "--block_size", 4096, "--config_overrides",
                                                                 f"{TINY_LM},max_position_embeddings=4096")]
                                       + ["--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "error: " in err and "fewer tokens than one --block_size block" in err, err
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_load_text_dataset_files_and_grouped_carve(lm_data):
    from hf_zformer.data import load_text_dataset

    jsonl = load_text_dataset(lm_data / "train.jsonl", validation_size=0.2, seed=1, group_column="movie")
    assert jsonl["train"].column_names == ["text"] and len(jsonl["train"]) + len(jsonl["validation"]) == 120
    movies = {json.loads(line)["text"]: json.loads(line)["movie"] for line in (lm_data / "train.jsonl").open()}
    sides = [{movies[t] for t in jsonl[split]["text"]} for split in ("train", "validation")]
    assert not sides[0] & sides[1]  # no movie on both sides
    again = load_text_dataset(lm_data / "train.jsonl", validation_size=0.2, seed=1, group_column="movie")
    assert again["validation"]["text"] == jsonl["validation"]["text"]  # deterministic
    txt = load_text_dataset(lm_data / "train.txt", validation_size=10, seed=1)  # one per line, empty dropped
    assert len(txt["train"]) == 110 and len(txt["validation"]) == 10
    with pytest.raises(ValueError, match="no text column 'body'|missing column"):
        load_text_dataset(lm_data / "train.jsonl", text_column="body")


def test_group_into_blocks():
    from hf_zformer.training.batching import block_collate, group_into_blocks

    blocks = group_into_blocks([[5, 6, 7], [8], [9, 10, 11, 12]], 3, eos_token_id=2)
    assert blocks.tolist() == [[5, 6, 7], [2, 8, 2], [9, 10, 11]]  # the remainder [12, 2] is dropped
    assert group_into_blocks([[5]], 3, 2).shape == (0, 3)
    batch = block_collate([{"input_ids": b} for b in blocks.tolist()])
    assert batch["input_ids"].shape == (3, 3) and (batch["labels"] == batch["input_ids"]).all()


def test_perplexity_interval():
    from hf_zformer.training.results import perplexity_ci

    low, high = perplexity_ci([1.0, 2.0, 3.0, 2.5], seed=0)
    assert math.exp(1.0) <= low <= math.exp(2.125) <= high <= math.exp(3.0)


@pytest.mark.slow
def test_imdb_unsup_carve():
    """The offline data of the README command: 5% of unsup.jsonl.gz held out, whole movies."""
    from hf_zformer.data import load_text_dataset

    data = load_text_dataset(SHARED_DATA / "imdb" / "unsup.jsonl.gz", validation_size=0.05, group_column="movie")
    assert len(data["train"]) + len(data["validation"]) == 50_000
    assert 2400 <= len(data["validation"]) <= 2500


def test_loss_by_position(lm_run, lm_data, tmp_path, capsys):
    """scripts/loss_by_position.py: run_clm.py's validation documents, each read from its first
    token; per-bucket mean losses that match a direct computation, the same for the same model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = lm_run
    script = load_script("loss_by_position.py")
    common = ["--train_file", str(lm_data / "train.jsonl"), "--validation_split_percentage", "10",
              "--max_length", "12", "--bucket_starts", "1", "4", "8", "--batch_size", "3"]
    table = script.main(["--model_name_or_path", str(out), str(out), "--labels", "a,b", *common,
                         "--output", str(tmp_path / "lbp.json")])
    assert table["buckets"] == ["1-3", "4-7", "8-11"]
    assert table["models"]["a"]["mean_loss"] == table["models"]["b"]["mean_loss"]
    assert json.loads((tmp_path / "lbp.json").read_text()) == table and "| 1-3 |" in capsys.readouterr().out

    texts = script.validation_documents(script.parse_args(["--model_name_or_path", str(out), *common]))
    assert len(texts) == table["documents"] > 0
    tokenizer, model = AutoTokenizer.from_pretrained(out), AutoModelForCausalLM.from_pretrained(out).eval()
    sums, counts = torch.zeros(12, dtype=torch.float64), torch.zeros(12, dtype=torch.float64)
    for text in texts:  # one document at a time, no padding
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"][:12]])
        if ids.shape[1] < 2:
            continue
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        losses = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="none").double()
        sums[1 : ids.shape[1]] += losses
        counts[1 : ids.shape[1]] += 1
    expected = [float(sums[a:b].sum() / counts[a:b].sum()) for a, b in [(1, 4), (4, 8), (8, 12)]]
    assert table["models"]["a"]["mean_loss"] == pytest.approx(expected, rel=1e-5)
    assert table["models"]["a"]["tokens"] == [int(counts[a:b].sum()) for a, b in [(1, 4), (4, 8), (8, 12)]]

    with pytest.raises(SystemExit):
        script.parse_args(["--model_name_or_path", str(out), *common, "--bucket_starts", "4", "2"])  # not increasing
