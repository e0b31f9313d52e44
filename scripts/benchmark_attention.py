#!/usr/bin/env python
"""Benchmark the attention family against PyTorch's fused attention (SDPA).

The timing experiment of the Zformer_Pytorch reference code: the attention module alone on input of shape (n, batch, d),
transposed to our (B, N, D) layout before the timed region. Reports the median time per call,
the speedup against fused SDPA (`full`), the peak extra memory, the achieved FLOP/s as a
fraction of this machine's measured matmul FLOP/s, and the operations one call dispatches with the
bytes they move per second as a fraction of its measured copy bandwidth, as CSV, JSON, a markdown
table and a PNG plot.

    python scripts/benchmark_attention.py                                   # CPU fp32 forward sweep
    python scripts/benchmark_attention.py --modes forward train --widths 512 768 1024
    python scripts/benchmark_attention.py --level module --dtype bf16       # whole attention modules, output projection included
    python scripts/benchmark_attention.py --level model --mask              # one-layer models, FFN shrunk away
    python scripts/benchmark_attention.py --device cuda --dtype bf16 --lengths 1024 4096 16384
    python scripts/benchmark_attention.py --level seq2seq --batch 16 --source_length 32   # vs BART
    python scripts/benchmark_attention.py --level seq2seq --batch 4 --seq2seq_lengths 16 32 64 128 256 512 1024
    python scripts/benchmark_attention.py --level causal --lengths 64 512 2048 8192       # vs GPT-2
    python scripts/benchmark_attention.py --level classification --batch 8 --lengths 128 256 512 1024 2048 4096

Levels: 'attention', 'module' (the same with the output projection) and 'model' (above); 'seq2seq' (our encoder-decoder against BART of identical
size, at one source/target length or swept with --seq2seq_lengths, source = target = n); 'causal'
(our causal LM against GPT-2); 'classification' (our sequence classifier against BERT). The last
three measure all models side by side (timed calls alternating) and report nominal FLOP ratios next
to the time ratios.

See docs/benchmarks.md for the method and measured results.
"""

import argparse
import functools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

import benchmarks  # noqa: E402
from hf_zformer import flags, folders  # noqa: E402
from hf_zformer.memory import retain_freed_memory  # noqa: E402


def parse_args(argv=None):
    parser = flags.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    add_case_args(parser)
    add_model_level_args(parser)
    add_run_args(parser)
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def add_case_args(parser) -> None:
    """What is measured: level, types, lengths, sizes, modes, device and precision."""
    parser.add_argument("--level", choices=benchmarks.LEVELS, default="attention",
                        help="'attention': the attention module alone, its output projection set aside; 'module': "
                             "the whole attention module, output projection included, as a model's layer calls it "
                             "(where a form merges the projection into another product); 'model': a one-layer "
                             "ZformerModel with "
                             "intermediate_size=1 (the FFN shrunk away), fed token ids; 'seq2seq': training "
                             "tokens/s and greedy sentences/s of our encoder-decoder against BART of identical size; "
                             "'causal': training and generation tokens/s, cache size and FLOP ratios of our causal LM "
                             "against GPT-2 of identical size; 'classification': inference and training tokens/s and "
                             "FLOP ratios of our sequence classifier against BERT of identical size")
    parser.add_argument("--types", nargs="+", choices=benchmarks.TYPES, default=list(benchmarks.DEFAULT_TYPES),
                        help="attention types; 'full' is fused SDPA (the baseline of every speedup), "
                             "'full_eager' our einsum reference, 'zformer_torch' / 'fastformer_torch' the type "
                             "with the torch forms of its sequence operations instead of the fused kernels "
                             "(the same code on a CPU), 'zformer_kernels' / 'fastformer_kernels' the type with "
                             "the kernels wherever they apply (also on a CPU under TRITON_INTERPRET=1; the folded "
                             "forms where the type takes them: fp32, CPU autocast), "
                             "'<type>_folded' / '<type>_plain' zformer or fastformer with its folded form under "
                             "autocast on every device / on none (by default: fastformer on CPUs)")
    parser.add_argument("--lengths", nargs="+", type=positive_int, default=None,
                        help="sequence lengths (default 128 ... 8192 by powers of 2); --level causal: training "
                             "length and generation prompt + output, half each (default 64 512 2048 8192); "
                             "--level classification: default 128 ... 4096")
    parser.add_argument("--widths", nargs="+", type=positive_int, default=[512])
    parser.add_argument("--heads", nargs="+", type=positive_int, default=[8])
    parser.add_argument("--batch", type=positive_int, default=None, help="default 8 for --level classification, else 4")
    parser.add_argument("--modes", nargs="+", choices=benchmarks.MODES, default=None,
                        help="'forward': inference under torch.inference_mode; 'train': forward+backward (--level "
                             "classification: forward with labels, backward and an AdamW step); default forward, "
                             "--level classification both")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=list(benchmarks.DTYPES), default="fp32",
                        help="bf16 runs fp32 parameters and inputs under torch.autocast(dtype=bfloat16)")
    parser.add_argument("--mask", action="store_true",
                        help="pass an all-ones (B, N) padding mask (default: no mask, SDPA's best case); a model "
                             "drops a mask without padding once per forward, an attention module (--level "
                             "attention, module) uses it as given, so there it times the masked forms")
    parser.add_argument("--cuda_graphs", action="store_true",
                        help="capture each configuration's call once as a CUDA graph and time its replays: the "
                             "GPU's own time, without the host work of eager PyTorch (what torch.compile(mode="
                             "'reduce-overhead') or a captured training step runs); --level attention/module/model only")
    parser.add_argument("--compile", choices=["default", "reduce-overhead", "max-autotune"], default=None,
                        help="time each module under torch.compile in this mode (inductor; 'reduce-overhead' "
                             "replays CUDA graphs on a GPU), called three times before its warm-up: what a "
                             "compiled model or training step runs; --level attention/module/model only (default: eager)")


def add_model_level_args(parser) -> None:
    """The whole-model levels' models and sizes."""
    seq2seq = parser.add_argument_group(
        "--level seq2seq / causal / classification (width and heads: the first of --widths / --heads)")
    seq2seq.add_argument("--seq2seq_models", nargs="+", choices=benchmarks.SEQ2SEQ_MODELS,
                         default=list(benchmarks.SEQ2SEQ_DEFAULT_MODELS),
                         help="--level seq2seq: BART and our models (fastformer-qv: fastformer_share_qv=True)")
    seq2seq.add_argument("--causal_models", nargs="+", choices=benchmarks.CAUSAL_MODELS,
                         default=list(benchmarks.CAUSAL_MODELS), help="--level causal: GPT-2 and our attention types")
    seq2seq.add_argument("--classification_models", nargs="+", choices=benchmarks.CLASSIFICATION_MODELS,
                         default=[m for m in benchmarks.CLASSIFICATION_MODELS if m != "xformer"],
                         help="--level classification: BERT and our attention types (zformer-hedgehog: zformer "
                              'with zformer_feature_map="hedgehog"; fastformer-conv5: encoder_conv_size=5)')
    seq2seq.add_argument("--source_length", type=positive_int, default=None, help="default 32")
    seq2seq.add_argument("--target_length", type=positive_int, default=None,
                         help="also the number of tokens generated (default 32)")
    seq2seq.add_argument("--seq2seq_lengths", nargs="+", type=positive_int, default=None,
                         help="a sweep instead of one length: source = target = n for each n, every length measured "
                              "side by side (a plot of the ratios against n as well)")
    seq2seq.add_argument("--layers", type=positive_int, default=6,
                         help="encoder layers = decoder layers (causal, classification: layers)")
    seq2seq.add_argument("--ffn", type=positive_int, default=2048, help="feed-forward width (BERT's intermediate_size)")
    seq2seq.add_argument("--vocab", type=positive_int, default=8000)


def add_run_args(parser) -> None:
    """How it is measured (warm-up, repeats, limits, threads, allocator) and where it is written."""
    parser.add_argument("--warmup", type=non_negative_int, default=1)
    parser.add_argument("--repeats", type=positive_int, default=5,
                        help="timed calls per configuration (median reported)")
    parser.add_argument("--max_seconds", type=float, default=30.0,
                        help="once a call of a type takes longer, its longer lengths are recorded as skipped")
    parser.add_argument("--max_memory_gb", type=float, default=None,
                        help="skip eager full attention when its N x N matrices would exceed this "
                             "(default: half the free RAM on CPU, none on CUDA)")
    parser.add_argument("--matmul_size", type=int, default=4096,
                        help="largest square matmul tried when measuring the machine's FLOP/s")
    parser.add_argument("--no_memory", action="store_true", help="skip the peak-memory measurement")
    parser.add_argument("--no_traffic", action="store_true",
                        help="skip counting each case's operations and bytes moved (one more call per case) "
                             "and measuring the copy bandwidth")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one call per configuration (torch.profiler) into the markdown report")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--cpu_allocator", choices=("system", "retain"), default="system",
                        help='"retain": glibc keeps the memory a call frees for the next call '
                        "(hf_zformer.retain_freed_memory, the training scripts' default), so no call pays page "
                        'faults to touch its buffers again; the same for every model of the run. "system": '
                        "the allocator as a user's own process has it")
    parser.add_argument("--output", default="bench/attention",
                        help="prefix of the .csv, .json, .md and .png files written")
    parser.add_argument("--plot", default=None, help="PNG path (default: <output>.png)")
    parser.add_argument("--no_plot", action="store_true")
    parser.add_argument("--no_progress", action="store_true")


def check_args(parser, args) -> None:
    """The level's defaults, options that belong together, and output files nobody else wrote."""
    if args.lengths is None:
        args.lengths = {"causal": [64, 512, 2048, 8192], "classification": [128, 256, 512, 1024, 2048, 4096]}.get(
            args.level, [128, 256, 512, 1024, 2048, 4096, 8192])
    if args.batch is None:
        args.batch = 8 if args.level == "classification" else 4
    if args.modes is None:
        args.modes = list(benchmarks.MODES) if args.level == "classification" else ["forward"]
    if args.seq2seq_lengths is not None and (args.source_length is not None or args.target_length is not None):
        parser.error("--seq2seq_lengths sets source = target = n: give it or --source_length / --target_length, "
                     "not both")
    if args.seq2seq_lengths is not None and args.level != "seq2seq":
        parser.error(f"--seq2seq_lengths is an option of --level seq2seq, not --level {args.level}")
    args.source_length = args.source_length or 32
    args.target_length = args.target_length or 32
    if args.level in ("seq2seq", "causal", "classification") and args.widths[0] % args.heads[0]:
        parser.error(f"the width ({args.widths[0]}) must be a multiple of the number of heads ({args.heads[0]})")
    if args.cuda_graphs and (args.level not in benchmarks.GRID_LEVELS or not args.device.startswith("cuda")):
        parser.error(f"--cuda_graphs needs --level attention, module or model on a CUDA device, not --level {args.level} "
                     f"on --device {args.device}")
    if args.compile and (args.level not in benchmarks.GRID_LEVELS or args.cuda_graphs):
        parser.error(f"--compile needs --level attention, module or model and no --cuda_graphs (mode 'reduce-overhead' "
                     f"captures them), not --level {args.level}{' with --cuda_graphs' if args.cuda_graphs else ''}")
    if args.level == "causal" and min(args.lengths) < 2:
        parser.error(f"--level causal: every length must be >= 2 (a prompt and a generated token), got {args.lengths}")
    try:  # before any work: no file of somebody else's is overwritten
        folders.check_output_files([args.output + suffix for suffix in (".csv", ".json", ".md", ".png")])
        if args.plot and not args.no_plot:
            folders.check_output_files([args.plot], name="--plot")
    except ValueError as error:
        parser.error(str(error))


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _bounded_int(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _bounded_int(text, 0, "an integer >= 0")


def _bounded_int(text: str, low: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def main(argv=None):
    args = parse_args(argv)
    device, max_memory = prepare_machine(args)
    metadata = benchmarks.machine_info(device)
    metadata["command"] = benchmarks.command_line()
    metadata["args"] = vars(args)
    if args.level == "seq2seq":
        return run_seq2seq(args, device, metadata)
    if args.level == "causal":
        return run_causal(args, device, metadata)
    if args.level == "classification":
        return run_classification(args, device, metadata)
    return run_grid(args, device, metadata, max_memory)


def prepare_machine(args):
    """Threads, the allocator and the device; ``(device, memory limit of eager full attention in bytes)``."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_allocator == "retain" and not retain_freed_memory():
        sys.exit("--cpu_allocator retain: not applied (it needs Linux with glibc, and neither "
                 "MALLOC_TRIM_THRESHOLD_ nor MALLOC_MMAP_THRESHOLD_ set)")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda given but CUDA is not available")
    max_memory = args.max_memory_gb * 2**30 if args.max_memory_gb is not None else None
    if max_memory is None and device.type == "cpu":
        free = benchmarks.available_memory_bytes()
        max_memory = free / 2 if free else None
    return device, max_memory


def _faster(metadata: dict, name: str, rate: str) -> dict:
    """The faster of the `<name>_start` and `<name>_end` measurements (by `rate`), or the start alone."""
    start = metadata[f"{name}_start"]
    return max(start, metadata.get(f"{name}_end", start), key=lambda m: m[rate])


def run_grid(args, device, metadata, max_memory):
    """--level attention / module / model: every type, length, width, heads and mode, with the machine's matmul FLOP/s."""
    dtype = benchmarks.DTYPES[args.dtype]
    print(f"measuring {args.dtype} matmul FLOP/s on {device} ...", file=sys.stderr)
    metadata["matmul_start"] = benchmarks.measure_matmul_flops(device, dtype, max_size=args.matmul_size)
    print(f"matmul: {metadata['matmul_start']['flops'] / 1e9:.1f} GFLOP/s", file=sys.stderr)
    if not args.no_traffic:
        metadata["bandwidth_start"] = benchmarks.measure_copy_bandwidth(device)
        print(f"copy: {metadata['bandwidth_start']['bytes_per_s'] / 1e9:.1f} GB/s", file=sys.stderr)

    with benchmarks.interrupt_on_terminate():  # stopped from outside, it still writes what it measured
        results = benchmarks.sweep(
            types=args.types,
            lengths=args.lengths,
            widths=args.widths,
            heads=args.heads,
            batch=args.batch,
            modes=args.modes,
            level=args.level,
            device=str(device),
            dtype=args.dtype,
            mask=args.mask,
            warmup=args.warmup,
            repeats=args.repeats,
            max_seconds=args.max_seconds,
            max_memory_bytes=max_memory,
            measure_memory=not args.no_memory,
            matmul_flops=metadata["matmul_start"]["flops"],
            progress=not args.no_progress,
            profile=args.profile,
            graphs=args.cuda_graphs,
            compiled=args.compile or "",
            measure_traffic=not args.no_traffic,
        )
    interrupted = any(r.note == benchmarks.INTERRUPTED for r in results)
    if interrupted:  # the cases not reached are recorded as skipped; no second matmul measurement
        print("stopped: writing the cases measured so far", file=sys.stderr)
        metadata["interrupted"] = True
    else:  # measured again at the end; the FLOP/s fractions use the faster of the two (conservative
        # on a machine shared with other work)
        metadata["matmul_end"] = benchmarks.measure_matmul_flops(device, dtype, max_size=args.matmul_size)
        if not args.no_traffic:
            metadata["bandwidth_end"] = benchmarks.measure_copy_bandwidth(device)
    metadata["load_average_end"] = benchmarks.load_average()
    metadata["matmul"] = _faster(metadata, "matmul", "flops")
    benchmarks.set_flops_fractions(results, metadata["matmul"]["flops"])
    if not args.no_traffic:
        metadata["bandwidth"] = _faster(metadata, "bandwidth", "bytes_per_s")
        benchmarks.set_bandwidth_fractions(results, metadata["bandwidth"]["bytes_per_s"])
    paths = benchmarks.write_reports(results, args.output, metadata, make_plot=False)
    if not args.no_plot:
        paths["png"] = args.plot or args.output + ".png"
        benchmarks.plot(results, paths["png"])
    for path in paths.values():
        folders.record_files([path])
    print(benchmarks.markdown_table(results))
    print("wrote " + ", ".join(os.path.relpath(p) for p in paths.values()), file=sys.stderr)
    if interrupted:
        sys.exit(130)  # what a shell reports for a run stopped by Ctrl-C


def run_seq2seq(args, device, metadata):
    shape = benchmarks.Seq2SeqShape(
        batch=args.batch, source_length=args.source_length, target_length=args.target_length,
        width=args.widths[0], layers=args.layers, heads=args.heads[0], ffn=args.ffn, vocab=args.vocab,
    )
    results = benchmarks.seq2seq_benchmark(args.seq2seq_models, shape, device=str(device), dtype=args.dtype,
                                          warmup=args.warmup, repeats=args.repeats, progress=not args.no_progress,
                                          lengths=args.seq2seq_lengths)
    write = functools.partial(benchmarks.write_seq2seq_reports, make_plot=not args.no_plot)
    report(args, metadata, results, write, benchmarks.seq2seq_markdown)


def run_causal(args, device, metadata):
    shape = benchmarks.CausalShape(batch=args.batch, lengths=tuple(args.lengths), width=args.widths[0],
                                  layers=args.layers, heads=args.heads[0], ffn=args.ffn, vocab=args.vocab)
    results = benchmarks.causal_benchmark(args.causal_models, shape, device=str(device), dtype=args.dtype,
                                         warmup=args.warmup, repeats=args.repeats, progress=not args.no_progress)
    report(args, metadata, results, benchmarks.write_causal_reports, benchmarks.causal_markdown)


def run_classification(args, device, metadata):
    shape = benchmarks.ClassificationShape(batch=args.batch, lengths=tuple(args.lengths), width=args.widths[0],
                                          layers=args.layers, heads=args.heads[0], ffn=args.ffn, vocab=args.vocab)
    results = benchmarks.classification_benchmark(
        args.classification_models, shape, kinds=args.modes, device=str(device), dtype=args.dtype,
        warmup=args.warmup, repeats=args.repeats, progress=not args.no_progress)
    write = functools.partial(benchmarks.write_classification_reports, make_plot=not args.no_plot)
    report(args, metadata, results, write, benchmarks.classification_markdown)


def report(args, metadata, results, write_reports, markdown):
    """The side-by-side levels' ending: load average, CSV/JSON/markdown files, the table on stdout."""
    metadata["load_average_end"] = benchmarks.load_average()
    paths = write_reports(results, args.output, metadata)
    folders.record_files(list(paths.values()))
    print(markdown(results))
    print("wrote " + ", ".join(os.path.relpath(p) for p in paths.values()), file=sys.stderr)


if __name__ == "__main__":
    main()
