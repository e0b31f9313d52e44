"""scripts/run_mlm.py, masked-language-model pretraining: the masking collator (a fixed count of
scored positions per block, BERT's 80/10/10, masks a pure function of seed, epoch and block), the
model's labelled-only projection, exact resume, the best model by perplexity, result records, a
saved folder that fills masks without hf_zformer and starts a classifier. Tiny runs on generated text."""

import json
import math

import numpy as np
import pytest
import torch
from conftest import run_isolated
from test_clm import assert_resume_matches, lm_data  # noqa: F401  (lm_data: 120 short reviews of 30 movies)
from test_scripts import _strict_json, load_script, run_script

TINY = "hidden_size=32,num_hidden_layers=2,num_attention_heads=2,intermediate_size=64"


def _common(lm_data, *extra):  # noqa: F811
    return ["--train_file", lm_data / "train.jsonl", "--config_overrides", f"{TINY},attention_type=zformer|fastformer",
            "--attention_type", "zformer", "--vocab_size", 60, "--block_size", 16, "--per_device_train_batch_size", 8,
            "--per_device_eval_batch_size", 16, "--validation_split_percentage", 10, *extra]


@pytest.fixture(scope="module")
def mlm_run(lm_data, tmp_path_factory):  # noqa: F811
    """Uninterrupted run of 8 steps with a checkpoint at step 4, validation every 4 steps, the best
    model kept, records written."""
    out = tmp_path_factory.mktemp("mlm-run") / "out"
    results_file = out.parent / "results.json"
    run_script("run_mlm.py", *_common(lm_data, "--max_train_steps", 8, "--checkpointing_steps", 4, "--eval_steps", 4,
                                      "--save_best", "--results_file", results_file, "--output_dir", out))
    return out, results_file


def _blocks(n, size, seed=0):
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(5, 50, size).tolist(), "block": i} for i in range(n)]


def test_masking_counts_labels_and_replacements():
    from hf_zformer.training.batching import MaskedLMCollator

    features = _blocks(400, 40)
    collate = MaskedLMCollator(mask_token_id=4, vocab_size=50, probability=0.15, seed=3, first_ordinary_id=5)
    batch = collate(features)
    original = torch.tensor([f["input_ids"] for f in features])
    scored = batch["labels"] != -100
    assert (scored.sum(dim=1) == 6).all()  # round(0.15 * 40) in every block
    assert (batch["labels"][scored] == original[scored]).all()  # labels: the original ids
    assert (batch["input_ids"][~scored] == original[~scored]).all()  # nothing else changes
    new = batch["input_ids"][scored]
    masked = (new == 4).float().mean().item()
    kept = (new == original[scored]).float().mean().item()  # includes random draws of the same id (1/45)
    assert 0.76 < masked < 0.84 and 0.08 < kept < 0.14
    assert new.min() >= 4 and new.max() < 50  # random replacements never draw a special token (ids 0-3)
    assert batch["labelled_logits_only"] is True


def test_masks_depend_on_seed_epoch_and_block_only():
    from hf_zformer.training.batching import LengthGroupedBatchSampler, MaskedLMCollator

    features = _blocks(8, 20)
    sampler = LengthGroupedBatchSampler([20] * 8, 4, seed=0)
    collate = MaskedLMCollator(mask_token_id=4, vocab_size=50, seed=1, sampler=sampler)
    first = collate(features)
    assert torch.equal(collate(features[::-1])["labels"], first["labels"].flip(0))  # per block, not per batch slot
    sampler.use_epoch(1)
    assert not torch.equal(collate(features)["labels"], first["labels"])  # new masks every epoch
    sampler.use_epoch(0)
    assert torch.equal(collate(features)["input_ids"], first["input_ids"])
    other_seed = MaskedLMCollator(mask_token_id=4, vocab_size=50, seed=2)(features)
    assert not torch.equal(other_seed["labels"], first["labels"])


@pytest.mark.parametrize("kwargs, message", [
    (dict(probability=0.0), "probability"), (dict(probability=1.0), "probability"),
    (dict(mask_token_id=None), "no mask token"), (dict(first_ordinary_id=50), "first_ordinary_id"),
])
def test_masking_refuses_bad_settings(kwargs, message):
    from hf_zformer.training.batching import MaskedLMCollator

    with pytest.raises(ValueError, match=message):
        MaskedLMCollator(**{"mask_token_id": 4, "vocab_size": 50, **kwargs})


def test_labelled_logits_only_equals_the_full_projection():
    from hf_zformer import ZformerConfig, ZformerForMaskedLM

    torch.manual_seed(0)
    model = ZformerForMaskedLM(ZformerConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                             intermediate_size=64, attention_type="fastformer")).eval()
    ids = torch.randint(5, 50, (3, 12))
    labels = torch.full_like(ids, -100)
    labels[0, [1, 5]], labels[2, [0, 7, 11]] = ids[0, [1, 5]], ids[2, [0, 7, 11]]
    full = model(input_ids=ids, labels=labels)
    only = model(input_ids=ids, labels=labels, labelled_logits_only=True)
    assert only.logits.shape == (5, 50)
    torch.testing.assert_close(only.logits, full.logits[labels != -100], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(only.loss, full.loss, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="needs labels"):
        model(input_ids=ids, labelled_logits_only=True)


def test_mlm_resume_matches_uninterrupted_run(mlm_run, lm_data, tmp_path):  # noqa: F811
    """The masks follow the epoch and block, not an RNG state: the resumed run masks as the uninterrupted one."""
    assert_resume_matches("run_mlm.py", lambda *extra: _common(lm_data, *extra), mlm_run[0], tmp_path)


def test_mlm_perplexity_accuracy_history_and_records(mlm_run, lm_data):  # noqa: F811
    out, results_file = mlm_run
    results = _strict_json(out / "all_results.json")
    assert results["eval_perplexity"] == pytest.approx(math.exp(results["eval_loss"]), rel=1e-12)
    assert 0.0 <= results["eval_accuracy"] <= 1.0 and results["eval_tokens"] == results["eval_samples"] * 2  # 2 of 16
    history = [json.loads(line) for line in (out / "eval_history.jsonl").read_text().splitlines()]
    assert [r["step"] for r in history] == [4, 8]
    best = min(history, key=lambda r: r["perplexity"])
    assert results["best_step"] == best["step"] and results["eval_perplexity"] == best["perplexity"]
    (record,) = json.loads(results_file.read_text())
    assert record["metric"] == "mlm_perplexity" and record["attention"] == "zformer|fastformer"
    assert record["value"] == results["eval_perplexity"] and record["ci95"][0] <= record["value"] <= record["ci95"][1]
    card = (out / "README.md").read_text()
    assert "pipeline_tag: fill-mask" in card and 'pipeline("fill-mask"' in card


def test_mlm_folder_fills_masks_and_starts_a_classifier(mlm_run, tmp_path):
    """Without hf_zformer, the folder fills a mask (pipeline) and gives AutoModelForSequenceClassification
    its encoder, weight for weight, with a new head."""
    out, _ = mlm_run
    code = f"""
import torch
from transformers import AutoModelForMaskedLM, AutoModelForSequenceClassification, AutoTokenizer, pipeline
fill = pipeline("fill-mask", model={str(out)!r}, trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained({str(out)!r})
answers = fill("the movie was " + tokenizer.mask_token)
assert len(answers) == 5 and all(a["token"] != tokenizer.mask_token_id for a in answers), answers
model = AutoModelForSequenceClassification.from_pretrained({str(out)!r}, num_labels=2, trust_remote_code=True)
mlm = AutoModelForMaskedLM.from_pretrained({str(out)!r}, trust_remote_code=True)
encoder = {{k: v for k, v in mlm.state_dict().items() if k.startswith("zformer.")}}
state = model.state_dict()
assert encoder and all(torch.equal(state[k], v) for k, v in encoder.items())
print("OK")
"""
    assert run_isolated(code, cwd=tmp_path).stdout.strip().endswith("OK")


@pytest.mark.parametrize("extra, message", [
    (["--mlm_probability", "0"], "--mlm_probability"),
    (["--mlm_probability", "1.5"], "--mlm_probability"),
    (["--block_size", "1"], "--block_size"),
])
def test_mlm_bad_arguments_fail_before_training(extra, message, lm_data, tmp_path, capsys):  # noqa: F811
    argv = ["--train_file", str(lm_data / "train.jsonl"), "--attention_type", "xformer", *extra,
            "--output_dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as error:
        load_script("run_mlm.py").parse_args(argv)
    assert error.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_first_ordinary_id():
    from types import SimpleNamespace

    script = load_script("run_mlm.py")
    assert script.first_ordinary_id(SimpleNamespace(all_special_ids=[0, 1, 2, 3, 4])) == 5
    assert script.first_ordinary_id(SimpleNamespace(all_special_ids=[0, 100, 101, 102, 103])) == 0  # BERT's
