#!/usr/bin/env python
"""Linearize a pretrained Llama-family causal LM: convert it (`hf_zformer.convert_decoder`), fit the
new attention to the source's softmax attention layer by layer (`hf_zformer.decoder_transfer`),
and measure the perplexity of the source and of the converted model before and after.

    python scripts/linearize_decoder.py --model_name_or_path path/to/smollm2 \\
        --gguf_file SmolLM2-135M-Instruct.Q4_1.gguf --attention_type zformer \\
        --config_overrides zformer_feature_map=hedgehog,attention_window=64 \\
        --train_file ../shared/data/imdb/unsup.jsonl.gz --eval_file ../shared/data/wikitext-2/valid.txt.gz \\
        --steps 400 --output_dir runs/smollm2-hedgehog-w64

Training text: documents of --train_file in a seeded order, each followed by the EOS token, packed
into blocks of --block_size tokens. Evaluation text: the whole of --eval_file as one string, cut
into blocks of --eval_block_size tokens, the first --eval_blocks of them (the same blocks for every
model). A progress line every --log_every steps; every --checkpoint_every steps the trained
parameters, optimizer and step go to OUTPUT_DIR/transfer_state.pt, and a run started again with
the same arguments resumes from there (another run's folder is refused). OUTPUT_DIR/results.json
gets each perplexity as soon as it is measured; OUTPUT_DIR/model the fitted model (loads with
AutoModelForCausalLM and trust_remote_code=True).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

# arguments a resumed run may change
RESUMABLE = {"log_every", "checkpoint_every"}
PROMPTS = ("The history of the city begins", "This movie was")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model_name_or_path", required=True, help="Folder or Hub id of a Llama-family causal LM.")
    parser.add_argument("--gguf_file", default=None, help="Load the source from this GGUF file of the folder.")
    parser.add_argument("--attention_type", nargs="+", default=["zformer"], help="One type, or one per layer.")
    parser.add_argument("--config_overrides", default=None, help='ZformerLlamaConfig fields, "k=v,k2=v2".')
    parser.add_argument("--train_file", required=True, help=".jsonl[.gz] documents (--text_column) or .txt[.gz] lines.")
    parser.add_argument("--text_column", default="text")
    parser.add_argument("--eval_file", required=True, help="Text scored for perplexity (.txt or .txt.gz).")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--block_size", type=int, default=512)
    parser.add_argument("--learning_rate", type=float, default=1e-2)
    parser.add_argument("--eval_block_size", type=int, default=1024)
    parser.add_argument("--eval_blocks", type=int, default=32)
    parser.add_argument("--log_every", type=int, default=5)
    parser.add_argument("--checkpoint_every", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "block_size", "eval_block_size", "eval_blocks", "log_every",
                 "checkpoint_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not (math.isfinite(args.learning_rate) and args.learning_rate > 0):
        parser.error(f"--learning_rate must be a finite number > 0, got {args.learning_rate}")
    return args


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


def read_documents(path: str, text_column: str, seed: int) -> list[str]:
    """The documents of `path` in a seeded order."""
    import random

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as handle:
        if ".jsonl" in path:
            texts = [json.loads(line)[text_column] for line in handle if line.strip()]
        else:
            texts = [line.rstrip("\n") for line in handle if line.strip()]
    random.Random(seed).shuffle(texts)
    return texts


def training_blocks(tokenizer, documents: list[str], count: int, block_size: int):
    """The first `count` blocks (count, block_size) of the documents packed with EOS after each."""
    import torch

    needed, stream = count * block_size, []
    for text in documents:
        stream.extend(tokenizer(text)["input_ids"] + [tokenizer.eos_token_id])
        if len(stream) >= needed:
            break
    if len(stream) < needed:
        raise ValueError(f"the training documents hold {len(stream)} tokens; {count} blocks need {needed}")
    return torch.tensor(stream[:needed]).view(count, block_size)


def save_atomically(obj, path: Path) -> None:
    import torch

    from hf_zformer import folders

    staging = path.with_name(path.name + ".tmp")
    torch.save(obj, staging)
    os.replace(staging, path)
    folders.record(path.parent, path.name)  # the output folder's marker lists what the run wrote


def write_results(path: Path, results: dict) -> None:
    from hf_zformer import folders

    staging = path.with_name(path.name + ".tmp")
    staging.write_text(json.dumps(results, indent=1) + "\n")
    os.replace(staging, path)
    folders.record(path.parent, path.name)


def main(argv=None):
    args = parse_args(argv)
    for name in ("train_file", "eval_file"):  # before the source is loaded
        if not Path(getattr(args, name)).is_file():
            sys.exit(f"linearize_decoder.py: error: --{name} {getattr(args, name)} is not a file")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_zformer.arguments import parse_config_overrides
    from hf_zformer.convert_decoder import convert_causal_lm, full_attention_copy
    from hf_zformer.decoder_transfer import AttentionTransfer, perplexity
    from hf_zformer.modeling import ZformerLlamaConfig
    from hf_zformer.results import git_commit, machine, perplexity_ci

    from hf_zformer import folders

    try:  # new, empty, or a folder this library wrote (a run to resume); never a folder of other files
        output_dir = folders.check_output_dir(args.output_dir, name="--output_dir", whole=False, inputs={
            "--model_name_or_path": args.model_name_or_path, "--train_file": args.train_file,
            "--eval_file": args.eval_file})
    except ValueError as error:
        sys.exit(f"linearize_decoder.py: error: {error}")
    torch.manual_seed(args.seed)
    output_dir.mkdir(parents=True, exist_ok=True)
    folders.record(output_dir)
    identity = {k: v for k, v in vars(args).items() if k not in RESUMABLE}
    identity_file = output_dir / "run_args.json"
    if identity_file.exists() and json.loads(identity_file.read_text()) != identity:
        sys.exit(f"linearize_decoder.py: error: {output_dir} holds a run with other arguments "
                 f"({identity_file}); choose another --output_dir")
    identity_file.write_text(json.dumps(identity, indent=1) + "\n")
    folders.record(output_dir, identity_file.name)
    results_file = output_dir / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {
        "source": args.model_name_or_path + (f" ({args.gguf_file})" if args.gguf_file else ""),
        "attention_type": args.attention_type, "config_overrides": args.config_overrides,
        "train_file": args.train_file, "eval_file": args.eval_file, "eval_block_size": args.eval_block_size,
        "eval_blocks": args.eval_blocks, "steps": args.steps, "batch_size": args.batch_size,
        "block_size": args.block_size, "learning_rate": args.learning_rate, "seed": args.seed,
        "precision": "fp32", "commit": git_commit(Path(__file__).resolve().parents[1]), "machine": machine(),
        "perplexity": {},
    }

    started = time.time()
    load = dict(gguf_file=args.gguf_file) if args.gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path, **load)
    source = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32, **load).eval()
    log(f"source {type(source).__name__} loaded ({sum(p.numel() for p in source.parameters()) / 1e6:.1f}M "
        f"parameters, {time.time() - started:.0f} s)")
    attention_type = args.attention_type[0] if len(args.attention_type) == 1 else args.attention_type
    overrides = parse_config_overrides(args.config_overrides, ZformerLlamaConfig)
    model = convert_causal_lm(args.model_name_or_path, attention_type, source=source, tokenizer=tokenizer,
                              **overrides)
    reference = full_attention_copy(model)
    results["config"] = {key: getattr(model.config, key) for key in (
        "attention_type", "zformer_feature_map", "attention_window", "num_hidden_layers", "hidden_size",
        "num_attention_heads", "num_key_value_heads")}

    with open(args.eval_file, "rb") as handle:
        raw = handle.read()
    eval_text = (gzip.decompress(raw) if args.eval_file.endswith(".gz") else raw).decode("utf-8")
    eval_ids = torch.tensor(tokenizer(eval_text)["input_ids"])
    log(f"evaluation text: {eval_ids.numel()} tokens; scoring the first {args.eval_blocks} blocks of "
        f"{args.eval_block_size}")

    def score(name, scored_model):
        if name in results["perplexity"]:
            return
        begin = time.time()

        def progress(done, total):
            if done % 8 == 0 or done == total:
                log(f"perplexity of {name}: block {done}/{total}")

        value, losses = perplexity(scored_model, eval_ids, args.eval_block_size, args.eval_blocks, progress)
        results["perplexity"][name] = {"value": round(value, 3), "ci95": perplexity_ci(losses),
                                       "tokens": len(losses) * (args.eval_block_size - 1),
                                       "seconds": round(time.time() - begin, 1)}
        write_results(results_file, results)
        log(f"perplexity of {name}: {value:.3f}")

    score("source", source)
    del source
    score("converted", model)

    transfer = AttentionTransfer(model, reference, steps=args.steps, learning_rate=args.learning_rate)
    state_file = output_dir / "transfer_state.pt"
    if state_file.exists():
        transfer.load_state_dict(torch.load(state_file, weights_only=False))
        log(f"resumed from {state_file} at step {transfer.completed}")
    documents = read_documents(args.train_file, args.text_column, args.seed)
    blocks = training_blocks(tokenizer, documents, args.steps * args.batch_size, args.block_size)
    log(f"attention transfer: {len(transfer.parameters)} tensors "
        f"({sum(p.numel() for p in transfer.parameters.values()) / 1e6:.2f}M parameters), {args.steps} steps of "
        f"{args.batch_size} x {args.block_size} tokens")
    begin, first = time.time(), transfer.completed
    while transfer.completed < args.steps:
        step = transfer.completed
        errors = transfer.step(blocks[step * args.batch_size : (step + 1) * args.batch_size])
        done = transfer.completed
        if done % args.log_every == 0 or done == args.steps:
            rate = (time.time() - begin) / (done - first)
            log(f"step {done}/{args.steps} error {sum(errors) / len(errors):.4f} (layers {min(errors):.3f}-"
                f"{max(errors):.3f}) lr {transfer.scheduler.get_last_lr()[0]:.2e} {rate:.1f} s/step, "
                f"{(args.steps - done) * rate / 60:.1f} min left")
        if done % args.checkpoint_every == 0 or done == args.steps:
            save_atomically(transfer.state_dict(), state_file)
    results["transfer_seconds"] = results.get("transfer_seconds", 0) + round(time.time() - begin, 1)
    results["last_step_layer_errors"] = [round(e, 4) for e in errors] if transfer.completed > first else None
    write_results(results_file, results)
    with folders.recording(output_dir):
        model.save_pretrained(output_dir / "model")
        tokenizer.save_pretrained(output_dir / "model")
    score("transferred", model)

    samples = {}
    for prompt in PROMPTS:
        encoded = tokenizer(prompt, return_tensors="pt")
        row = {}
        for name, sampled in (("source", reference), ("transferred", model)):
            tokens = sampled.generate(**encoded, max_new_tokens=30, do_sample=False)
            row[name] = tokenizer.decode(tokens[0, encoded["input_ids"].shape[1]:], skip_special_tokens=True)
        samples[prompt] = row
    results["greedy_samples"] = samples
    results["wall_time_s"] = round(time.time() - started, 1)
    write_results(results_file, results)
    log(f"done: {json.dumps(results['perplexity'])}")


if __name__ == "__main__":
    main()
