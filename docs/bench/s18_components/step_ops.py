"""Session 18 (2026-11-25): where a whole training step's time goes, per ATen operator, measured in place
(a TorchDispatchMode times every dispatched call; it adds ~1 us per call in a hot loop, while in place even a
`view` reads ~10 us). Models interleaved, medians over rounds.
Calls as run: `python docs/bench/s18_components/step_ops.py full,zformer,bart 12`,
`... full,zformer,zformer_fused 12`, and with the tied-embedding operators split out, `... full,bart 10`."""
import sys, time, statistics, collections
import variants  # noqa: F401  (registers this folder's variants; puts s17_components on the path)
from common import build, step
import torch
from torch.utils._python_dispatch import TorchDispatchMode
names=sys.argv[1].split(','); rounds=int(sys.argv[2])
runners=build(names)
acc=None; cnt=None
class Timer(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0=time.perf_counter(); r=func(*args, **(kwargs or {})); d=time.perf_counter()-t0
        k=str(func.overloadpacket.__name__)
        if k in ("add","add_","zeros","fill_","embedding_dense_backward","copy_") and any(isinstance(a,torch.Tensor) and a.numel()>=4096000 for a in args): k+=" BIG"
        acc[k]+=d; cnt[k]+=1
        return r
res={n:collections.defaultdict(list) for n in names}; counts={}
wall={n:[] for n in names}
for it in range(rounds+3):
    for n in names:
        acc=collections.defaultdict(float); cnt=collections.Counter()
        t0=time.perf_counter()
        with Timer(): step(runners[n])
        w=time.perf_counter()-t0
        if it>=3:
            for k,v in acc.items(): res[n][k].append(v)
            res[n]['~TOTAL_OPS'].append(sum(acc.values())); wall[n].append(w); counts[n]=cnt
for n in names: print(n, 'wall', round(statistics.median(wall[n])*1e3,1), 'ops', sum(counts[n].values()))
keys=set().union(*[res[n] for n in names])
rows=[]
for k in keys:
    m=[statistics.median(res[n][k])*1e3 if k in res[n] else 0.0 for n in names]
    rows.append((max(m)-min(m),k,m,[counts[n].get(k,0) for n in names]))
rows.sort(reverse=True)
for d,k,m,c in rows[:25]: print(f"{k:45s}", " ".join(f"{x:9.3f}" for x in m), c)
