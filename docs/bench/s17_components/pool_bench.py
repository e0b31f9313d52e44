# Session 17 (2026-11-25): fastformer score timing behind docs/benchmarks.md, 'Fastformer's pooling scores'. Ad-hoc script, kept as run.
import torch, time, statistics
torch.set_num_threads(2)
B,N,H,d=4,32,8,64; D=H*d
proj=torch.randn(B,N,D); sc0=torch.randn(B,H,N,1)
def split(t): return t.view(B,N,H,d).transpose(1,2)
def mm(w,v): return w.transpose(-1,-2) @ v
def elem(w,v): return (w*v).sum(2, keepdim=True)
fs=dict(matmul=mm, elem=elem)
for k,fn in fs.items(): assert torch.allclose(fn(torch.softmax(sc0,2),split(proj)), mm(torch.softmax(sc0,2),split(proj)), atol=1e-5)
T={k:[] for k in fs}
for it in range(400):
    for k,fn in fs.items():
        p=proj.clone().requires_grad_(True); s=sc0.clone().requires_grad_(True)
        t0=time.perf_counter(); out=fn(torch.softmax(s,2),split(p)); out.backward(torch.ones_like(out)); dt=time.perf_counter()-t0
        if it>=50: T[k].append(dt)
for k in fs: print(k, round(statistics.median(T[k])*1e6,1),'us')
