#!/usr/bin/env python
"""Train or fine-tune a Zformer-family translation model with a plain Accelerate loop.

Works as ``python scripts/run_translation.py ...`` (one process) and under
``accelerate launch`` (N GPUs / N CPU processes, mixed precision from the launcher), e.g.

    accelerate launch --mixed_precision bf16 scripts/run_translation.py --dataset_name bentrevett/multi30k \
        --attention_type zformer --decoder_attention_type zformer --output_dir runs/multi30k-zformer

Evaluates sacreBLEU on detokenized text after every epoch (validation) and at the end on the test
split when there is one; writes the model (loads with ``trust_remote_code=True``), tokenizer,
generation config, ``all_results.json`` (``eval_bleu``, ``test_bleu``) and a model card.
"""

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from hf_zformer import enable_cpu_speedups, flags  # noqa: E402
from hf_zformer.training import arguments, batching, loop, run  # noqa: E402
from hf_zformer.training.scoring import generate_and_score  # noqa: E402


@dataclass
class TranslationArguments:
    """The language pair, lengths, beams and label smoothing of a translation run; checked when built."""

    source_lang: str = "de"
    target_lang: str = "en"
    max_source_length: int = 128
    max_target_length: int = 128
    num_beams: int = 1
    eval_num_beams: int = 1
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        if self.source_lang == self.target_lang:
            raise ValueError(f"--source_lang and --target_lang are both {self.source_lang!r}")
        for name, least in (("max_source_length", 2), ("max_target_length", 2), ("num_beams", 1),
                            ("eval_num_beams", 1)):
            if getattr(self, name) < least:
                raise ValueError(f"--{name} must be >= {least}, got {getattr(self, name)}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"--label_smoothing must be in [0, 1), got {self.label_smoothing}")


def parse_args(argv=None) -> arguments.RunArguments:
    parser = flags.ArgumentParser(description=__doc__.split("\n")[1], formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    arguments.add_data_args(parser)
    parser.add_argument("--source_lang", default="de")
    parser.add_argument("--target_lang", default="en")
    parser.add_argument("--max_source_length", type=int, default=128, help="Truncate sources to this many tokens.")
    parser.add_argument(
        "--max_target_length", type=int, default=128, help="Truncate targets; also the generation max_length."
    )
    parser.add_argument(
        "--num_beams", type=int, default=1,
        help="Beam size of the final test scoring (saved in generation_config); the test split is also decoded "
        "greedily when this is > 1.",
    )
    parser.add_argument(
        "--eval_num_beams", type=int, default=1,
        help="Beam size of the validation runs during training (greedy by default: beam search on 1,000 sentences "
        "costs about half an epoch on CPU).",
    )
    parser.add_argument("--label_smoothing", type=float, default=0.0, help="Label smoothing of the loss.")
    arguments.add_model_args(parser, seq2seq=True)
    arguments.add_training_args(parser)
    return arguments.parse_run_args(parser, argv, seq2seq=True, task=TranslationArguments)


def score_test(generate: Callable[[int], tuple], num_beams: int) -> tuple[dict, dict]:
    """Score the test split once with ``num_beams`` and, when that is beam search, greedily too
    (cheap next to beam search). ``generate(beams)`` is :func:`hf_zformer.training.scoring.generate_and_score`'s result.
    Returns (``test_bleu``, ``test_bleu_lowercase``, ``test_samples``, ``test_greedy_*``) and
    ``{beams: (predictions, references)}`` for confidence intervals."""
    results, outputs = {}, {}
    for beams in dict.fromkeys((num_beams, 1)):
        scores, _, predictions, references = generate(beams)
        prefix = "test_" if beams == num_beams else "test_greedy_"
        results.update({f"{prefix}{k}": v for k, v in scores.items() if k != "samples" or beams == num_beams})
        outputs[beams] = (predictions, references)
    return results, outputs


def result_records(args: arguments.RunArguments, config, results: dict, test_outputs: dict, test_split: str, **fields) -> list[dict]:
    """The ``--results_file`` records: best (or last) validation BLEU, and test BLEU cased and
    lowercased for each decoding, with bootstrap 95% intervals over test sentences."""
    from hf_zformer.training import results as records

    common = records.run_fields(args.flags(), config, results, **fields)
    rows = [{**common, "split": results["eval_split"], "metric": "bleu", "value": results["eval_bleu"],
             "beams": args.task.eval_num_beams, "samples": results.get("eval_samples"), "ci95": None}]
    for beams, (predictions, references) in test_outputs.items():
        prefix = "test_" if beams == args.task.num_beams else "test_greedy_"
        for metric in ("bleu", "bleu_lowercase"):
            ci = records.bleu_ci(predictions, references, lowercase=metric == "bleu_lowercase", seed=args.training.seed)
            rows.append({**common, "split": test_split, "metric": metric, "value": results[prefix + metric],
                         "beams": beams, "samples": len(predictions), "ci95": ci})
    return rows


def test_split_name(args: arguments.RunArguments) -> str:
    """``test2016`` for Multi30K's usual test set (``test_2016_flickr`` files, or the Hub copy), else ``test``."""
    if args.data.data_dir:
        found = any(Path(args.data.data_dir).glob(f"test_2016_flickr.{args.task.source_lang}*"))
    else:
        found = args.data.dataset_name.rstrip("/").lower().endswith("multi30k")
    return "test2016" if found else "test"


def read_data(args: arguments.RunArguments):
    """``(raw, eval_splits)``: the pairs and the splits scored (validation, then test when present).
    Bad data is a message naming file and line, before any training."""
    from hf_zformer.data import load_translation_dataset

    data, split_seed = args.data, args.evaluation.split_seed
    with run.data_errors():
        raw = load_translation_dataset(
            data.data_dir or data.dataset_name,
            args.task.source_lang,
            args.task.target_lang,
            seed=split_seed,
            config_name=data.dataset_config_name,
        )
    eval_splits = [s for s in ("validation", "test") if s in raw]
    if not eval_splits:
        raise ValueError(f"the dataset has no validation or test split (splits: {list(raw)})")
    run.subsample(raw, {"train": data.max_train_samples}, args.training.seed)
    run.subsample(raw, dict.fromkeys(eval_splits, data.max_eval_samples), split_seed)  # same rows for every --seed
    return raw, eval_splits


def build_model(args: arguments.RunArguments, accelerator, raw, logger):
    """``(tokenizer, model, max_source, max_target)``: a pretrained encoder-decoder or a new one from
    the config flags, its generation settings, and the lengths its positions hold."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    flags, task = args.model, args.task
    base, trust = flags.model_name_or_path, flags.trust_remote_code
    tokenizer = run.load_tokenizer(args, accelerator, raw)
    run.require_pad_token(tokenizer, flags)
    if base:
        config = AutoConfig.from_pretrained(base, trust_remote_code=trust, label_smoothing=task.label_smoothing)
        model = run.load_pretrained(AutoModelForSeq2SeqLM, base, config=config, trust_remote_code=trust,
                                    dtype=torch.float32)
    else:
        extra = {"label_smoothing": task.label_smoothing, "pad_token_id": tokenizer.pad_token_id}
        if "max_position_embeddings" not in flags.config_kwargs:
            extra["max_position_embeddings"] = max(512, task.max_source_length, task.max_target_length)
        config = run.new_model_config(flags, vocab_size=len(tokenizer), seq2seq=True, **extra)
        model = AutoModelForSeq2SeqLM.from_config(config)
    max_source = run.fit_to_positions("--max_source_length", task.max_source_length, model.config, logger)
    max_target = run.fit_to_positions("--max_target_length", task.max_target_length, model.config, logger)
    model.generation_config.num_beams = task.num_beams
    model.generation_config.max_length = max_target
    model.generation_config.decoder_start_token_id = model.config.decoder_start_token_id
    return tokenizer, model, max_source, max_target


def tokenize_splits(args: arguments.RunArguments, accelerator, tokenizer, raw, splits, max_source: int,
                    max_target: int):
    """``splits`` as source ids, target ids (labels) and the pair's index."""
    source_lang, target_lang = args.task.source_lang, args.task.target_lang

    def tokenize(batch, indices):
        sources = [pair[source_lang] for pair in batch["translation"]]
        targets = [pair[target_lang] for pair in batch["translation"]]
        inputs = tokenizer(sources, truncation=True, max_length=max_source)
        labels = tokenizer(text_target=targets, truncation=True, max_length=max_target)
        return {
            "input_ids": inputs["input_ids"],
            "attention_mask": inputs["attention_mask"],
            "labels": labels["input_ids"],
            "index": indices,
        }

    with accelerator.main_process_first():
        return {
            split: raw[split].map(
                tokenize,
                batched=True,
                with_indices=True,
                remove_columns=raw[split].column_names,
                num_proc=args.data.preprocessing_num_workers,
                desc=f"tokenize {split}",
            )
            for split in splits
        }


def train_and_score(args: arguments.RunArguments, accelerator, model, tokenizer, processed: dict, eval_splits: list[str], max_target: int,
                    logger):
    """Train, then score the test split once on the final (with --save_best: best) model:
    ``(model, results, test_outputs, train_lengths)``, ``test_outputs`` as :func:`score_test` gives them."""
    from hf_zformer import metrics as hf_metrics

    training, task = args.training, args.task
    collate = batching.pad_collate(tokenizer.pad_token_id)
    train_set = processed["train"].remove_columns(["index"])
    train_lengths = [len(s) + len(t) for s, t in zip(train_set["input_ids"], train_set["labels"])]
    train_dataloader, train_sampler = batching.make_dataloader(
        train_set, train_lengths, training.per_device_train_batch_size, collate, shuffle=True, seed=training.seed
    )
    eval_dataloaders = batching.make_eval_dataloaders(
        processed, eval_splits, training.per_device_eval_batch_size, collate, seed=training.seed
    )
    enable_cpu_speedups(model)  # faster layer forms on CPUs (hf_zformer.cpu_speedups); the saved model is unchanged
    optimizer = loop.make_optimizer(model, training)
    model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)
    eval_dataloaders = {split: accelerator.prepare(loader) for split, loader in eval_dataloaders.items()}
    bleu = hf_metrics.load("sacrebleu")

    def generate(split: str, num_beams: int) -> tuple:
        return generate_and_score(
            accelerator, model, eval_dataloaders[split], tokenizer, num_beams=num_beams, max_length=max_target,
            metric=bleu,
        )

    results = loop.train(
        args, accelerator, model, optimizer, train_dataloader, train_sampler,
        lambda: generate(eval_splits[0], task.eval_num_beams)[0], logger, tokenizer=tokenizer, best_metric="bleu",
    )
    results["eval_split"] = eval_splits[0]
    test_outputs = {}
    if "test" in eval_splits and eval_splits[0] != "test":  # once, on the final (with --save_best: best) model
        test_results, test_outputs = score_test(lambda beams: generate("test", beams), task.num_beams)
        results.update(test_results)
        logger.info(f"test: bleu {results['test_bleu']:.2f} (lowercased {results['test_bleu_lowercase']:.2f}), "
                    f"{task.num_beams} beams")
    results["num_beams"], results["eval_num_beams"] = task.num_beams, task.eval_num_beams
    return model, results, test_outputs, train_lengths


def main(argv=None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()

    accelerator, logger = run.start_run(args.training, __name__)
    raw, eval_splits = read_data(args)
    tokenizer, model, max_source, max_target = build_model(args, accelerator, raw, logger)
    processed = tokenize_splits(args, accelerator, tokenizer, raw, ["train", *eval_splits], max_source, max_target)
    model, results, test_outputs, train_lengths = train_and_score(
        args, accelerator, model, tokenizer, processed, eval_splits, max_target, logger)
    card = dict(task="translation", metric_name="bleu", languages=[args.task.source_lang, args.task.target_lang],
                example=raw[eval_splits[0]][0]["translation"][args.task.source_lang])
    run.finish_run(args, accelerator, model, tokenizer, results, card_kwargs=card, logger=logger)
    results_file = args.evaluation.results_file
    if results_file and accelerator.is_main_process:
        from hf_zformer.training.results import append_records

        records = result_records(
            args, accelerator.unwrap_model(model).config, results, test_outputs, test_split_name(args),
            max_length=max_target, wall_time_s=time.perf_counter() - started, tokens_per_epoch=sum(train_lengths),
            train_examples=len(train_lengths),
        )
        with run.write_errors():
            append_records(results_file, records)
        logger.info(f"{len(records)} result records appended to {results_file}; the model is in "
                    f"{args.training.output_dir}")
    return results


if __name__ == "__main__":
    main()
