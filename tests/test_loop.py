"""The training loop the long runs need: validation every --eval_steps with an evaluation history,
the best checkpoint (--save_best) restored at the end and kept across resume, test scoring of the
best model, the --results_file records (hf_zformer.training.results), scripts/plot_curves.py, and the
validation split carved grouped by movie with its own --split_seed.

Tiny end-to-end runs reuse the helpers and data of test_scripts.py."""

import collections
import os
import subprocess
import sys
import json
import random
import shutil

import pytest
from conftest import SHARED_DATA
from test_scripts import TINY_CLF, TINY_MT, load_script, run_script, tiny_data  # noqa: F401  (fixture)

RECORD_FIELDS = {"task", "attention", "decoder_attention", "split", "metric", "value", "beams", "epochs", "seed", "ci95",
                 "commit", "base_model", "distillation", "max_length", "split_seed", "config", "best_step", "wall_time_s",
                 "tokens_per_s", "date", "machine", "mixed_precision"}


def _history(out):
    return [json.loads(line) for line in (out / "eval_history.jsonl").read_text().splitlines()]


def _same_weights(a, b):
    from safetensors.torch import load_file

    first, second = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return first.keys() == second.keys() and all((first[k] == second[k]).all() for k in first)


@pytest.fixture(scope="module")
def mt_best_run(tiny_data, tmp_path_factory):  # noqa: F811
    """2 epochs of 5 steps, validation every 3 steps and per epoch, best kept, records written."""
    root = tmp_path_factory.mktemp("mt_best")
    out = root / "out"
    run_script(
        "run_translation.py",
        "--data_dir", tiny_data / "mt", "--attention_type", "zformer", "--config_overrides", TINY_MT,
        "--vocab_size", 120, "--max_target_length", 16, "--num_beams", 2, "--per_device_train_batch_size", 16,
        "--num_train_epochs", 2, "--eval_steps", 3, "--save_best", "--checkpointing_steps", 4,
        "--results_file", root / "results.json", "--output_dir", out,
    )
    return out, root / "results.json"


@pytest.fixture(scope="module")
def movie_data(tmp_path_factory):
    """120 training reviews of 40 movies (3 each, one label per movie, movie-specific words), IMDB's
    layout, and 20 test reviews of 10 other movies."""
    root = tmp_path_factory.mktemp("movies")
    rng = random.Random(1)
    words = "the a movie film plot actor scene story music ending".split()
    for split, rows, movies, first_movie in (("train", 120, 40, 0), ("test", 20, 10, 40)):
        _write_movie_reviews(root / f"{split}.jsonl", rows, movies, first_movie, rng, words)
    return root


def _write_movie_reviews(path, rows, movies, first_movie, rng, words):  # movies even: one label per movie
    with open(path, "w") as f:
        for i in range(rows):
            movie, label = first_movie + i % movies, i % 2
            text = " ".join(rng.choice(words) for _ in range(rng.randint(3, 20)))
            f.write(json.dumps({"text": f"title{movie} {text} {'great fun' if label else 'awful bore'}",
                                "label": label, "id": f"r{i}", "movie": f"tt{movie:04d}"}) + "\n")


@pytest.fixture(scope="module")
def clf_common(movie_data):
    return ["--data_dir", movie_data, "--attention_type", "fastformer", "--config_overrides", TINY_CLF,
            "--vocab_size", 120, "--max_length", 32, "--per_device_train_batch_size", 16, "--learning_rate", 3e-3,
            "--num_train_epochs", 2, "--eval_steps", 3, "--save_best", "--checkpointing_steps", 4]


@pytest.fixture(scope="module")
def clf_best_run(clf_common, tmp_path_factory):
    root = tmp_path_factory.mktemp("clf_best")
    run_script("run_classification.py", *clf_common, "--results_file", root / "results.json",
               "--output_dir", root / "out")
    return root / "out", root / "results.json"


def test_translation_eval_steps_history_and_best(mt_best_run):
    out, _ = mt_best_run
    history = _history(out)
    # 80 pairs - 0 carved (val exists) = 5 batches of 16 per epoch: evaluations at 3, 5 (epoch), 6, 9, 10 (epoch)
    assert [r["step"] for r in history] == [3, 5, 6, 9, 10]
    assert [r["epoch"] for r in history] == [0.6, 1.0, 1.2, 1.8, 2.0]
    assert [r.get("end_of_epoch") for r in history] == [None, 0, None, None, 1]
    assert all({"bleu", "bleu_lowercase", "samples"} <= set(r) for r in history)
    results = json.loads((out / "all_results.json").read_text())
    best = max(history, key=lambda r: r["bleu"])  # first of the best on ties: only an improvement saves
    assert results["best_step"] == best["step"] and results["eval_bleu"] == best["bleu"]
    assert results["eval_num_beams"] == 1 and results["num_beams"] == 2
    for key in ("test_bleu", "test_bleu_lowercase", "test_samples", "test_greedy_bleu", "test_greedy_bleu_lowercase"):
        assert key in results, key
    state = json.loads((out / "best" / "best_state.json").read_text())
    assert state["best_step"] == results["best_step"] and state["metric"] == "bleu"
    assert _same_weights(out, out / "best")  # the final model is the best one
    assert (out / "best" / "tokenizer.json").is_file() and (out / "best" / "generation_config.json").is_file()
    assert json.loads((out / "best" / "generation_config.json").read_text())["num_beams"] == 2
    assert not list(out.glob(".hf_zformer-*-*"))  # no staging or backup folder left behind
    training_state = json.loads((out / "step_8" / "training_state.json").read_text())
    assert training_state["best_step"] == results["best_step"] and "best_metric" in training_state


def test_translation_results_records(mt_best_run):
    _, results_file = mt_best_run
    records = json.loads(results_file.read_text())
    assert [(r["split"], r["metric"], r["beams"]) for r in records] == [
        ("validation", "bleu", 1), ("test", "bleu", 2), ("test", "bleu_lowercase", 2),
        ("test", "bleu", 1), ("test", "bleu_lowercase", 1)]
    for record in records:
        assert RECORD_FIELDS <= set(record)
        assert record["task"] == "mt" and record["attention"] == "zformer" and record["decoder_attention"] == "full"
        assert record["epochs"] == 2.0 and record["seed"] == 42 and record["split_seed"] == 42
        assert record["base_model"] is None and record["max_length"] == 16 and record["best_step"] >= 3
        assert record["config"]["num_decoder_layers"] == 1 and 0.0 <= record["value"] <= 100.0
        assert record["train_examples"] == 80 and record["mixed_precision"] == "no"  # sentence pairs; fp32
    for record in records[1:]:
        low, high = record["ci95"]
        assert low <= high and record["samples"] == 12


def test_classification_best_model_restored(clf_best_run):
    out, results_file = clf_best_run
    history = _history(out)
    assert [r["step"] for r in history] == [3, 6, 7, 9, 12, 14]  # 108 rows / 16 = 7 steps per epoch
    results = json.loads((out / "all_results.json").read_text())
    first_best = next(r for r in history if r["accuracy"] == max(h["accuracy"] for h in history))
    assert results["best_step"] == first_best["step"] and results["eval_accuracy"] == first_best["accuracy"]
    assert results["last_eval_accuracy"] == history[-1]["accuracy"]
    assert _same_weights(out, out / "best")
    record, test_record = json.loads(results_file.read_text())
    assert test_record["split"] == "test" and test_record["samples"] == 20
    assert test_record["value"] == pytest.approx(100 * results["test_accuracy"]) and results["test_samples"] == 20
    assert RECORD_FIELDS <= set(record)
    assert record["metric"] == "accuracy" and record["split"] == "validation" and record["decoder_attention"] is None
    assert record["value"] == pytest.approx(100 * first_best["accuracy"])  # re-scored best model, in %
    assert record["train_examples"] == 108  # the training carve (7 steps of 16 per epoch)
    assert record["ci95"][0] <= record["value"] <= record["ci95"][1]


def test_evaluate_model_carves_the_same_validation_rows(clf_best_run, movie_data, tmp_path):
    """evaluate_model.py (same default --split_seed and grouping) scores the best model on exactly
    the rows the training run validated on: same count, same accuracy."""
    out, _ = clf_best_run
    run_script("evaluate_model.py", "--model_name_or_path", out, "--data_dir", movie_data, "--split", "validation",
               "--max_length", 32, "--output_dir", tmp_path, "--length_buckets", 8)
    metrics = json.loads((tmp_path / "validation_results.json").read_text())
    trained = json.loads((out / "all_results.json").read_text())
    assert metrics["validation_samples"] == trained["eval_samples"] == 12
    assert metrics["validation_accuracy"] == pytest.approx(trained["eval_accuracy"])
    buckets = metrics["validation_by_length"]  # accuracy by words of the review: 1-8, >= 9
    assert [b["words"] for b in buckets] == ["1-8", ">=9"] and sum(b["samples"] for b in buckets) == 12
    correct = sum(b["accuracy"] * b["samples"] / 100 for b in buckets if b["samples"])
    assert correct / 12 == pytest.approx(metrics["validation_accuracy"])


def test_evaluate_model_records_the_recipe_of_the_run_it_scores(clf_best_run, movie_data, tmp_path):
    """A record of evaluate_model.py for the run's best/ folder carries the recipe fields of the
    training run's own record (read from the folder's training_args.json and all_results.json)."""
    out, results_file = clf_best_run
    assert json.loads((out / "training_args.json").read_text())["seed"] == 42
    scored = tmp_path / "results.json"
    run_script("evaluate_model.py", "--model_name_or_path", out / "best", "--data_dir", movie_data, "--split",
               "validation", "--max_length", 32, "--output_dir", tmp_path / "eval", "--results_file", scored)
    (record,) = json.loads(scored.read_text())
    trained = json.loads(results_file.read_text())[0]
    for key in ("seed", "learning_rate", "mixed_precision", "epochs", "train_steps", "best_step", "base_model",
                "distillation", "config"):
        assert record[key] == trained[key], key
    assert record["output_dir"] == str(out) and record["teacher"] is None and record["value"] == trained["value"]


def test_resume_keeps_best_and_history(clf_common, clf_best_run, tmp_path):
    """Resume in the same output folder from a mid-run checkpoint: the history is cut back to the
    checkpoint and extended again without duplicates, the best value/step come from the training
    state, and the results equal those of the uninterrupted run."""
    reference, _ = clf_best_run
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    state = json.loads((out / "step_8" / "training_state.json").read_text())
    assert {"best_metric", "best_step"} <= set(state)
    run_script("run_classification.py", *clf_common, "--resume_from_checkpoint", out / "step_8", "--output_dir", out)
    assert _history(out) == _history(reference)
    resumed, uninterrupted = (json.loads((d / "all_results.json").read_text()) for d in (out, reference))
    for key in ("best_step", "eval_accuracy", "last_eval_accuracy", "train_steps"):
        assert resumed[key] == uninterrupted[key], key
    assert _same_weights(out, reference) and _same_weights(out, out / "best")
    # resumed into a new folder: history up to the checkpoint and the best model come along
    other = tmp_path / "other"
    run_script("run_classification.py", *clf_common, "--resume_from_checkpoint", reference / "step_8",
               "--output_dir", other)
    assert _history(other) == _history(reference)
    assert json.loads((other / "all_results.json").read_text())["best_step"] == uninterrupted["best_step"]
    assert _same_weights(other, reference) and _same_weights(other, other / "best")


# The run_args of clf_common's run as checkpoints stored them before the arguments were typed
# (argparse's flat Namespace: every flag but the resumable ones, by flag name; "MOVIES": --data_dir).
FLAT_RUN_ARGS = {
    "attention_type": "fastformer", "config_overrides": TINY_CLF, "data_dir": "MOVIES", "dataset_config_name": None,
    "dataset_name": None, "distill_alpha": 0.5, "distill_temperature": 2.0, "eval_steps": 3,
    "gradient_accumulation_steps": 1, "group_column": "movie", "label_column": "label", "label_names": None,
    "learning_rate": 0.003, "lowercase": False, "lr_scheduler_type": "linear", "max_eval_samples": None,
    "max_grad_norm": 1.0, "max_length": 32, "max_train_samples": None, "max_train_steps": None,
    "max_unlabeled_samples": None, "model_name_or_path": None, "num_labels": None, "num_train_epochs": 2,
    "num_warmup_steps": 0, "per_device_train_batch_size": 16, "save_best": True, "seed": 42, "split_seed": 42,
    "teacher_model_name_or_path": None, "text_column": "text", "tokenizer_name": None, "truncation_side": None,
    "unlabeled_file": None, "vocab_size": 120, "weight_decay": 0.01,
}


def test_resume_from_a_checkpoint_with_flat_run_args(clf_common, clf_best_run, movie_data, tmp_path, capsys):
    """A checkpoint whose run_args are the flat flag dict written before the typed arguments
    resumes to the uninterrupted run's results; other arguments than its own are still refused."""
    reference, _ = clf_best_run
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    state_file = out / "step_8" / "training_state.json"
    state = json.loads(state_file.read_text())
    flat = {**FLAT_RUN_ARGS, "data_dir": str(movie_data)}
    assert state["run_args"] == flat  # what the typed arguments store is that same flat form
    state_file.write_text(json.dumps({**state, "run_args": flat}, indent=2))
    script = load_script("run_classification.py")
    with pytest.raises(SystemExit):
        script.parse_args([str(a) for a in clf_common] + ["--learning_rate", "1e-3", "--output_dir", str(out),
                                                          "--resume_from_checkpoint", str(out / "step_8")])
    assert "--learning_rate 0.003 there, 0.001 now" in capsys.readouterr().err
    run_script("run_classification.py", *clf_common, "--resume_from_checkpoint", out / "step_8", "--output_dir", out)
    resumed, uninterrupted = (json.loads((d / "all_results.json").read_text()) for d in (out, reference))
    for key in ("best_step", "eval_accuracy", "last_eval_accuracy", "train_steps"):
        assert resumed[key] == uninterrupted[key], key
    assert json.loads((out / "training_args.json").read_text()) == flat


def test_eval_arguments_fail_before_training(tiny_data, tmp_path, capsys):  # noqa: F811
    for script, extra, message in (
        ("run_classification.py", ["--data_dir", str(tiny_data / "clf"), "--eval_steps", "0"], "--eval_steps"),
        ("run_translation.py", ["--data_dir", str(tiny_data / "mt"), "--eval_num_beams", "0"], "--eval_num_beams"),
    ):
        with pytest.raises(SystemExit):
            load_script(script).parse_args([*extra, "--attention_type", "full", "--output_dir", str(tmp_path)])
        assert message in capsys.readouterr().err
    args = load_script("run_translation.py").parse_args(
        ["--data_dir", str(tiny_data / "mt"), "--attention_type", "full", "--output_dir", str(tmp_path)])
    evaluation = args.evaluation
    assert evaluation.eval_steps is None and args.task.eval_num_beams == 1 and not evaluation.save_best
    assert evaluation.split_seed == 42 and evaluation.results_file is None
    with pytest.raises(SystemExit):
        load_script("run_classification.py").parse_args(["--help"])
    assert "bleu for translation, accuracy for classification" in " ".join(capsys.readouterr().out.split())


# --------------------------------------------------------------------------------------------
# validation carved grouped by movie, seeded by --split_seed
# --------------------------------------------------------------------------------------------


def _validation(ds, column="id"):
    return list(ds["validation"][column])


def test_grouped_carve_keeps_movies_on_one_side(movie_data):
    from hf_zformer.data import load_classification_dataset, load_text_dataset

    for seed in range(5):
        ds = load_classification_dataset(movie_data, group_column="movie", extra_columns=("id", "movie"), seed=seed)
        assert not set(ds["train"]["movie"]) & set(ds["validation"]["movie"]), seed
        assert len(ds["validation"]) == 12 and collections.Counter(ds["validation"]["label"]) == {0: 6, 1: 6}
    plain = load_classification_dataset(movie_data, group_column=None, extra_columns=("id", "movie"), seed=0)
    assert set(plain["train"]["movie"]) & set(plain["validation"]["movie"])  # a row carve splits movies
    # the library's default groups as the scripts' --group_column does (it carved by rows before)
    for seed in range(5):
        default = load_classification_dataset(movie_data, extra_columns=("id", "movie"), seed=seed)
        assert not set(default["train"]["movie"]) & set(default["validation"]["movie"]), seed
        grouped = load_classification_dataset(movie_data, group_column="movie", extra_columns=("id",), seed=seed)
        assert _validation(default) == _validation(grouped)
        text = load_text_dataset(movie_data / "train.jsonl", validation_size=12, seed=seed)
        assert set(text["validation"]["text"]) == set(load_text_dataset(
            movie_data / "train.jsonl", validation_size=12, seed=seed, group_column="movie")["validation"]["text"])
    # the group column is used, not returned, unless asked for; data without it is carved by rows
    assert load_classification_dataset(movie_data, group_column="movie")["train"].column_names == ["text", "label"]
    assert len(load_classification_dataset(movie_data, group_column="no_such_column")["validation"]) == 12


def test_grouped_pick_sizes():
    """Groups of mixed labels and sizes: never above the label quotas, close to the requested size."""
    from hf_zformer.data.splits import grouped_pick

    rng = random.Random(0)
    groups, labels = [], []
    for movie in range(500):
        for _ in range(rng.randint(1, 12)):
            groups.append(movie)
            labels.append(int(rng.random() < 0.5))
    count = len(groups) // 10
    picked = grouped_pick(groups, labels, count, random.Random(3))
    by_label = collections.Counter(labels[i] for i in picked)
    share = sum(labels) / len(labels)
    assert count - 5 <= len(picked) <= count and abs(by_label[1] - share * count) <= 3
    chosen = {groups[i] for i in picked}
    assert all((groups[i] in chosen) == (i in set(picked)) for i in range(len(groups)))  # whole groups only


def test_split_seed_fixes_validation_rows_across_seeds(movie_data, tmp_path):
    script = load_script("run_classification.py")

    def validation(*extra):
        args = script.parse_args(["--data_dir", str(movie_data), "--attention_type", "full",
                                  "--output_dir", str(tmp_path), *extra])
        raw, split = script.load_data(args)
        assert split == "validation"
        return raw["validation"]["text"]

    assert validation("--seed", "1") == validation("--seed", "2")
    assert validation("--seed", "1", "--max_eval_samples", "6") == validation("--seed", "2", "--max_eval_samples", "6")
    assert validation("--split_seed", "7") != validation()
    texts = validation()
    assert len(texts) == 12 and len({t.split()[0] for t in texts}) == 4  # 4 whole movies


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED_DATA / "imdb").is_dir(), reason="shared data not present")
def test_imdb_carve_grouped_by_movie():
    from hf_zformer.data import load_classification_dataset

    ds = load_classification_dataset(SHARED_DATA / "imdb", group_column="movie", extra_columns=("movie",))
    assert (len(ds["train"]), len(ds["validation"])) == (22500, 2500)
    assert collections.Counter(ds["validation"]["label"]) == {0: 1250, 1: 1250}
    assert not set(ds["train"]["movie"]) & set(ds["validation"]["movie"])


# --------------------------------------------------------------------------------------------
# scripts/plot_curves.py
# --------------------------------------------------------------------------------------------


def test_plot_curves(mt_best_run, clf_best_run, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    script = load_script("plot_curves.py")
    mt_out, _ = mt_best_run
    other = tmp_path / "other"
    other.mkdir()
    (other / "eval_history.jsonl").write_text(
        "".join(json.dumps({"step": s, "epoch": s / 5, "bleu": b}) + "\n" for s, b in ((3, 1.0), (6, 2.5), (9, 2.0))))
    png = script.main([str(mt_out), str(other), "--output", str(tmp_path / "img" / "mt.png"), "--labels", "zformer,other"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    clf_out, _ = clf_best_run
    png = script.main([str(clf_out), "--output", str(tmp_path / "clf.png"), "--x", "epoch"])  # metric found: accuracy
    assert png.is_file()
    with pytest.raises(SystemExit):
        script.parse_args([str(tmp_path), "--output", str(tmp_path / "x.png")])  # no history there
    assert "no eval_history.jsonl" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="no metric"):
        script.main([str(other), "--metric", "accuracy", "--output", str(tmp_path / "y.png")])


# --------------------------------------------------------------------------------------------
# hf_zformer.training.results
# --------------------------------------------------------------------------------------------


def _append_many(path, worker, count):
    from hf_zformer.training.results import append_records

    for i in range(count):
        append_records(path, [{"worker": worker, "i": i}])


def test_append_records_keeps_every_record(tmp_path):
    import multiprocessing

    from hf_zformer.training.results import append_records, read_records

    path = tmp_path / "docs" / "results.json"
    assert append_records(path, [{"a": 1}]) == [{"a": 1}]
    append_records(path, [{"a": 2}, {"a": 3}])
    assert read_records(path) == [{"a": 1}, {"a": 2}, {"a": 3}]
    # forked where the system can (the workers only append records: no torch operation, and each opens its
    # own lock); a spawned worker started an interpreter and imported torch and the library for it
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    workers = [context.Process(target=_append_many, args=(path, w, 10)) for w in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
        assert worker.exitcode == 0
    records = read_records(path)
    assert len(records) == 33 and {(r["worker"], r["i"]) for r in records[3:]} == {(w, i) for w in range(3) for i in range(10)}
    assert not [p.name for p in path.parent.iterdir() if p.name not in ("results.json", "results.json.lock")]
    for bad in ('{"a": 1}', "[1, 2]", "not json"):
        path.write_text(bad)
        with pytest.raises(ValueError, match="results file"):
            append_records(path, [{"a": 4}])
        assert path.read_text() == bad  # left unchanged


def test_bootstrap_intervals(tmp_path):
    from sacrebleu.metrics import BLEU

    from hf_zformer.training.results import accuracy_ci, bleu_ci, git_commit

    hits = [True] * 80 + [False] * 20
    low, high = accuracy_ci(hits, seed=1)
    assert low < 80.0 < high and high - low < 20 and accuracy_ci(hits, seed=1) == [low, high]
    rng = random.Random(0)
    words = "a man dog cat runs plays on the street in park".split()
    references = [" ".join(rng.choice(words) for _ in range(8)) for _ in range(200)]
    predictions = [" ".join(r.split()[:5] + ["dog"]) if i % 3 else r.upper() for i, r in enumerate(references)]
    cased = BLEU().corpus_score(predictions, [references]).score
    lowered = BLEU(lowercase=True).corpus_score(predictions, [references]).score
    low, high = bleu_ci(predictions, references, resamples=200)
    assert low < cased < high
    low, high = bleu_ci(predictions, references, lowercase=True, resamples=200)
    assert low < lowered < high and lowered > cased
    assert accuracy_ci([]) is None
    assert len(git_commit() or "0" * 40) == 40 and git_commit(tmp_path) is None


def test_translation_test_split_name(tiny_data, tmp_path):  # noqa: F811
    script = load_script("run_translation.py")
    base = ["--attention_type", "full", "--output_dir", str(tmp_path / "out")]  # a new folder beside the data
    assert script.test_split_name(script.parse_args(["--data_dir", str(tiny_data / "mt"), *base])) == "test"
    multi30k = tmp_path / "multi30k"
    multi30k.mkdir()
    for stem in ("train", "test_2016_flickr"):
        for lang in ("de", "en"):
            (multi30k / f"{stem}.{lang}.gz").write_bytes(b"")
    assert script.test_split_name(script.parse_args(["--data_dir", str(multi30k), *base])) == "test2016"
    assert script.test_split_name(script.parse_args(["--dataset_name", "bentrevett/multi30k", *base])) == "test2016"


def test_optimizer_is_fused_adamw_without_decay_on_vectors():
    import argparse

    import torch

    from hf_zformer.training.loop import make_optimizer

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optimizer = make_optimizer(model, argparse.Namespace(weight_decay=0.01, learning_rate=1e-3))
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["fused"]
    decay, no_decay = optimizer.param_groups
    assert [p.ndim for p in decay["params"]] == [2] and decay["weight_decay"] == 0.01
    assert len(no_decay["params"]) == 3 and no_decay["weight_decay"] == 0.0


_REFAULT_PROBE = """
import resource, sys, torch
from hf_zformer import retain_freed_memory
print(retain_freed_memory())
def step():  # a training step's pattern: several large activations, all freed at the end
    tensors = [torch.ones(6 * 2**20) for _ in range(4)]  # 4 x 24 MiB, touched
    del tensors
for _ in range(4):  # the heap settles over the first steps (small objects can split it at first)
    step()
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(min(faults))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_retain_freed_memory_avoids_refaulting_a_steps_activations():
    """`--cpu_allocator retain` (the scripts' default): memory a step frees is reused by the next
    step without page faults; the system allocator returns it and faults it in again. A user's own
    MALLOC_* setting wins. (The fewest faults of three steps after four warm-up steps: CI once saw
    one of the four blocks faulted in again on the third step, before the heap had settled.)"""
    def probe(**env):
        environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env
        out = subprocess.run([sys.executable, "-c", _REFAULT_PROBE], env=environment, capture_output=True,
                             text=True, check=True).stdout.split()
        return out[0] == "True", int(out[1])

    applied, retained = probe()
    assert applied
    user_set, returned = probe(MALLOC_TRIM_THRESHOLD_="131072")
    assert not user_set and returned > 10000, returned  # 96 MiB faulted in again: ~24k faults of 4 KiB
    assert retained < returned / 4, (retained, returned)


def test_cpu_allocator_argument(tiny_data):
    script = load_script("run_classification.py")
    common = ["--data_dir", str(tiny_data / "clf"), "--output_dir", "x", "--attention_type", "full"]
    assert script.parse_args(common).training.cpu_allocator == "retain"
    assert script.parse_args(common + ["--cpu_allocator", "system"]).training.cpu_allocator == "system"
    with pytest.raises(SystemExit):
        script.parse_args(common + ["--cpu_allocator", "bogus"])


def test_run_fields_record_learning_rate():
    """A record carries the run's peak learning rate (runs of one comparison may differ only there)."""
    import argparse

    from hf_zformer import ZformerConfig
    from hf_zformer.training.results import run_fields

    args = argparse.Namespace(seed=1, split_seed=2, learning_rate=3e-4, model_name_or_path=None, output_dir="runs/x",
                              data_dir="data/imdb", dataset_name=None, train_file=None)
    record = run_fields(args, ZformerConfig(attention_type="zformer"), {}, max_length=64, wall_time_s=1.0)
    assert record["learning_rate"] == 3e-4 and record["config"]["attention_type"] == "zformer"


def test_run_fields_record_the_truncation_side_and_architecture_options_where_set():
    import argparse

    from hf_zformer import ZformerConfig
    from hf_zformer.training.results import run_fields

    common = dict(seed=1, split_seed=2, learning_rate=3e-4, model_name_or_path=None, output_dir="runs/x",
                  data_dir="data/imdb", dataset_name=None, train_file=None)
    left = run_fields(argparse.Namespace(**common, truncation_side="left"),
                      ZformerConfig(attention_type="fastformer", encoder_conv_size=5, fastformer_share_qv=True), {},
                      max_length=64, wall_time_s=1.0)
    default = run_fields(argparse.Namespace(**common, truncation_side=None), ZformerConfig(), {}, max_length=64,
                         wall_time_s=1.0)
    assert left["truncation_side"] == "left" and "truncation_side" not in default
    assert left["config"]["encoder_conv_size"] == 5 and "encoder_conv_size" not in default["config"]
    assert left["config"]["fastformer_share_qv"] is True and "fastformer_share_qv" not in default["config"]


def test_records_say_whether_accelerate_compiled_the_model():
    """`accelerate launch --dynamo_backend inductor [--dynamo_mode M]` compiles the model: the loop's
    results and the run's records name backend and mode; eager runs carry no such field."""
    import argparse

    from accelerate.utils import TorchDynamoPlugin

    from hf_zformer import ZformerConfig
    from hf_zformer.training.loop import compile_setting
    from hf_zformer.training.results import run_fields

    def accelerator(**plugin):
        return argparse.Namespace(state=argparse.Namespace(dynamo_plugin=TorchDynamoPlugin(**plugin)))

    assert compile_setting(accelerator(backend="no")) is None
    assert compile_setting(accelerator(backend="inductor")) == "inductor"
    assert compile_setting(accelerator(backend="inductor", mode="reduce-overhead")) == "inductor/reduce-overhead"
    args = argparse.Namespace(seed=1, split_seed=2, learning_rate=3e-4, model_name_or_path=None, output_dir="runs/x",
                              data_dir="data/imdb", dataset_name=None, train_file=None)
    compiled = run_fields(args, ZformerConfig(), {"compiled": "inductor/reduce-overhead"}, max_length=64,
                          wall_time_s=1.0)
    eager = run_fields(args, ZformerConfig(), {"compiled": None}, max_length=64, wall_time_s=1.0)
    assert compiled["compiled"] == "inductor/reduce-overhead" and "compiled" not in eager
