#!/usr/bin/env python
"""Where the time goes: torch.profiler tables of the benchmark's seq2seq models (training step and
greedy generation), ours against BART of identical size.

    python scripts/profile_models.py --source_length 32 --target_length 32 --batch 4
    python scripts/profile_models.py --models bart fastformer --kinds generate --threads 1

For each model and kind it runs one warm-up call, then profiles `--steps` calls and prints the
operators sorted by self CPU time (their share of the total and their calls per call), the wall
time and the total number of operator calls per call: on short inputs every operator costs a
dispatch, so that count shows per-call overhead. See docs/benchmarks.md ("Short inputs") for
what it showed.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from hf_zformer import flags  # noqa: E402
from benchmarks import SEQ2SEQ_DEFAULT_MODELS, SEQ2SEQ_MODELS, Seq2SeqShape, build_seq2seq  # noqa: E402


def parse_args(argv=None):
    parser = flags.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=SEQ2SEQ_MODELS, default=list(SEQ2SEQ_DEFAULT_MODELS))
    parser.add_argument("--kinds", nargs="+", choices=("train", "generate"), default=["train", "generate"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--source_length", type=int, default=32)
    parser.add_argument("--target_length", type=int, default=32, help="also the number of tokens generated")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--steps", type=int, default=3, help="profiled calls per model and kind")
    parser.add_argument("--top", type=int, default=15, help="operators shown per table")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    for name in ("batch", "source_length", "target_length", "steps", "top"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = Seq2SeqShape(batch=args.batch, source_length=args.source_length, target_length=args.target_length,
                         width=args.width, layers=args.layers, heads=args.heads, ffn=args.ffn, vocab=args.vocab)
    generator = torch.Generator().manual_seed(0)
    source = torch.randint(3, shape.vocab, (shape.batch, shape.source_length), generator=generator)
    mask = torch.ones_like(source)
    labels = torch.randint(3, shape.vocab, (shape.batch, shape.target_length), generator=generator)
    print(f"batch {shape.batch}, source {shape.source_length} / target {shape.target_length} tokens, width "
          f"{shape.width}, {shape.layers}+{shape.layers} layers, {shape.heads} heads, FFN {shape.ffn}, vocabulary "
          f"{shape.vocab}, fp32, {torch.get_num_threads()} threads, torch {torch.__version__}")
    for name in args.models:
        torch.manual_seed(0)
        model, description = build_seq2seq(name, shape)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # as the benchmark and the scripts

        def train():
            model.train()
            model(input_ids=source, attention_mask=mask, labels=labels).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        def generate():
            model.eval()
            with torch.inference_mode():
                model.generate(input_ids=source, attention_mask=mask, max_new_tokens=shape.target_length,
                               min_new_tokens=shape.target_length, num_beams=1, do_sample=False)

        for kind in args.kinds:
            function = train if kind == "train" else generate
            function()  # warm-up
            started = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(args.steps):
                    function()
            wall = (time.perf_counter() - started) / args.steps
            events = prof.key_averages()
            total = sum(e.self_cpu_time_total for e in events)
            calls = sum(e.count for e in events)
            print(f"\n## {name} {kind}: {description}")
            print(f"per call: wall {wall * 1e3:.0f} ms under the profiler, self CPU total {total / args.steps / 1e3:.0f} "
                  f"ms, {calls / args.steps:.0f} operator calls")
            print("| operator | self ms / call | share | calls / call |")
            print("|---|---:|---:|---:|")
            for event in sorted(events, key=lambda e: -e.self_cpu_time_total)[: args.top]:
                print(f"| {event.key} | {event.self_cpu_time_total / args.steps / 1e3:.1f} | "
                      f"{event.self_cpu_time_total / total:.1%} | {event.count / args.steps:.0f} |")


if __name__ == "__main__":
    main()
