"""Paired A/B of bidirectional fastformer's attention module (docs/benchmarks.md, "Where fastformer's
time goes"): the benchmark's grid shape (bf16 autocast, batch 40, width 512, 8 heads), each variant
captured once as a CUDA graph (the GPU's own time) and replayed in alternating rounds, forward and
training step, SDPA's module beside them (with and without stacked projections); every variant's
output is first checked, in fp32, against the unpooled form's (the form before these remedies), and
the script stops unless each variant ran the form it names. Every module is whole (the benchmark's
level `module`, output projection included): the pooled output moves W_r's bias into that
projection's and the folded form merges the projection into its own products, which a module
without one (level `attention`) cannot show.

Variants of the module (all but `folded` in the plain form, as CUDA runs it by default):
- `shipped`: the projections of one input stacked into one product (`blocks.project`), from N >= D
  the pooled output (`FastformerAttention._pooled_output`): q + v (W_r diag(k_g))^T in one batched
  product whose accumulator starts from q, b_r moved into the output projection's bias, and
  poolings split into slices of 128 rows, one program each (`triton_ops.POOL_CHUNK`);
- `unstacked`: one product per projection (autocast casts the fp32 input once per projection);
- `unpooled`: u_i = k_g * v_i, then r_i = W_r u_i + b_r + q_i (two element-wise passes over (B, N, D)
  tensors besides the products);
- `per_pair`: the pooling kernels with one program per (sequence, head) pair over the whole
  sequence where the pairs fill the GPU (`triton_ops.POOL_CHUNK = None`, the rule before slices);
- `chunk512`, `chunk256`: slices of 512 or 256 rows per program instead of the shipped 128;
- `ungated`: the key pooling along w_k * q_g, then q_g times the pooling, as two operations of
  their own (before `ops.direction_pool` took q_g as its gate);
- `unfused_map`: W_r diag(k_g) as two casts and a multiply (before `ops.column_scaled`, whose
  backward reads the map's gradient once);
- `fused_product`: r = q + (v diag(k_g)) W_r^T as one Triton product that scales v as it loads it
  (`ops.column_scaled_product` with CUDA in `ops.FUSED_PRODUCT_DEVICES`): no (B, D, D) map and no
  column-scaling launch forward (the script stops if its kernel did not run on a GPU);
- `fused_product_n64`: the same with (128, 64) tiles of 4 warps (`triton_ops._PRODUCT_TILES`; two
  programs per multiprocessor where (128, 128) tiles of 8 warps fit one);
- `folded`: the folded form (`FastformerAttention._folded`, one (D, D) map per sequence, no Q, K, V)
  under bf16 autocast too: its input cast to bf16 once, both poolings of it in one fused kernel
  each, the output projection folded in (the default on CPUs; on CUDA in fp32 only);
- `folded_unpaired`: `folded` with the poolings' backward holding each head's direction and its
  gradient in separate tiles (`triton_ops._paired_backward` false: the kernel before pairing).

Forward rows also print each variant's bf16 output error against the fp32 output (relative norm).

    python docs/bench/ab/fastformer_gpu.py                      # on a CUDA GPU: 512 and 2,048 tokens
    python docs/bench/ab/fastformer_gpu.py --output ab.json     # the medians and errors as JSON too (with the commit)
    python docs/bench/ab/fastformer_gpu.py --batch 2 --width 64 --lengths 64 --rounds 2   # a dry run on a CPU

On a CPU the variants run eagerly (no graphs) under bf16 autocast, as on the GPU (in fp32 the module
takes its folded form instead), with the projections stacked and the plain form taken as on CUDA: a
check of the script and of the outputs.
"""
import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the checkout: benchmarks/ beside hf_zformer/

import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from benchmarks.cases import BenchCase, build_module, make_config  # noqa: E402
from benchmarks import machine_info  # noqa: E402
from benchmarks.harness import _make_inputs, _make_step, capture_graph, timed_call  # noqa: E402
from hf_zformer.modeling import blocks, ops, triton_ops  # noqa: E402
from hf_zformer.modeling import attention as attention_module  # noqa: E402
from hf_zformer.modeling.attention import FastformerAttention  # noqa: E402

FULL = ("full", "full_unstacked")
VARIANTS = ("shipped", "unstacked", "unpooled", "per_pair", "chunk512", "chunk256", "ungated", "unfused_map",
            "fused_product", "fused_product_n64", "folded", "folded_unpaired")


def _ungated_pool(values, direction=None, mask=None, scale=1.0, gate=None):
    """`ops.direction_pool` with the gate's two products outside the kernel (variant `ungated`)."""
    if gate is None:
        return ops.direction_pool(values, direction, mask, scale)
    direction = None if direction is None else direction * gate
    return gate[:, :, None] * ops.direction_pool(values, direction, mask, scale)


def _unfused_map(weight, scales, dtype):
    """W diag(k) per sequence by `ops.column_scaled`'s torch form (variant `unfused_map`)."""
    with ops.use_kernel_backend("torch"):
        return ops.column_scaled(weight, scales, dtype)


@contextlib.contextmanager
def variant(name, device):
    """Within: the projections, FastformerAttention and the pooling kernels as variant `name` has them."""
    saved = (blocks.STACKED_PROJECTION_DEVICES, FastformerAttention._takes_pooled_output, triton_ops.POOL_CHUNK,
             FastformerAttention.FOLDED_AUTOCAST_DEVICES, triton_ops._paired_backward,
             attention_module.direction_pool, attention_module.column_scaled, ops.FUSED_PRODUCT_DEVICES,
             triton_ops._PRODUCT_TILES)
    if name.startswith("fused_product"):
        ops.FUSED_PRODUCT_DEVICES = (device.type,)
    if name == "fused_product_n64":
        triton_ops._PRODUCT_TILES = (128, 64, 64, 4, 3)
    if name == "ungated":
        attention_module.direction_pool = _ungated_pool
    if name == "unfused_map":
        attention_module.column_scaled = _unfused_map
    blocks.STACKED_PROJECTION_DEVICES = () if name.endswith("unstacked") else (device.type,)
    # the folded form under autocast for the `folded` variants only (the CPU takes it by default:
    # the other variants are the plain form's, as on CUDA)
    FastformerAttention.FOLDED_AUTOCAST_DEVICES = (device.type,) if name.startswith("folded") else ()
    if name == "folded_unpaired":
        triton_ops._paired_backward = lambda heads: False
    if name == "unpooled":
        FastformerAttention._takes_pooled_output = lambda self, length, width: False
    if name == "per_pair":
        triton_ops.POOL_CHUNK = None
    if name.startswith("chunk"):
        triton_ops.POOL_CHUNK = int(name[len("chunk"):])
    try:
        yield
    finally:
        (blocks.STACKED_PROJECTION_DEVICES, FastformerAttention._takes_pooled_output, triton_ops.POOL_CHUNK,
         FastformerAttention.FOLDED_AUTOCAST_DEVICES, triton_ops._paired_backward,
         attention_module.direction_pool, attention_module.column_scaled, ops.FUSED_PRODUCT_DEVICES,
         triton_ops._PRODUCT_TILES) = saved


def expected_form(name, length, width):
    """The FastformerAttention method that computes variant `name`'s output at this shape under bf16
    autocast (what `forms_taken` must see)."""
    if name.startswith("folded"):
        return "_folded"
    return "_pooled_output" if name != "unpooled" and length >= width else "context"


@contextlib.contextmanager
def forms_taken():
    """Within: a list that names each of FastformerAttention's forms (`_folded`, `_pooled_output`,
    `context`) as a forward call enters it."""
    taken, saved = [], {name: getattr(FastformerAttention, name) for name in ("_folded", "_pooled_output", "context")}

    def recording(name, method):
        def recorded(self, *args, **kwargs):
            taken.append(name)
            return method(self, *args, **kwargs)
        return recorded

    for name, method in saved.items():
        setattr(FastformerAttention, name, recording(name, method))
    try:
        yield taken
    finally:
        for name, method in saved.items():
            setattr(FastformerAttention, name, method)


def variant_step(name, case, device):
    """(step, the fp32 and the bf16-autocast output of one forward call, or Nones) of variant `name`
    at `case`; stops unless the bf16 call takes the variant's form (`expected_form`)."""
    config = make_config(case.attention_type, case.length, case.width, case.heads)
    torch.manual_seed(0)
    module = build_module(case.attention_type, config, case.level, device)
    with torch.no_grad():  # biases away from their zero start, so the check sees b_r's path
        for parameter_name, parameter in module.named_parameters():
            if parameter_name.endswith("bias"):
                parameter.normal_(std=0.5)
    inputs = _make_inputs(case, config, device)
    step = _make_step(module, inputs, case, device)

    def patched():
        with variant(name, device):
            step()

    output = low = None
    if case.mode == "forward":  # in fp32 through the plain form (fp32 would otherwise take the folded one)
        plain = attention_module.use_folded_form
        attention_module.use_folded_form = lambda hidden_states, pays_off, *layers, **_: False
        try:
            with torch.no_grad(), variant(name, device):
                output = module(**inputs)[0]
        finally:
            attention_module.use_folded_form = plain
        fused, launch = [], ops.scaled_product_kernel
        ops.scaled_product_kernel = lambda *args: fused.append(1) or launch(*args)
        try:
            with torch.no_grad(), variant(name, device), torch.autocast(device.type, dtype=torch.bfloat16), \
                    forms_taken() as taken:
                low = module(**inputs)[0].float()
        finally:
            ops.scaled_product_kernel = launch
        if name.startswith("fused_product") and device.type == "cuda" and not fused:
            raise SystemExit(f"{name} at n={case.length}: its kernel did not run")
        if name in VARIANTS and taken != [expected_form(name, case.length, case.width)]:
            raise SystemExit(f"{name} at n={case.length}: the module ran {taken}, not "
                             f"{expected_form(name, case.length, case.width)!r}")
    return (capture_graph(patched, device) if case.graphs else patched), output, low


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--batch", type=int, default=40)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--output", type=Path, help="a JSON file: the machine and commit, the settings, each "
                        "row's medians (ms) and each length's bf16 errors, rewritten after every row")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda"
    settings = {key: value for key, value in vars(args).items() if key != "output"}
    record = {"metadata": machine_info(device), "settings": {**settings, "graphs": on_gpu},
              "baseline": "shipped", "rows": [], "bf16_errors": []}
    print(record["metadata"])
    names = [*FULL, *VARIANTS]
    print("| n | mode | " + " | ".join(f"{name} ms (shipped / it)" for name in names) + " |")
    print("|---:|---|" + "---:|" * len(names))
    for length in args.lengths:
        for mode in ("forward", "train"):
            steps, outputs, lows = {}, {}, {}
            for name in names:
                case = BenchCase("module", "full" if name in FULL else "fastformer", mode, args.batch, length,
                                 args.width, args.heads, "bf16", device.type, False,
                                 graphs=on_gpu)
                steps[name], outputs[name], lows[name] = variant_step(name, case, device)
            if mode == "forward":
                reference = outputs["unpooled"]
                for name in VARIANTS:
                    error = ((outputs[name] - reference).norm() / reference.norm()).item()
                    limit = 1e-5 if device.type == "cpu" else 5e-3  # fp32 (TF32 products on a GPU)
                    if not error < limit:
                        raise SystemExit(f"{name} at n={length}: relative difference {error:.2e} from the "
                                         f"unpooled form (limit {limit:g})")
                errors = {name: ((lows[name] - reference).norm() / reference.norm()).item() for name in VARIANTS}
                record["bf16_errors"].append({"length": length, "errors": errors})
                print(f"bf16 error against fp32 at n={length}: "
                      + ", ".join(f"{name} {error:.1e}" for name, error in errors.items()), flush=True)
            times = {name: [] for name in names}
            for _ in range(args.rounds):  # alternate: drift and load hit every variant alike
                for name in names:
                    times[name].append(timed_call(steps[name], device))
            medians = {name: statistics.median(values) * 1e3 for name, values in times.items()}
            cells = [f"{medians[name]:.3f} ({medians['shipped'] / medians[name]:.2f}x)" for name in names]
            print(f"| {length:,} | {mode} | " + " | ".join(cells) + " |", flush=True)
            record["rows"].append({"length": length, "mode": mode, "ms": medians})
            if args.output:
                args.output.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
