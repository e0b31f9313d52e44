# Session 17 (2026-11-25): minor page faults per training step (getrusage), behind docs/benchmarks.md. Ad-hoc script, kept as run; reads /tmp/prof_alt.py (a copy is in this folder).
import torch, resource, time, sys, statistics
exec(open('/tmp/prof_alt.py').read().split("S={n:collections.Counter()")[0].replace("import torch, collections, sys","import torch, collections"))
F={n:[] for n in names}; T={n:[] for n in names}
for r in range(15):
    for n in names:
        f0=resource.getrusage(resource.RUSAGE_SELF).ru_minflt; t0=time.perf_counter()
        step(n)
        T[n].append(time.perf_counter()-t0); F[n].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt-f0)
for n in names: print(n, 'faults/step', F[n], 'median ms', round(statistics.median(T[n])*1e3,1))
