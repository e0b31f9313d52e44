# Session 17 (2026-11-25): fastformer score timing behind docs/benchmarks.md, 'Fastformer's pooling scores'. Ad-hoc script, kept as run.
import torch, time, statistics
torch.set_num_threads(2)
B,N,H,d=4,32,8,64; D=H*d
proj=torch.randn(B,N,D)
w0=torch.randn(H,d)
def split(t): return t.view(B,N,H,d).transpose(1,2)
def a(x,w):  # old bmm
    return torch.bmm(x.transpose(0,1).reshape(H,B*N,d), w[:,:,None]).view(H,B,N,1).transpose(0,1)
eye=torch.eye(H)
def blocks(w): return (w[:,:,None]*eye[:,None,:]).view(D,H)
def b(x,w):
    return (x.transpose(1,2).reshape(B*N,D) @ blocks(w)).view(B,N,H).transpose(1,2)[...,None]
def c(x,w):
    return (blocks(w).t() @ x.transpose(1,2).reshape(B*N,D).t()).view(H,B,N).transpose(0,1)[...,None]
def e(x,w):
    return (x * w[:,None,:]).sum(-1, keepdim=True)
def f(x,w):
    return torch.einsum('bhnd,hd->bhn', x, w)[...,None]
fs=dict(bmm=a,mm=b,mmT=c,elem=e,einsum=f)
ref=a(split(proj),w0)
for k,fn in fs.items(): assert torch.allclose(fn(split(proj),w0),ref,atol=1e-4), k
T={k:[] for k in fs}
for it in range(300):
    for k,fn in fs.items():
        p=proj.clone().requires_grad_(True); w=w0.clone().requires_grad_(True)
        t0=time.perf_counter(); out=fn(split(p),w); out.backward(torch.ones_like(out)); dt=time.perf_counter()-t0
        if it>=50: T[k].append(dt)
for k in fs: print(k, round(statistics.median(T[k])*1e6,1),'us')
