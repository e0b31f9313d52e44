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

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from hf_zformer import flags  # noqa: E402
from hf_zformer.training import arguments, batching, language_modeling  # noqa: E402
from hf_zformer.training.scoring import score_masked_lm  # noqa: E402


@dataclass
class MaskedDocumentArguments(language_modeling.DocumentArguments):
    """The documents, and the share of each block's positions that is masked and scored."""

    mlm_probability: float = 0.15

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.mlm_probability < 1.0:
            raise ValueError(f"--mlm_probability must be between 0 and 1 (exclusive), got {self.mlm_probability}")


def parse_args(argv=None) -> arguments.RunArguments:
    parser = flags.ArgumentParser(description=__doc__.split("\n")[1], formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    arguments.add_data_args(parser)
    language_modeling.add_document_args(parser)
    parser.add_argument(
        "--mlm_probability", type=float, default=0.15,
        help="Share of each block's positions that are masked and scored (exactly round(p * block_size) per block).",
    )
    arguments.add_model_args(parser, seq2seq=False)
    arguments.add_training_args(parser)
    return arguments.parse_run_args(parser, argv, seq2seq=False, task=MaskedDocumentArguments)


def first_ordinary_id(tokenizer) -> int:
    """The lowest id a random replacement may take: past the special tokens when they come first
    (hf_zformer's tokenizers: ids 0-4), else 0 (a vocabulary with specials elsewhere, e.g. BERT's)."""
    specials = sorted(set(tokenizer.all_special_ids))
    return len(specials) if specials == list(range(len(specials))) else 0


def usable_tokenizer(model: arguments.ModelArguments):
    """The check of the tokenizer: masked-language modelling needs a mask token and an EOS token
    (it separates the documents of a block)."""
    source = model.tokenizer_name or model.model_name_or_path or "the trained tokenizer"

    def check(tokenizer) -> None:
        for name in ("mask", "eos"):
            if getattr(tokenizer, f"{name}_token_id") is None:
                raise SystemExit(f"error: the tokenizer of {source} has no {name} token, which masked-language "
                                 "modelling needs" + (" (it separates the documents of a block)" if name == "eos" else ""))
    return check


def main(argv=None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()
    from transformers import AutoModelForMaskedLM

    lm = language_modeling.build_blocks(args, AutoModelForMaskedLM, __name__, usable_tokenizer(args.model))
    tokenizer, block_size, processed = lm.tokenizer, lm.block_size, lm.processed
    masking = dict(mask_token_id=tokenizer.mask_token_id, vocab_size=min(len(tokenizer), lm.model.config.vocab_size),
                   probability=args.task.mlm_probability, first_ordinary_id=first_ordinary_id(tokenizer))
    train_collate = batching.MaskedLMCollator(**masking, seed=args.training.seed)  # new masks every epoch (its sampler's)
    lm.logger.info(f"{len(processed['train'])} training and {len(processed['validation'])} validation blocks of "
                    f"{block_size} tokens, {train_collate.scored_per_block(block_size)} masked in each")
    return language_modeling.train_on_blocks(
        args, lm.accelerator, lm.logger, lm.model, tokenizer, processed, train_collate=train_collate,
        eval_collate=batching.MaskedLMCollator(**masking, seed=args.evaluation.split_seed), score=score_masked_lm,
        record_metric="mlm_perplexity",
        card_kwargs=dict(task="fill-mask", metric_name="perplexity",
                         example=" ".join([*lm.raw["validation"][0]["text"].split()[:6], tokenizer.mask_token]) + "."),
        started=started,
    )


if __name__ == "__main__":
    main()
