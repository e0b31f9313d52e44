"""Paired A/B of bidirectional fastformer's attention module (docs/benchmarks.md, "Where fastformer's
time goes"): the benchmark's grid shape (bf16 autocast, batch 40, width 512, 8 heads), each variant
captured once as a CUDA graph (the GPU's own time) and replayed in alternating rounds, forward and
training step, SDPA's module beside them; every variant's output is first checked, in fp32, against
the shipped form's.

Variants of the module:
- `current`: the shipped plain form, u_i = k_g * v_i, then r_i = W_r u_i + b_r + q_i (two
  element-wise passes over (B, N, D) tensors besides the products);
- `fold`: W_r diag(k_g) built per sequence (B x D x D, a quarter of v at 2,048 tokens), then
  r = q' + v (W_r diag(k_g))^T in one batched product whose accumulator starts from
  q' = W_q x + (b_q + b_r): a constant added to q shifts every pooling score of a head by the same
  amount, so the softmax pooling of q' is q's pooling plus b_r, and q_g = pool(q') - b_r. No
  element-wise pass over (B, N, D) is left;
- `split`: the pooling kernels split each sequence over several programs even when the (sequence,
  head) pairs fill the GPU (`triton_ops.FUSED_MIN_PAIRS`), to have more memory reads in flight;
- `fold+split`.

    python docs/bench/ab/fastformer_gpu.py                      # on a CUDA GPU: 512 and 2,048 tokens
    python docs/bench/ab/fastformer_gpu.py --batch 2 --width 64 --lengths 32 --rounds 2   # a dry run on a CPU

On a CPU the variants run eagerly (no graphs) under bf16 autocast, as on the GPU (in fp32 the module
takes its folded form instead): a check of the script and of the outputs.
"""
import argparse
import contextlib
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the checkout: benchmarks/ beside hf_zformer/

import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from benchmarks.cases import BenchCase, build_module, make_config  # noqa: E402
from benchmarks import machine_info  # noqa: E402
from benchmarks.harness import _make_inputs, _make_step, capture_graph, timed_call  # noqa: E402
from hf_zformer.modeling import triton_ops  # noqa: E402
from hf_zformer.modeling import attention as attention_module  # noqa: E402
from hf_zformer.modeling.attention import FastformerAttention  # noqa: E402
from hf_zformer.modeling.blocks import split_heads  # noqa: E402
from hf_zformer.modeling.ops import direction_pool  # noqa: E402

CURRENT = FastformerAttention.context


def folded_context(self, hidden_states, attention_mask=None, memory=None, memory_mask=None, cache=None,
                   position_ids=None):
    """r_i = W_r (k_g * v_i) + b_r + q_i as q'_i + v_i (W_r diag(k_g))^T (see the module's text)."""
    if self.is_causal or self.value is None or self.query.bias is None or self.transform.bias is None:
        return CURRENT(self, hidden_states, attention_mask, memory, memory_mask, cache, position_ids)
    batch, _, width = hidden_states.shape
    shift = self.transform.bias
    query_proj = F.linear(hidden_states, self.query.weight, self.query.bias + shift)  # q_i + b_r
    query = split_heads(query_proj, self.num_heads)
    key = split_heads(self.key(hidden_states), self.num_heads)
    value = self.value(hidden_states)
    scale = self.head_dim**-0.5
    w_q = (self.query_score * scale)[None] if self.additive else None
    global_query = direction_pool(query, w_q, attention_mask)  # (B, H, 1, d): q_g + b_r
    global_query = global_query - shift.view(self.num_heads, 1, self.head_dim).to(global_query.dtype)
    direction = self.key_score * scale * global_query[:, :, 0] if self.additive else None
    global_key = global_query * direction_pool(key, direction, attention_mask)  # k_g (B, H, 1, d)
    scaled = self.transform.weight * global_key.reshape(batch, 1, width).to(self.transform.weight.dtype)
    return torch.baddbmm(query_proj, value, scaled.transpose(1, 2))


@contextlib.contextmanager
def variant(name):
    """Within: FastformerAttention and the pooling kernels as variant `name` has them."""
    context, pairs = FastformerAttention.context, triton_ops.FUSED_MIN_PAIRS
    FastformerAttention.context = folded_context if "fold" in name else CURRENT
    if "split" in name:
        triton_ops.FUSED_MIN_PAIRS = 1 << 30  # never one program per pair: the pooling always split
    try:
        yield
    finally:
        FastformerAttention.context, triton_ops.FUSED_MIN_PAIRS = context, pairs


def variant_step(name, case, device):
    """(step, the fp32 output of one forward call or None) of variant `name` at `case`."""
    config = make_config(case.attention_type, case.length, case.width, case.heads)
    torch.manual_seed(0)
    module = build_module(case.attention_type, config, "attention", device)
    with torch.no_grad():  # biases away from their zero start, so the check sees b_r's path
        for parameter_name, parameter in module.named_parameters():
            if parameter_name.endswith("bias"):
                parameter.normal_(std=0.5)
    inputs = _make_inputs(case, config, device)
    step = _make_step(module, inputs, case, device)

    def patched():
        with variant(name):
            step()

    output = None
    if case.mode == "forward":  # in fp32 through the plain form (fp32 would otherwise take the folded one)
        plain = attention_module.use_folded_form
        attention_module.use_folded_form = lambda hidden_states, pays_off: False
        try:
            with torch.no_grad(), variant(name):
                output = module(**inputs)[0]
        finally:
            attention_module.use_folded_form = plain
    return (capture_graph(patched, device) if case.graphs else patched), output


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--batch", type=int, default=40)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda"
    print(machine_info(device))
    names = ["full", "current", "fold", "split", "fold+split"]
    print("| n | mode | " + " | ".join(f"{name} ms (vs current)" for name in names) + " |")
    print("|---:|---|" + "---:|" * len(names))
    for length in args.lengths:
        for mode in ("forward", "train"):
            steps, outputs = {}, {}
            for name in names:
                case = BenchCase("attention", "full" if name == "full" else "fastformer", mode, args.batch, length,
                                 args.width, args.heads, "bf16", device.type, False,
                                 graphs=on_gpu)
                steps[name], outputs[name] = variant_step(name, case, device)
            if mode == "forward":
                reference = outputs["current"]
                for name in names[2:]:
                    error = ((outputs[name] - reference).norm() / reference.norm()).item()
                    limit = 1e-5 if device.type == "cpu" else 5e-3  # fp32 (TF32 products on a GPU)
                    if not error < limit:
                        raise SystemExit(f"{name} at n={length}: relative difference {error:.2e} from the shipped "
                                         f"form (limit {limit:g})")
            times = {name: [] for name in names}
            for _ in range(args.rounds):  # alternate: drift and load hit every variant alike
                for name in names:
                    times[name].append(timed_call(steps[name], device))
            medians = {name: statistics.median(values) * 1e3 for name, values in times.items()}
            cells = [f"{medians[name]:.3f} ({medians['current'] / medians[name]:.2f}x)" for name in names]
            print(f"| {length:,} | {mode} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
