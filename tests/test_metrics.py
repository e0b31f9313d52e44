"""Tests for hf_zformer.metrics: packaged evaluate modules that work offline."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import sacrebleu

from hf_zformer import metrics

PREDICTIONS = [
    "The cat sat on the mat.",
    "A dog is running through the park!",
    "Two men, both wearing hats, play chess.",
    "hello world",
    "It's 6:30 and the bakery opens.",
]
REFERENCES = [
    ["The cat is sitting on the mat.", "A cat sat on the mat."],
    ["A dog runs through the park.", "The dog is running in a park!"],
    ["Two men wearing hats are playing chess.", "Two men in hats play a game of chess."],
    ["Hello, world!", "hello world"],
    ["It is 6:30 and the bakery is opening.", "At 6:30 the bakery opens."],
]
BLEU_KEYS = {"score", "counts", "totals", "precisions", "bp", "sys_len", "ref_len"}


def corpus_bleu(predictions, references, **kwargs):
    """sacrebleu's own API: references as one stream per reference position."""
    return sacrebleu.corpus_bleu(predictions, [list(stream) for stream in zip(*references)], **kwargs)


def assert_same_bleu(result: dict, expected) -> None:
    assert set(result) == BLEU_KEYS
    assert result["score"] == pytest.approx(expected.score, abs=1e-6)
    assert result["counts"] == expected.counts
    assert result["totals"] == expected.totals
    assert result["precisions"] == pytest.approx(expected.precisions, abs=1e-6)
    assert result["bp"] == pytest.approx(expected.bp, abs=1e-9)
    assert (result["sys_len"], result["ref_len"]) == (expected.sys_len, expected.ref_len)


def test_sacrebleu_matches_corpus_bleu() -> None:
    bleu = metrics.load("sacrebleu")
    expected = corpus_bleu(PREDICTIONS, REFERENCES)
    assert 0 < expected.score < 100
    assert_same_bleu(bleu.compute(predictions=PREDICTIONS, references=REFERENCES), expected)
    # one reference per prediction, as plain strings or as one-element lists
    single = [refs[0] for refs in REFERENCES]
    expected_single = corpus_bleu(PREDICTIONS, [[ref] for ref in single])
    assert expected_single.score != pytest.approx(expected.score)
    assert_same_bleu(bleu.compute(predictions=PREDICTIONS, references=single), expected_single)
    assert_same_bleu(bleu.compute(predictions=PREDICTIONS, references=[[r] for r in single]), expected_single)


def test_sacrebleu_add_batch() -> None:
    bleu = metrics.load("sacrebleu")
    for start in range(0, len(PREDICTIONS), 2):
        bleu.add_batch(predictions=PREDICTIONS[start : start + 2], references=REFERENCES[start : start + 2])
    assert_same_bleu(bleu.compute(), corpus_bleu(PREDICTIONS, REFERENCES))
    for prediction, refs in zip(PREDICTIONS, REFERENCES):
        bleu.add(prediction=prediction, reference=refs)
    assert_same_bleu(bleu.compute(), corpus_bleu(PREDICTIONS, REFERENCES))


def test_sacrebleu_options_and_alias() -> None:
    bleu = metrics.load("bleu")  # alias of sacrebleu
    for options in [
        {"lowercase": True},
        {"tokenize": "intl"},
        {"tokenize": "char"},
        {"smooth_method": "add-k", "smooth_value": 0.5},
        {"smooth_method": "none"},
        {"use_effective_order": True},
    ]:
        result = bleu.compute(predictions=PREDICTIONS, references=REFERENCES, **options)
        assert_same_bleu(result, corpus_bleu(PREDICTIONS, REFERENCES, **options))
    perfect = bleu.compute(predictions=["hello there general kenobi"], references=[["hello there general kenobi", "x"]])
    assert perfect["score"] == pytest.approx(100.0)


# In-memory modules for failing calls: after an exception in compute(), evaluate holds its cache-file
# lock, and the next module with the same experiment id waits ~1 s for it.


def test_sacrebleu_errors() -> None:
    with pytest.raises(ValueError, match="same number of references"):
        metrics.load("sacrebleu", keep_in_memory=True).compute(
            predictions=["a b", "c d"], references=[["a b"], ["c d", "c e"]]
        )
    with pytest.raises(ValueError):
        metrics.load("sacrebleu", keep_in_memory=True).compute(predictions=["a b", "c d"], references=[["a b"]])


def test_accuracy() -> None:
    accuracy = metrics.load("accuracy")
    assert accuracy.compute(predictions=[0, 1, 1, 0, 2], references=[0, 1, 0, 0, 1]) == {"accuracy": 0.6}
    assert accuracy.compute(predictions=[0, 1, 1, 0, 2], references=[0, 1, 0, 0, 1], normalize=False) == {
        "accuracy": 3.0
    }
    weighted = accuracy.compute(predictions=[1, 1, 0], references=[1, 0, 0], sample_weight=[0.5, 2.0, 1.5])
    assert weighted["accuracy"] == pytest.approx(2.0 / 4.0)
    weighted_count = accuracy.compute(
        predictions=[1, 1, 0], references=[1, 0, 0], sample_weight=[0.5, 2.0, 1.5], normalize=False
    )
    assert weighted_count["accuracy"] == pytest.approx(2.0)
    accuracy.add_batch(predictions=[1, 0], references=[1, 1])
    accuracy.add_batch(predictions=[1, 1, 1], references=[1, 1, 0])
    result = accuracy.compute()
    assert result == {"accuracy": 0.6} and isinstance(result["accuracy"], float)
    with pytest.raises(ValueError, match="sample_weight"):
        metrics.load("accuracy", keep_in_memory=True).compute(
            predictions=[1, 0], references=[1, 0], sample_weight=[1.0]
        )


def test_f1() -> None:
    f1 = metrics.load("f1")
    # binary: TP=1, FP=1, FN=0 -> 2 / (2 + 1)
    assert f1.compute(predictions=[0, 1, 1, 0], references=[0, 1, 0, 0]) == pytest.approx({"f1": 2 / 3})
    # pos_label=0: TP=2, FP=0, FN=1 -> 4 / 5
    assert f1.compute(predictions=[0, 1, 1, 0], references=[0, 1, 0, 0], pos_label=0)["f1"] == pytest.approx(0.8)
    # scikit-learn's documented multiclass example
    y_true, y_pred = [0, 1, 2, 0, 1, 2], [0, 2, 1, 0, 0, 1]
    assert f1.compute(predictions=y_pred, references=y_true, average="macro")["f1"] == pytest.approx(0.26666666)
    assert f1.compute(predictions=y_pred, references=y_true, average="micro")["f1"] == pytest.approx(1 / 3)
    assert f1.compute(predictions=y_pred, references=y_true, average="weighted")["f1"] == pytest.approx(0.26666666)
    assert f1.compute(predictions=y_pred, references=y_true, average=None)["f1"] == pytest.approx([0.8, 0.0, 0.0])
    # micro-F1 of single-label multiclass data is accuracy
    micro = f1.compute(predictions=[0, 1, 2, 2, 1], references=[0, 2, 2, 2, 0], average="micro")["f1"]
    assert micro == pytest.approx(0.6)
    # weighted by support: class 0 has F1 0.8 and 3 references, class 1 F1 0.5 and 1 reference
    weighted = f1.compute(predictions=[0, 0, 1, 1], references=[0, 0, 0, 1], average="weighted")["f1"]
    assert weighted == pytest.approx((3 * 0.8 + 1 * (2 / 3)) / 4)
    # labels restrict the classes that are averaged
    restricted = f1.compute(predictions=y_pred, references=y_true, average="macro", labels=[0])["f1"]
    assert restricted == pytest.approx(0.8)
    # sample weights scale the counts: TP=2, FP=1, FN=0 -> 4 / 5
    sample_weighted = f1.compute(predictions=[1, 1, 0], references=[1, 0, 0], sample_weight=[2.0, 1.0, 5.0])
    assert sample_weighted["f1"] == pytest.approx(0.8)
    # no positive predictions or references at all -> 0, like scikit-learn's zero_division=0
    assert f1.compute(predictions=[0, 0], references=[0, 0])["f1"] == 0.0
    f1.add_batch(predictions=[0, 1], references=[0, 1])
    f1.add_batch(predictions=[1, 0], references=[0, 0])
    assert f1.compute()["f1"] == pytest.approx(2 / 3)


def test_f1_errors() -> None:
    with pytest.raises(ValueError, match="average='binary' needs at most 2 labels"):
        metrics.load("f1", keep_in_memory=True).compute(predictions=[0, 1, 2], references=[0, 1, 1])
    with pytest.raises(ValueError, match="pos_label=1 is not a valid label"):
        metrics.load("f1", keep_in_memory=True).compute(predictions=[0, 2], references=[2, 0])
    with pytest.raises(ValueError, match="average must be one of"):
        metrics.load("f1", keep_in_memory=True).compute(predictions=[0, 1], references=[0, 1], average="samples")
    with pytest.raises(ValueError, match="sample_weight"):
        metrics.load("f1", keep_in_memory=True).compute(
            predictions=[0, 1], references=[0, 1], sample_weight=[1.0, 2.0, 3.0]
        )


def test_unknown_metric() -> None:
    with pytest.raises(ValueError, match="'rouge'.*sacrebleu, bleu, accuracy, f1"):
        metrics.load("rouge")
    with pytest.raises(ValueError, match="available"):
        metrics.metric_path("../accuracy")


def test_metric_paths_are_packaged_scripts() -> None:
    for name in metrics.AVAILABLE_METRICS:
        path = metrics.metric_path(name)
        assert path.is_absolute() and path.is_file() and path.suffix == ".py"
        assert path.parent.parent == Path(metrics.__file__).resolve().parent
    assert metrics.metric_path("bleu") == metrics.metric_path("sacrebleu")


def test_load_from_any_directory_without_network(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    attempts: list[object] = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("network access attempted")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.chdir(tmp_path)  # relative paths would break here
    (tmp_path / "sacrebleu").mkdir()  # a same-named directory in the cwd must not shadow the package
    assert metrics.load("sacrebleu").compute(predictions=["a b c d"], references=[["a b c d"]])[
        "score"
    ] == pytest.approx(100.0)
    assert metrics.load("accuracy").compute(predictions=[1], references=[1]) == {"accuracy": 1.0}
    assert metrics.load("f1").compute(predictions=[1], references=[1]) == {"f1": 1.0}
    assert attempts == []


def test_load_with_hf_hub_offline(tmp_path: Path) -> None:
    # Load hf_zformer/metrics/__init__.py by path: the check is about evaluate under HF_HUB_OFFLINE,
    # and skipping the package __init__ (torch, models) keeps this subprocess quick.
    code = (
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('packaged_metrics', {str(Path(metrics.__file__))!r})\n"
        "metrics = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(metrics)\n"
        "print(metrics.load('sacrebleu').compute(predictions=['a b c d'], references=['a b c d'])['score'])\n"
        "print(metrics.load('f1').compute(predictions=[1, 0], references=[1, 1])['f1'])\n"
    )
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
    }
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    bleu, f1 = map(float, result.stdout.split())
    assert bleu == pytest.approx(100.0) and f1 == pytest.approx(2 / 3)
