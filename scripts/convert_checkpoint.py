#!/usr/bin/env python
"""Convert a pretrained BERT / RoBERTa / DistilBERT checkpoint into a Zformer-family model.

    python scripts/convert_checkpoint.py --model_name_or_path sentence-transformers/all-MiniLM-L6-v2 \
        --attention_type fastformer --task text-classification --classifier_pooling mean \
        --output_dir runs/minilm-fastformer

The folder (config, safetensors weights, model code, tokenizer, README.md with ``base_model``) is
ready for ``scripts/run_classification.py --model_name_or_path`` and loads elsewhere with
``trust_remote_code=True``. What maps onto what: docs/warm_start.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from hf_zformer.convert import TASKS, convert_pretrained  # noqa: E402
from hf_zformer.modeling.configuration_zformer import ATTENTION_TYPES, CLASSIFIER_POOLINGS  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model_name_or_path", required=True, help="BERT / RoBERTa / DistilBERT folder or Hub id.")
    parser.add_argument(
        "--attention_type", nargs="+", default=["full"], choices=ATTENTION_TYPES,
        help="One attention type for every layer, or one per layer (e.g. fastformer fastformer full ...).",
    )
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--task", default=None, choices=TASKS, help="Head to build (default: the source's).")
    parser.add_argument("--classifier_pooling", default=None, choices=CLASSIFIER_POOLINGS,
                        help='Pooling of a classifier (default: "pooler" when a trained pooler carries over, else "mean").')
    parser.add_argument("--num_labels", type=int, default=None, help="Classes of a new classifier (default 2).")
    parser.add_argument("--base_model", default=None, help="Hub id named as base_model in the model card.")
    parser.add_argument("--config_overrides", default=None, help='Further config fields, "k=v,k2=v2".')
    parser.add_argument("--overwrite", action="store_true", help="Replace a non-empty --output_dir.")
    args = parser.parse_args(argv)
    if args.num_labels is not None and args.num_labels < 1:
        parser.error(f"--num_labels must be >= 1, got {args.num_labels}")
    return args


def main(argv=None):
    args = parse_args(argv)
    from hf_zformer.arguments import parse_config_overrides

    attention_type = args.attention_type[0] if len(args.attention_type) == 1 else args.attention_type
    try:
        model = convert_pretrained(
            args.model_name_or_path, attention_type, args.output_dir, task=args.task,
            classifier_pooling=args.classifier_pooling, num_labels=args.num_labels, base_model=args.base_model,
            overwrite=args.overwrite, **parse_config_overrides(args.config_overrides),
        )
    except ValueError as error:  # a bad source, field or folder: the message names it
        sys.exit(f"convert_checkpoint.py: error: {error}")
    print(f"wrote {type(model).__name__} ({attention_type} attention) to {args.output_dir}")
    return model


if __name__ == "__main__":
    main()
