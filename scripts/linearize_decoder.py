#!/usr/bin/env python
"""Linearize a pretrained Llama-family causal LM: convert it (`hf_zformer.conversion.convert_decoder`), fit the
new attention to the source's softmax attention layer by layer (stage 1, attention transfer:
`hf_zformer.conversion.decoder_transfer`), fine-tune the result with next-token loss, LoRA or every weight,
optionally distilling the source's logits (stage 2: `hf_zformer.conversion.decoder_finetune`), and measure the
perplexity of the source and of the model after each stage.

    python scripts/linearize_decoder.py --model_name_or_path path/to/smollm2 \\
        --attention_type zformer --config_overrides zformer_feature_map=hedgehog,attention_window=64 \\
        --train_file ../shared/data/imdb/unsup.jsonl.gz \\
        --eval_file ../shared/data/wikitext-2/valid.txt.gz ../shared/data/imdb/test.jsonl.gz \\
        --steps 300 --finetune_steps 100 --distill_weight 0.5 --output_dir runs/smollm2-hedgehog-w64

Training text: documents of --train_file in a seeded order, each followed by the EOS token, packed
into blocks of --block_size tokens; stage 1 takes its blocks from the start of that order, stage 2
from its end, so the stages never train on the same text (an error if they would meet).
Evaluation text, per --eval_file: a .txt[.gz] file's whole text as one string, or a .jsonl[.gz]
file's documents in a fixed shuffled order, each followed by EOS; cut into blocks of
--eval_block_size tokens, the first --eval_blocks of them (the same blocks for every model).
--init_model starts from a model this script saved (OUTPUT_DIR/transferred of an earlier run, with
--steps 0 to go straight to stage 2) instead of converting the source.

A progress line every --log_every steps; every --checkpoint_every steps the trained parameters,
optimizer and step go to OUTPUT_DIR/transfer_state.safetensors (stage 1) or
OUTPUT_DIR/finetune_state.safetensors
(stage 2), and a run started again with the same arguments resumes from there (another run's
folder is refused). OUTPUT_DIR/results.json gets each perplexity as soon as it is measured;
OUTPUT_DIR/transferred and OUTPUT_DIR/finetuned the model after each stage (LoRA folded into the
weights; both load with AutoModelForCausalLM and trust_remote_code=True).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from hf_zformer.conversion.arguments import LinearizationArguments, evaluation_name  # noqa: E402

# arguments a resumed run may change
RESUMABLE = {"log_every", "checkpoint_every", "skip_scores"}
# what a run writes into --output_dir (a file of the user's under one of these names stops it)
OUTPUT_FILES = ("run_args.json", "results.json", "transfer_state.*", "finetune_state.*", "transferred", "finetuned")
PROMPTS = ("The history of the city begins", "This movie was")
MODELS = ("source", "converted", "init_model", "transferred", "finetuned")


def parse_args(argv=None) -> LinearizationArguments:
    parser = build_parser()
    try:  # counts, rates and weights, peft, the device and the evaluation texts' names: the first problem
        return LinearizationArguments.from_flags(vars(parser.parse_args(argv)))
    except ValueError as error:
        parser.error(str(error))


def build_parser() -> argparse.ArgumentParser:
    from hf_zformer.conversion.decoder_finetune import FINETUNE_METHODS, LORA_TARGETS

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model_name_or_path", required=True, help="Folder or Hub id of a Llama-family causal LM.")
    parser.add_argument("--gguf_file", default=None, help="Load the source from this GGUF file of the folder.")
    parser.add_argument("--attention_type", nargs="+", default=["zformer"], help="One type, or one per layer.")
    parser.add_argument("--config_overrides", default=None, help='ZformerLlamaConfig fields, "k=v,k2=v2".')
    parser.add_argument("--init_model", default=None,
                        help="Start from this converted model (a folder this script saved) instead of converting.")
    parser.add_argument("--train_file", required=True, help=".jsonl[.gz] documents (--text_column) or .txt[.gz] lines.")
    parser.add_argument("--text_column", default="text")
    parser.add_argument("--eval_file", nargs="+", required=True,
                        help="Texts scored for perplexity: .txt[.gz] (one string) or .jsonl[.gz] (documents).")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--steps", type=int, default=400, help="Stage 1 (attention transfer) steps; 0 skips it.")
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--block_size", type=int, default=512)
    parser.add_argument("--learning_rate", type=float, default=1e-2, help="Stage 1's peak learning rate.")
    parser.add_argument("--finetune_steps", type=int, default=0, help="Stage 2 (fine-tuning) steps; 0 skips it.")
    parser.add_argument("--finetune_method", default="lora", choices=FINETUNE_METHODS,
                        help="LoRA adapters on --lora_targets (needs peft) or every weight.")
    parser.add_argument("--finetune_learning_rate", type=float, default=None,
                        help="Stage 2's peak learning rate (default 1e-3 for LoRA, 5e-5 for full fine-tuning).")
    parser.add_argument("--lora_rank", type=int, default=8)
    parser.add_argument("--lora_alpha", type=float, default=16.0)
    parser.add_argument("--lora_targets", nargs="+", default=list(LORA_TARGETS))
    parser.add_argument("--finetune_new_attention", action=argparse.BooleanOptionalAction, default=True,
                        help="Stage 2 also trains the feature maps and window shares.")
    parser.add_argument("--distill_weight", type=float, default=0.0,
                        help="Share of the source-logit KL in stage 2's loss (0: next-token loss alone, 1: KL alone).")
    parser.add_argument("--distill_temperature", type=float, default=2.0)
    parser.add_argument("--eval_block_size", type=int, default=1024)
    parser.add_argument("--eval_blocks", type=int, default=32)
    parser.add_argument("--skip_scores", nargs="*", default=[], choices=MODELS,
                        help="Models not to score (e.g. the source, scored by an earlier run).")
    parser.add_argument("--log_every", type=int, default=5)
    parser.add_argument("--checkpoint_every", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto",
                        help='"cpu", "cuda", "cuda:N", or "auto" (the GPU when there is one; fp32 with TF32 matmuls there).')
    return parser


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


def packed_tokens(tokenizer, documents, needed: int) -> tuple[list[int], int]:
    """The token stream of `documents` with EOS after each, cut to `needed` tokens (None: all of
    them), and the number of documents it took."""
    stream, used = [], 0
    for text in documents:
        stream.extend(tokenizer(text)["input_ids"] + [tokenizer.eos_token_id])
        used += 1
        if needed is not None and len(stream) >= needed:
            break
    return stream if needed is None else stream[:needed], used


def training_blocks(tokenizer, documents: list[str], count: int, block_size: int):
    """The first `count` blocks (count, block_size) of the documents packed with EOS after each,
    and the number of documents they took."""
    import torch

    needed = count * block_size
    stream, used = packed_tokens(tokenizer, documents, needed)
    if len(stream) < needed:
        raise ValueError(f"the training documents hold {len(stream)} tokens; {count} blocks need {needed}")
    return torch.tensor(stream).view(count, block_size), used


def evaluation_tokens(path: str, tokenizer, text_column: str, needed: int):
    """The token ids (1-D) of an evaluation text: a .txt[.gz] file's whole text, or the documents of
    a .jsonl[.gz] file in a fixed shuffled order (labels sorted in the file mix), each followed by
    EOS, up to `needed` tokens."""
    import torch

    if ".jsonl" in path:
        return torch.tensor(packed_tokens(tokenizer, read_documents(path, text_column, seed=0), needed)[0])
    with open(path, "rb") as handle:
        raw = handle.read()
    return torch.tensor(tokenizer((gzip.decompress(raw) if path.endswith(".gz") else raw).decode("utf-8"))["input_ids"])


def write_file(path: Path, write) -> None:
    """``write(staged_path)`` writes the file that becomes ``path``: staged and moved into place
    (:func:`hf_zformer.folders.writing`), so a failed write leaves the earlier file; it stops the
    script with one error line naming the path and the errno."""
    from hf_zformer import folders

    try:
        with folders.writing(path.parent) as staging:
            write(staging / path.name)
    except folders.WriteFailed as failure:
        error(str(failure))


def save_state(state: dict, path: Path) -> None:
    from hf_zformer.conversion.decoder_transfer import save_state as save

    write_file(path, lambda staged: save(state, staged))


def load_state(path: Path) -> dict:
    """A stage's saved state: safetensors (:func:`hf_zformer.conversion.decoder_transfer.load_state`),
    or the ``.pt`` file of an earlier version, unpickled only as tensors and plain values."""
    import pickle

    import torch

    from hf_zformer.conversion.decoder_transfer import load_state as load

    try:
        return load(path) if path.suffix == ".safetensors" else torch.load(path, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, ValueError, KeyError) as problem:
        error(f"{path} cannot be resumed: it holds something other than a training state of tensors and plain "
              f"values ({str(problem).strip().splitlines()[0]}); nothing in it was run. Delete it to start the "
              "stage again")


def write_results(path: Path, results: dict) -> None:
    write_file(path, lambda staged: staged.write_text(json.dumps(results, indent=1) + "\n"))


def error(message: str):
    print(f"linearize_decoder.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def check_inputs(args: LinearizationArguments) -> None:
    """The training and evaluation files and --init_model exist, before the source is loaded."""
    for name, path in [("train_file", args.train_file), ("init_model", args.init_model)] + [
            ("eval_file", path) for path in args.eval_file]:
        if path is not None and not (Path(path).is_dir() if name == "init_model" else Path(path).is_file()):
            error(f"--{name} {path} is not a {'folder' if name == 'init_model' else 'file'}")


def pick_device(args: LinearizationArguments):
    import torch

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 weights, TF32 matrix products
    return device


def prepare_output_dir(args: LinearizationArguments) -> Path:
    """--output_dir checked (new, empty, or a folder this library wrote: a run to resume, with the
    same arguments), created and marked, with this run's arguments in run_args.json."""
    import torch

    from hf_zformer import folders

    inputs = {"--model_name_or_path": args.model_name_or_path, "--train_file": args.train_file,
              **{f"--eval_file {path}": path for path in args.eval_file}}
    if args.init_model:
        inputs["--init_model"] = args.init_model
    try:  # never a folder of other files, nor one of the user's files under a name this run writes
        output_dir = folders.check_output_dir(args.output_dir, name="--output_dir", whole=False, inputs=inputs)
        folders.check_writes(output_dir, OUTPUT_FILES, name="--output_dir")
    except (ValueError, OSError) as problem:
        error(str(problem))
    torch.manual_seed(args.seed)
    try:  # the disk full or a read-only folder at its first write: the path and the errno
        output_dir.mkdir(parents=True, exist_ok=True)
        folders.record(output_dir)
    except OSError as problem:
        error(str(folders.WriteFailed(problem, output_dir)))
    folders.recover(output_dir)  # what a killed write left
    identity = {k: v for k, v in args.flags().items() if k not in RESUMABLE}
    identity_file = output_dir / "run_args.json"
    if identity_file.exists() and json.loads(identity_file.read_text()) != identity:
        error(f"{output_dir} holds a run with other arguments ({identity_file}); choose another --output_dir")
    write_file(identity_file, lambda staged: staged.write_text(json.dumps(identity, indent=1) + "\n"))
    return output_dir


def initial_results(args: LinearizationArguments, device) -> dict:
    """What results.json records before any number: the source, the recipe of each stage, where it runs."""
    import torch

    from hf_zformer.training.results import git_commit, machine

    transfer, stage = args.transfer, args.finetune
    lora = {"rank": stage.lora_rank, "alpha": stage.lora_alpha, "targets": stage.lora_targets}
    return {
        "source": args.model_name_or_path + (f" ({args.gguf_file})" if args.gguf_file else ""),
        "init_model": args.init_model, "attention_type": args.attention_type,
        "config_overrides": args.config_overrides, "train_file": args.train_file, "eval_file": args.eval_file,
        "eval_block_size": args.eval_block_size, "eval_blocks": args.eval_blocks, "seed": args.seed,
        "transfer": {"steps": transfer.steps, "batch_size": args.batch_size, "block_size": args.block_size,
                     "tokens": transfer.steps * args.batch_size * args.block_size,
                     "learning_rate": transfer.learning_rate},
        "finetune": {"steps": stage.finetune_steps, "batch_size": args.batch_size, "block_size": args.block_size,
                     "tokens": stage.finetune_steps * args.batch_size * args.block_size,
                     "method": stage.finetune_method, "learning_rate": stage.finetune_learning_rate,
                     "lora": lora if stage.finetune_method == "lora" else None,
                     "new_attention": stage.finetune_new_attention, "distill_weight": stage.distill_weight,
                     "distill_temperature": stage.distill_temperature},
        "device": str(device), "precision": "fp32, TF32 matmuls" if device.type == "cuda" else "fp32",
        "commit": git_commit(Path(__file__).resolve().parents[1]), "machine": machine(),
        "threads": torch.get_num_threads(), "perplexity": {}, "greedy_samples": {},
    }


def load_models(args: LinearizationArguments, device):
    """``(tokenizer, source, model, start)``: the source, and the model to train on ``device``,
    converted from it or --init_model (``start`` names which)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_zformer.conversion.convert_decoder import convert_causal_lm
    from hf_zformer.modeling import ZformerLlamaConfig, ZformerLlamaForCausalLM
    from hf_zformer.training.arguments import parse_config_overrides
    from hf_zformer.hub import weights_failure

    started = time.time()
    load = dict(gguf_file=args.gguf_file) if args.gguf_file else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path, **load)
        source = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32, **load).eval()
    except Exception as problem:  # noqa: BLE001  (no or damaged weights, a pickle, no network for a Hub id)
        error(f"--model_name_or_path {args.model_name_or_path}: its tokenizer or causal LM cannot be loaded "
              f"({weights_failure(problem)})")
    log(f"source {type(source).__name__} loaded ({sum(p.numel() for p in source.parameters()) / 1e6:.1f}M "
        f"parameters, {time.time() - started:.0f} s)")
    if args.init_model:
        try:
            model = ZformerLlamaForCausalLM.from_pretrained(args.init_model, dtype=torch.float32).eval()
        except Exception as problem:  # not a folder of a converted model: name it and the cause
            error(f"--init_model {args.init_model} holds no converted model ({weights_failure(problem)})")
        start = "init_model"
    else:
        attention_type = args.layer_attention
        try:  # an unknown field, a value the config refuses, one attention type per layer of another count
            overrides = parse_config_overrides(args.config_overrides, ZformerLlamaConfig)
            model = convert_causal_lm(args.model_name_or_path, attention_type, source=source, tokenizer=tokenizer,
                                      **overrides)
        except ValueError as problem:
            error(f"invalid model configuration (--attention_type, --config_overrides): {problem}")
        start = "converted"
    return tokenizer, source.to(device), model.to(device), start


class Run:
    """One run's output folder, results, tokenizer and evaluation texts: scoring, saving and the
    training loop both stages share."""

    def __init__(self, args: LinearizationArguments, device, output_dir: Path, tokenizer):
        self.args, self.device, self.output_dir, self.tokenizer = args, device, output_dir, tokenizer
        self.results_file = output_dir / "results.json"
        self.results = (json.loads(self.results_file.read_text()) if self.results_file.exists()
                        else initial_results(args, device))
        needed = args.eval_blocks * args.eval_block_size
        self.evaluations = {evaluation_name(path): evaluation_tokens(path, tokenizer, args.text_column, needed)
                            for path in args.eval_file}
        for name, ids in self.evaluations.items():
            log(f"evaluation text {name}: {ids.numel()} tokens; scoring the first {args.eval_blocks} blocks of "
                f"{args.eval_block_size}")

    def score(self, name: str, model) -> None:
        """The perplexity of ``model`` on each evaluation text not scored yet, and its greedy samples."""
        from hf_zformer.conversion.decoder_transfer import perplexity
        from hf_zformer.training.results import perplexity_ci

        args, results = self.args, self.results
        for text, ids in self.evaluations.items():
            if name in args.skip_scores or text in results["perplexity"].get(name, {}):
                continue
            begin = time.time()

            def progress(done, total):
                if done % 8 == 0 or done == total:
                    log(f"perplexity of {name} on {text}: block {done}/{total}")

            value, losses = perplexity(model, ids, args.eval_block_size, args.eval_blocks, progress)
            results["perplexity"].setdefault(name, {})[text] = {
                "value": round(value, 3), "ci95": perplexity_ci(losses), "tokens": len(losses) * (args.eval_block_size - 1),
                "seconds": round(time.time() - begin, 1)}
            write_results(self.results_file, results)
            log(f"perplexity of {name} on {text}: {value:.3f}")
        for prompt in PROMPTS:
            if name not in results["greedy_samples"].get(prompt, {}):
                encoded = self.tokenizer(prompt, return_tensors="pt").to(self.device)
                tokens = model.generate(**encoded, max_new_tokens=30, do_sample=False)
                results["greedy_samples"].setdefault(prompt, {})[name] = self.tokenizer.decode(
                    tokens[0, encoded["input_ids"].shape[1]:], skip_special_tokens=True)
        write_results(self.results_file, results)

    def save(self, name: str, model) -> None:
        """The model and tokenizer as ``OUTPUT_DIR/name``, written whole into a staging folder and
        moved into place (never half a model, even when killed or out of space)."""
        from hf_zformer import folders

        staging = folders.staging_dir(self.output_dir, name)
        try:
            model.save_pretrained(staging)
            self.tokenizer.save_pretrained(staging)
            folders.replace_atomically(staging, self.output_dir / name)
            folders.record(self.output_dir, name)
        except OSError as failure:
            error(str(folders.WriteFailed(failure, self.output_dir / name)))
        finally:
            folders.discard(staging)
        log(f"saved {self.output_dir / name}")

    def train(self, stage: str, trainer, blocks, total: int, state_file: Path, describe):
        """Run ``trainer`` to ``total`` steps on ``blocks`` (resuming ``state_file``, saved every
        --checkpoint_every steps); the last step's output."""
        import torch

        args, device = self.args, self.device
        earlier = state_file.with_suffix(".pt")  # the format of an earlier version
        saved = state_file if state_file.exists() else earlier if earlier.exists() else None
        if saved is not None:
            trainer.load_state_dict(load_state(saved))
            log(f"{stage}: resumed from {saved} at step {trainer.completed}")
        begin, first, last = time.time(), trainer.completed, None
        while trainer.completed < total:
            step = trainer.completed
            last = trainer.step(blocks[step * args.batch_size : (step + 1) * args.batch_size].to(device))
            done = trainer.completed
            if done % args.log_every == 0 or done == total:
                rate = (time.time() - begin) / (done - first)
                log(f"{stage} step {done}/{total} {describe(last)} lr {trainer.scheduler.get_last_lr()[0]:.2e} "
                    f"{rate:.1f} s/step, {(total - done) * rate / 60:.1f} min left")
            if done % args.checkpoint_every == 0 or done == total:
                save_state(trainer.state_dict(), state_file)
        key = f"{stage.replace(' ', '_')}_seconds"
        self.results[key] = self.results.get(key, 0) + round(time.time() - begin, 1)
        return last


def transfer_attention(run: Run, model, documents: list[str]) -> int:
    """Stage 1: fit the new attention to the softmax attention layer by layer; the documents it took."""
    from hf_zformer.conversion.convert_decoder import full_attention_copy
    from hf_zformer.conversion.decoder_transfer import AttentionTransfer

    args, stage = run.args, run.args.transfer
    transfer = AttentionTransfer(model, full_attention_copy(model).to(run.device), steps=stage.steps,
                                 learning_rate=stage.learning_rate)
    blocks, used = training_blocks(run.tokenizer, documents, stage.steps * args.batch_size, args.block_size)
    log(f"attention transfer: {len(transfer.parameters)} tensors "
        f"({sum(p.numel() for p in transfer.parameters.values()) / 1e6:.2f}M parameters), {stage.steps} steps of "
        f"{args.batch_size} x {args.block_size} tokens")
    errors = run.train("attention transfer", transfer, blocks, stage.steps,
                       run.output_dir / "transfer_state.safetensors",
                       lambda e: f"error {sum(e) / len(e):.4f} (layers {min(e):.3f}-{max(e):.3f})")
    if errors is not None:
        run.results["last_step_layer_errors"] = [round(e, 4) for e in errors]
    del transfer
    run.save("transferred", model)
    run.score("transferred", model)
    return used


def describe_losses(losses: dict) -> str:
    extra = f", distillation {losses['distillation']:.4f}" if losses["distillation"] is not None else ""
    return f"loss {losses['loss']:.4f} (next-token {losses['next_token']:.4f}{extra})"


def finetune(run: Run, model, source, documents: list[str], used: int):
    """Stage 2: next-token loss (and the source's logits) on the documents stage 1 did not take
    (``used``: how many it took); the fine-tuned model, LoRA folded in."""
    from hf_zformer.conversion.decoder_finetune import Finetuning

    args, stage = run.args, run.args.finetune
    finetuning = Finetuning(
        model, steps=stage.finetune_steps, learning_rate=stage.finetune_learning_rate, method=stage.finetune_method,
        lora_rank=stage.lora_rank, lora_alpha=stage.lora_alpha, lora_targets=stage.lora_targets,
        new_attention=stage.finetune_new_attention, teacher=source if stage.distill_weight > 0 else None,
        distill_weight=stage.distill_weight, temperature=stage.distill_temperature)
    blocks, from_end = training_blocks(run.tokenizer, documents[::-1], stage.finetune_steps * args.batch_size,
                                       args.block_size)
    if used + from_end > len(documents):
        error(f"{args.train_file} holds too little text for both stages: "
              f"stage 1 takes {used} of its {len(documents)} documents and stage 2 {from_end}")
    log(f"fine-tuning ({stage.finetune_method}): {finetuning.trainable_count() / 1e6:.2f}M trained parameters, "
        f"{stage.finetune_steps} steps of {args.batch_size} x {args.block_size} tokens"
        + (f", distilling the source's logits (weight {stage.distill_weight}, T={stage.distill_temperature})"
           if stage.distill_weight else ""))
    losses = run.train("fine-tuning", finetuning, blocks, stage.finetune_steps,
                       run.output_dir / "finetune_state.safetensors",
                       describe_losses)
    if losses is not None:
        run.results["last_step_finetune_losses"] = {k: None if v is None else round(v, 4) for k, v in losses.items()}
    model = finetuning.merged_model()
    del finetuning
    run.save("finetuned", model)
    run.score("finetuned", model)
    return model


def report(run: Run, started: float) -> None:
    results = run.results
    results["wall_time_s"] = results.get("wall_time_s", 0) + round(time.time() - started, 1)
    write_results(run.results_file, results)
    log(f"done: {json.dumps({m: {t: e['value'] for t, e in p.items()} for m, p in results['perplexity'].items()})}")


def main(argv=None):
    args = parse_args(argv)
    check_inputs(args)
    device = pick_device(args)
    output_dir = prepare_output_dir(args)
    started = time.time()
    tokenizer, source, model, start = load_models(args, device)
    try:  # texts too short for the blocks asked (--block_size, --eval_block_size): one line, not a traceback
        run = Run(args, device, output_dir, tokenizer)
        run.results["config"] = {key: getattr(model.config, key) for key in (
            "attention_type", "zformer_feature_map", "attention_window", "attention_sinks", "feature_map_horizon",
            "rotary_feature_maps", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads")}
        run.score("source", source)
        run.score(start, model)
        documents = read_documents(args.train_file, args.text_column, args.seed)
        used = transfer_attention(run, model, documents) if args.transfer.steps else 0
        if args.finetune.finetune_steps:
            model = finetune(run, model, source, documents, used)
    except ValueError as problem:
        error(str(problem))
    report(run, started)


if __name__ == "__main__":
    main()
