#!/usr/bin/env python
"""Long-context evaluation of a causal LM: passkey retrieval at several lengths, perplexity of long
texts by position bucket, and the cache's bytes and the ms per decoding step at each length
(`hf_zformer.conversion.long_context`).

    python scripts/evaluate_long_context.py --model_name_or_path runs/smollm2-w256-s4/finetuned \\
        --eval_file ../shared/data/wikitext-2/valid.txt.gz --output_dir runs/longctx-w256-s4

The model: a folder this library or transformers saved, a Hub id, or a GGUF file (--gguf_file) of
a folder. --baseline scores a reference on the same texts instead: `state_off` (a converted model
with its feature-map part switched off: its softmax window and sinks alone) or `streaming` (the
source's own weights with attention masked to --streaming_window tokens and --streaming_sinks
sinks, no training: StreamingLLM).

Passkey: --trials per length in --lengths, the key sentence at the depths of --depths in turn
(trial t at depth t mod len(depths)), a 5-digit key per (--seed, length, trial); greedy answer,
exact match of its first number, 95% Wilson interval. Perplexity: --ppl_blocks blocks of each
--ppl_lengths of --eval_file (a .txt[.gz] file's whole text as one string), starting at block
--ppl_first_block, each block one forward; the loss of each position bucket
(0-256, 256-1k, 1k-2k, 2k-4k, 4k-8k).

Every finished trial and block goes to OUTPUT_DIR/trials.jsonl at once; a run started again with
the same arguments skips what is there (resume). OUTPUT_DIR/summary.json holds the tables, and with
--results_file the summary's records (one per length and measure, with the model's config, the
baseline, precision, commit and machine) are appended to that file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

BASELINES = ("none", "state_off", "streaming")
RESUMABLE = {"results_file", "name", "note"}
OUTPUTS = ("run_args.json", "trials.jsonl", "summary.json")


def build_parser() -> argparse.ArgumentParser:
    from hf_zformer.conversion.long_context import DEPTHS

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model_name_or_path", required=True, help="Folder or Hub id of a causal LM.")
    parser.add_argument("--gguf_file", default=None, help="Load the model from this GGUF file of the folder.")
    parser.add_argument("--baseline", default="none", choices=BASELINES,
                        help="Score a reference instead of the model as it is (see the description).")
    parser.add_argument("--config_overrides", default=None,
                        help='ZformerLlamaConfig fields for a converted model or the streaming baseline, "k=v,k2=v2" '
                             '(e.g. "attention_memory=64": a recall memory, no training).')
    parser.add_argument("--streaming_window", type=int, default=256, help="Window of --baseline streaming.")
    parser.add_argument("--streaming_sinks", type=int, default=4, help="Sinks of --baseline streaming.")
    parser.add_argument("--lengths", type=int, nargs="*", default=[1024, 2048, 4096, 8192],
                        help="Passkey prompt lengths in tokens (none: no passkey trials).")
    parser.add_argument("--trials", type=int, default=10, help="Passkey trials per length.")
    parser.add_argument("--depths", type=float, nargs="+", default=list(DEPTHS),
                        help="Where the key sentence goes, as a share of the filler (0..1).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the keys.")
    parser.add_argument("--eval_file", default=None, help="A .txt[.gz] text for perplexity by position.")
    parser.add_argument("--ppl_lengths", type=int, nargs="*", default=[4096, 8192], help="Block lengths scored.")
    parser.add_argument("--ppl_blocks", type=int, default=4, help="Blocks per length.")
    parser.add_argument("--ppl_first_block", type=int, default=0, help="Skip this many blocks of each length first.")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--results_file", default=None, help="Append the summary's records to this JSON list.")
    parser.add_argument("--name", default=None, help="The model's name in the records (default: the path).")
    parser.add_argument("--note", default=None, help="A note carried by every record.")
    parser.add_argument("--device", default="auto", help='"cpu", "cuda", "cuda:N" or "auto".')
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("trials", "ppl_blocks", "streaming_window"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)} must be at least 1")
    if args.ppl_first_block < 0 or args.streaming_sinks < 0:
        parser.error("--ppl_first_block and --streaming_sinks must be at least 0")
    for name in ("lengths", "ppl_lengths"):
        bad = [n for n in getattr(args, name) if n < 64]
        if bad:
            parser.error(f"--{name} {bad[0]} is too short: at least 64 tokens")
    bad = [d for d in args.depths if not 0.0 <= d <= 1.0]
    if bad:
        parser.error(f"--depths {bad[0]} must be between 0 and 1")
    if args.ppl_lengths and args.eval_file is None and args.lengths == []:
        parser.error("nothing to do: give --lengths for passkey trials or --eval_file for perplexity")
    if args.eval_file is not None and not Path(args.eval_file).is_file():
        parser.error(f"--eval_file {args.eval_file} is not a file")
    if args.eval_file is not None and ".txt" not in Path(args.eval_file).name:
        parser.error(f"--eval_file {args.eval_file}: a .txt or .txt.gz file (its whole text is scored as one string)")
    if args.baseline == "streaming" and args.streaming_window < 2:
        parser.error(f"--streaming_window {args.streaming_window} must be at least 2")
    from hf_zformer.modeling import ZformerLlamaConfig
    from hf_zformer.training.arguments import parse_config_overrides

    try:
        args.overrides = parse_config_overrides(args.config_overrides, ZformerLlamaConfig)
    except ValueError as problem:
        parser.error(str(problem))
    return args, parser


def fail(message: str):
    print(f"evaluate_long_context.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


def identity(args) -> dict:
    return {k: v for k, v in vars(args).items() if k not in RESUMABLE and k != "overrides"}


def prepare_output_dir(args, parser) -> Path:
    """The output folder checked (new, empty, or this script's run with the same arguments), made and marked."""
    from hf_zformer import folders
    from hf_zformer.training.results import check_results_file

    inputs = {"--model_name_or_path": args.model_name_or_path}
    if args.eval_file:
        inputs["--eval_file"] = args.eval_file
    try:
        output_dir = folders.check_output_dir(args.output_dir, name="--output_dir", whole=False, inputs=inputs)
        folders.check_writes(output_dir, OUTPUTS)  # names this script owns, never through a link
        if args.results_file:
            check_results_file(args.results_file, output_dir)
    except (ValueError, OSError) as problem:
        parser.error(str(problem))
    try:  # the disk full or a read-only folder at its first write: the path and the errno
        output_dir.mkdir(parents=True, exist_ok=True)
        folders.record(output_dir)
    except OSError as problem:
        parser.error(str(folders.WriteFailed(problem, output_dir)))
    run_file = output_dir / "run_args.json"
    if run_file.exists() and json.loads(run_file.read_text()) != identity(args):
        parser.error(f"--output_dir {output_dir} holds a run with other arguments ({run_file}); choose another folder")
    run_file.write_text(json.dumps(identity(args), indent=1) + "\n")
    folders.record(output_dir, run_file.name)
    return output_dir


def load(args, device):
    """(tokenizer, model) as --baseline asks, in eval mode on `device`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_zformer.conversion.long_context import streaming_model, switch_off_state
    from hf_zformer.hub import weights_failure

    extra = dict(gguf_file=args.gguf_file) if args.gguf_file else {}
    converted = args.baseline != "streaming"  # the overrides are the converted model's, else the baseline's
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path, **extra)
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32, **extra,
                                                     **(args.overrides if converted else {}))
    except Exception as problem:  # noqa: BLE001  (no folder, no or damaged weights, a pickle, no network)
        fail(f"--model_name_or_path {args.model_name_or_path}: its tokenizer or causal LM cannot be loaded "
             f"({weights_failure(problem)})")
    model.eval()
    try:
        if converted and args.overrides and model.config.model_type != "zformer_llama":
            raise ValueError(f"--config_overrides {args.config_overrides} is for a converted model "
                             f"(zformer_llama), not {model.config.model_type}")
        if args.baseline == "state_off":
            model = switch_off_state(model)
        elif args.baseline == "streaming":
            model = streaming_model(model, args.streaming_window, args.streaming_sinks, **args.overrides)
    except ValueError as problem:
        fail(f"--baseline {args.baseline}: {problem}")
    return tokenizer, model.to(device).eval()


def read_done(path: Path) -> dict:
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                entry = json.loads(line)
                done[entry["id"]] = entry
    return done


def append(path: Path, entry: dict) -> None:
    from hf_zformer import folders

    with open(path, "a") as handle:
        handle.write(json.dumps(entry) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    folders.record(path.parent, path.name)


def passkey_trials(args, model, tokenizer, trials_file: Path, done: dict) -> None:
    from hf_zformer.conversion.long_context import passkey_trial, trial_key

    total = len(args.lengths) * args.trials
    count = 0
    for length in args.lengths:
        for trial in range(args.trials):
            count += 1
            key = f"passkey-{length}-{trial}"
            if key in done:
                continue
            depth = args.depths[trial % len(args.depths)]
            entry = {"id": key, "trial": trial,
                     **passkey_trial(model, tokenizer, length, depth, trial_key(args.seed, length, trial))}
            done[key] = entry
            append(trials_file, entry)
            right = sum(e["correct"] for k, e in done.items() if k.startswith(f"passkey-{length}-"))
            log(f"passkey {count}/{total}: {length} tokens, depth {depth}: {'right' if entry['correct'] else 'wrong'} "
                f"({entry['answer'].strip()!r} for {entry['key']}); {right}/{trial + 1} right at {length}; "
                f"prefill {entry['prefill_s']:.1f} s, {entry['ms_per_token']:.1f} ms/token, "
                f"cache {entry['cache_bytes'] / 2**20:.1f} MiB")


def evaluation_ids(path: str, tokenizer):
    import gzip

    import torch

    with open(path, "rb") as handle:
        raw = handle.read()
    text = (gzip.decompress(raw) if path.endswith(".gz") else raw).decode("utf-8")
    return torch.tensor(tokenizer(text)["input_ids"])


def check_blocks(args, ids) -> None:
    """Before any work: the text holds --ppl_blocks blocks of each length after --ppl_first_block."""
    for length in args.ppl_lengths:
        available = ids.numel() // length - args.ppl_first_block
        if available < args.ppl_blocks:
            fail(f"--eval_file {args.eval_file} holds {ids.numel()} tokens: {max(available, 0)} blocks of {length} "
                 f"after --ppl_first_block {args.ppl_first_block}, fewer than --ppl_blocks {args.ppl_blocks}")


def perplexity_blocks(args, model, ids, trials_file: Path, done: dict) -> None:
    from hf_zformer.conversion.long_context import bucket_losses

    for length in args.ppl_lengths:
        for index in range(args.ppl_first_block, args.ppl_first_block + args.ppl_blocks):
            key = f"ppl-{length}-{index}"
            if key in done:
                continue
            begin = time.time()
            sums = bucket_losses(model, ids[index * length : (index + 1) * length])
            entry = {"id": key, "length": length, "block": index, "buckets": sums, "seconds": round(time.time() - begin, 1)}
            done[key] = entry
            append(trials_file, entry)
            loss = sum(s for s, _ in sums) / sum(n for _, n in sums)
            log(f"perplexity block {index} of {length} tokens: {math.exp(loss):.3f} ({entry['seconds']:.0f} s)")


def summarize(args, done: dict) -> dict:
    """The passkey table (per length: right / trials, Wilson interval, per depth, median ms/token and
    cache bytes) and the perplexity table (per block length: overall and per bucket)."""
    from statistics import median

    from hf_zformer.conversion.long_context import BUCKETS, wilson_interval
    from hf_zformer.training.results import perplexity_ci

    passkey = {}
    for length in args.lengths:
        entries = [done[f"passkey-{length}-{t}"] for t in range(args.trials) if f"passkey-{length}-{t}" in done]
        if not entries:
            continue
        right = sum(e["correct"] for e in entries)
        depths = {}
        for e in entries:
            depths.setdefault(str(e["depth"]), []).append(e["correct"])
        passkey[str(length)] = {
            "right": right, "trials": len(entries), "accuracy": round(right / len(entries), 4),
            "ci95": wilson_interval(right, len(entries)),
            "by_depth": {d: f"{sum(v)}/{len(v)}" for d, v in depths.items()},
            "ms_per_token": round(median(e["ms_per_token"] for e in entries), 2),
            "cache_bytes": int(median(e["cache_bytes"] for e in entries)),
            "prefill_s": round(median(e["prefill_s"] for e in entries), 1)}
    names = [f"{low}-{high}" for low, high in zip(BUCKETS[:-1], BUCKETS[1:])]
    perplexity = {}
    for length in args.ppl_lengths:
        entries = [e for k, e in done.items() if k.startswith(f"ppl-{length}-")]
        if not entries:
            continue
        block_losses = [sum(s for s, _ in e["buckets"]) / sum(n for _, n in e["buckets"]) for e in entries]
        buckets = {}
        for b, name in enumerate(names):
            total, count = sum(e["buckets"][b][0] for e in entries), sum(e["buckets"][b][1] for e in entries)
            if count:
                buckets[name] = {"loss": round(total / count, 4), "perplexity": round(math.exp(total / count), 3)}
        losses = sum(sum(s for s, _ in e["buckets"]) for e in entries)
        tokens = sum(sum(n for _, n in e["buckets"]) for e in entries)
        perplexity[str(length)] = {"value": round(math.exp(losses / tokens), 3), "ci95": perplexity_ci(block_losses),
                                   "blocks": len(entries), "tokens": tokens, "buckets": buckets}
    return {"passkey": passkey, "perplexity": perplexity}


def recipe_fields() -> list[str]:
    """The fields `ZformerLlamaConfig` adds to Llama's (attention types, window, sinks, memory, ...):
    what a record keeps of a converted model's recipe, every such field, new ones included."""
    import dataclasses

    from transformers import LlamaConfig

    from hf_zformer import ZformerLlamaConfig

    llama = {field.name for field in dataclasses.fields(LlamaConfig)}
    return [field.name for field in dataclasses.fields(ZformerLlamaConfig) if field.name not in llama]


def records(args, model, summary: dict, device) -> list[dict]:
    import torch

    from hf_zformer.training.results import git_commit, machine

    config = model.config.to_dict()
    kept = {k: config.get(k) for k in ("model_type", *recipe_fields(),
                                       "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads")
            if k in config}
    common = {
        "model": args.name or args.model_name_or_path + (f" ({args.gguf_file})" if args.gguf_file else ""),
        "baseline": {"none": None, "state_off": "feature-map part switched off (window and sinks alone)",
                     "streaming": f"source weights, attention masked to a {args.streaming_window}-token window and "
                                  f"{args.streaming_sinks} sinks (StreamingLLM)"}[args.baseline],
        "attention": config.get("attention_type", "full"), "config": kept, "precision": "fp32", "device": str(device), "threads": torch.get_num_threads(),
        "commit": git_commit(Path(__file__).resolve().parents[1]), "machine": machine(),
        "script": "scripts/evaluate_long_context.py", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **({"note": args.note} if args.note else {})}
    out = []
    for length, row in summary["passkey"].items():
        out.append({**common, "task": "passkey", "split": f"generated prompts (seed {args.seed})",
                    "metric": "exact match", "max_length": int(length),
                    "value": row["accuracy"], "ci95": row["ci95"], "samples": row["trials"], "seed": args.seed,
                    "by_depth": row["by_depth"], "ms_per_token": row["ms_per_token"], "cache_bytes": row["cache_bytes"]})
    for length, row in summary["perplexity"].items():
        out.append({**common, "task": "wikitext-2", "split": "validation" if args.ppl_first_block == 0 else
                    f"validation, blocks from {args.ppl_first_block}", "metric": "perplexity", "max_length": int(length),
                    "value": row["value"], "ci95": row["ci95"], "eval_blocks": row["blocks"], "eval_tokens": row["tokens"],
                    "first_block": args.ppl_first_block, "buckets": row["buckets"], "eval_file": args.eval_file})
    return out


def write_summary(output_dir: Path, summary: dict) -> None:
    from hf_zformer import folders

    path = output_dir / "summary.json"
    staging = output_dir / "summary.json.tmp"
    staging.write_text(json.dumps(summary, indent=1) + "\n")
    os.replace(staging, path)
    folders.record(output_dir, path.name)


def main(argv=None):
    import torch

    args, parser = parse_args(argv)
    output_dir = prepare_output_dir(args, parser)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    tokenizer, model = load(args, device)
    log(f"{type(model).__name__} loaded{'' if args.baseline == 'none' else ' as baseline ' + args.baseline} on {device}")
    from hf_zformer.conversion.long_context import passkey_prompt

    for length in args.lengths:  # before any work: every length has room for the filler
        try:
            passkey_prompt(tokenizer, length, 0.5, "12345")
        except ValueError as problem:
            fail(f"--lengths {length}: {problem}")
    ids = evaluation_ids(args.eval_file, tokenizer) if args.eval_file else None
    if ids is not None:
        check_blocks(args, ids)
    trials_file = output_dir / "trials.jsonl"
    done = read_done(trials_file)
    if done:
        log(f"resuming: {len(done)} trials and blocks done in {trials_file}")
    passkey_trials(args, model, tokenizer, trials_file, done)
    if ids is not None:
        perplexity_blocks(args, model, ids, trials_file, done)
    summary = summarize(args, done)
    write_summary(output_dir, summary)
    for length, row in summary["passkey"].items():
        log(f"passkey at {length}: {row['right']}/{row['trials']} (95% CI {row['ci95']}), {row['ms_per_token']} ms/token, "
            f"cache {row['cache_bytes'] / 2**20:.1f} MiB")
    for length, row in summary["perplexity"].items():
        log(f"perplexity at {length}: {row['value']} "
            + ", ".join(f"{name}: {b['perplexity']}" for name, b in row["buckets"].items()))
    if args.results_file:
        from hf_zformer.training.results import append_records

        append_records(args.results_file, records(args, model, summary, device))
        log(f"records appended to {args.results_file}")


if __name__ == "__main__":
    main()
