#!/usr/bin/env python
"""Pretrain or continue pretraining a Zformer-family masked language model with a plain Accelerate loop.

The counterpart of transformers' ``examples/pytorch/language-modeling/run_mlm_no_trainer.py``: the
training documents are tokenized, concatenated with an EOS token after each document and cut into
blocks of ``--block_size`` tokens (as ``run_clm.py`` does); in every block ``--mlm_probability`` of
the positions are scored, BERT's way (80% replaced by the mask token, 10% by a random token, 10%
kept), and only those positions are projected onto the vocabulary. Every attention type works,
per-layer lists included. Pretraining on unlabeled text of the task's domain and then fine-tuning
with ``run_classification.py --model_name_or_path <output_dir>`` is the from-scratch model's way to
more accuracy (docs/results.md):

    python scripts/run_mlm.py --train_file ../shared/data/imdb/unsup.jsonl.gz --attention_type zformer \\
        --block_size 512 --output_dir runs/imdb-mlm-zformer

Reports the validation perplexity and accuracy at the scored positions (the masks of the validation
blocks are fixed by ``--split_seed``, so every run and evaluation scores the same ones) and writes
the model (loads with ``AutoModelForMaskedLM`` / ``pipeline("fill-mask")``, also with
``trust_remote_code=True`` without hf_zformer; ``AutoModelForSequenceClassification`` gets its
encoder and a new head), tokenizer, ``all_results.json`` and a model card into ``--output_dir``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from hf_zformer import arguments, batching, language_modeling, run, training  # noqa: E402
from hf_zformer.scoring import score_masked_lm  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1], formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    arguments.add_data_args(parser)
    language_modeling.add_document_args(parser)
    parser.add_argument(
        "--mlm_probability", type=float, default=0.15,
        help="Share of each block's positions that are masked and scored (exactly round(p * block_size) per block).",
    )
    arguments.add_model_args(parser, seq2seq=False)
    arguments.add_training_args(parser)
    args = parser.parse_args(argv)
    language_modeling.check_document_args(parser, args)
    if not 0.0 < args.mlm_probability < 1.0:
        parser.error(f"--mlm_probability must be between 0 and 1 (exclusive), got {args.mlm_probability}")
    return arguments.validate_args(parser, args, seq2seq=False)


def first_ordinary_id(tokenizer) -> int:
    """The lowest id a random replacement may take: past the special tokens when they come first
    (hf_zformer's tokenizers: ids 0-4), else 0 (a vocabulary with specials elsewhere, e.g. BERT's)."""
    specials = sorted(set(tokenizer.all_special_ids))
    return len(specials) if specials == list(range(len(specials))) else 0


def main(argv=None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()

    from transformers import AutoModelForMaskedLM

    import hf_zformer  # noqa: F401  (registers the Auto classes)

    accelerator, logger = run.start_run(args, __name__)

    # ---- data, tokenizer, model
    with run.data_errors():  # bad data: a message naming file and line, before any training
        raw = language_modeling.load_documents(args)
    tokenizer = run.load_tokenizer(args, accelerator, raw, model_max_length=args.block_size)
    source = args.tokenizer_name or args.model_name_or_path or "the trained tokenizer"
    for name in ("mask", "eos"):
        if getattr(tokenizer, f"{name}_token_id") is None:
            raise SystemExit(f"error: the tokenizer of {source} has no {name} token, which masked-language modelling "
                             "needs" + (" (it separates the documents of a block)" if name == "eos" else ""))
    base = args.model_name_or_path
    if base:
        model = AutoModelForMaskedLM.from_pretrained(base, trust_remote_code=args.trust_remote_code, dtype=torch.float32)
    else:
        positions = {} if "max_position_embeddings" in args.config_kwargs else {"max_position_embeddings": max(512, args.block_size)}
        config = arguments.build_config(
            args, vocab_size=len(tokenizer), seq2seq=False, pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **positions,
        )
        model = AutoModelForMaskedLM.from_config(config)
    block_size = min(args.block_size, model.config.max_position_embeddings - getattr(model.config, "position_offset", 0))
    if block_size < args.block_size:
        logger.warning(f"--block_size {args.block_size} > the model's {block_size} positions: blocks of {block_size}")
    with run.data_errors():
        processed = language_modeling.make_blocks(raw, tokenizer, block_size, accelerator, args)
    masking = dict(mask_token_id=tokenizer.mask_token_id, vocab_size=min(len(tokenizer), model.config.vocab_size),
                   probability=args.mlm_probability, first_ordinary_id=first_ordinary_id(tokenizer))
    train_collate = batching.MaskedLMCollator(**masking, seed=args.seed)
    logger.info(f"{len(processed['train'])} training and {len(processed['validation'])} validation blocks of "
                f"{block_size} tokens, {train_collate.scored_per_block(block_size)} masked in each")

    train_dataloader, train_sampler = batching.make_dataloader(
        processed["train"], [block_size] * len(processed["train"]), args.per_device_train_batch_size,
        train_collate, shuffle=True, seed=args.seed,
    )
    train_collate.sampler = train_sampler  # new masks every epoch
    eval_dataloaders = batching.make_eval_dataloaders(
        processed, ["validation"], args.per_device_eval_batch_size,
        batching.MaskedLMCollator(**masking, seed=args.split_seed), seed=args.seed,
    )
    optimizer = training.make_optimizer(model, args)
    model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)
    eval_dataloader = accelerator.prepare(eval_dataloaders["validation"])
    block_losses: list[float] = []  # of the latest evaluation (bootstrap interval)

    def evaluate() -> dict:
        scores, block_losses[:] = score_masked_lm(accelerator, model, eval_dataloader)
        return scores

    results = training.train(
        args, accelerator, model, optimizer, train_dataloader, train_sampler, evaluate, logger,
        tokenizer=tokenizer, best_metric="perplexity", greater_is_better=False,
    )
    results["eval_split"] = "validation"
    results["block_size"] = block_size
    if args.save_best and args.results_file:  # block losses of the best model (the final one) for the interval
        evaluate()
    logger.info(f"validation perplexity {results['eval_perplexity']:.2f} (loss {results['eval_loss']:.4f}), "
                f"accuracy at the masked positions {results['eval_accuracy']:.4f}")
    run.finish_run(
        args, accelerator, model, tokenizer, results,
        card_kwargs=dict(task="fill-mask", metric_name="perplexity",
                         example=" ".join([*raw["validation"][0]["text"].split()[:6], tokenizer.mask_token]) + "."),
        logger=logger,
    )
    if args.results_file and accelerator.is_main_process:
        from hf_zformer import results as records

        common = records.run_fields(
            args, accelerator.unwrap_model(model).config, results, max_length=block_size,
            wall_time_s=time.perf_counter() - started, tokens_per_epoch=len(processed["train"]) * block_size,
        )
        row = {**common, "split": "validation", "metric": "mlm_perplexity", "beams": None, "samples": len(block_losses),
               "value": results["eval_perplexity"], "ci95": records.perplexity_ci(block_losses, seed=args.seed)}
        records.append_records(args.results_file, [row])
        logger.info(f"1 result record appended to {args.results_file}")
    return results


if __name__ == "__main__":
    main()
