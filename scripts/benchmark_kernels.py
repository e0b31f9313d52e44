#!/usr/bin/env python
"""Time the sequence operations alone on a GPU: the fused Triton kernels against the torch forms
(and, for causal linear attention, against flash-linear-attention's chunked kernel where `fla` is
installed), with the memory bandwidth each reaches.

Each operation reads its inputs from the layout the attention classes hand over (head views of the
(B, N, D) projections) and the bytes counted are the least any implementation must move: the
inputs read once and the outputs written once (forward), plus the gradients (train). Their rate
over this run's measured device-to-device copy rate is the fraction of memory bandwidth reached.

    python scripts/benchmark_kernels.py --output bench/kernels            # H100/H200, bf16 and fp32
    python scripts/benchmark_kernels.py --batch 4 --lengths 8192 65536 --dtypes bf16

Writes <output>.json (every row, the machine and the commit) and <output>.md.
"""

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

import benchmarks  # noqa: E402
from hf_zformer import flags, folders  # noqa: E402
from hf_zformer.modeling import ops  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
OPERATIONS = {"bidirectional": "zformer bidirectional", "pooling": "fastformer pooling",
              "causal_pooling": "fastformer causal pooling", "causal": "zformer causal"}


def parse_args(argv=None):
    parser = flags.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--batch", type=int, default=40)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048])
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["bf16", "fp32"])
    parser.add_argument("--modes", nargs="+", choices=["forward", "train"], default=["forward", "train"])
    parser.add_argument("--repeats", type=int, default=7, help="timed batches of calls (median reported)")
    parser.add_argument("--calls", type=int, default=10, help="calls per timed batch")
    parser.add_argument("--operations", nargs="+", choices=list(OPERATIONS), default=list(OPERATIONS),
                        help="bidirectional: zformer's linear attention; pooling: fastformer's direction pooling; "
                             "causal: zformer's causal linear attention, torch form against fla's chunked kernel "
                             "(fla tunes itself on the first call of every shape: minutes)")
    parser.add_argument("--output", default="bench/kernels", help="prefix of the .json and .md written")
    parser.add_argument("--device", default="cuda",
                        help="cuda; cpu only checks this script (the kernels then run in triton's interpreter "
                             "when TRITON_INTERPRET=1: no meaningful times)")
    args = parser.parse_args(argv)
    if args.width % args.heads:
        parser.error(f"--width {args.width} is not a multiple of --heads {args.heads}")
    try:  # before any work: no file of somebody else's is overwritten
        folders.check_output_files([args.output + ".json", args.output + ".md"])
    except ValueError as error:
        parser.error(str(error))
    return args


def time_ms(function, repeats: int, calls: int) -> float:
    """Median over `repeats` batches of `calls` calls of the time per call (CUDA events on a GPU)."""
    function()
    if not torch.cuda.is_available():
        return statistics.median(_wall_ms(function) for _ in range(repeats))
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            function()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def _wall_ms(function) -> float:
    start = time.perf_counter()
    function()
    return (time.perf_counter() - start) * 1e3


def _projections(batch, length, heads, dim, dtype, count, generator, device):
    """`count` (B, H, N, d) head views of (B, N, D) tensors, as the classes pass them."""
    return [
        torch.randn(batch, length, heads * dim, generator=generator).to(device, dtype)
        .view(batch, length, heads, dim).transpose(1, 2)
        for _ in range(count)
    ]


def operations(batch, length, heads, dim, dtype, device):
    """[(name, function of the input list, inputs, (B, N, D) tensors moved at least forward / forward
    and backward, backends)], and the scale. Linear attention reads Q, K, V and writes the output
    (4), then reads them and the output's gradient and writes three gradients (7 more); the pooling
    reads the values (1), then reads them again and writes their gradient (2 more); the causal
    pooling, as the causal class runs it on fp32 values, reads them and writes one pooling per
    position (2), then reads the values, poolings and their gradient and writes two gradients (5
    more)."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = _projections(batch, length, heads, dim, dtype, 3, generator, device)
    mask = torch.ones(batch, length, dtype=torch.long, device=device)
    mask[batch // 2 :, length - length // 4 :] = 0  # half the rows padded by a quarter
    scale = torch.tensor([dim**-0.5], device=device)
    direction = torch.randn(1, heads, dim, generator=generator).to(device)

    def bidirectional(inputs):
        return ops.linear_attention(*inputs, mask, scale=scale)[0]

    def pool(inputs):
        return ops.direction_pool(inputs[0], direction, mask)

    def causal_pool(inputs):
        values = inputs[0].float()
        return ops.softmax_pool(ops.direction_scores(values, direction), values, mask, causal=True)[0]

    def causal(inputs):
        return ops.linear_attention(*inputs, causal=True, scale=scale)[0]

    cases = [
        ("zformer bidirectional", bidirectional, [q, k, v], (4, 11), ("triton", "torch")),
        ("fastformer pooling", pool, [q], (1, 3), ("triton", "torch")),
        ("fastformer causal pooling", causal_pool, [q], (2, 7), ("triton", "torch")),
        ("zformer causal", causal, [q, k, v], (4, 11), ("torch", "fla")),
    ]
    return cases, scale


def fla_causal(scale):
    """flash-linear-attention's chunked linear attention without a normaliser, or None where fla is
    not installed: the same function as `ops.linear_attention(..., causal=True)`."""
    try:
        from fla.ops.linear_attn import chunk_linear_attn
    except ImportError:
        return None

    def run(inputs):
        q, k, v = (t.transpose(1, 2) for t in inputs)  # (B, N, H, d): fla's layout, a view of ours
        out, _ = chunk_linear_attn(q, k, v, scale=float(scale), normalize=False)
        return out.transpose(1, 2)

    return run


def measure(args) -> list[dict]:
    rows = []
    dim = args.width // args.heads
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for length in args.lengths:
            cases, scale = operations(args.batch, length, args.heads, dim, dtype, torch.device(args.device))
            fla = fla_causal(scale) if args.device == "cuda" else None
            chosen = {OPERATIONS[o] for o in args.operations}
            for name, function, inputs, traffic, backends in (c for c in cases if c[0] in chosen):
                reference = None
                for backend in backends:
                    if backend == "fla" and fla is None:
                        continue
                    run = fla if backend == "fla" else function
                    for mode in args.modes:
                        rows.append(_measure_one(args, name, backend, mode, run, inputs, traffic, dtype_name, length))
                        if mode == "forward":
                            with torch.no_grad(), ops.use_kernel_backend(_backend_choice(backend)):
                                result = run(inputs).float()
                            if reference is None:
                                reference = result
                            rows[-1]["relative_difference"] = (
                                (result - reference).norm() / reference.norm()).item()
                        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def _measure_one(args, name, backend, mode, run, inputs, traffic, dtype_name, length) -> dict:
    train = mode == "train"
    leaves = [t.detach().requires_grad_(train) for t in inputs]
    tensors = traffic[1] if train else traffic[0]
    backend_choice = _backend_choice(backend)
    grad = None

    def step():
        nonlocal grad
        with ops.use_kernel_backend(backend_choice):
            if not train:
                with torch.no_grad():
                    run(leaves)
                return
            out = run(leaves)
            if grad is None:
                grad = torch.randn_like(out)
            torch.autograd.backward(out, grad)
            for leaf in leaves:
                leaf.grad = None

    ms = time_ms(step, args.repeats, args.calls)
    moved = tensors * leaves[0].numel() * leaves[0].element_size()
    return {"operation": name, "backend": backend, "mode": mode, "dtype": dtype_name, "batch": args.batch,
            "length": length, "width": args.width, "heads": args.heads, "time_ms": ms,
            "bytes": moved, "bandwidth": moved / (ms / 1e3)}


def _backend_choice(backend: str) -> str:
    """The `ops` backend a row runs under (fla rows call fla directly)."""
    return "torch" if backend in ("torch", "fla") else "triton"


def markdown(rows, peak) -> str:
    lines = [
        "| operation | mode | dtype | n | backend | ms | GB/s | of copy rate | vs torch form | rel. difference |",
        "|---|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    torch_times = {(r["operation"], r["mode"], r["dtype"], r["length"]): r["time_ms"]
                   for r in rows if r["backend"] == "torch"}
    for r in rows:
        base = torch_times.get((r["operation"], r["mode"], r["dtype"], r["length"]))
        lines.append(
            f"| {r['operation']} | {r['mode']} | {r['dtype']} | {r['length']} | {r['backend']} | {r['time_ms']:.3f} "
            f"| {r['bandwidth'] / 1e9:.0f} | {r['bandwidth'] / peak:.0%} "
            f"| {base / r['time_ms']:.2f}x | {r.get('relative_difference', float('nan')):.1e} |"
        )
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here")
    peak = benchmarks.measure_copy_bandwidth(device)["bytes_per_s"]
    rows = measure(args)
    metadata = benchmarks.machine_info(device)
    metadata.update(command=benchmarks.command_line(), args=vars(args), copy_bandwidth=peak)
    table = markdown(rows, peak)
    print(table)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".json").write_text(json.dumps({"metadata": metadata, "rows": rows}, indent=1))
    header = (f"Sequence operations alone, batch {args.batch}, width {args.width}, {args.heads} heads, on "
              f"{metadata.get('gpu')}; copy rate {peak / 1e9:.0f} GB/s; commit {metadata['commit']}, "
              f"{metadata['date']}.\n\n`{metadata['command']}`\n\n")
    output.with_suffix(".md").write_text(header + table + "\n")
    folders.record_files([output.with_suffix(".json"), output.with_suffix(".md")])
    print(f"wrote {output.with_suffix('.json')}, {output.with_suffix('.md')}", file=sys.stderr)


if __name__ == "__main__":
    main()
