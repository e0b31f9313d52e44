# Session 17 (2026-11-25) component timing behind docs/benchmarks.md, 'The 32-token level on Zen 4'.
# Ad-hoc measurement script, kept as run (AMD EPYC Zen 4, 2 threads); run from the repository root.
import torch, time
torch.set_num_threads(2)
torch.manual_seed(0)
D=512
x=torch.randn(128,D,requires_grad=True)
sep=[torch.nn.Linear(D,D) for _ in range(3)]
fused=torch.nn.Linear(D,3*D)
def run_sep():
    outs=[l(x) for l in sep]
    s=sum(o.sum() for o in outs)
    s.backward()
def run_fused():
    o=fused(x)
    q,k,v=o.split(D,-1)
    s=q.sum()+k.sum()+v.sum()
    s.backward()
for f in (run_sep,run_fused)*3: f()
for rep in range(5):
    for name,f in (("sep",run_sep),("fused",run_fused)):
        t=time.perf_counter()
        for _ in range(50): f()
        print(name, (time.perf_counter()-t)/50*1e3, "ms")
