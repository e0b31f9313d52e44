"""Session 17 (2026-11-25): minor page faults per training step (getrusage), behind docs/benchmarks.md.
As run: python docs/bench/s17_components/faults.py bart,full,zformer,fastformer"""
import resource
import statistics
import sys
import time

from common import build, step

if __name__ == "__main__":
    names = sys.argv[1].split(",")
    runners = build(names)
    for _ in range(3):
        for name in names:
            step(runners[name])
    faults, times = {name: [] for name in names}, {name: [] for name in names}
    for _ in range(15):
        for name in names:
            before, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
            step(runners[name])
            times[name].append(time.perf_counter() - start)
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    for name in names:
        print(name, "faults/step", faults[name], "median ms", round(statistics.median(times[name]) * 1e3, 1))
