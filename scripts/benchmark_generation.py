#!/usr/bin/env python
"""Time per generated token against the generated length, for full and linear-attention decoders.

A full-attention decoder attends to every earlier token, so each new token costs more than the
last; Zformer and Fastformer decoders carry a fixed-size state, so the cost per token stays flat.
The decoders step in lockstep (one token of each type in turn, same source, same batch), so
machine noise hits them alike and their ratio is measured side by side.

    python scripts/benchmark_generation.py --max_length 4096 --output docs/bench/generation

With --model_name_or_path, pretrained causal LMs instead (a transformers Llama and the models
converted from it, say), batch 1, greedy from --prompt: each model in a process of its own, stepped
in lockstep, with the bytes its cache holds and the resident memory its process gains at every
checkpoint, and with --samples N greedy continuations of the same prompts side by side.

    python scripts/benchmark_generation.py --model_name_or_path SOURCE CONVERTED --names source,converted \
        --max_length 4096 --checkpoints 512,4096 --threads 1 --samples 30
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
from hf_zformer import enable_cpu_speedups, flags, folders  # noqa: E402
from hf_zformer.decoding import StepDecoder  # noqa: E402
from hf_zformer.modeling.modeling_zformer import CACHE_FIELD  # noqa: E402

# sample prompts: two short ones, and one longer than a 64-token softmax window
PROMPTS = (
    "The history of the city begins",
    "This movie was",
    "The Amazon is the largest rainforest on Earth. It covers much of the Amazon basin of South America, an area "
    "of about seven million square kilometres, of which five and a half million are covered by the forest. The "
    "region includes territory belonging to nine nations: Brazil holds about sixty percent of it, followed by "
    "Peru and Colombia. The forest is home to",
)


def parse_args(argv=None):
    parser = flags.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--decoders", default="full,zformer,fastformer", help="decoder attention types, comma-separated")
    parser.add_argument("--model_name_or_path", nargs="+", default=None,
                        help="pretrained causal LMs (folders or Hub ids) to decode instead of the encoder-decoders; "
                             "the first is the baseline of the ratios")
    parser.add_argument("--names", default=None, help="comma-separated names of those models (default: folder names)")
    parser.add_argument("--gguf_file", default=None,
                        help="GGUF file to load from every --model_name_or_path folder that holds it")
    parser.add_argument("--prompt", default=PROMPTS[0], help="the causal LMs' prompt (batch 1)")
    parser.add_argument("--prefill", type=int, default=0, help="tokens of context read before the timed steps: "
                        "causal LMs read the prompt's tokens repeated, in chunks of 1,024; encoder-decoders a random "
                        "decoder prefix after the start token, in one forward (lengths count from its end)")
    parser.add_argument("--samples", type=int, default=0,
                        help="causal LMs: greedy continuations of this many tokens from each of the sample prompts")
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
    parser.add_argument("--output", type=Path, default=None,
                        help="write <output>.json (the record; its \"markdown\" is the table printed) and, for the "
                             "encoder-decoders, <output>.png")
    parser.add_argument("--append", action="store_true",
                        help="add this run's record to <output>.json as written before (the file then holds a list "
                             "of records, oldest first) instead of replacing it")
    args = parser.parse_args(argv)
    args.decoders = [d.strip() for d in args.decoders.split(",") if d.strip()]
    if args.model_name_or_path:
        _causal_arguments(parser, args)
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
            folders.check_output_files(output_files(args))
        except ValueError as error:
            parser.error(str(error))
    return args


def _causal_arguments(parser, args):
    """Check and complete the arguments of the pretrained causal LMs' mode (`--model_name_or_path`)."""
    paths = args.model_name_or_path
    names = [n.strip() for n in args.names.split(",")] if args.names else [Path(p).name or p for p in paths]
    if len(names) != len(paths) or len(set(names)) != len(names):
        parser.error(f"--names needs one distinct name per --model_name_or_path ({len(paths)}), got {names}")
    if args.device != "cpu" or args.cuda_graphs or args.dtype != "fp32":
        parser.error("--model_name_or_path runs on the CPU in fp32 (no --device, --cuda_graphs or --dtype)")
    args.decoders = names


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
        max_position_embeddings=max(args.prefill + args.max_length, args.source_length) + 1,
    )
    torch.manual_seed(args.seed)
    return enable_cpu_speedups(AutoModelForSeq2SeqLM.from_config(config)).eval().to(args.device)


class EagerDecoder:
    """Greedy decoding by eager forwards with the model's cache (what generate() runs): `step()`
    feeds the last token, `cache` is the decoding state."""

    def __init__(self, model, source, mask, decoder_prefix=None):
        self.model, self.mask = model, mask
        self.encoded = model.get_encoder()(input_ids=source, attention_mask=mask)
        self.tokens = torch.full((source.shape[0], 1), model.config.decoder_start_token_id, device=source.device)
        self.cache = None
        if decoder_prefix is not None:  # the start token and the prefix in one forward, not timed
            self.tokens = torch.cat([self.tokens, decoder_prefix], 1)
            self.step()

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
    prefix = None
    if args.prefill:
        prefix = torch.randint(5, args.vocab_size, (args.batch_size, args.prefill), generator=generator).to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16")
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    steps = {kind: [] for kind in models}
    decoders = {}
    with autocast:
        for kind, model in models.items():
            if args.cuda_graphs and kind != "full":  # its first step (the start token) runs in the constructor
                seconds, decoders[kind] = timed(lambda: StepDecoder(
                    model, source, mask, max_new_tokens=args.max_length, graphs=True, decoder_prefix=prefix),
                    synchronize)
                if prefix is None:  # with a prefix, the steps after it are timed, as for the eager decoders
                    steps[kind].append(seconds)
            else:
                decoders[kind] = EagerDecoder(model, source, mask, prefix)
        try:
            for _ in tqdm(range(args.max_length), desc="decoding", unit="token"):
                for kind, decoder in decoders.items():
                    if len(steps[kind]) < args.max_length:
                        steps[kind].append(timed(decoder.step, synchronize)[0])
        except KeyboardInterrupt:  # stopped from outside (Ctrl-C, SIGTERM): the steps timed so far count
            print(f"stopped after {tokens_timed(steps)} tokens", file=sys.stderr)
    state_sizes = {kind: decoder.cache.self_attention_numel() for kind, decoder in decoders.items()}
    return steps, state_sizes


def measure_causal(args):
    """Decode the pretrained causal LMs in lockstep, one process each: ({name: [seconds of step t]},
    {name: {checkpoint: memory}}, {name: model description}, {prompt: {name: continuation}})."""
    names, checkpoints = args.decoders, set(args.checkpoints)
    steps, memory = {name: [] for name in names}, {name: {} for name in names}
    with benchmarks.LockstepModels(args.model_name_or_path, args.gguf_file, args.threads) as models:
        described = dict(zip(names, models.descriptions))
        samples = {}
        if args.samples:
            for name, texts in zip(names, models.ask_all("samples", list(PROMPTS), args.samples)):
                for prompt, text in zip(PROMPTS, texts):
                    samples.setdefault(prompt, {})[name] = text
        for name, length in zip(names, models.ask_all("start", args.prompt, args.prefill)):
            described[name]["prompt_tokens"] = length
        try:
            for t in tqdm(range(1, args.max_length + 1), desc="decoding", unit="token"):
                for name, seconds in zip(names, models.step_all()):
                    steps[name].append(seconds)
                if t in checkpoints:
                    for name, state in zip(names, models.ask_all("memory")):
                        memory[name][t] = state
        except KeyboardInterrupt:  # stopped from outside: the steps and checkpoints every model reached count
            print(f"stopped after {tokens_timed(steps)} tokens", file=sys.stderr)
            reached = set.intersection(*(set(states) for states in memory.values()))
            memory = {name: {t: states[t] for t in sorted(reached)} for name, states in memory.items()}
    return steps, memory, described, samples


def tokens_timed(steps) -> int:
    """The tokens every decoder was timed on: all of them, unless the run was stopped first."""
    return min(map(len, steps.values()))


def summarize(args, steps):
    """ms/token at each checkpoint (the median over the `window` steps before it) that every decoder
    reached: all of them, unless the run was stopped first."""
    rows, reached = [], tokens_timed(steps)
    for length in (length for length in args.checkpoints if length <= reached):
        row = {"length": length}
        for kind, times in steps.items():
            row[kind] = statistics.median(times[length - args.window : length]) * 1000  # ms per step
        rows.append(row)
    return rows


def ratio_table(args, rows, baseline):
    """Markdown lines: ms/token of each decoder at each checkpoint, and `baseline`'s time over each other's."""
    kinds = args.decoders
    header = "| generated length | " + " | ".join(f"{k} ms/token" for k in kinds)
    ratios = [k for k in kinds if k != baseline] if baseline in kinds else []
    header += "".join(f" | {baseline} / {k}" for k in ratios) + " |"
    lines = [header, "|" + "---|" * (1 + len(kinds) + len(ratios))]
    for row in rows:
        cells = [str(row["length"])] + [f"{row[k]:.2f}" for k in kinds]
        cells += [f"{row[baseline] / row[k]:.2f}x" for k in ratios]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown(args, rows, state_sizes):
    lines = ratio_table(args, rows, "full") + [""]
    if args.prefill:
        lines.append(f"Each decoder first read a {args.prefill:,}-token decoder prefix after the start token (one "
                     "forward, not timed); lengths count the tokens generated after it.")
    if args.cuda_graphs:
        lines.append("zformer and fastformer decoders: each token one CUDA-graph replay of a fixed-shape step "
                     "(hf_zformer.decoding.StepDecoder); full attention: eager steps with its KV cache.")
    lines.append("Decoder self-attention state after the last token (elements, whole batch): "
                 + ", ".join(f"{k}: {state_sizes[k]:,}" for k in args.decoders))
    return "\n".join(lines)


def causal_markdown(args, rows, memory, samples):
    """The ratio table (the first model the baseline), then memory per model and checkpoint (MiB), then
    the greedy samples side by side."""
    lengths, mib = list(memory[args.decoders[0]]), 2.0**20  # the checkpoints every model reached (measure_causal)
    lines = ratio_table(args, rows, args.decoders[0]) + ["", "Memory (MiB) after each generated length: bytes held "
                                                         "by the cache object / peak RSS growth of the model's process "
                                                         "since its first token.", ""]
    lines += ["| model | " + " | ".join(f"{n} tokens" for n in lengths) + " |", "|---" * (1 + len(lengths)) + "|"]
    for name in args.decoders:
        cells = [f"{memory[name][n]['cache_bytes'] / mib:.1f} / {max(memory[name][n]['peak_rss_growth'], 0) / mib:.1f}"
                 for n in lengths]  # a peak a few pages under the baseline (pages released) reads 0
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if samples:
        lines += ["", f"Greedy continuations ({args.samples} new tokens at most):", "",
                  "| prompt | " + " | ".join(args.decoders) + " |", "|---" * (1 + len(args.decoders)) + "|"]
        for prompt, texts in samples.items():
            cells = [_cell(prompt)] + [_cell(texts[name]) for name in args.decoders]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(text: str) -> str:
    """`text` as one markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


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


def output_files(args) -> list[Path]:
    """What --output writes: the record (its "markdown" is the table printed), and the plot of the
    encoder-decoders' times."""
    suffixes = (".json",) if args.model_name_or_path else (".json", ".png")
    return [args.output.with_suffix(suffix) for suffix in suffixes]


def write_record(args, record: dict) -> None:
    """<output>.json: the record, or with --append the records there before and this one (a list)."""
    path = args.output.with_suffix(".json")
    if args.append and path.exists():
        before = json.loads(path.read_text())
        record = [*(before if isinstance(before, list) else [before]), record]
    path.write_text(json.dumps(record, indent=2))


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    machine = benchmarks.machine_info(torch.device(args.device))  # load average at the start
    with benchmarks.interrupt_on_terminate():  # stopped from outside, it still writes what it timed
        try:
            if args.model_name_or_path:
                steps, memory, described, samples = measure_causal(args)
            else:
                steps, state_sizes = measure(args)
        except KeyboardInterrupt:  # the decoding loops keep what they timed; this is a stop outside them
            print("stopped outside the decoding loop (loading the models, the samples, the prompt or closing "
                  "the model processes): nothing written", file=sys.stderr)
            sys.exit(130)
    rows, timed = summarize(args, steps), tokens_timed(steps)
    if args.model_name_or_path:
        table = causal_markdown(args, rows, memory, samples)
        results = {"models": described, "memory": memory, "samples": samples, "tokens_timed": timed}
    else:
        table = markdown(args, rows, state_sizes)
        results = {"state_numel": state_sizes, "tokens_timed": timed}
    if timed < args.max_length:
        table += f"\nStopped after {timed:,} of {args.max_length:,} tokens: the checkpoints after it are not reported."
    print(table)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        record = {"command": benchmarks.command_line(), "settings": settings, "torch": torch.__version__,
                  "threads": torch.get_num_threads(), "machine": machine, "load_average_end": benchmarks.load_average(),
                  "rows": rows, **results, "markdown": table}
        write_record(args, record)
        if not args.model_name_or_path:
            plot(args, rows, args.output.with_suffix(".png"))
        folders.record_files(output_files(args))
    if timed < args.max_length:
        sys.exit(130)  # stopped from outside: what a shell reports for Ctrl-C
    return rows


if __name__ == "__main__":
    main()
