#!/usr/bin/env python
"""Train or fine-tune a Zformer-family text classifier with a plain Accelerate loop.

Works as ``python scripts/run_classification.py ...`` (one process) and under
``accelerate launch`` (N GPUs / N CPU processes, mixed precision from the launcher), e.g.

    accelerate launch --mixed_precision bf16 scripts/run_classification.py --dataset_name stanfordnlp/imdb \
        --attention_type fastformer --max_length 256 --output_dir runs/imdb-fastformer

Writes the model (loads with ``trust_remote_code=True``), tokenizer, ``all_results.json``
(``eval_accuracy``) and a model card into ``--output_dir``.
"""

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from hf_zformer import enable_cpu_speedups, flags  # noqa: E402
from hf_zformer.data.splits import DEFAULT_GROUP_COLUMN  # noqa: E402  (the loader's default too)
from hf_zformer.training import arguments, batching, loop, run  # noqa: E402
from hf_zformer.training.scoring import score_accuracy  # noqa: E402


@dataclass
class ClassificationArguments:
    """The columns, classes, truncation and test split of a classification run (:func:`add_label_args`)
    and its teacher (:func:`add_teacher_args`); checked when built (``ValueError``), which settles
    the teacher's defaults, ``label_names`` as a list and ``num_labels`` from them."""

    text_column: str = "text"
    label_column: str = "label"
    num_labels: int | None = None
    max_length: int = 256
    truncation_side: str | None = None
    label_names: str | list[str] | None = None
    skip_test: bool = False
    group_column: str = DEFAULT_GROUP_COLUMN
    teacher_model_name_or_path: str | None = None
    distill_alpha: float | None = None
    distill_temperature: float | None = None
    unlabeled_file: str | None = None
    max_unlabeled_samples: int | None = None

    def __post_init__(self) -> None:
        check_teacher_args(self)
        check_label_args(self)


def parse_args(argv=None) -> arguments.RunArguments:
    parser = flags.ArgumentParser(description=__doc__.split("\n")[1], formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    arguments.add_data_args(parser)
    add_label_args(parser)
    arguments.add_model_args(parser, seq2seq=False)
    arguments.add_training_args(parser)
    add_teacher_args(parser)
    return arguments.parse_run_args(parser, argv, seq2seq=False, task=ClassificationArguments, check=check_single_label)


def check_single_label(args: arguments.RunArguments) -> None:
    """A new model's ``problem_type`` must be single-label classification, what this script trains
    (``ValueError``)."""
    try:
        kind = arguments.parse_config_overrides(args.model.config_overrides).get("problem_type")
    except ValueError:  # named by the validation of the model arguments
        return
    problem = problem_type_problem(kind)
    if problem:
        raise ValueError(f"invalid model configuration: {problem}")


def problem_type_problem(kind) -> str | None:
    """Why a config's ``problem_type`` ``kind`` cannot be trained here, or None."""
    if kind in (None, "single_label_classification"):
        return None
    return (f"problem_type={kind!r}: this script trains single-label classification (one class id per text, "
            "cross-entropy); drop problem_type")


def add_label_args(parser: argparse.ArgumentParser) -> None:
    """The text and label columns, the classes, truncation, the test split and the validation groups."""
    parser.add_argument("--text_column", default="text")
    parser.add_argument("--label_column", default="label")
    parser.add_argument(
        "--num_labels",
        type=int,
        default=None,
        help="Number of classes K: every label must be 0..K-1 (an error names the file and line). "
        "Default: the largest label of the training and evaluation splits + 1.",
    )
    parser.add_argument("--max_length", type=int, default=256, help="Truncate texts to this many tokens.")
    parser.add_argument(
        "--truncation_side", choices=("right", "left"), default=None,
        help="Which end of a text longer than --max_length is cut: right keeps its beginning, left its end "
        "(IMDB reviews tend to end with their verdict). Saved with the tokenizer, so pipelines and "
        "evaluate_model.py truncate the same way. Default: the tokenizer's own setting (right for a new one).",
    )
    parser.add_argument(
        "--label_names",
        default=None,
        help='Class names in label-id order, comma-separated (IMDB: "negative,positive"); saved as the config\'s '
        "id2label/label2id, which pipeline() shows. Default: the dataset's ClassLabel names (Hub datasets that "
        "have them, e.g. neg,pos), else LABEL_0, LABEL_1, ...",
    )
    parser.add_argument(
        "--skip_test", action="store_true",
        help="Do not score the test split at the end (by default a labelled test split beside the validation one "
        "is scored once, on the final model: IMDB's 25,000 reviews take minutes on a CPU).",
    )
    parser.add_argument(
        "--group_column", default=DEFAULT_GROUP_COLUMN,
        help='When the data has this column, the validation split carved from train keeps each group (IMDB: each '
        'movie\'s reviews) on one side; "" carves by rows.',
    )


def add_teacher_args(parser: argparse.ArgumentParser) -> None:
    teach = parser.add_argument_group(
        "knowledge distillation",
        "Learn from a fine-tuned teacher's predictions as well as the labels (hf_zformer.conversion.teacher): "
        "alpha * T^2 * KL(teacher || model at temperature T) + (1 - alpha) * cross-entropy; docs/warm_start.md.",
    )
    teach.add_argument("--teacher_model_name_or_path", default=None,
                       help="A fine-tuned classifier with the model's tokenizer and classes, e.g. a full-attention "
                            "run's --output_dir. Without it: labels only.")
    teach.add_argument("--distill_alpha", type=float, default=None,
                       help="Weight of the teacher term, in [0, 1] (default 0.5); only with a teacher.")
    teach.add_argument("--distill_temperature", type=float, default=None,
                       help="Softmax temperature T, in (0, 100] (default 2.0); only with a teacher.")
    teach.add_argument("--unlabeled_file", default=None,
                       help="Texts without labels (.jsonl[.gz] / .csv[.gz] with --text_column, or .txt[.gz], one "
                            "per line; e.g. ../shared/data/imdb/unsup.jsonl.gz) added to the training set: they "
                            "learn from the teacher only. Needs --teacher_model_name_or_path.")
    teach.add_argument("--max_unlabeled_samples", type=int, default=None,
                       help="Use a seeded random N texts of --unlabeled_file (--seed).")


def check_teacher_args(task: ClassificationArguments) -> None:
    """The teacher flags' defaults and ranges (``ValueError``); every one of them needs the teacher."""
    for name, default in (("distill_alpha", 0.5), ("distill_temperature", 2.0)):
        if getattr(task, name) is not None and not task.teacher_model_name_or_path:
            raise ValueError(f"--{name} {getattr(task, name)} weighs a teacher's predictions, but no "
                             "--teacher_model_name_or_path is given: pass the teacher, or drop the flag")
        if getattr(task, name) is None:
            setattr(task, name, default)
    if not 0.0 <= task.distill_alpha <= 1.0:
        raise ValueError(f"--distill_alpha must be in [0, 1], got {task.distill_alpha}")
    from hf_zformer.conversion.teacher import temperature_problem

    if temperature_problem(task.distill_temperature):
        raise ValueError(f"--distill_temperature {temperature_problem(task.distill_temperature)}")
    if task.unlabeled_file is not None:
        if not task.teacher_model_name_or_path:
            raise ValueError("--unlabeled_file texts learn from the teacher only: pass --teacher_model_name_or_path too")
        if not Path(task.unlabeled_file).expanduser().is_file():
            raise ValueError(f"--unlabeled_file {task.unlabeled_file!r} is not a file")
    if task.max_unlabeled_samples is not None and task.max_unlabeled_samples < 1:
        raise ValueError(f"--max_unlabeled_samples must be >= 1, got {task.max_unlabeled_samples}")


def check_label_args(task: ClassificationArguments) -> None:
    """--max_length, --label_names (a list, which fixes --num_labels) and --num_labels (``ValueError``)."""
    if task.max_length < 2:
        raise ValueError(f"--max_length must be >= 2, got {task.max_length}")
    if isinstance(task.label_names, str):
        task.label_names = [name.strip() for name in task.label_names.split(",")]
        if not all(task.label_names) or len(set(task.label_names)) < len(task.label_names):
            raise ValueError(f"--label_names must be distinct non-empty names separated by commas, got {task.label_names}")
        if task.num_labels is None:  # the names declare the classes: other labels are errors
            task.num_labels = len(task.label_names)
        elif task.num_labels != len(task.label_names):
            raise ValueError(f"--num_labels {task.num_labels} but {len(task.label_names)} --label_names {task.label_names}")
    if task.num_labels is not None and task.num_labels < 2:
        raise ValueError(f"--num_labels must be >= 2, got {task.num_labels}")


def load_data(args: arguments.RunArguments):
    """The splits and the name of the evaluation one. The validation split carved from train
    (grouped by ``--group_column`` when present) and its ``--max_eval_samples`` subset depend on
    ``--split_seed`` only, so runs with different ``--seed`` validate on the same rows."""
    from hf_zformer.data import load_classification_dataset

    data, task, split_seed = args.data, args.task, args.evaluation.split_seed
    raw = load_classification_dataset(
        data.data_dir or data.dataset_name,
        text_column=task.text_column,
        label_column=task.label_column,
        seed=split_seed,
        group_column=task.group_column or None,
        config_name=data.dataset_config_name,
        num_labels=task.num_labels,
        allow_negative_labels=bool(data.dataset_name),  # Hub test splits use -1 for "no label"
    )
    eval_split = "validation" if "validation" in raw else "test"
    run.subsample(raw, {"train": data.max_train_samples}, args.training.seed)
    run.subsample(raw, {s: data.max_eval_samples for s in ("validation", "test") if s in raw}, split_seed)
    return raw, eval_split


def load_unlabeled(task: ClassificationArguments, seed: int):
    """The texts of ``--unlabeled_file`` (a ``--max_unlabeled_samples`` of them, drawn with ``seed``)
    as a split with the label -100 (:data:`hf_zformer.conversion.teacher.IGNORE_LABEL`); None without the file."""
    if task.unlabeled_file is None:
        return None
    from hf_zformer.data import load_text_dataset
    from hf_zformer.conversion.teacher import IGNORE_LABEL

    texts = {"train": load_text_dataset(task.unlabeled_file, text_column=task.text_column, validation_size=None)["train"]}
    if len(texts["train"]) == 0:
        raise ValueError(f"--unlabeled_file {task.unlabeled_file}: no texts in it (only blank lines or empty texts)")
    run.subsample(texts, {"train": task.max_unlabeled_samples}, seed)
    return texts["train"].map(lambda batch: {"label": [IGNORE_LABEL] * len(batch["text"])}, batched=True)


def class_count(raw, splits, source, logger) -> int:
    """K without --num_labels: the largest label of ``splits`` + 1. Labels are class ids, so a
    negative one is an error; ids with no training example get a warning (a stray label 7 in
    binary data would otherwise silently make an 8-class model)."""
    labels = {split: set(raw[split]["label"]) for split in splits}
    for split, found in labels.items():
        if found and min(found) < 0:
            raise ValueError(f"{source} split {split!r}: label {min(found)} is negative; class ids must be 0..K-1")
    num_labels = max(max(found, default=0) for found in labels.values()) + 1
    unused = sorted(set(range(num_labels)) - labels["train"])
    if unused:
        logger.warning(
            f"{num_labels} classes (largest label + 1) but no training example has label(s) {unused}; pass "
            "--num_labels K to make labels outside 0..K-1 an error instead"
        )
    return num_labels


def example_text(text: str, limit: int = 200) -> str:
    """``text`` cut at a word boundary to about ``limit`` characters (the model card's example)."""
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


def label_mapping(task: ClassificationArguments, raw, splits, source, logger) -> tuple[int, dict[int, str] | None]:
    """``(num_labels, id2label)``. The class names are ``--label_names``, else the names of a
    ``ClassLabel`` label column (Hub datasets), else none (a new model then says LABEL_<i>); K is
    ``--num_labels``, else one per name, else :func:`class_count`."""
    names = task.label_names or getattr(raw["train"].features["label"], "names", None)
    num_labels = task.num_labels or (len(names) if names else class_count(raw, splits, source, logger))
    if num_labels < 2:  # one class would make the model a regression (MSE) on the labels
        raise ValueError(f"{source}: every label is 0, which makes 1 class; a classifier needs at least 2 (pass "
                         "--num_labels K when the data lacks some of the classes 0..K-1)")
    if names and len(names) != num_labels:
        raise ValueError(f"{len(names)} label names {names} for {num_labels} classes: give one name per class")
    return num_labels, dict(enumerate(names)) if names else None


class Data(NamedTuple):
    """What :func:`read_data` read: the splits, the evaluation split(s), the classes and the
    ``--unlabeled_file`` texts (None without one)."""

    raw: Any
    eval_split: str
    eval_splits: list[str]
    num_labels: int
    id2label: dict[int, str] | None
    unlabeled: Any


def read_data(args: arguments.RunArguments, logger) -> Data:
    """The splits and classes; bad data is a message naming file and line, before any training."""
    source, task = args.data.data_dir or args.data.dataset_name, args.task
    with run.data_errors():
        logger.info(f"reading {source}")
        raw, eval_split = load_data(args)
        logger.info("read " + ", ".join(f"{len(raw[split]):,} {split}" for split in raw) + " texts")
        # a test split next to validation is scored once at the end, if labelled (Hub test splits may hold -1)
        labelled_test = ("test" in raw and eval_split != "test" and not task.skip_test
                         and min(raw["test"]["label"], default=-1) >= 0)
        eval_splits = [eval_split, *(["test"] if labelled_test else [])]
        num_labels, id2label = label_mapping(task, raw, ("train", *eval_splits), source, logger)
        return Data(raw, eval_split, eval_splits, num_labels, id2label, load_unlabeled(task, args.training.seed))


def build_model(args: arguments.RunArguments, accelerator, data: Data, logger):
    """``(tokenizer, model, max_length)``: a pretrained classifier (a new head when the classes
    differ) or a new one from the config flags; ``max_length`` is what the positions hold."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    flags, task = args.model, args.task
    base, trust, num_labels, id2label = flags.model_name_or_path, flags.trust_remote_code, data.num_labels, data.id2label
    tokenizer = run.load_tokenizer(args, accelerator, data.raw, model_max_length=task.max_length)
    run.require_pad_token(tokenizer, flags)
    if task.truncation_side:
        tokenizer.truncation_side = task.truncation_side
    if base:
        config = AutoConfig.from_pretrained(base, trust_remote_code=trust)
        if problem_type_problem(getattr(config, "problem_type", None)):
            run.usage_error(f"--model_name_or_path {base!r}: {problem_type_problem(config.problem_type)}")
        if getattr(config, "num_labels", None) != num_labels:
            logger.warning(f"{base} has {config.num_labels} labels, the data {num_labels}: new classifier head")
        names = {"id2label": id2label, "label2id": {v: k for k, v in id2label.items()}} if id2label else {}
        model = run.load_pretrained(
            AutoModelForSequenceClassification, base, num_labels=num_labels, ignore_mismatched_sizes=True, trust_remote_code=trust,
            dtype=torch.float32, **names,
        )
    else:
        id2label = id2label or {i: f"LABEL_{i}" for i in range(num_labels)}
        positions = {} if "max_position_embeddings" in flags.config_kwargs else {"max_position_embeddings": max(512, task.max_length)}
        config = run.new_model_config(
            flags,
            vocab_size=len(tokenizer),
            seq2seq=False,
            num_labels=num_labels,
            id2label=id2label,
            label2id={v: k for k, v in id2label.items()},
            pad_token_id=tokenizer.pad_token_id,
            **positions,
        )
        model = AutoModelForSequenceClassification.from_config(config)
    # a converted RoBERTa's positions start at position_offset = 2: 514 positions hold 512 tokens
    max_length = run.fit_to_positions("--max_length", task.max_length, model.config, logger)
    tokenizer.model_max_length = max_length  # saved with the model: evaluate_model.py truncates where training did
    return tokenizer, model, max_length


def teacher_loss(args: arguments.RunArguments, accelerator, model, max_length: int):
    """The loss with ``--teacher_model_name_or_path`` (:class:`hf_zformer.conversion.teacher.TeacherLoss`),
    else None (the model's own). Built before any tokenizing: a mismatched teacher is refused at once."""
    task = args.task
    if not task.teacher_model_name_or_path:
        return None
    from hf_zformer.conversion.teacher import TeacherLoss, load_teacher

    try:
        teacher = load_teacher(task.teacher_model_name_or_path, model.config, accelerator.device,
                               max_length=max_length, trust_remote_code=args.model.trust_remote_code)
    except ValueError as error:  # no model, no classifier, another tokenizer, classes or length: named
        run.usage_error(str(error))
    return TeacherLoss(teacher, alpha=task.distill_alpha, temperature=task.distill_temperature,
                       autocast=accelerator.autocast)  # the teacher in the run's mixed precision too


def tokenize_splits(args: arguments.RunArguments, accelerator, tokenizer, data: Data, max_length: int, logger) -> dict:
    """The training and evaluation splits as token ids and labels; the unlabeled texts join train."""
    from datasets import concatenate_datasets

    raw, unlabeled, splits = data.raw, data.unlabeled, ("train", *data.eval_splits)
    num_proc = args.data.preprocessing_num_workers

    def tokenize(batch):
        encoded = tokenizer(batch["text"], truncation=True, max_length=max_length)
        return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"], "labels": batch["label"]}

    texts = sum(len(raw[split]) for split in splits) + (len(unlabeled) if unlabeled is not None else 0)
    logger.info(f"tokenizing {texts:,} texts")
    with accelerator.main_process_first():
        processed = {
            split: raw[split].map(tokenize, batched=True, remove_columns=raw[split].column_names,
                                  num_proc=num_proc, desc=f"tokenize {split}")
            for split in splits
        }
        if unlabeled is not None:
            processed["train"] = concatenate_datasets([
                processed["train"],
                unlabeled.map(tokenize, batched=True, remove_columns=unlabeled.column_names,
                              num_proc=num_proc, desc="tokenize unlabeled")
                .cast(processed["train"].features),
            ])
            logger.info(f"{len(unlabeled)} unlabeled texts of {args.task.unlabeled_file} join the "
                        f"{len(raw['train'])} labelled ones: they learn from the teacher only")
    return processed


def train_and_score(args: arguments.RunArguments, accelerator, model, tokenizer, processed: dict, train_lengths: list[int], data: Data, loss_fn,
                    logger):
    """Train, then score the final (with --save_best: best) model: ``(model, results, hits)``, ``hits``
    per split and example of its latest evaluation (for the bootstrap intervals)."""
    eval_split, eval_splits, training = data.eval_split, data.eval_splits, args.training
    collate = batching.pad_collate(tokenizer.pad_token_id)
    train_dataloader, train_sampler = batching.make_dataloader(
        processed["train"], train_lengths, training.per_device_train_batch_size, collate, shuffle=True, seed=training.seed
    )
    eval_dataloaders = batching.make_eval_dataloaders(
        processed, eval_splits, training.per_device_eval_batch_size, collate, seed=training.seed
    )
    enable_cpu_speedups(model)  # faster layer forms on CPUs (hf_zformer.cpu_speedups); the saved model is unchanged
    optimizer = loop.make_optimizer(model, training)
    model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)
    eval_dataloaders = {split: accelerator.prepare(loader) for split, loader in eval_dataloaders.items()}
    hits: dict[str, list[bool]] = {}

    def evaluate(split: str = eval_split) -> dict:
        desc = "evaluate" if split == eval_split else f"evaluate {split}"
        scores, hits[split] = score_accuracy(accelerator, model, eval_dataloaders[split], desc=desc)
        return scores

    results = loop.train(
        args, accelerator, model, optimizer, train_dataloader, train_sampler, evaluate, logger,
        tokenizer=tokenizer, best_metric="accuracy", loss_fn=loss_fn,
    )
    results["eval_split"] = eval_split
    if data.unlabeled is not None:  # the texts the teacher taught (records of a later evaluation read it)
        results["unlabeled_examples"] = len(data.unlabeled)
    if args.evaluation.save_best and args.evaluation.results_file:  # hits of the best model (the final one) for the interval
        evaluate()
    if "test" in eval_splits and eval_split != "test":  # once, on the final (with --save_best: best) model
        logger.info(f"scoring the final model on the {len(data.raw['test']):,} texts of the test split (--skip_test: don't)")
        results.update({f"test_{k}": v for k, v in evaluate("test").items()})
    return model, results, hits


def write_records(args: arguments.RunArguments, model, results: dict, hits: dict, data: Data, max_length: int, wall_time_s: float,
                  tokens_per_epoch: int, logger) -> None:
    """One --results_file record per scored split, with its bootstrap interval."""
    from hf_zformer.training import results as records

    flags, seed, results_file = args.flags(), args.training.seed, args.evaluation.results_file
    common = records.run_fields(
        flags, model.config, results, max_length=max_length, wall_time_s=wall_time_s,
        tokens_per_epoch=tokens_per_epoch, train_examples=len(data.raw["train"]),
    )
    if args.task.teacher_model_name_or_path:
        common["teacher"] = records.teacher_of(flags, len(data.unlabeled) if data.unlabeled is not None else 0)
    rows = [
        {**common, "split": split, "metric": "accuracy", "beams": None, "samples": len(hits[split]),
         "value": round(100.0 * results[f"{prefix}_accuracy"], 4), "ci95": records.accuracy_ci(hits[split], seed=seed)}
        for split, prefix in zip(data.eval_splits, ("eval", "test"))
    ]
    with run.write_errors():
        records.append_records(results_file, rows)
    logger.info(f"{len(rows)} result records appended to {results_file}; the model is in {args.training.output_dir}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()

    accelerator, logger = run.start_run(args.training, __name__)
    data = read_data(args, logger)
    tokenizer, model, max_length = build_model(args, accelerator, data, logger)
    loss_fn = teacher_loss(args, accelerator, model, max_length)
    processed = tokenize_splits(args, accelerator, tokenizer, data, max_length, logger)
    train_lengths = [len(x) for x in processed["train"]["input_ids"]]
    model, results, hits = train_and_score(args, accelerator, model, tokenizer, processed, train_lengths, data, loss_fn,
                                           logger)
    card = dict(task="text-classification", metric_name="accuracy", example=example_text(data.raw[data.eval_split][0]["text"]))
    run.finish_run(args, accelerator, model, tokenizer, results, card_kwargs=card, logger=logger)
    if args.evaluation.results_file and accelerator.is_main_process:
        write_records(args, accelerator.unwrap_model(model), results, hits, data, max_length,
                      time.perf_counter() - started, sum(train_lengths), logger)
    return results


if __name__ == "__main__":
    main()
