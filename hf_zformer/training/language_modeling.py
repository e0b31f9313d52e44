"""What the language-modelling scripts share (library side, never shipped): their document arguments
(:class:`DocumentArguments`, the scripts' ``task``), the documents with a carved validation split, the fixed-length blocks both ``run_clm.py`` (causal
LM) and ``run_mlm.py`` (masked LM) train on, and the run on them (:func:`train_on_blocks`)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..cpu_speedups import enable_cpu_speedups
from . import batching, run

if TYPE_CHECKING:
    from .arguments import DataArguments, RunArguments

__all__ = ["Blocks", "DocumentArguments", "add_document_args", "build_blocks", "load_documents",
           "load_model", "make_blocks", "train_on_blocks"]


@dataclass
class DocumentArguments:
    """The documents of a language-modelling run and the blocks they are cut into (the flags of
    :func:`add_document_args`); checked when built (``ValueError``)."""

    train_file: str | None = None
    validation_file: str | None = None
    text_column: str = "text"
    validation_split_percentage: int = 5
    group_column: str = field(default_factory=lambda: _default_group_column())
    block_size: int = 512

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"--block_size must be >= 2, got {self.block_size}")
        if not 0 < self.validation_split_percentage < 100:
            raise ValueError(f"--validation_split_percentage must be in 1..99, got {self.validation_split_percentage}")
        if self.validation_file and not self.train_file:
            raise ValueError("--validation_file goes with --train_file")


def _default_group_column() -> str:
    from ..data.splits import DEFAULT_GROUP_COLUMN  # the loaders' default too (imports datasets: only when asked)

    return DEFAULT_GROUP_COLUMN


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
    parser.add_argument(
        "--group_column", default=_default_group_column(),
        help='When the data has this column, the held-out validation documents keep each group (IMDB: each movie\'s '
        'reviews) on one side; "" carves by documents.',
    )
    parser.add_argument("--block_size", type=int, default=512, help="Tokens per training/validation block.")


def load_documents(data: DataArguments, documents: DocumentArguments, *, split_seed: int, seed: int):
    """The documents: ``train`` and ``validation`` (carved from train, grouped by ``--group_column``
    when present, when the data has none). The carve and the ``--max_eval_samples`` subset depend
    on ``--split_seed`` (``split_seed``) only, so runs with different ``--seed`` are scored on the same text.
    ``--max_train_samples`` / ``--max_eval_samples`` count documents, before grouping into blocks."""
    from ..data import load_text_dataset

    raw = load_text_dataset(
        data.data_dir or documents.train_file or data.dataset_name,
        text_column=documents.text_column,
        validation_file=documents.validation_file,
        validation_size=documents.validation_split_percentage / 100,
        seed=split_seed,
        group_column=documents.group_column or None,
        config_name=data.dataset_config_name,
    )
    if "validation" not in raw:
        raise ValueError(f"the dataset has no validation split and none could be carved (splits: {list(raw)})")
    run.subsample(raw, {"train": data.max_train_samples}, seed)
    run.subsample(raw, {"validation": data.max_eval_samples}, split_seed)
    return raw


def make_blocks(raw, tokenizer, block_size: int, accelerator, num_proc: int | None) -> dict:
    """``{split: Dataset of input_ids blocks}`` (:func:`hf_zformer.training.batching.group_into_blocks`, the
    documents separated by the EOS token), each row with its ``block`` index; an error when a split
    has less than one block of text. ``num_proc``: ``--preprocessing_num_workers``."""
    import datasets

    def tokenize(batch):
        return {"input_ids": tokenizer(batch["text"], add_special_tokens=False, verbose=False)["input_ids"]}

    processed = {}
    with accelerator.main_process_first():
        for split in ("train", "validation"):
            tokens = raw[split].map(tokenize, batched=True, remove_columns=raw[split].column_names,
                                    num_proc=num_proc, desc=f"tokenize {split}")
            documents = (ids for batch in tokens.with_format("numpy").iter(batch_size=1000) for ids in batch["input_ids"])
            blocks = batching.group_into_blocks(documents, block_size, tokenizer.eos_token_id)
            if len(blocks) == 0:
                raise ValueError(
                    f"the {split} split has fewer tokens than one --block_size block of {block_size}: lower "
                    "--block_size, or give it more text (--validation_split_percentage, --max_*_samples)"
                )
            processed[split] = datasets.Dataset.from_dict({"input_ids": blocks, "block": list(range(len(blocks)))})
    return processed


def load_model(args: RunArguments, auto_class, tokenizer):
    """``--model_name_or_path`` in fp32, or a new model of ``auto_class`` from the model arguments,
    with the tokenizer's vocabulary and special tokens and positions for ``--block_size``."""
    import torch

    model = args.model
    if model.model_name_or_path:
        return run.load_pretrained(auto_class, model.model_name_or_path, trust_remote_code=model.trust_remote_code,
                                   dtype=torch.float32)
    positions = ({} if "max_position_embeddings" in model.config_kwargs
                 else {"max_position_embeddings": max(512, args.task.block_size)})
    config = run.new_model_config(
        model, vocab_size=len(tokenizer), seq2seq=False, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **positions,
    )
    return auto_class.from_config(config)


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


def build_blocks(args: RunArguments, auto_class, logger_name: str,
                 check_tokenizer: Callable[[Any], None] = lambda tokenizer: None) -> Blocks:
    """Start the run, read the documents (bad data: a message naming file and line, before any
    training), load or train the tokenizer (``check_tokenizer`` refuses one the objective cannot
    use), build the model with ``auto_class`` and cut the documents into blocks."""
    accelerator, logger = run.start_run(args.training, logger_name)
    with run.data_errors():
        raw = load_documents(args.data, args.task, split_seed=args.evaluation.split_seed, seed=args.training.seed)
    tokenizer = run.load_tokenizer(args, accelerator, raw, model_max_length=args.task.block_size)
    check_tokenizer(tokenizer)
    model = load_model(args, auto_class, tokenizer)
    block_size = run.fit_to_positions("--block_size", args.task.block_size, model.config, logger)
    with run.data_errors():
        processed = make_blocks(raw, tokenizer, block_size, accelerator, args.data.preprocessing_num_workers)
    return Blocks(accelerator, logger, raw, tokenizer, model, block_size, processed)


def train_on_blocks(args: RunArguments, accelerator, logger, model, tokenizer, processed: dict, *, train_collate,
                    eval_collate, score, record_metric: str, card_kwargs: dict, started: float) -> dict:
    """The rest of a language-modelling run on ``processed`` blocks (:func:`make_blocks`): the
    dataloaders (``train_collate.sampler``, when it has one, is set to the training sampler so that
    it can follow the epoch), training with validation by ``score`` (lowest perplexity is best),
    the saved folder and model card, and the ``record_metric`` record of ``--results_file``."""
    from . import loop
    from . import results as records

    training, evaluation = args.training, args.evaluation
    block_size = len(processed["train"][0]["input_ids"])
    train_dataloader, train_sampler = batching.make_dataloader(
        processed["train"], [block_size] * len(processed["train"]), training.per_device_train_batch_size,
        train_collate, shuffle=True, seed=training.seed,
    )
    if hasattr(train_collate, "sampler"):
        train_collate.sampler = train_sampler
    eval_dataloaders = batching.make_eval_dataloaders(
        processed, ["validation"], training.per_device_eval_batch_size, eval_collate, seed=training.seed
    )
    enable_cpu_speedups(model)  # faster layer forms on CPUs (hf_zformer.cpu_speedups); the saved model is unchanged
    optimizer = loop.make_optimizer(model, training)
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
    if evaluation.save_best and evaluation.results_file:  # block losses of the best model (the final one) for the interval
        evaluate()
    accuracy = f", accuracy {results['eval_accuracy']:.4f}" if "eval_accuracy" in results else ""
    logger.info(f"validation perplexity {results['eval_perplexity']:.2f} (loss {results['eval_loss']:.4f}){accuracy}")
    run.finish_run(args, accelerator, model, tokenizer, results, card_kwargs=card_kwargs, logger=logger)
    if evaluation.results_file and accelerator.is_main_process:
        common = records.run_fields(
            args.flags(), accelerator.unwrap_model(model).config, results, max_length=block_size,
            wall_time_s=time.perf_counter() - started, tokens_per_epoch=len(processed["train"]) * block_size,
            train_examples=len(processed["train"]),
        )
        row = {**common, "split": "validation", "metric": record_metric, "beams": None, "samples": len(block_losses),
               "value": results["eval_perplexity"], "ci95": records.perplexity_ci(block_losses, seed=training.seed)}
        with run.write_errors():
            records.append_records(evaluation.results_file, [row])
        logger.info(f"1 result record appended to {evaluation.results_file}; the model is in {training.output_dir}")
    return results
