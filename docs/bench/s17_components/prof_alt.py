"""Session 17 (2026-11-25): interleaved profiling behind docs/benchmarks.md: one profiled training step
of each model per round, operator self-times summed per model, the largest differences between the
first two printed. As run: python docs/bench/s17_components/prof_alt.py full,zformer 12"""
import collections
import sys

from common import build, step
from torch.profiler import ProfilerActivity, profile

if __name__ == "__main__":
    names, rounds = sys.argv[1].split(","), int(sys.argv[2])
    runners = build(names)
    for _ in range(3):
        for name in names:
            step(runners[name])
    self_ms = {name: collections.Counter() for name in names}
    calls = {name: collections.Counter() for name in names}
    for _ in range(rounds):
        for name in names:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step(runners[name])
            for event in prof.key_averages():
                self_ms[name][event.key] += event.self_cpu_time_total / rounds / 1e3
                calls[name][event.key] += event.count / rounds
    a, b = names[0], names[1]
    print({name: round(sum(self_ms[name].values()), 1) for name in names})
    for key in sorted(set(self_ms[a]) | set(self_ms[b]), key=lambda k: -abs(self_ms[b][k] - self_ms[a][k]))[:30]:
        print(f"{key[:70]:70s} {a} {calls[a][key]:6.0f} {self_ms[a][key]:7.2f}  {b} {calls[b][key]:6.0f} "
              f"{self_ms[b][key]:7.2f}  diff {self_ms[b][key] - self_ms[a][key]:+.2f}")
