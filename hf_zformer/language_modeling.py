"""Text of the language-modelling scripts (library side, never shipped): their data arguments,
the documents with a carved validation split, and the fixed-length blocks both ``run_clm.py``
(causal LM) and ``run_mlm.py`` (masked LM) train on."""

from __future__ import annotations

import argparse

from . import batching, run

__all__ = ["add_document_args", "check_document_args", "load_documents", "make_blocks"]


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
        "--group_column", default="movie",
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
    from .data import load_text_dataset

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
    """``{split: Dataset of input_ids blocks}`` (:func:`hf_zformer.batching.group_into_blocks`, the
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
