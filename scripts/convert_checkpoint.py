#!/usr/bin/env python
"""Convert a BERT / RoBERTa / DistilBERT checkpoint, a full-attention Zformer model or a Llama-family causal LM into a Zformer-family model.

    python scripts/convert_checkpoint.py --model_name_or_path sentence-transformers/all-MiniLM-L6-v2 \
        --attention_type fastformer --task text-classification --classifier_pooling mean \
        --output_dir runs/minilm-fastformer

Add ``--distill_file ../shared/data/imdb/unsup.jsonl.gz`` to fit the new attention layers to the
source's softmax attention on unlabeled text first (``--distill_steps``, ``--distill_batch_size``, ...).

A Llama, SmolLM, Mistral or Qwen2 causal LM converts with ``--task text-generation`` into a
``ZformerLlamaForCausalLM``; ``--config_overrides`` sets its ``zformer_feature_map`` and
``attention_window`` (docs/decoders.md):

    python scripts/convert_checkpoint.py --model_name_or_path HuggingFaceTB/SmolLM2-135M \
        --attention_type zformer --task text-generation \
        --config_overrides zformer_feature_map=hedgehog,attention_window=64 --output_dir runs/smollm2-hedgehog

The folder (config, safetensors weights, model code, tokenizer, README.md with ``base_model``) is
ready for ``scripts/run_classification.py --model_name_or_path`` (encoders) and loads elsewhere with
``trust_remote_code=True``. What maps onto what: docs/warm_start.md and docs/decoders.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from hf_zformer import flags  # noqa: E402
from hf_zformer.conversion.arguments import ConversionArguments, DistillationArguments  # noqa: E402
from hf_zformer.conversion.convert import TASKS, convert_pretrained  # noqa: E402
from hf_zformer.modeling.configuration_zformer import ATTENTION_TYPES, CLASSIFIER_POOLINGS  # noqa: E402


def parse_args(argv=None) -> ConversionArguments:
    parser = flags.ArgumentParser(description=__doc__.split("\n")[1], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model_name_or_path", required=True,
                        help="BERT / RoBERTa / DistilBERT folder or Hub id, a full-attention Zformer-family "
                             "encoder (e.g. one already fine-tuned on the task), or a Llama / Mistral / Qwen2 "
                             "causal LM.")
    parser.add_argument(
        "--attention_type", nargs="+", default=["full"], choices=ATTENTION_TYPES,
        help="One attention type for every layer, or one per layer (e.g. fastformer fastformer full ...).",
    )
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--task", default=None, choices=TASKS, help="Head to build (default: the source's).")
    parser.add_argument("--classifier_pooling", default=None, choices=CLASSIFIER_POOLINGS,
                        help='Pooling of a classifier (default: "pooler" when a trained pooler carries over, else "mean").')
    parser.add_argument("--num_labels", type=int, default=None, help="Classes of a new classifier (default 2).")
    parser.add_argument("--tokenizer_name", default=None,
                        help="Tokenizer saved with the model (folder or Hub id); default the source's own.")
    parser.add_argument("--base_model", default=None, help="Hub id named as base_model in the model card.")
    parser.add_argument("--config_overrides", default=None,
                        help='Further config fields, "k=v,k2=v2" (of ZformerLlamaConfig with --task text-generation).')
    parser.add_argument("--overwrite", action="store_true",
                        help="Replace an --output_dir this library wrote (one holding files of others is refused).")
    add_distillation_args(parser)
    try:  # ranges, the distillation device and the output folder, before any work
        return ConversionArguments.from_flags(vars(parser.parse_args(argv)))
    except ValueError as error:
        parser.error(str(error))


def add_distillation_args(parser: argparse.ArgumentParser) -> None:
    distill = parser.add_argument_group(
        "attention distillation",
        "Fit the converted attention layers to the source's softmax attention on unlabeled text before "
        "fine-tuning (hf_zformer.conversion.distillation.distill_attention; docs/warm_start.md).",
    )
    distill.add_argument("--distill_file", default=None,
                         help="Unlabeled documents: .jsonl[.gz] / .csv[.gz] (--distill_text_column) or .txt[.gz] "
                              "(one per line), e.g. ../shared/data/imdb/unsup.jsonl.gz. Without it: no distillation.")
    distill.add_argument("--distill_text_column", default="text")
    distill.add_argument("--distill_steps", type=int, default=300,
                         help="Layer-wise steps: each new attention layer fits the source's on the source's inputs.")
    distill.add_argument("--distill_model_steps", type=int, default=0,
                         help="Then whole-model steps: every layer's output, the model running on its own, "
                              "fits the source's (corrects the layers' compounding errors).")
    distill.add_argument("--distill_batch_size", type=int, default=16, help="Documents per step.")
    distill.add_argument("--distill_max_length", type=int, default=256, help="Truncate documents to this many tokens.")
    distill.add_argument("--distill_learning_rate", type=float, default=1e-3)
    distill.add_argument("--distill_attention_weight_loss", type=float, default=1.0,
                         help="Weight of the attention-weight cross-entropy beside the output error, for layers "
                              "with a feature map (--config_overrides zformer_feature_map=hedgehog); 0: outputs only.")
    distill.add_argument("--distill_max_documents", type=int, default=None,
                         help="Read only the first N documents of --distill_file.")
    distill.add_argument("--seed", type=int, default=0, help="Seed of the documents' order.")
    distill.add_argument("--distill_device", default="auto",
                         help='Where the distillation runs: "auto" (a CUDA GPU when there is one, else the CPU), '
                              '"cpu", "cuda", "cuda:1", ... The written model is the same either way, up to rounding.')


def distillation_of(distillation: DistillationArguments):
    """The `Distillation` the arguments ask for, with the documents of --distill_file; None without it."""
    if distillation.distill_file is None:
        return None
    from hf_zformer.conversion.distillation import Distillation
    from hf_zformer.data import load_text_dataset

    texts = load_text_dataset(distillation.distill_file, text_column=distillation.distill_text_column,
                              validation_size=None)["train"]
    if distillation.distill_max_documents is not None:
        texts = texts.select(range(min(distillation.distill_max_documents, len(texts))))
    return Distillation(texts["text"], steps=distillation.distill_steps, model_steps=distillation.distill_model_steps,
                        batch_size=distillation.distill_batch_size, max_length=distillation.distill_max_length,
                        learning_rate=distillation.distill_learning_rate, seed=distillation.seed,
                        attention_weight_loss=distillation.distill_attention_weight_loss,
                        source=str(distillation.distill_file), device=distillation.device())


def main(argv=None):
    args = parse_args(argv)
    import logging

    # the calibration factors and the distillation's fit per layer are logged at INFO
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    from hf_zformer.training.arguments import parse_config_overrides
    from hf_zformer.modeling import ZformerConfig, ZformerLlamaConfig

    attention_type = args.layer_attention
    decoder = args.task == "text-generation"  # the fields of a Llama-family decoder's config
    try:
        overrides = parse_config_overrides(args.config_overrides, ZformerLlamaConfig if decoder else ZformerConfig)
        model = convert_pretrained(
            args.model_name_or_path, attention_type, args.output_dir, task=args.task,
            classifier_pooling=args.classifier_pooling, num_labels=args.num_labels, base_model=args.base_model,
            overwrite=args.overwrite, distillation=distillation_of(args.distillation),
            tokenizer_name=args.tokenizer_name,
            **overrides,
        )
    except (ValueError, OSError) as error:  # a bad source, field, folder or file: the message names it
        print(f"convert_checkpoint.py: error: {error}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {type(model).__name__} ({attention_type} attention) to {args.output_dir}")
    return model


if __name__ == "__main__":
    main()
