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

from hf_zformer import flags  # noqa: E402
from hf_zformer.training import arguments, batching, language_modeling  # noqa: E402
from hf_zformer.modeling.configuration_zformer import CAUSAL_ATTENTION_TYPES  # noqa: E402
from hf_zformer.training.scoring import score_perplexity  # noqa: E402


def parse_args(argv=None) -> arguments.RunArguments:
    parser = flags.ArgumentParser(description=__doc__.split("\n")[1], formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    arguments.add_data_args(parser)
    language_modeling.add_document_args(parser)
    arguments.add_model_args(parser, seq2seq=False)
    arguments.add_training_args(parser)
    return arguments.parse_run_args(parser, argv, seq2seq=False, task=language_modeling.DocumentArguments,
                                    check=check_causal)


def check_causal(args: arguments.RunArguments) -> None:
    """A new model's attention (every layer's) must have a causal form (``ValueError``)."""
    model = args.model
    if not model.attention_type or model.model_name_or_path:
        return
    try:
        layers = arguments.parse_config_overrides(model.config_overrides).get("attention_type", model.attention_type)
    except ValueError:  # named by the validation of the model arguments
        return
    for kind in [layers] if isinstance(layers, str) else layers:
        if kind not in CAUSAL_ATTENTION_TYPES:
            raise ValueError(f"attention type {kind!r} has no causal form; a causal language model takes "
                             f"{list(CAUSAL_ATTENTION_TYPES)} (or a per-layer list of them)")


def usable_tokenizer(model: arguments.ModelArguments):
    """The check of the tokenizer: it needs an EOS token (it separates the documents of a block);
    a missing pad token becomes EOS (batched generation pads)."""
    def check(tokenizer) -> None:
        if tokenizer.eos_token_id is None:
            raise SystemExit(f"error: the tokenizer of {model.tokenizer_name or model.model_name_or_path} has no EOS "
                             "token, which separates the documents of a language-modelling block")
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    return check


def main(argv=None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()
    from transformers import AutoModelForCausalLM

    lm = language_modeling.build_blocks(args, AutoModelForCausalLM, __name__, usable_tokenizer(args.model))
    lm.logger.info(f"{len(lm.processed['train'])} training and {len(lm.processed['validation'])} validation "
                    f"blocks of {lm.block_size} tokens")
    return language_modeling.train_on_blocks(
        args, lm.accelerator, lm.logger, lm.model, lm.tokenizer, lm.processed, train_collate=batching.block_collate,
        eval_collate=batching.block_collate, score=score_perplexity, record_metric="perplexity",
        card_kwargs=dict(task="text-generation", metric_name="perplexity",
                         example=" ".join(lm.raw["validation"][0]["text"].split()[:8])),
        started=started,
    )


if __name__ == "__main__":
    main()
