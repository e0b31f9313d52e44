"""Session 18 (2026-11-25): the attention core (Q K^T) V without head-batch copies, forward only: copies +
one bmm each (now) against loops of bmm over strided per-sequence or per-head views (with and without out=).
Calls as run: `python docs/bench/s18_components/core_forms.py B N H d` for (4 32 8 64), (4 16 8 64), (32 32 8 64), (8 64 8 64)."""
import torch, time, statistics, sys
from hf_zformer.memory import retain_freed_memory; retain_freed_memory()
torch.set_num_threads(2)
B,N,H,d=[int(v) for v in sys.argv[1:5]]; D=H*d
q,k,v=[torch.randn(B,N,D) for _ in range(3)]
def copies():
    qh=q.view(B,N,H,d).transpose(1,2).reshape(B*H,N,d); kh=k.view(B,N,H,d).transpose(1,2).reshape(B*H,N,d); vh=v.view(B,N,H,d).transpose(1,2).reshape(B*H,N,d)
    S=torch.bmm(qh,kh.transpose(1,2)); ctx=torch.bmm(S,vh)
    return ctx.view(B,H,N,d).transpose(1,2).reshape(B,N,D)
def loop_b():
    out=torch.empty(B,N,D); S=torch.empty(B,H,N,N)
    q4=q.view(B,N,H,d); k4=k.view(B,N,H,d); v4=v.view(B,N,H,d); o4=out.view(B,N,H,d)
    for b in range(B):
        torch.bmm(q4[b].transpose(0,1), k4[b].permute(1,2,0), out=S[b])
        torch.bmm(S[b], v4[b].transpose(0,1), out=o4[b].transpose(0,1))
    return out
def loop_h():
    out=torch.empty(B,N,D); S=torch.empty(H,B,N,N)
    q4=q.view(B,N,H,d); k4=k.view(B,N,H,d); v4=v.view(B,N,H,d); o4=out.view(B,N,H,d)
    for h in range(H):
        torch.bmm(q4[:,:,h], k4[:,:,h].transpose(1,2), out=S[h])
        torch.bmm(S[h], v4[:,:,h], out=o4[:,:,h])
    return out
def loop_b_noout():
    q4=q.view(B,N,H,d); k4=k.view(B,N,H,d); v4=v.view(B,N,H,d)
    outs=[torch.bmm(torch.bmm(q4[b].transpose(0,1), k4[b].permute(1,2,0)), v4[b].transpose(0,1)) for b in range(B)]
    return torch.stack(outs,0).transpose(1,2).reshape(B,N,D)
ref=copies()
for f in (loop_b,loop_h,loop_b_noout): assert torch.allclose(f(),ref,atol=1e-4), f.__name__
cases=[copies,loop_b,loop_h,loop_b_noout]
T={f.__name__:[] for f in cases}
for it in range(330):
    for f in cases:
        t0=time.perf_counter(); f(); dt=time.perf_counter()-t0
        if it>=30: T[f.__name__].append(dt)
print(sys.argv[1:], {k:round(statistics.median(v)*1e6,1) for k,v in T.items()})
