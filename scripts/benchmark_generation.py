#!/usr/bin/env python
"""Time per generated token against the generated length, for full and linear-attention decoders.

A full-attention decoder attends to every earlier token, so each new token costs more than the
last; Zformer and Fastformer decoders carry a fixed-size state, so the cost per token stays flat.
The decoders step in lockstep (one token of each type in turn, same source, same batch), so
machine noise hits them alike and their ratio is measured side by side.

    python scripts/benchmark_generation.py --max_length 4096 --output docs/bench/generation
"""

import argparse
import sys
import json
import statistics
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402
from transformers import AutoConfig, AutoModelForSeq2SeqLM  # noqa: E402

import benchmarks  # noqa: E402
from hf_zformer import flags, folders  # noqa: E402
from hf_zformer.decoding import StepDecoder  # noqa: E402
from hf_zformer.modeling.modeling_zformer import CACHE_FIELD  # noqa: E402


def parse_args(argv=None):
    parser = flags.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--decoders", default="full,zformer,fastformer", help="decoder attention types, comma-separated")
    parser.add_argument("--max_length", type=int, default=2048, help="tokens to generate")
    parser.add_argument("--checkpoints", default=None,
                        help="lengths at which to report the step time (default: powers of two up to --max_length)")
    parser.add_argument("--window", type=int, default=16, help="steps around each checkpoint whose median is reported")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--source_length", type=int, default=32)
    parser.add_argument("--hidden_size", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=6, help="encoder and decoder layers")
    parser.add_argument("--vocab_size", type=int, default=8000)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="bf16 runs under autocast")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (each step is timed to its last kernel)")
    parser.add_argument("--cuda_graphs", action="store_true",
                        help="zformer and fastformer decoders step through hf_zformer.decoding.StepDecoder, each "
                             "token a replay of one CUDA graph (their state has a fixed shape); full attention "
                             "decodes eagerly with its growing KV cache, as generate() does")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's choice; 1 is steadier on a shared machine)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None, help="write <output>.json, .md and .png")
    args = parser.parse_args(argv)
    args.decoders = [d.strip() for d in args.decoders.split(",") if d.strip()]
    if args.checkpoints:
        args.checkpoints = sorted({int(c) for c in args.checkpoints.split(",")})
    else:
        args.checkpoints = [2**k for k in range(4, 32) if 2**k <= args.max_length]
    if args.cuda_graphs and not args.device.startswith("cuda"):
        parser.error(f"--cuda_graphs needs --device cuda, not {args.device}")
    bad = [c for c in args.checkpoints if not args.window <= c <= args.max_length]
    if bad:
        raise SystemExit(f"--checkpoints {bad} must lie in [--window={args.window}, --max_length={args.max_length}]")
    if args.output:
        try:  # before any work: no file of somebody else's is overwritten
            folders.check_output_files([args.output.with_suffix(s) for s in (".json", ".md", ".png")])
        except ValueError as error:
            parser.error(str(error))
    return args


def build_model(args, decoder_type):
    config = AutoConfig.for_model(
        "zformer",
        attention_type="full",
        decoder_attention_type=decoder_type,
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_attention_heads=args.heads,
        intermediate_size=4 * args.hidden_size,
        num_hidden_layers=args.layers,
        num_decoder_layers=args.layers,
        max_position_embeddings=max(args.max_length, args.source_length) + 1,
    )
    torch.manual_seed(args.seed)
    return AutoModelForSeq2SeqLM.from_config(config).eval().to(args.device)


class EagerDecoder:
    """Greedy decoding by eager forwards with the model's cache (what generate() runs): `step()`
    feeds the last token, `cache` is the decoding state."""

    def __init__(self, model, source, mask):
        self.model, self.mask = model, mask
        self.encoded = model.get_encoder()(input_ids=source, attention_mask=mask)
        self.tokens = torch.full((source.shape[0], 1), model.config.decoder_start_token_id, device=source.device)
        self.cache = None

    def step(self):
        out = self.model(encoder_outputs=self.encoded, attention_mask=self.mask, decoder_input_ids=self.tokens,
                         cache=self.cache, use_cache=True)  # our forwards take `cache` on every version
        self.tokens = out.logits[:, -1:].argmax(-1)  # greedy
        self.cache = getattr(out, CACHE_FIELD)


def timed(action, synchronize) -> tuple[float, object]:
    synchronize()
    start = time.perf_counter()
    result = action()
    synchronize()
    return time.perf_counter() - start, result


@torch.inference_mode()
def measure(args):
    """Step all decoders in lockstep; returns {decoder: [seconds of step t for t in 1..max_length]}."""
    device = torch.device(args.device)
    models = {kind: build_model(args, kind) for kind in args.decoders}
    generator = torch.Generator().manual_seed(args.seed)
    source = torch.randint(5, args.vocab_size, (args.batch_size, args.source_length), generator=generator).to(device)
    mask = torch.ones_like(source)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16")
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    steps = {kind: [] for kind in models}
    decoders = {}
    with autocast:
        for kind, model in models.items():
            if args.cuda_graphs and kind != "full":  # its first step (the start token) runs in the constructor
                seconds, decoders[kind] = timed(lambda: StepDecoder(
                    model, source, mask, max_new_tokens=args.max_length, graphs=True), synchronize)
                steps[kind].append(seconds)
            else:
                decoders[kind] = EagerDecoder(model, source, mask)
        for _ in tqdm(range(args.max_length), desc="decoding", unit="token"):
            for kind, decoder in decoders.items():
                if len(steps[kind]) < args.max_length:
                    steps[kind].append(timed(decoder.step, synchronize)[0])
    state_sizes = {kind: decoder.cache.self_attention_numel() for kind, decoder in decoders.items()}
    return steps, state_sizes


def summarize(args, steps):
    rows = []
    for length in args.checkpoints:
        row = {"length": length}
        for kind, times in steps.items():
            row[kind] = statistics.median(times[length - args.window : length]) * 1000  # ms per step
        rows.append(row)
    return rows


def markdown(args, rows, state_sizes):
    kinds = args.decoders
    header = "| generated length | " + " | ".join(f"{k} ms/token" for k in kinds)
    ratios = [k for k in kinds if k != "full"] if "full" in kinds else []
    header += "".join(f" | full / {k}" for k in ratios) + " |"
    lines = [header, "|" + "---|" * (1 + len(kinds) + len(ratios))]
    for row in rows:
        cells = [str(row["length"])] + [f"{row[k]:.2f}" for k in kinds]
        cells += [f"{row['full'] / row[k]:.2f}x" for k in ratios]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    if args.cuda_graphs:
        lines.append("zformer and fastformer decoders: each token one CUDA-graph replay of a fixed-shape step "
                     "(hf_zformer.decoding.StepDecoder); full attention: eager steps with its KV cache.")
    lines.append("Decoder self-attention state after the last token (elements, whole batch): "
                 + ", ".join(f"{k}: {state_sizes[k]:,}" for k in kinds))
    return "\n".join(lines)


def plot(args, rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for kind in args.decoders:
        axis.plot([r["length"] for r in rows], [r[kind] for r in rows], marker="o", label=f"{kind} decoder")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("generated length (tokens)")
    axis.set_ylabel("time per generated token (ms)")
    axis.set_title(f"Greedy decoding, batch {args.batch_size}, d={args.hidden_size}, {args.layers} layers, {args.dtype}")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    steps, state_sizes = measure(args)
    rows = summarize(args, steps)
    table = markdown(args, rows, state_sizes)
    print(table)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        record = {"settings": settings, "torch": torch.__version__, "threads": torch.get_num_threads(),
                  "machine": benchmarks.machine_info(torch.device(args.device)),
                  "rows": rows, "state_numel": state_sizes}
        args.output.with_suffix(".json").write_text(json.dumps(record, indent=2))
        args.output.with_suffix(".md").write_text(table + "\n")
        plot(args, rows, args.output.with_suffix(".png"))
        folders.record_files([args.output.with_suffix(s) for s in (".json", ".md", ".png")])
    return rows


if __name__ == "__main__":
    main()
