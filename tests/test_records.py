"""Result records carry the whole recipe, and the README's results table traces to them.

- `config_summary` records every config entry that differs from its default (feature map,
  convolutions, dropout, ...), not a fixed list of options;
- a record written by `evaluate_model.py` for a folder a training run wrote carries that run's
  recipe (base model and distillation of the folder it started from, teacher, mixed precision,
  seed, learning rate), read from the folder's `training_args.json` and `all_results.json`;
- every number of README.md's "Results at a glance" table is a record's value in docs/results.json
  (or, for a row that says so, the mean of one record per seed), with the options its footnote names.
"""

import argparse
import itertools
import json
import re

import pytest
from conftest import REPO_ROOT

from hf_zformer import ZformerConfig
from hf_zformer.training import results as records


def test_config_summary_records_every_option_that_differs_from_the_default():
    config = ZformerConfig(attention_type="zformer", zformer_feature_map="hedgehog", encoder_conv_size=5,
                           hidden_dropout_prob=0.3, num_labels=2, id2label={0: "neg", 1: "pos"})
    summary = records.config_summary(config)
    assert summary["zformer_feature_map"] == "hedgehog" and summary["encoder_conv_size"] == 5
    assert summary["hidden_dropout_prob"] == 0.3 and summary["hidden_size"] == config.hidden_size
    assert not {"id2label", "label2id", "architectures", "transformers_version"} & set(summary)
    plain = records.config_summary(ZformerConfig())
    assert "zformer_feature_map" not in plain and "encoder_conv_size" not in plain
    assert "decoder_attention_type" not in plain  # decoder entries for encoder-decoder models only
    assert records.config_summary(ZformerConfig(is_encoder_decoder=True))["decoder_attention_type"] == "full"


def _card(folder, metadata: str):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "README.md").write_text(f"---\n{metadata}---\n# a model\n")


def test_evaluation_of_a_run_folder_records_the_run_recipe(tmp_path):
    """`runs/kd/best` scored later: the record names what `runs/kd` was trained from and how."""
    converted = tmp_path / "converted"
    _card(converted, "base_model: runs/teacher\ndistillation:\n  steps: 400\n  model_steps: 200\n")
    run = tmp_path / "kd"
    (run / "best").mkdir(parents=True)
    training = argparse.Namespace(
        model_name_or_path=str(converted), teacher_model_name_or_path="runs/teacher", distill_alpha=0.5,
        distill_temperature=2.0, unlabeled_file="unsup.jsonl.gz", max_unlabeled_samples=None, seed=7,
        learning_rate=1e-4, output_dir=str(run), hub_token="secret",
    )
    stored = json.loads(records.save_training_args(training).read_text())
    assert stored["teacher_model_name_or_path"] == "runs/teacher" and "hub_token" not in stored
    (run / "all_results.json").write_text(json.dumps(
        {"epoch": 2.0, "train_steps": 100, "best_step": 80, "mixed_precision": "bf16", "unlabeled_examples": 500}))
    config = ZformerConfig(attention_type="zformer", zformer_feature_map="hedgehog")
    args = argparse.Namespace(model_name_or_path=str(run / "best"), data_dir=str(tmp_path / "imdb"), split_seed=42)
    record = records.evaluation_fields(args, config)
    assert record["base_model"] == "runs/teacher" and record["distillation"] == {"steps": 400, "model_steps": 200}
    assert record["teacher"] == {"model": "runs/teacher", "alpha": 0.5, "temperature": 2.0,
                                 "unlabeled_examples": 500, "unlabeled_file": "unsup.jsonl.gz"}
    assert record["mixed_precision"] == "bf16" and record["seed"] == 7 and record["learning_rate"] == 1e-4
    assert (record["epochs"], record["train_steps"], record["best_step"]) == (2.0, 100, 80)
    assert record["output_dir"] == str(run) and record["model_name_or_path"] == str(run / "best")
    assert record["config"]["zformer_feature_map"] == "hedgehog" and record["task"] == "imdb"


def test_evaluation_of_a_converted_folder_or_a_model_trained_from_scratch(tmp_path):
    converted = tmp_path / "converted"
    _card(converted, "base_model: org/bert\ndistillation:\n  steps: 5\n")
    args = argparse.Namespace(model_name_or_path=str(converted), dataset_name="stanfordnlp/imdb", split_seed=42)
    record = records.evaluation_fields(args, ZformerConfig())
    assert record["base_model"] == "org/bert" and record["distillation"] == {"steps": 5}
    assert record["teacher"] is None and record["mixed_precision"] is None and record["output_dir"] is None
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    records.save_training_args(argparse.Namespace(model_name_or_path=None, seed=1, learning_rate=1e-3,
                                                  output_dir=str(scratch)))
    (scratch / "all_results.json").write_text(json.dumps({"mixed_precision": "no"}))
    record = records.evaluation_fields(argparse.Namespace(model_name_or_path=str(scratch), dataset_name="imdb"),
                                       ZformerConfig())
    assert record["base_model"] is None and record["distillation"] is None and record["teacher"] is None
    assert record["mixed_precision"] == "no" and record["seed"] == 1


# ---- README's results table against docs/results.json

# row label -> (what a record of the row is, how many seeds a cell averages)
ROWS = {
    "Multi30K De→En, test2016 BLEU, 4 beams, mean of 3 seeds":
        (lambda r: r["task"] == "multi30k" and r["split"] == "test2016" and r["metric"] == "bleu" and r["beams"] == 4, 3),
    "IMDB from scratch, accuracy % on the official test split":
        (lambda r: r["task"] == "imdb" and r["split"] == "test" and r["base_model"] is None, 1),
    "IMDB warm-started from all-MiniLM-L6-v2, accuracy % on the official test split":
        (lambda r: r["task"] == "imdb" and r["split"] == "test" and r["base_model"] is not None, 1),
    "Causal LM on IMDB reviews, perplexity (validation, lower is better)":
        (lambda r: r["task"] == "imdb-unsup" and r["split"] == "validation" and r["metric"] == "perplexity", 1),
}


def _conv5(r):
    return r["config"].get("encoder_conv_size") == 5


def _plain(r):
    return not r["config"].get("encoder_conv_size") and not r["config"].get("zformer_feature_map")


# footnote -> what its records must be; a cell without a footnote is the plain model
ONE_SEED = {"¹"}  # "one seed": a single record even in a row of means
FOOTNOTES = {
    "¹": lambda r: r["decoder_attention"] == "full" and _plain(r),
    "²": _conv5,
    "³": lambda r: r["config"].get("zformer_feature_map") == "hedgehog" and bool(r.get("teacher"))
    and r.get("mixed_precision") == "bf16",
    "⁴": lambda r: _conv5(r) and bool(r.get("teacher")),
    "⁵": lambda r: r["config"].get("zformer_feature_map") == "hedgehog" and r["config"].get("attention_window") == 64,
    "⁶": lambda r: r["config"].get("decoder_conv_size") == 4,
}


def _results_table():
    lines = (REPO_ROOT / "README.md").read_text().splitlines()
    start = next(i for i in range(lines.index("## Results at a glance"), len(lines)) if lines[i].startswith("| "))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in itertools.takewhile(lambda x: x.startswith("|"), lines[start + 2:]):
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows.append((cells[0], dict(zip(header[1:], cells[1:]))))
    return rows


def _traces(cell: str, attention: str, row_filter, seeds: int, all_records) -> bool:
    match = re.fullmatch(r"(\d+(?:\.(\d+))?)\s*([¹²³⁴⁵⁶]?)", cell)
    assert match, f"unreadable cell {cell!r}"
    number, decimals, note = float(match.group(1)), len(match.group(2) or ""), match.group(3)
    kind = FOOTNOTES[note] if note else _plain
    candidates = [r for r in all_records if row_filter(r) and r["attention"] == attention and kind(r)
                  and (note == "¹" or r["decoder_attention"] in (None, attention))]
    if seeds == 1 or note in ONE_SEED:
        return any(round(r["value"], decimals) == number for r in candidates)
    groups = {}  # one recipe: the same model and training length
    for r in candidates:
        groups.setdefault((json.dumps(r["config"], sort_keys=True), r.get("epochs")), []).append(r)
    for group in groups.values():
        for chosen in itertools.combinations(group, seeds):
            if len({r.get("seed") for r in chosen}) == seeds and \
                    round(sum(r["value"] for r in chosen) / seeds, decimals) == number:
                return True
    return False


def test_every_number_of_the_readme_results_table_has_its_record():
    all_records = json.loads((REPO_ROOT / "docs" / "results.json").read_text())
    rows = _results_table()
    assert [label for label, _ in rows] == list(ROWS), "a README results row without a rule in this test"
    missing = []
    for label, cells in rows:
        row_filter, seeds = ROWS[label]
        for attention, cell in cells.items():
            if cell in ("—", "n/a"):
                continue
            if not _traces(cell, attention, row_filter, seeds, all_records):
                missing.append(f"{label} / {attention}: {cell}")
    assert not missing, "README results without a record in docs/results.json:\n" + "\n".join(missing)


def test_the_trace_fails_for_a_number_without_record():
    all_records = json.loads((REPO_ROOT / "docs" / "results.json").read_text())
    row_filter, _ = ROWS["IMDB from scratch, accuracy % on the official test split"]
    assert _traces("88.15", "zformer", row_filter, 1, all_records)
    assert not _traces("88.16", "zformer", row_filter, 1, all_records)
    assert not _traces("88.15 ²", "zformer", row_filter, 1, all_records)  # no such record with the convolution
    bleu, seeds = ROWS["Multi30K De→En, test2016 BLEU, 4 beams, mean of 3 seeds"]
    assert _traces("41.05", "full", bleu, seeds, all_records) and not _traces("41.06", "full", bleu, seeds, all_records)
