"""Knowledge distillation from a fine-tuned teacher (hf_zformer.conversion.teacher and run_classification.py's
--teacher_model_name_or_path / --unlabeled_file): the loss, the teacher's checks, the script's
wiring and its records."""

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import random_batch, tiny_config
from test_scripts import TINY_CLF, load_script, run_script, run_script_failing, tiny_data  # noqa: F401  (fixture)

from hf_zformer.conversion.teacher import IGNORE_LABEL, TeacherLoss, distillation_loss, load_teacher


def _logits(seed, rows=6, classes=3):
    return torch.randn(rows, classes, generator=torch.Generator().manual_seed(seed))


def test_loss_is_cross_entropy_at_alpha_0_and_kl_at_alpha_1():
    student, teacher, labels = _logits(0), _logits(1), torch.tensor([0, 2, 1, IGNORE_LABEL, 1, IGNORE_LABEL])
    labelled = labels != IGNORE_LABEL
    expected_ce = F.cross_entropy(student[labelled], labels[labelled])
    assert distillation_loss(student, teacher, labels, 0.0, 3.0) == pytest.approx(float(expected_ce))
    T = 3.0
    p_teacher = torch.softmax(teacher / T, -1)
    kl = (p_teacher * (p_teacher.log() - torch.log_softmax(student / T, -1))).sum(-1).mean()  # over all 6 rows
    assert distillation_loss(student, teacher, labels, 1.0, T) == pytest.approx(float(T**2 * kl), rel=1e-5)
    mixed = distillation_loss(student, teacher, labels, 0.25, T)
    assert mixed == pytest.approx(float(0.25 * T**2 * kl + 0.75 * expected_ce), rel=1e-5)


def test_unlabeled_rows_learn_from_the_teacher_only():
    student, teacher = _logits(2).requires_grad_(), _logits(3)
    labels = torch.tensor([1, IGNORE_LABEL, 0, IGNORE_LABEL, 2, 1])
    distillation_loss(student, teacher, labels, 0.5, 2.0).backward()
    grad = student.grad.clone()
    # an unlabeled row's gradient is the KL term's alone: it pulls the student's softmax towards the teacher's
    kl_grad = 0.5 * 2.0 * (torch.softmax(student / 2, -1) - torch.softmax(teacher / 2, -1)) / 6
    for row in (1, 3):
        assert torch.allclose(grad[row], kl_grad[row].detach(), atol=1e-6)
    assert not torch.allclose(grad[0], kl_grad[0].detach(), atol=1e-4)  # a labelled row adds cross-entropy
    # a batch with no labelled text: the teacher term only, and finite
    none = torch.full((6,), IGNORE_LABEL)
    assert torch.isfinite(distillation_loss(student, teacher, none, 0.5, 2.0))
    assert distillation_loss(teacher, teacher, none, 0.5, 2.0) == pytest.approx(0.0, abs=1e-7)


def test_teacher_loss_pulls_the_student_towards_the_teacher():
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    student = AutoModelForSequenceClassification.from_config(tiny_config(attention_type="zformer", num_labels=2))
    teacher = AutoModelForSequenceClassification.from_config(tiny_config(attention_type="full", num_labels=2)).eval()
    with torch.no_grad():  # a confident teacher, far from the untrained student's near-uniform outputs
        teacher.classifier.weight.mul_(50.0)
    ids, mask = random_batch([7, 5, 9, 3])
    batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.full((4,), IGNORE_LABEL)}
    loss_fn = TeacherLoss(teacher, alpha=1.0, temperature=1.0)
    optimizer = torch.optim.Adam(student.parameters(), lr=1e-2)
    student.eval()  # no dropout: the losses are comparable
    first = loss_fn(student, batch).item()
    for _ in range(20):
        optimizer.zero_grad()
        loss_fn(student, batch).backward()
        optimizer.step()
    assert first > 0.05 and loss_fn(student, batch).item() < 0.2 * first
    assert all(p.grad is None for p in teacher.parameters())  # the teacher never trains
    for alpha, temperature in ((1.5, 1.0), (-0.1, 1.0), (0.5, 0.0), (0.5, 1e30)):
        with pytest.raises(ValueError, match="alpha|temperature"):
            TeacherLoss(teacher, alpha=alpha, temperature=temperature)


def test_teacher_runs_under_the_runs_mixed_precision():
    """The teacher's forward pass runs inside ``autocast()`` (the scripts pass the accelerator's), so a
    bf16 run does not pay an fp32 teacher; without it, no autocast."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    student = AutoModelForSequenceClassification.from_config(tiny_config(attention_type="zformer", num_labels=2))
    teacher = AutoModelForSequenceClassification.from_config(tiny_config(attention_type="full", num_labels=2)).eval()
    seen = []
    teacher.register_forward_hook(lambda module, args, output: seen.append(
        (torch.is_autocast_enabled("cpu"), output.logits.dtype)))
    ids, mask = random_batch([7, 5, 9, 3])
    batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1, IGNORE_LABEL, 1])}
    plain = TeacherLoss(teacher)(student, batch)
    bf16 = TeacherLoss(teacher, autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16))(student, batch)
    assert seen == [(False, torch.float32), (True, torch.bfloat16)]
    assert bf16.dtype == torch.float32 and torch.isfinite(bf16)  # the loss itself is fp32
    assert bf16.item() == pytest.approx(plain.item(), abs=0.05)  # only the teacher's rounding differs


def test_load_teacher_names_a_mismatched_vocabulary_or_class_count(tmp_path):
    from transformers import AutoModelForSequenceClassification

    AutoModelForSequenceClassification.from_config(tiny_config(num_labels=3)).save_pretrained(tmp_path / "t")
    with pytest.raises(ValueError, match="num_labels is 3, the model's is 2"):
        load_teacher(str(tmp_path / "t"), tiny_config(num_labels=2), "cpu")
    with pytest.raises(ValueError, match="vocab_size"):
        load_teacher(str(tmp_path / "t"), tiny_config(num_labels=3, vocab_size=50), "cpu")
    teacher = load_teacher(str(tmp_path / "t"), tiny_config(num_labels=3), "cpu")
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())


def test_script_trains_on_labelled_and_unlabeled_texts_with_a_teacher(tiny_data, tmp_path):  # noqa: F811
    common = ["--data_dir", tiny_data / "clf", "--max_length", 32, "--per_device_train_batch_size", 16,
              "--learning_rate", 3e-3]
    run_script("run_classification.py", *common, "--attention_type", "full", "--config_overrides", TINY_CLF,
               "--vocab_size", 120, "--num_train_epochs", 1, "--output_dir", tmp_path / "teacher")
    unlabeled = tmp_path / "unlabeled.jsonl"
    unlabeled.write_text("".join(json.dumps({"text": f"the movie {w} story"}) + "\n" for w in ("great", "awful") * 20))
    result = run_script(
        "run_classification.py", *common, "--model_name_or_path", tmp_path / "teacher",
        "--teacher_model_name_or_path", tmp_path / "teacher", "--distill_alpha", 0.7, "--distill_temperature", 3,
        "--unlabeled_file", unlabeled, "--max_unlabeled_samples", 30, "--num_train_epochs", 1,
        "--results_file", tmp_path / "results.json", "--output_dir", tmp_path / "student",
        env={"ACCELERATE_MIXED_PRECISION": "bf16"},  # student and teacher under bf16 autocast, as plain python allows
    )
    log = result.stdout + result.stderr
    # 120 rows - 12 carved for validation = 108 labelled + 30 unlabeled = 138 texts: 9 steps of 16
    assert "30 unlabeled texts" in log and "Training: 138 examples" in log
    assert json.loads((tmp_path / "student" / "all_results.json").read_text())["train_steps"] == 9
    (record,) = json.loads((tmp_path / "results.json").read_text())
    assert record["train_examples"] == 108 and record["mixed_precision"] == "bf16"
    assert record["teacher"] == {"model": str(tmp_path / "teacher"), "alpha": 0.7, "temperature": 3.0,
                                 "unlabeled_examples": 30, "unlabeled_file": str(unlabeled)}


def test_distillation_arguments_fail_before_training(tiny_data, tmp_path, capsys):  # noqa: F811
    base = ["--data_dir", str(tiny_data / "clf"), "--attention_type", "full", "--output_dir", str(tmp_path)]
    for extra, message in (
        (["--unlabeled_file", str(tiny_data / "clf" / "train.jsonl")], "pass --teacher_model_name_or_path too"),
        (["--teacher_model_name_or_path", "x", "--unlabeled_file", str(tmp_path / "missing.jsonl")], "is not a file"),
        (["--teacher_model_name_or_path", "x", "--distill_alpha", "1.5"], "--distill_alpha must be in [0, 1], got 1.5"),
        (["--teacher_model_name_or_path", "x", "--distill_temperature", "0"], "--distill_temperature must be in (0, 100]"),
        # was a NaN loss, stopped as a divergence with advice to lower --learning_rate
        (["--teacher_model_name_or_path", "x", "--distill_temperature", "1e30"],
         "--distill_temperature must be in (0, 100], got 1e+30 (distillation uses 1-20"),
        (["--max_unlabeled_samples", "0"], "--max_unlabeled_samples must be >= 1"),
    ):
        with pytest.raises(SystemExit):
            load_script("run_classification.py").parse_args([*base, *extra])
        assert message in capsys.readouterr().err


def test_script_refuses_a_teacher_with_another_vocabulary(tiny_data, tmp_path):  # noqa: F811
    from transformers import AutoModelForSequenceClassification

    AutoModelForSequenceClassification.from_config(tiny_config(num_labels=2)).save_pretrained(tmp_path / "t")
    result = run_script_failing(
        "run_classification.py", "--data_dir", tiny_data / "clf", "--attention_type", "full",
        "--config_overrides", TINY_CLF, "--vocab_size", 120, "--max_length", 32, "--max_train_steps", 1,
        "--teacher_model_name_or_path", tmp_path / "t", "--output_dir", tmp_path / "out",
    )
    assert "error: --teacher_model_name_or_path" in result.stderr and "its vocab_size is 97" in result.stderr
    assert "teacher and student need one vocabulary" in result.stderr and "Traceback" not in result.stderr
