"""Paired A/B of bidirectional fastformer's attention module (docs/benchmarks.md, "Where fastformer's
time goes"): the benchmark's grid shape (bf16 autocast, batch 40, width 512, 8 heads), each variant
captured once as a CUDA graph (the GPU's own time) and replayed in alternating rounds, forward and
training step, SDPA's module beside them (with and without stacked projections); every variant's
output is first checked, in fp32, against the unpooled form's (the form before these remedies), and
the script stops unless each variant runs the form it names (`explain`). Each variant is a set of
changes to the execution policy put in force by `use_policy` (`VARIANT_POLICIES`): nothing of the
library is patched. Every module is whole (the benchmark's
level `module`, output projection included): the pooled output moves W_r's bias into that
projection's and the folded form merges the projection into its own products, which a module
without one (level `attention`) cannot show.

Variants of the module (all but `folded` in the plain form, as CUDA runs it by default):
- `shipped`: the projections of one input stacked into one product (`blocks.project`), from N >= D
  the pooled output (`FastformerAttention._pooled_output`): q + v (W_r diag(k_g))^T in one batched
  product whose accumulator starts from q, b_r moved into the output projection's bias, and
  poolings split into slices of 128 rows, one program each (the policy's `pool_chunk`);
- `unstacked`: one product per projection (autocast casts the fp32 input once per projection);
- `unpooled`: u_i = k_g * v_i, then r_i = W_r u_i + b_r + q_i (two element-wise passes over (B, N, D)
  tensors besides the products);
- `per_pair`: the pooling kernels with one program per (sequence, head) pair over the whole
  sequence where the pairs fill the GPU (`pool_chunk=None`, the rule before slices);
- `chunk512`, `chunk256`: slices of 512 or 256 rows per program instead of the shipped 128;
- `ungated`: the key pooling along w_k * q_g, then q_g times the pooling, as two operations of
  their own (before `ops.direction_pool` took q_g as its gate);
- `unfused_map`: W_r diag(k_g) as two casts and a multiply (before `ops.column_scaled`, whose
  backward reads the map's gradient once);
- `fused_product`: r = q + (v diag(k_g)) W_r^T as one Triton product that scales v as it loads it
  (`ops.column_scaled_product` with CUDA in the policy's experimental `fused_product`): no (B, D, D)
  map and no column-scaling launch forward (the script stops unless `explain` names its kernel on a GPU);
- `fused_product_n64`: the same with (128, 64) tiles of 4 warps (the policy's `product_tiles`; two
  programs per multiprocessor where (128, 128) tiles of 8 warps fit one);
- `folded`: the folded form (`FastformerAttention._folded`, one (D, D) map per sequence, no Q, K, V)
  under bf16 autocast too: its input cast to bf16 once, both poolings of it in one fused kernel
  each, the output projection folded in (the default on CPUs; on CUDA in fp32 only);
- `folded_unpaired`: `folded` with the poolings' backward holding each head's direction and its
  gradient in separate tiles (`paired_shared_backward=False`: the kernel before pairing).

Forward rows also print each variant's bf16 output error against the fp32 output (relative norm).

    python docs/bench/ab/fastformer_gpu.py                      # on a CUDA GPU: 512 and 2,048 tokens
    python docs/bench/ab/fastformer_gpu.py --output ab.json     # the medians and errors as JSON too (with the commit)
    python docs/bench/ab/fastformer_gpu.py --batch 2 --width 64 --lengths 64 --rounds 2   # a dry run on a CPU

On a CPU the variants run eagerly (no graphs) under bf16 autocast, as on the GPU (in fp32 the module
takes its folded form instead), with the projections stacked and the plain form taken as on CUDA: a
check of the script and of the outputs.
"""
import argparse
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
from hf_zformer.modeling.explain import explain  # noqa: E402
from hf_zformer.modeling.policy import use_policy  # noqa: E402

FULL = ("full", "full_unstacked")
VARIANTS = ("shipped", "unstacked", "unpooled", "per_pair", "chunk512", "chunk256", "ungated", "unfused_map",
            "fused_product", "fused_product_n64", "folded", "folded_unpaired")


# Each variant as changes of the execution policy (`hf_zformer/modeling/policy.py`) from the shipped
# one; `variant` puts them in force (with the projections stacked on the device at hand).
VARIANT_POLICIES = {
    "shipped": {},
    "unstacked": {"stacked_projection": ()},
    "unpooled": {"pooled_output": False},
    "per_pair": {"pool_chunk": None},
    "chunk512": {"pool_chunk": 512},
    "chunk256": {"pool_chunk": 256},
    "ungated": {"gate_in_kernel": False},
    "unfused_map": {"plain_operations": ("column_scale",)},
    "fused_product": {"fused_product": "DEVICE"},
    "fused_product_n64": {"fused_product": "DEVICE", "product_tiles": (128, 64, 64, 4, 3)},
    "folded": {"folded_autocast": {"fastformer": "DEVICE"}},
    "folded_unpaired": {"folded_autocast": {"fastformer": "DEVICE"}, "paired_shared_backward": False},
}
# every form as CUDA runs it by default, on whatever device the script runs: the projections stacked,
# fastformer's plain form under autocast
BASE = {"stacked_projection": "DEVICE", "folded_autocast": {"fastformer": ()}}


def _on(value, device):
    """A variant's value with "DEVICE" standing for the device type at hand."""
    if value == "DEVICE":
        return (device.type,)
    if isinstance(value, dict):
        return {key: _on(item, device) for key, item in value.items()}
    return value


def variant(name, device, **extra):
    """`use_policy` with variant `name`'s changes (`VARIANT_POLICIES`) over `BASE`, and `extra`."""
    changes = {**BASE, **VARIANT_POLICIES.get(name, {}), **extra}
    if name in FULL:  # SDPA's module: stacked or not, nothing else of fastformer's
        changes = {**BASE, **({"stacked_projection": ()} if name.endswith("unstacked") else {})}
    return use_policy(**{key: _on(value, device) for key, value in changes.items()})


def expected_form(name, length, width):
    """The form (`explain`'s name) variant `name` computes its output with at this shape under bf16
    autocast."""
    if name.startswith("folded"):
        return "folded"
    return "pooled" if name != "unpooled" and length >= width else "plain"


def _paths(name, module, inputs, device):
    """What `explain` says variant `name`'s module runs under bf16 autocast (without running it)."""
    with variant(name, device):
        return explain(module, inputs, autocast=torch.bfloat16)[0]["paths"]


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
        with torch.no_grad(), variant(name, device, folded=False):
            output = module(**inputs)[0]
        with torch.no_grad(), variant(name, device), torch.autocast(device.type, dtype=torch.bfloat16):
            low = module(**inputs)[0].float()
        if name in VARIANTS:
            paths = _paths(name, module, inputs, device)
            if paths["form"] != expected_form(name, case.length, case.width):
                raise SystemExit(f"{name} at n={case.length}: the module runs {paths}, not the form "
                                 f"{expected_form(name, case.length, case.width)!r}")
            if name.startswith("fused_product") and device.type == "cuda" and paths.get("fused_product") != "triton":
                raise SystemExit(f"{name} at n={case.length}: its kernel does not run ({paths})")
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
