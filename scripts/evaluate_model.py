#!/usr/bin/env python
"""Evaluate a saved model folder or Hub id on a dataset split.

The task follows the checkpoint: sequence-to-sequence models (config ``is_encoder_decoder`` or a
``*ForConditionalGeneration`` architecture) are scored with sacreBLEU on generated, detokenized
text; sequence classifiers with accuracy. Writes ``<split>_predictions.jsonl`` (one row per
example, in dataset order) and ``<split>_results.json`` into ``--output_dir``. Runs on one process
or under ``accelerate launch`` (predictions gathered across processes).

    python scripts/evaluate_model.py --model_name_or_path runs/multi30k-zformer \
        --data_dir ../shared/data/multi30k --split test --output_dir runs/multi30k-zformer/eval
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from hf_zformer import enable_cpu_speedups, flags, folders  # noqa: E402
from hf_zformer.data import load_classification_dataset, load_translation_dataset  # noqa: E402
from hf_zformer.data.splits import DEFAULT_GROUP_COLUMN  # noqa: E402  (the loaders' and the training scripts' default)
from hf_zformer.training import batching, feedback, run  # noqa: E402
from hf_zformer.training import results as records  # noqa: E402
from hf_zformer.training.arguments import ModelArguments, ModelEvaluationArguments, RunArguments  # noqa: E402
from hf_zformer.training.scoring import corpus_bleu, generate_and_score, predict_labels  # noqa: E402


def score_by_length(rows: list[dict], texts: dict, edges: list[int], metric=None) -> list[dict]:
    """Per length bucket of the inputs (whitespace words of `texts[row["index"]]`; buckets end at
    `edges`, the last open): the number of examples and, with a sacreBLEU `metric` (translation),
    corpus BLEU of the bucket's sentences, cased and lowercased, else accuracy in %."""
    bounds = [(1 if i == 0 else edges[i - 1] + 1, edge) for i, edge in enumerate(edges)] + [(edges[-1] + 1, None)]
    words = {index: len(text.split()) for index, text in texts.items()}
    buckets = []
    for low, high in bounds:
        members = [r for r in rows if low <= words[r["index"]] and (high is None or words[r["index"]] <= high)]
        entry = {"words": f"{low}-{high}" if high is not None else f">={low}", "samples": len(members)}
        if metric is not None:
            entry.update(corpus_bleu(metric, [r["prediction"] for r in members], [r["reference"] for r in members])
                         if members else {"bleu": None, "bleu_lowercase": None})
        else:
            entry["accuracy"] = 100 * sum(r["prediction"] == r["label"] for r in members) / len(members) if members else None
        buckets.append(entry)
    return buckets


def length_table(buckets: list[dict], seq2seq: bool) -> str:
    """A markdown table of `score_by_length`'s buckets."""
    names = ["bleu", "bleu_lowercase"] if seq2seq else ["accuracy"]
    lines = ["| words | samples | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
    for b in buckets:
        cells = ["-" if b[n] is None else f"{b[n]:.2f}" for n in names]
        lines.append(f"| {b['words']} | {b['samples']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv=None) -> RunArguments:
    parser = flags.ArgumentParser(description=__doc__.split("\n")[1], allow_abbrev=False)
    parser.add_argument("--model_name_or_path", required=True, help="Saved folder or Hub id.")
    parser.add_argument("--tokenizer_name", default=None, help="Default: the model's tokenizer.")
    parser.add_argument("--dataset_name", default=None, help="Hub dataset (exclusive with --data_dir).")
    parser.add_argument("--dataset_config_name", default=None)
    parser.add_argument("--data_dir", default=None, help="Local dataset folder (exclusive with --dataset_name).")
    parser.add_argument("--split", default=None, help="Default: test if the dataset has one, else validation.")
    parser.add_argument("--output_dir", required=True, help="Where predictions and metrics go.")
    parser.add_argument("--results_file", default=None,
                        help="Append one result record (split, metric, value, samples, bootstrap ci95, the model's "
                             "config, and the recipe of the run that trained the folder: base model, distillation, "
                             "teacher, precision) to this JSON list, e.g. docs/results.json (docs/training.md).")
    parser.add_argument("--per_device_eval_batch_size", type=int, default=64)
    parser.add_argument("--max_eval_samples", type=int, default=None,
                        help="Evaluate a seeded random subset (the rows training's --max_eval_samples and --split_seed pick).")
    add_task_args(parser)
    parser.add_argument("--seed", type=int, default=42, help="Seed of the evaluation dataloader (not of the rows).")
    parser.add_argument("--split_seed", type=int, default=42,
                        help="Seed of the validation split carved from train and of --max_eval_samples: the "
                        "training run's --split_seed gives the rows it validated on.")
    parser.add_argument("--group_column", default=DEFAULT_GROUP_COLUMN,
                        help='Classification: carve validation by whole groups of this column when present (as '
                        'run_classification.py does); "" carves by rows.')
    parser.add_argument("--length_buckets", type=int, nargs="+", default=None,
                        help="Also score by input length: the upper ends (in words of the source / text, "
                        "whitespace-split) of the length buckets, the last bucket open-ended, e.g. 8 12 16 "
                        "for Multi30K, 128 256 512 for IMDB. BLEU (cased and lowercased) or accuracy per bucket, "
                        "in <split>_results.json under <split>_by_length and printed as a table.")
    parser.add_argument("--trust_remote_code", action="store_true",
                        help="Run the code a checkpoint ships (auto_map) for model types hf_zformer does not provide. "
                        "Off by default: hf_zformer's own models load with the installed library code.")
    args = RunArguments.from_flags(vars(parser.parse_args(argv)), ModelEvaluationArguments)
    check_args(parser, args)
    return args


def add_task_args(parser) -> None:
    """The columns and lengths of each task (translation, classification)."""
    parser.add_argument("--source_lang", default="de")
    parser.add_argument("--target_lang", default="en")
    parser.add_argument("--text_column", default="text")
    parser.add_argument("--label_column", default="label")
    parser.add_argument("--max_source_length", type=int, default=128, help="Seq2seq: truncate sources.")
    parser.add_argument("--max_target_length", type=int, default=None, help="Seq2seq: generation max_length (default: generation config).")
    parser.add_argument("--num_beams", type=int, default=None, help="Seq2seq: beams (default: generation config).")
    parser.add_argument("--max_length", type=int, default=None,
                        help="Classification: truncate texts to this many tokens. Default: the length the model was "
                             "trained with (its tokenizer's model_max_length), else 512.")
    parser.add_argument("--truncation_side", choices=("right", "left"), default=None,
                        help="Classification: cut long texts at their end (right) or beginning (left). Default: "
                        "the tokenizer's saved setting (run_classification.py --truncation_side).")


def check_args(parser, args: RunArguments) -> None:
    """Ranges, the one data source, the output folder (never the model's) and --results_file, before any work."""
    edges = args.task.length_buckets
    if edges is not None and (edges[0] < 1 or any(b <= a for a, b in zip(edges, edges[1:]))):
        parser.error(f"--length_buckets must be increasing positive word counts, got {edges}")
    if bool(args.data.dataset_name) == bool(args.data.data_dir):
        parser.error("pass exactly one of --dataset_name (Hub) and --data_dir (local folder)")
    if args.data.data_dir and not Path(args.data.data_dir).is_dir():
        parser.error(f"--data_dir {args.data.data_dir!r} is not a directory")
    for part, name in ((args.training, "per_device_eval_batch_size"), (args.data, "max_eval_samples"),
                       (args.task, "num_beams"), (args.task, "max_target_length"), (args.task, "max_length")):
        value = getattr(part, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be >= 1, got {value}")
    try:  # new, empty or a folder of this library's that takes a write; never the model or the data
        args.training.output_dir = str(folders.check_output_dir(
            args.training.output_dir, name="--output_dir", whole=False,
            inputs={"--model_name_or_path": args.model.model_name_or_path,
                    "--tokenizer_name": args.model.tokenizer_name, "--data_dir": args.data.data_dir}))
        check_writes(args, args.task.split)
    except (ValueError, OSError) as error:
        parser.error(str(error))
    try:  # found after the whole evaluation otherwise
        if args.evaluation.results_file:
            records.check_results_file(args.evaluation.results_file, args.training.output_dir)
    except ValueError as error:
        parser.error(f"--results_file: {error}")


def output_files(split: str) -> list[str]:
    """What an evaluation of ``split`` writes into --output_dir."""
    return [f"{split}_predictions.jsonl", f"{split}_results.json"]


def check_writes(args: RunArguments, split: str | None) -> None:
    """--output_dir takes a write, and holds no file of the user's (nor a link) under the names the
    evaluation of ``split`` writes (:func:`hf_zformer.folders.check_writes`); ``ValueError`` /
    ``OSError`` naming it. Checked while parsing, and again once the split is known."""
    folders.check_writes(args.training.output_dir, output_files(split) if split else [], name="--output_dir")


def result_record(args: RunArguments, config, rows, results, split: str, seq2seq: bool) -> dict:
    """The record ``--results_file`` gets: the saved model's fields (``results.evaluation_fields``)
    and this evaluation's split, metric, value, sample count and seeded bootstrap interval."""
    if seq2seq:
        metric, value, beams = "bleu", results[f"{split}_bleu"], results["num_beams"]
        ci95 = records.bleu_ci([r["prediction"] for r in rows], [r["reference"] for r in rows], seed=args.training.seed)
        max_length = args.task.max_source_length
    else:
        metric, value, beams = "accuracy", 100.0 * results[f"{split}_accuracy"], None
        ci95 = records.accuracy_ci([r["prediction"] == r["label"] for r in rows], seed=args.training.seed)
        max_length = results["max_length"]
    return {**records.evaluation_fields(args.flags(), config), "max_length": max_length,
            **({"truncation_side": results["truncation_side"]} if not seq2seq else {}),
            "split": split, "metric": metric, "beams": beams, "samples": len(rows), "value": round(value, 4),
            "ci95": ci95}


def is_seq2seq(config) -> bool:
    return bool(getattr(config, "is_encoder_decoder", False)) or any(
        arch.endswith("ForConditionalGeneration") for arch in (config.architectures or [])
    )


def load_config(model: ModelArguments):
    """The model's config; a folder that is no saved model, a config that fails validation, foreign
    code without --trust_remote_code and a Hub id not found are usage errors naming it."""
    from transformers import AutoConfig

    folder = Path(model.model_name_or_path).expanduser()
    if folder.is_dir() and not (folder / "config.json").is_file():
        run.usage_error(f"--model_name_or_path {model.model_name_or_path!r} is not a saved model (no "
                        "config.json); pass a folder a training script or the converter wrote")
    try:
        return AutoConfig.from_pretrained(model.model_name_or_path, trust_remote_code=model.trust_remote_code)
    except ValueError as error:
        if "trust_remote_code" not in str(error):  # a config.json that fails validation: named, with its field
            run.usage_error(f"--model_name_or_path {model.model_name_or_path!r}: {str(error).splitlines()[0]}")
        raise SystemExit(
            f"error: {model.model_name_or_path} ships its own model code (auto_map in config.json) for a model type "
            "hf_zformer does not provide; it was not run. Inspect that code, then pass --trust_remote_code to run it."
        ) from None
    except OSError as error:  # a Hub id that is not cached (offline) or does not exist
        run.usage_error(f"--model_name_or_path {model.model_name_or_path!r}: no model config found "
                        f"({str(error).splitlines()[0]})")


def read_split(args: RunArguments, seq2seq: bool):
    """``(split, data)``: the split evaluated, with training's ``--max_eval_samples`` rows. Bad data
    or an unreachable Hub dataset is one line naming it, exit code 2."""
    source = args.data.data_dir or args.data.dataset_name
    loading = {"seed": args.evaluation.split_seed, "config_name": args.data.dataset_config_name}
    with run.data_errors():
        if seq2seq:
            raw = load_translation_dataset(source, args.task.source_lang, args.task.target_lang, **loading)
        else:
            raw = load_classification_dataset(
                source, text_column=args.task.text_column, label_column=args.task.label_column,
                group_column=args.task.group_column or None, **loading
            )
    split = args.task.split or ("test" if "test" in raw else "validation")
    if split not in raw:
        run.usage_error(f"--split {split!r} is not a split of {source} (splits: {list(raw)})")
    # the rows training evaluated on
    run.subsample(raw, {split: args.data.max_eval_samples}, args.evaluation.split_seed)
    return split, raw[split]


def tokenized_loader(args: RunArguments, tokenizer, data, seq2seq: bool, limit: int, max_length: int):
    """``data`` tokenized as training did (``limit``: the model's positions; ``max_length``: the
    texts' truncation, classification), in a dataloader that keeps each example's index."""
    def tokenize(batch, indices):
        if seq2seq:
            sources = [p[args.task.source_lang] for p in batch["translation"]]
            encoded = tokenizer(sources, truncation=True, max_length=min(args.task.max_source_length, limit))
            labels = tokenizer(text_target=[p[args.task.target_lang] for p in batch["translation"]])["input_ids"]
        else:
            encoded = tokenizer(batch["text"], truncation=True, max_length=min(max_length, limit))
            labels = batch["label"]
        return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"], "labels": labels,
                "index": indices}

    processed = data.map(tokenize, batched=True, with_indices=True, remove_columns=data.column_names)
    loader, _ = batching.make_dataloader(
        processed, [len(x) for x in processed["input_ids"]], args.training.per_device_eval_batch_size,
        batching.pad_collate(tokenizer.pad_token_id), shuffle=False, seed=args.training.seed,
    )
    return loader


def score_translation(args: RunArguments, accelerator, model, loader, tokenizer, data, split: str, limit: int):
    """``(results, rows, metric)``: BLEU of the generated translations, one row per sentence."""
    from hf_zformer import metrics as hf_metrics

    generation = accelerator.unwrap_model(model).generation_config
    num_beams = args.task.num_beams or generation.num_beams or 1
    max_length = min(args.task.max_target_length or generation.max_length or 128, limit)
    metric = hf_metrics.load("sacrebleu")
    scores, indices, predictions, _ = generate_and_score(
        accelerator, model, loader, tokenizer, num_beams=num_beams, max_length=max_length, metric=metric,
    )
    results = {f"{split}_bleu": scores["bleu"], f"{split}_samples": scores["samples"], "num_beams": num_beams}
    rows = [
        {"index": i, "source": data[i]["translation"][args.task.source_lang], "prediction": p,
         "reference": data[i]["translation"][args.task.target_lang]}
        for i, p in zip(indices, predictions)
    ]
    return results, rows, metric


def score_classification(accelerator, model, loader, tokenizer, split: str, limit: int, max_length: int):
    """``(results, rows)``: accuracy of the predicted labels, one row per text."""
    predictions, labels, indices = predict_labels(accelerator, model, loader)
    found = dict(zip(indices or [], zip(predictions, labels)))
    id2label = model.config.id2label
    rows = [
        {"index": i, "prediction": p, "prediction_label": id2label.get(p, str(p)), "label": y}
        for i, (p, y) in sorted(found.items())
    ]
    accuracy = sum(r["prediction"] == r["label"] for r in rows) / max(len(rows), 1)
    results = {f"{split}_accuracy": accuracy, f"{split}_samples": len(rows),
               "max_length": min(max_length, limit), "truncation_side": tokenizer.truncation_side}
    return results, rows


def write_outputs(args: RunArguments, config, rows: list[dict], results: dict, split: str, seq2seq: bool, logger) -> None:
    """``<split>_predictions.jsonl`` and ``<split>_results.json`` in --output_dir; the --results_file record."""
    predictions, results_name = output_files(split)
    with run.write_errors(), folders.writing(args.training.output_dir) as staging:  # moved into place when whole
        with open(staging / predictions, "w") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        (staging / results_name).write_text(json.dumps(results, indent=2))
    logger.info(f"results: {json.dumps(results)}")
    if args.evaluation.results_file:
        record = result_record(args, config, rows, results, split, seq2seq)
        with run.write_errors():
            records.append_records(args.evaluation.results_file, [record])
        logger.info(f"result record ({split}, {record['metric']} {record['value']}) appended to "
                    f"{args.evaluation.results_file}")


def classification_length(task: ModelEvaluationArguments, tokenizer) -> int:
    """--max_length, else the training length, which the training scripts save with the tokenizer, else 512."""
    if task.max_length is not None:
        return task.max_length
    saved = getattr(tokenizer, "model_max_length", None)
    return saved if isinstance(saved, int) and 0 < saved <= 100_000 else 512


def load_model(auto_class, model_args: ModelArguments):
    """The model, refused (exit code 2) unless it is the folder's own: every weight loaded, none
    left over or of another shape (a folder of another kind, or a config edited after training,
    would be scored with random weights) and none NaN or infinite."""
    name = model_args.model_name_or_path
    try:
        model, loading = auto_class.from_pretrained(name, trust_remote_code=model_args.trust_remote_code,
                                                    dtype=torch.float32, output_loading_info=True,
                                                    ignore_mismatched_sizes=True)  # listed below, not a traceback
    except Exception as error:  # noqa: BLE001  (a pickle refused, a truncated file, a missing shard)
        run.usage_error(f"--model_name_or_path {name!r}: its weights cannot be loaded ({run.weights_failure(error)})")
    problems = [(what, [str(key[0] if isinstance(key, tuple) else key) for key in loading.get(field) or []])
                for field, what in (("missing_keys", "missing (initialised at random)"),
                                    ("unexpected_keys", "left unused"),
                                    ("mismatched_keys", "of another shape than the config's"))]
    problems = [(what, keys) for what, keys in problems if keys]
    if problems:
        found = ", ".join(getattr(model.config, "architectures", None) or ["no architecture"])
        listed = "; ".join(f"{len(keys)} weights {what} (e.g. {', '.join(keys[:2])})" for what, keys in problems)
        run.usage_error(f"--model_name_or_path {name!r} ({found}) does not load as a {type(model).__name__}: "
                        f"{listed}. Its weights are not the model its config describes (a folder of another task, "
                        "or a config.json edited after training); evaluate the folder a training script or the "
                        "converter wrote")
    run.require_finite_weights(model, f"--model_name_or_path {name!r}")
    return model


def check_labels(data, config, name: str, split: str) -> None:
    """Stop (exit code 2) when the labels of ``data`` do not fit the classifier's classes."""
    labels = [label for label in data["label"] if label >= 0]  # Hub test splits use -1 for "no label"
    if labels and max(labels) >= config.num_labels:
        run.usage_error(f"--split {split!r} holds labels up to {max(labels)}, but --model_name_or_path {name!r} has "
                        f"{config.num_labels} classes (0..{config.num_labels - 1}): its head does not fit these "
                        "labels; evaluate it on the data it was trained for")


def main(argv=None) -> dict:
    args = parse_args(argv)
    from transformers import AutoModelForSeq2SeqLM, AutoModelForSequenceClassification

    accelerator = run.make_accelerator(args.training)  # one process's batches: no accumulation, no tracking
    feedback.setup_logging(accelerator)
    logger = feedback.get_logger(__name__, accelerator)
    config = load_config(args.model)
    tokenizer = run.pretrained_tokenizer(args.model, args.model.tokenizer_name or args.model.model_name_or_path)
    if args.task.truncation_side:
        tokenizer.truncation_side = args.task.truncation_side
    seq2seq = is_seq2seq(config)
    split, data = read_split(args, seq2seq)
    try:  # the split is known: before the evaluation, its files' names are checked
        folders.recover(args.training.output_dir, logger=logger)  # what a killed evaluation left
        check_writes(args, split)
    except (ValueError, OSError) as error:
        run.usage_error(str(error))
    auto = AutoModelForSeq2SeqLM if seq2seq else AutoModelForSequenceClassification
    model = load_model(auto, args.model)
    if not seq2seq:
        check_labels(data, model.config, args.model.model_name_or_path, split)
    limit = model.config.max_position_embeddings
    if seq2seq:  # cut with a warning, and recorded as cut
        args.task.max_source_length = run.fit_to_positions("--max_source_length", args.task.max_source_length,
                                                           model.config, logger)
    max_length = classification_length(args.task, tokenizer)
    if not seq2seq and args.task.max_length is not None:
        max_length = run.fit_to_positions("--max_length", max_length, model.config, logger)
    enable_cpu_speedups(model)  # faster layer forms on CPUs (hf_zformer.cpu_speedups); the saved model is unchanged
    model, loader = accelerator.prepare(model, tokenized_loader(args, tokenizer, data, seq2seq, limit, max_length))
    if seq2seq:
        results, rows, metric = score_translation(args, accelerator, model, loader, tokenizer, data, split, limit)
    else:
        (results, rows), metric = score_classification(accelerator, model, loader, tokenizer, split, limit,
                                                       max_length), None
    results.update(model=args.model.model_name_or_path, dataset=args.data.data_dir or args.data.dataset_name,
                   split=split, task="translation" if seq2seq else "text-classification")
    if args.task.length_buckets:
        source_lang, column = args.task.source_lang, args.task.text_column
        texts = {r["index"]: data[r["index"]]["translation"][source_lang] if seq2seq else data[r["index"]][column]
                 for r in rows}
        results[f"{split}_by_length"] = score_by_length(rows, texts, args.task.length_buckets, metric)
        logger.info("by input length (words):\n" + length_table(results[f"{split}_by_length"], seq2seq))
    if accelerator.is_main_process:
        write_outputs(args, accelerator.unwrap_model(model).config, rows, results, split, seq2seq, logger)
    return results


if __name__ == "__main__":
    main()
