"""Session 17 (2026-11-25): the zero-fills, allocations and AdamW of a training step by input shape
(5 profiled steps per model), behind docs/benchmarks.md. As run:
python docs/bench/s17_components/fill_shapes.py full,zformer
With a filter of '8000' in the shapes instead (any operator on the embedding-sized tensors), the same
loop gave the sparse-embedding profile: python docs/bench/s17_components/fill_shapes.py full,full_sparse 8000"""
import collections
import sys

from common import build, step
from torch.profiler import ProfilerActivity, profile

OPERATORS = ("aten::fill_", "aten::zero_", "aten::zeros", "aten::_fused_adamw_")

if __name__ == "__main__":
    names = sys.argv[1].split(",")
    shape_filter = sys.argv[2] if len(sys.argv) > 2 else None
    runners = build(names)
    for name in names:
        for _ in range(3):
            step(runners[name])
        total, count = collections.Counter(), collections.Counter()
        for _ in range(5):
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                step(runners[name])
            for event in prof.key_averages(group_by_input_shape=True):
                shapes = str(event.input_shapes)
                if (shape_filter in shapes) if shape_filter else event.key in OPERATORS:
                    key = (event.key, shapes[:80])
                    total[key] += event.self_cpu_time_total / 5 / 1e3
                    count[key] += event.count / 5
        print(name)
        for key, ms in sorted(total.items(), key=lambda kv: -kv[1])[:14]:
            print("   ", key, round(ms, 2), "ms", count[key])
