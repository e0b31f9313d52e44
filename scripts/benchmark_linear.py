#!/usr/bin/env python
"""Few-row projections: torch's `nn.Linear` against `FewRowsLinear`, per weight shape and row count.

A decoding step sends batch-many rows (one token per sequence) through every projection, and its
time goes into streaming the weights from memory. `hf_zformer.cpu_speedups.FewRowsLinear` (the
opt-in CPU layer forms, `hf_zformer.enable_cpu_speedups`) computes 1 to `few_rows()` rows as
(W x^T + b)^T on the CPU where torch computes x W^T + b; this script measures both forms side by
side (their calls alternate), over many copies of each weight so that every call reads its weight
from memory as a decoding step does, and prints a markdown table of microseconds per call.

    python scripts/benchmark_linear.py --threads 2
    python scripts/benchmark_linear.py --shapes 512x512 512x2048 --rows 1 2 4 8 --threads 1

A cell reads `nn.Linear us / FewRowsLinear us (speed-up)`; `=` marks the cells where
`FewRowsLinear` takes the plain form itself (more than `few_rows()` rows, or in_features >
out_features), so both columns time the same computation. `--form transposed` times the
transposed product in every cell instead, the rule's limits ignored. See docs/benchmarks.md
("Generation and memory").
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from hf_zformer import flags, folders  # noqa: E402
from hf_zformer.cpu_speedups import FewRowsLinear, few_rows, takes_transposed_form, transposed_linear  # noqa: E402


def parse_shape(text: str) -> tuple[int, int]:
    try:
        in_features, out_features = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is IN_FEATURESxOUT_FEATURES (e.g. 512x2048), got {text!r}")
    if in_features < 1 or out_features < 1:
        raise argparse.ArgumentTypeError(f"shape sizes must be >= 1, got {text!r}")
    return in_features, out_features


def parse_args(argv=None):
    parser = flags.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--shapes", nargs="+", type=parse_shape,
                        default=[(512, 512), (512, 2048), (2048, 512), (512, 8000)],
                        help="weights as IN_FEATURESxOUT_FEATURES (the defaults: the benchmark seq2seq model's "
                             "projections, FFN up and down, and LM head)")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 3, 4, 8, 16])
    parser.add_argument("--weights_mb", type=float, default=64.0,
                        help="memory held by the copies of each weight, so that calls read weights from memory")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (median reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--form", choices=("linear", "transposed"), default="linear",
                        help="'linear': FewRowsLinear as the models call it; 'transposed': its transposed "
                             "product in every cell, past the limits of its rule (to show why the rule stops there)")
    parser.add_argument("--output", type=Path, default=None, help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if any(r < 1 for r in args.rows):
        parser.error(f"--rows must all be >= 1, got {args.rows}")
    if args.weights_mb <= 0:
        parser.error(f"--weights_mb must be > 0, got {args.weights_mb}")
    if args.output:
        try:  # before any work: no file of somebody else's is overwritten
            folders.check_output_files([args.output])
        except ValueError as error:
            parser.error(str(error))
    return args


def time_shape(in_features: int, out_features: int, rows: int, copies: int, repeats: int,
               form: str = "linear") -> tuple[float, float]:
    """Median microseconds per call of nn.Linear and of ours (`form`: FewRowsLinear, or its transposed
    product everywhere), each round running every copy once."""
    layers = [FewRowsLinear(in_features, out_features) for _ in range(copies)]
    x = torch.randn(rows, in_features)
    forms = {
        "nn.Linear": lambda layer: torch.nn.functional.linear(x, layer.weight, layer.bias),
        "ours": (lambda layer: layer(x)) if form == "linear" else (
            lambda layer: transposed_linear(x, layer.weight, layer.bias)),
    }
    rounds = {name: [] for name in forms}
    with torch.inference_mode():
        for round_ in range(repeats + 1):  # the first round warms up
            for name, call in forms.items():
                start = time.perf_counter()
                for layer in layers:
                    call(layer)
                if round_:
                    rounds[name].append((time.perf_counter() - start) / copies * 1e6)
    return statistics.median(rounds["nn.Linear"]), statistics.median(rounds["ours"])


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    ours = "FewRowsLinear" if args.form == "linear" else "the transposed product in every cell"
    lines = [
        f"**nn.Linear vs {ours}, fp32 CPU, {threads} thread{'s' if threads > 1 else ''}, torch {torch.__version__}, "
        f"few rows = {few_rows()}** (microseconds per call, median of {args.repeats} rounds"
        + ("; `=`: FewRowsLinear takes the plain form there)" if args.form == "linear" else ")"),
        "",
        "| weight (in x out) | " + " | ".join(f"{r} row{'s' if r > 1 else ''}" for r in args.rows) + " |",
        "|---|" + "---:|" * len(args.rows),
    ]
    for in_features, out_features in args.shapes:
        copies = max(1, int(args.weights_mb * 2**20 / (4 * in_features * out_features)))
        cells = []
        for rows in args.rows:
            plain, ours = time_shape(in_features, out_features, rows, copies, args.repeats, args.form)
            same = "" if args.form == "transposed" or takes_transposed_form(in_features, out_features, rows) else " ="
            cells.append(f"{plain:.0f} / {ours:.0f} ({plain / ours:.2f}x){same}")
        lines.append(f"| {in_features} x {out_features} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(table + "\n")
        folders.record_files([args.output])
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
