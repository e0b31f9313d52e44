"""The training loop the long runs need: validation every --eval_steps with an evaluation history,
the best checkpoint (--save_best) restored at the end and kept across resume, test scoring of the
best model, the --results_file records (hf_zformer.results), scripts/plot_curves.py, and the
validation split carved grouped by movie with its own --split_seed.

Tiny end-to-end runs reuse the helpers and data of test_scripts.py."""

import json
import shutil

import pytest
from test_scripts import TINY_CLF, TINY_MT, load_script, run_script, tiny_data  # noqa: F401  (fixture)

RECORD_FIELDS = {"task", "attention", "decoder_attention", "split", "metric", "value", "beams", "epochs", "seed",
                 "commit", "base_model", "max_length", "split_seed", "config", "best_step", "wall_time_s",
                 "tokens_per_s", "date", "machine"}


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
def clf_common(tiny_data):  # noqa: F811
    return ["--data_dir", tiny_data / "clf", "--attention_type", "fastformer", "--config_overrides", TINY_CLF,
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
    assert not list(out.glob(".tmp-*")) and not list(out.glob(".old-*"))
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
    [record] = json.loads(results_file.read_text())
    assert RECORD_FIELDS <= set(record)
    assert record["metric"] == "accuracy" and record["split"] == "validation" and record["decoder_attention"] is None
    assert record["value"] == pytest.approx(100 * first_best["accuracy"])  # re-scored best model, in %
    assert record["ci95"][0] <= record["value"] <= record["ci95"][1]


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
    assert args.eval_steps is None and args.eval_num_beams == 1 and not args.save_best and args.split_seed == 42
    assert args.results_file is None
