#!/usr/bin/env python
"""Train or fine-tune a Zformer-family causal language model with a plain Accelerate loop.

The counterpart of transformers' ``examples/pytorch/language-modeling/run_clm_no_trainer.py``:
the training documents are tokenized, concatenated with an EOS token after each document and cut
into blocks of ``--block_size`` tokens (the remainder is dropped); the model learns to predict each
next token. Works as ``python scripts/run_clm.py ...`` (one process) and under ``accelerate launch``:

    python scripts/run_clm.py --train_file ../shared/data/imdb/unsup.jsonl.gz --attention_type zformer \
        --block_size 256 --output_dir runs/imdb-lm-zformer

Reports the validation perplexity (exp of the mean token loss over the validation blocks) and
writes the model (loads with ``AutoModelForCausalLM`` / ``pipeline("text-generation")``, also
with ``trust_remote_code=True`` without hf_zformer), tokenizer, ``all_results.json``
(``eval_loss``, ``eval_perplexity``) and a model card into ``--output_dir``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from hf_zformer import arguments, batching, run, training  # noqa: E402
from hf_zformer.modeling.configuration_zformer import CAUSAL_ATTENTION_TYPES  # noqa: E402
from hf_zformer.scoring import score_perplexity  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1], formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    arguments.add_data_args(parser)
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
    arguments.add_model_args(parser, seq2seq=False)
    arguments.add_training_args(parser)
    args = parser.parse_args(argv)
    if args.block_size < 2:
        parser.error(f"--block_size must be >= 2, got {args.block_size}")
    if not 0 < args.validation_split_percentage < 100:
        parser.error(f"--validation_split_percentage must be in 1..99, got {args.validation_split_percentage}")
    if args.validation_file and not args.train_file:
        parser.error("--validation_file goes with --train_file")
    if args.attention_type and not args.model_name_or_path:
        layers = arguments.parse_config_overrides(args.config_overrides).get("attention_type", args.attention_type)
        for kind in [layers] if isinstance(layers, str) else layers:
            if kind not in CAUSAL_ATTENTION_TYPES:
                parser.error(f"attention type {kind!r} has no causal form; a causal language model takes "
                             f"{list(CAUSAL_ATTENTION_TYPES)} (or a per-layer list of them)")
    return arguments.validate_args(parser, args, seq2seq=False)


def load_data(args: argparse.Namespace):
    """The documents: ``train`` and ``validation`` (carved from train, grouped by ``--group_column``
    when present, when the data has none). The carve and the ``--max_eval_samples`` subset depend
    on ``--split_seed`` only, so runs with different ``--seed`` are scored on the same text.
    ``--max_train_samples`` / ``--max_eval_samples`` count documents, before grouping into blocks."""
    from hf_zformer.data import load_text_dataset

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
    """``{split: Dataset of input_ids blocks}``; an error when a split has less than one block of text."""
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
            processed[split] = datasets.Dataset.from_dict({"input_ids": blocks})
    return processed


def main(argv=None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()

    from transformers import AutoModelForCausalLM

    import hf_zformer  # noqa: F401  (registers the Auto classes)

    accelerator, logger = run.start_run(args, __name__)

    # ---- data, tokenizer, model
    with run.data_errors():  # bad data: a message naming file and line, before any training
        raw = load_data(args)
    tokenizer = run.load_tokenizer(args, accelerator, raw, model_max_length=args.block_size)
    if tokenizer.eos_token_id is None:
        raise SystemExit(f"error: the tokenizer of {args.tokenizer_name or args.model_name_or_path} has no EOS token, "
                         "which separates the documents of a language-modelling block")
    if tokenizer.pad_token is None:  # batched generation (pipeline) pads
        tokenizer.pad_token = tokenizer.eos_token
    base = args.model_name_or_path
    if base:
        model = AutoModelForCausalLM.from_pretrained(base, trust_remote_code=args.trust_remote_code, dtype=torch.float32)
    else:
        positions = {} if "max_position_embeddings" in args.config_kwargs else {"max_position_embeddings": max(512, args.block_size)}
        config = arguments.build_config(
            args, vocab_size=len(tokenizer), seq2seq=False, pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **positions,
        )
        model = AutoModelForCausalLM.from_config(config)
    block_size = min(args.block_size, model.config.max_position_embeddings - getattr(model.config, "position_offset", 0))
    if block_size < args.block_size:
        logger.warning(f"--block_size {args.block_size} > the model's {block_size} positions: blocks of {block_size}")
    with run.data_errors():
        processed = make_blocks(raw, tokenizer, block_size, accelerator, args)
    logger.info(f"{len(processed['train'])} training and {len(processed['validation'])} validation blocks of "
                f"{block_size} tokens")

    train_dataloader, train_sampler = batching.make_dataloader(
        processed["train"], [block_size] * len(processed["train"]), args.per_device_train_batch_size,
        batching.block_collate, shuffle=True, seed=args.seed,
    )
    eval_dataloaders = batching.make_eval_dataloaders(
        processed, ["validation"], args.per_device_eval_batch_size, batching.block_collate, seed=args.seed
    )
    optimizer = training.make_optimizer(model, args)
    model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)
    eval_dataloader = accelerator.prepare(eval_dataloaders["validation"])
    block_losses: list[float] = []  # of the latest evaluation (bootstrap interval)

    def evaluate() -> dict:
        scores, block_losses[:] = score_perplexity(accelerator, model, eval_dataloader)
        return scores

    results = training.train(
        args, accelerator, model, optimizer, train_dataloader, train_sampler, evaluate, logger,
        tokenizer=tokenizer, best_metric="perplexity", greater_is_better=False,
    )
    results["eval_split"] = "validation"
    results["block_size"] = block_size
    if args.save_best and args.results_file:  # block losses of the best model (the final one) for the interval
        evaluate()
    logger.info(f"validation perplexity {results['eval_perplexity']:.2f} (loss {results['eval_loss']:.4f})")
    run.finish_run(
        args, accelerator, model, tokenizer, results,
        card_kwargs=dict(task="text-generation", metric_name="perplexity",
                         example=" ".join(raw["validation"][0]["text"].split()[:8])),
        logger=logger,
    )
    if args.results_file and accelerator.is_main_process:
        from hf_zformer import results as records

        common = records.run_fields(
            args, accelerator.unwrap_model(model).config, results, max_length=block_size,
            wall_time_s=time.perf_counter() - started, tokens_per_epoch=len(processed["train"]) * block_size,
        )
        row = {**common, "split": "validation", "metric": "perplexity", "beams": None, "samples": len(block_losses),
               "value": results["eval_perplexity"], "ci95": records.perplexity_ci(block_losses, seed=args.seed)}
        records.append_records(args.results_file, [row])
        logger.info(f"1 result record appended to {args.results_file}")
    return results


if __name__ == "__main__":
    main()
