"""What the language-modelling scripts share (library side, never shipped): their data arguments,
the documents with a carved validation split, the fixed-length blocks both ``run_clm.py`` (causal
LM) and ``run_mlm.py`` (masked LM) train on, and the run on them (:func:`train_on_blocks`)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import batching, run

__all__ = ["Blocks", "add_document_args", "block_size_for", "build_blocks", "check_document_args", "load_documents",
           "load_model", "make_blocks", "train_on_blocks"]


def add_document_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--train_file", default=None,
        help="Local file of training documents: .jsonl[.gz]/.csv[.gz] (one per row, in --text_column) or "
        ".txt[.gz] (one per line). Exclusive with --dataset_name and --data_dir.",
    )
    parser.add_argument("--validation_file", default=None, help="Local file of validation documents (with --train_file).")
    parser.add_argument("--text_column", default="text")
    parser.add_argument(
        "--validation_split_percentage", type=int, default=5,
        help="Without a validation split, hold out this percentage of the training documents (seeded by --split_seed).",
    )
    from ..data.splits import DEFAULT_GROUP_COLUMN  # the loaders' default too

    parser.add_argument(
        "--group_column", default=DEFAULT_GROUP_COLUMN,
        help='When the data has this column, the held-out validation documents keep each group (IMDB: each movie\'s '
        'reviews) on one side; "" carves by documents.',
    )
    parser.add_argument("--block_size", type=int, default=512, help="Tokens per training/validation block.")


def check_document_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.block_size < 2:
        parser.error(f"--block_size must be >= 2, got {args.block_size}")
    if not 0 < args.validation_split_percentage < 100:
        parser.error(f"--validation_split_percentage must be in 1..99, got {args.validation_split_percentage}")
    if args.validation_file and not args.train_file:
        parser.error("--validation_file goes with --train_file")


def load_documents(args: argparse.Namespace):
    """The documents: ``train`` and ``validation`` (carved from train, grouped by ``--group_column``
    when present, when the data has none). The carve and the ``--max_eval_samples`` subset depend
    on ``--split_seed`` only, so runs with different ``--seed`` are scored on the same text.
    ``--max_train_samples`` / ``--max_eval_samples`` count documents, before grouping into blocks."""
    from ..data import load_text_dataset

    raw = load_text_dataset(
        args.data_dir or args.train_file or args.dataset_name,
        text_column=args.text_column,
        validation_file=args.validation_file,
        validation_size=args.validation_split_percentage / 100,
        seed=args.split_seed,
        group_column=args.group_column or None,
        config_name=args.dataset_config_name,
    )
    if "validation" not in raw:
        raise ValueError(f"the dataset has no validation split and none could be carved (splits: {list(raw)})")
    run.subsample(raw, {"train": args.max_train_samples}, args.seed)
    run.subsample(raw, {"validation": args.max_eval_samples}, args.split_seed)
    return raw


def make_blocks(raw, tokenizer, block_size: int, accelerator, args) -> dict:
    """``{split: Dataset of input_ids blocks}`` (:func:`hf_zformer.training.batching.group_into_blocks`, the
    documents separated by the EOS token), each row with its ``block`` index; an error when a split
    has less than one block of text."""
    import datasets

    def tokenize(batch):
        return {"input_ids": tokenizer(batch["text"], add_special_tokens=False, verbose=False)["input_ids"]}

    processed = {}
    with accelerator.main_process_first():
        for split in ("train", "validation"):
            tokens = raw[split].map(tokenize, batched=True, remove_columns=raw[split].column_names,
                                    num_proc=args.preprocessing_num_workers, desc=f"tokenize {split}")
            documents = (ids for batch in tokens.with_format("numpy").iter(batch_size=1000) for ids in batch["input_ids"])
            blocks = batching.group_into_blocks(documents, block_size, tokenizer.eos_token_id)
            if len(blocks) == 0:
                raise ValueError(
                    f"the {split} split has fewer tokens than one --block_size block of {block_size}: lower "
                    "--block_size, or give it more text (--validation_split_percentage, --max_*_samples)"
                )
            processed[split] = datasets.Dataset.from_dict({"input_ids": blocks, "block": list(range(len(blocks)))})
    return processed


def load_model(args: argparse.Namespace, auto_class, tokenizer):
    """``--model_name_or_path`` in fp32, or a new model of ``auto_class`` from the model arguments,
    with the tokenizer's vocabulary and special tokens and positions for ``--block_size``."""
    import torch

    from .arguments import build_config

    if args.model_name_or_path:
        return run.load_pretrained(auto_class, args.model_name_or_path, trust_remote_code=args.trust_remote_code,
                                   dtype=torch.float32)
    positions = {} if "max_position_embeddings" in args.config_kwargs else {"max_position_embeddings": max(512, args.block_size)}
    config = build_config(
        args, vocab_size=len(tokenizer), seq2seq=False, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **positions,
    )
    return auto_class.from_config(config)


def block_size_for(args: argparse.Namespace, config, logger) -> int:
    """``--block_size``, cut to the model's positions (with a warning)."""
    block_size = min(args.block_size, config.max_position_embeddings - getattr(config, "position_offset", 0))
    if block_size < args.block_size:
        logger.warning(f"--block_size {args.block_size} > the model's {block_size} positions: blocks of {block_size}")
    return block_size


@dataclass
class Blocks:
    """A language-modelling run up to its training: the documents, tokenizer and model, and the
    documents cut into blocks of ``block_size`` tokens (``processed``: train and validation)."""

    accelerator: Any
    logger: Any
    raw: Any
    tokenizer: Any
    model: Any
    block_size: int
    processed: dict


def build_blocks(args: argparse.Namespace, auto_class, logger_name: str,
                 check_tokenizer: Callable[[Any], None] = lambda tokenizer: None) -> Blocks:
    """Start the run, read the documents (bad data: a message naming file and line, before any
    training), load or train the tokenizer (``check_tokenizer`` refuses one the objective cannot
    use), build the model with ``auto_class`` and cut the documents into blocks."""
    accelerator, logger = run.start_run(args, logger_name)
    with run.data_errors():
        raw = load_documents(args)
    tokenizer = run.load_tokenizer(args, accelerator, raw, model_max_length=args.block_size)
    check_tokenizer(tokenizer)
    model = load_model(args, auto_class, tokenizer)
    block_size = block_size_for(args, model.config, logger)
    with run.data_errors():
        processed = make_blocks(raw, tokenizer, block_size, accelerator, args)
    return Blocks(accelerator, logger, raw, tokenizer, model, block_size, processed)


def train_on_blocks(args: argparse.Namespace, accelerator, logger, model, tokenizer, processed: dict, *, train_collate,
                    eval_collate, score, record_metric: str, card_kwargs: dict, started: float) -> dict:
    """The rest of a language-modelling run on ``processed`` blocks (:func:`make_blocks`): the
    dataloaders (``train_collate.sampler``, when it has one, is set to the training sampler so that
    it can follow the epoch), training with validation by ``score`` (lowest perplexity is best),
    the saved folder and model card, and the ``record_metric`` record of ``--results_file``."""
    from . import loop
    from . import results as records

    block_size = len(processed["train"][0]["input_ids"])
    train_dataloader, train_sampler = batching.make_dataloader(
        processed["train"], [block_size] * len(processed["train"]), args.per_device_train_batch_size,
        train_collate, shuffle=True, seed=args.seed,
    )
    if hasattr(train_collate, "sampler"):
        train_collate.sampler = train_sampler
    eval_dataloaders = batching.make_eval_dataloaders(
        processed, ["validation"], args.per_device_eval_batch_size, eval_collate, seed=args.seed
    )
    optimizer = loop.make_optimizer(model, args)
    model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)
    eval_dataloader = accelerator.prepare(eval_dataloaders["validation"])
    block_losses: list[float] = []  # of the latest evaluation (bootstrap interval)

    def evaluate() -> dict:
        scores, block_losses[:] = score(accelerator, model, eval_dataloader)
        return scores

    results = loop.train(
        args, accelerator, model, optimizer, train_dataloader, train_sampler, evaluate, logger,
        tokenizer=tokenizer, best_metric="perplexity", greater_is_better=False,
    )
    results["eval_split"] = "validation"
    results["block_size"] = block_size
    if args.save_best and args.results_file:  # block losses of the best model (the final one) for the interval
        evaluate()
    accuracy = f", accuracy {results['eval_accuracy']:.4f}" if "eval_accuracy" in results else ""
    logger.info(f"validation perplexity {results['eval_perplexity']:.2f} (loss {results['eval_loss']:.4f}){accuracy}")
    run.finish_run(args, accelerator, model, tokenizer, results, card_kwargs=card_kwargs, logger=logger)
    if args.results_file and accelerator.is_main_process:
        common = records.run_fields(
            args, accelerator.unwrap_model(model).config, results, max_length=block_size,
            wall_time_s=time.perf_counter() - started, tokens_per_epoch=len(processed["train"]) * block_size,
            train_examples=len(processed["train"]),
        )
        row = {**common, "split": "validation", "metric": record_metric, "beams": None, "samples": len(block_losses),
               "value": results["eval_perplexity"], "ci95": records.perplexity_ci(block_losses, seed=args.seed)}
        records.append_records(args.results_file, [row])
        logger.info(f"1 result record appended to {args.results_file}; the model is in {args.output_dir}")
    return results
