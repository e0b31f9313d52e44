#!/usr/bin/env python
"""Mean token loss of causal language models by position in the document.

Each held-out document is read from its first token (truncated at --max_length tokens, no
packing), and the loss of predicting token t from tokens < t is averaged over the documents within
position buckets (1-15, 16-31, ... by default). Several models are compared on the same documents:
the validation documents run_clm.py carves (same --train_file / --data_dir, --validation_split_percentage,
--group_column, --split_seed and --max_eval_samples give the same rows). It shows whether a model's
gap to another grows with the context length (Zformer's output grows with the number of tokens it
sums).

    python scripts/loss_by_position.py --model_name_or_path runs/lm-full runs/lm-zformer \\
        --train_file ../shared/data/imdb/unsup.jsonl.gz --max_eval_samples 400 --max_length 256 \\
        --output runs/loss_by_position.json

Prints a markdown table (one row per bucket, one column per model) and writes it with the
per-bucket numbers to --output (.json; the table to the same name with .md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from hf_zformer import flags, folders  # noqa: E402
from hf_zformer.training import language_modeling  # noqa: E402
from hf_zformer.training.arguments import DataArguments  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = flags.ArgumentParser(description=__doc__.split("\n")[1], allow_abbrev=False)
    parser.add_argument("--model_name_or_path", nargs="+", required=True, help="Causal LM folders or Hub ids.")
    parser.add_argument("--labels", default=None, help="Comma-separated column names (default: the folder names).")
    parser.add_argument("--train_file", default=None, help="As run_clm.py's (exclusive with --data_dir/--dataset_name).")
    parser.add_argument("--data_dir", default=None)
    parser.add_argument("--dataset_name", default=None)
    parser.add_argument("--dataset_config_name", default=None)
    parser.add_argument("--validation_file", default=None)
    parser.add_argument("--text_column", default="text")
    parser.add_argument("--validation_split_percentage", type=int, default=5)
    parser.add_argument("--group_column", default="movie")
    parser.add_argument("--split_seed", type=int, default=42)
    parser.add_argument("--max_eval_samples", type=int, default=None, help="Documents (run_clm.py's subset).")
    parser.add_argument("--max_length", type=int, default=256, help="Tokens read per document.")
    parser.add_argument("--bucket_starts", type=int, nargs="+", default=[1, 16, 32, 64, 128],
                        help="Positions where a bucket starts (position 0, the first token, has no prediction).")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--trust_remote_code", action="store_true")
    parser.add_argument("--output", default=None, help="Write <output>.json and <output>.md (give a .json path).")
    args = parser.parse_args(argv)
    starts = args.bucket_starts
    if starts[0] < 1 or any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= args.max_length:
        parser.error(f"--bucket_starts must increase from >= 1 and stay below --max_length={args.max_length}; got {starts}")
    labels = args.labels.split(",") if args.labels else [Path(p).name for p in args.model_name_or_path]
    if len(labels) != len(args.model_name_or_path):
        parser.error(f"--labels names {len(labels)} models, --model_name_or_path gives {len(args.model_name_or_path)}")
    args.labels = labels
    if args.output:
        try:  # before any work: no file of somebody else's is overwritten
            folders.check_output_files([Path(args.output).with_suffix(s) for s in (".json", ".md")])
        except ValueError as error:
            parser.error(str(error))
    return args


def validation_documents(args) -> list[str]:
    """The texts of run_clm.py's validation documents for the same data arguments."""
    data = DataArguments(data_dir=args.data_dir, dataset_name=args.dataset_name,
                         dataset_config_name=args.dataset_config_name, max_eval_samples=args.max_eval_samples)
    documents = language_modeling.DocumentArguments(
        train_file=args.train_file, validation_file=args.validation_file, text_column=args.text_column,
        validation_split_percentage=args.validation_split_percentage, group_column=args.group_column)
    raw = language_modeling.load_documents(data, documents, split_seed=args.split_seed, seed=args.split_seed)
    return list(raw["validation"]["text"])


@torch.no_grad()
def token_losses(model, tokenizer, texts: list[str], max_length: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of token losses, number of tokens) per position 0..max_length-1 (position t: predicting
    token t from tokens < t; position 0 stays 0)."""
    sums, counts = torch.zeros(max_length, dtype=torch.float64), torch.zeros(max_length, dtype=torch.float64)
    for start in range(0, len(texts), batch_size):
        ids = [tokenizer(t, add_special_tokens=False)["input_ids"][:max_length] for t in texts[start : start + batch_size]]
        ids = [row for row in ids if len(row) >= 2]
        if not ids:
            continue
        width = max(len(row) for row in ids)
        input_ids = torch.zeros(len(ids), width, dtype=torch.long)
        mask = torch.zeros(len(ids), width, dtype=torch.long)
        for i, row in enumerate(ids):  # right padding
            input_ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
        logits = model(input_ids=input_ids, attention_mask=mask).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), input_ids[:, 1:], reduction="none")
        real = mask[:, 1:].to(loss.dtype)
        sums[1:width] += (loss * real).sum(0).double()
        counts[1:width] += real.sum(0).double()
    return sums, counts


def main(argv=None) -> dict:
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    texts = validation_documents(args)
    ends = args.bucket_starts[1:] + [args.max_length]
    buckets = [f"{a}-{b - 1}" for a, b in zip(args.bucket_starts, ends)]
    table = {"documents": len(texts), "max_length": args.max_length, "buckets": buckets, "models": {}}
    for label, path in zip(args.labels, args.model_name_or_path):
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=args.trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=args.trust_remote_code,
                                                     dtype=torch.float32).eval()
        sums, counts = token_losses(model, tokenizer, texts, args.max_length, args.batch_size)
        table["models"][label] = {
            "model": str(path),
            "mean_loss": [float(sums[a:b].sum() / counts[a:b].sum()) if counts[a:b].sum() else None
                          for a, b in zip(args.bucket_starts, ends)],
            "tokens": [int(counts[a:b].sum()) for a, b in zip(args.bucket_starts, ends)],
        }
    lines = ["| positions | " + " | ".join(args.labels) + " | tokens |", "|---|" + "---:|" * (len(args.labels) + 1)]
    first = table["models"][args.labels[0]]
    for i, bucket in enumerate(buckets):
        cells = [table["models"][label]["mean_loss"][i] for label in args.labels]
        lines.append(f"| {bucket} | " + " | ".join("-" if c is None else f"{c:.3f}" for c in cells)
                     + f" | {first['tokens'][i]} |")
    markdown = "\n".join(lines)
    print(f"mean token loss by position, {len(texts)} validation documents, first {args.max_length} tokens\n")
    print(markdown)
    if args.output:
        output = Path(args.output)
        output.parent.mkdir(parents=True, exist_ok=True)
        output.with_suffix(".json").write_text(json.dumps(table, indent=2) + "\n")
        output.with_suffix(".md").write_text(markdown + "\n")
        folders.record_files([output.with_suffix(".json"), output.with_suffix(".md")])
    return table


if __name__ == "__main__":
    main()
