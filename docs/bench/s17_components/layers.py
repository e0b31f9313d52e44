# Session 17 (2026-11-25) component timing behind docs/benchmarks.md, 'The 32-token level on Zen 4'.
# Ad-hoc measurement script, kept as run (AMD EPYC Zen 4, 2 threads); run from the repository root.
import torch, time, statistics, sys
from hf_zformer.benchmark.seq2seq import build_seq2seq, Seq2SeqShape
from hf_zformer.memory import retain_freed_memory; retain_freed_memory()
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv)>1 else 2)
shape=Seq2SeqShape(batch=4,source_length=32,target_length=32,width=512,layers=6,heads=8,ffn=2048,vocab=8000)
M={}
for n in ['bart','full','zformer']:
    torch.manual_seed(0); m,_=build_seq2seq(n,shape); m.train(); M[n]=m
x=torch.randn(4,32,512); mem=torch.randn(4,32,512)
def enc_layer(n):
    m=M[n]
    if n=='bart': L=m.model.encoder.layers[0]; f=lambda h: L(h, None)[0] if isinstance(L(h,None),tuple) else L(h,None)
    else: L=m.model.encoder.layers[0] if hasattr(m,'model') else m.encoder.layers[0]; f=lambda h: L(h)[0] if isinstance(L(h),tuple) else L(h)
    return L
def find(m, kind):
    for name,mod in m.named_modules():
        if name.endswith(kind+'.layers.0') or name.endswith(kind+'.layer.0'): return mod
    raise KeyError([n for n,_ in m.named_modules()][:40])
import inspect
Ls={n:(find(M[n],'encoder'),find(M[n],'decoder')) for n in M}
def run_enc(n):
    h=x.clone().requires_grad_(True); L=Ls[n][0]
    out=L(h, None) if n=='bart' else L(h)
    out=out[0] if isinstance(out,tuple) else out
    out.sum().backward()
def run_dec(n):
    h=x.clone().requires_grad_(True); e=mem.clone().requires_grad_(True); L=Ls[n][1]
    if n=='bart': out=L(h, attention_mask=None, encoder_hidden_states=e)
    else:
        sig=inspect.signature(L.forward); 
        out=L(h, None, e, None) 
    out=out[0] if isinstance(out,tuple) else out
    out.sum().backward()
print(inspect.signature(Ls['full'][1].forward))
T={(n,k):[] for n in M for k in ('enc','dec')}
for it in range(20):
    for k,f in (('enc',run_enc),('dec',run_dec)):
        for n in M:
            t=time.perf_counter(); f(n); d=time.perf_counter()-t
            if it>=5: T[n,k].append(d)
for k in ('enc','dec'):
    for n in M: print(k,n,round(statistics.median(T[n,k])*1e3,3),'ms', 'paired bart/n', round(statistics.median([a/b for a,b in zip(T['bart',k],T[n,k])]),3))
from torch.profiler import profile, ProfilerActivity
import collections
for n in M:
    for _ in range(3): run_dec(n)
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(10): run_dec(n)
    c=collections.Counter(); tm=collections.Counter()
    for e in p.key_averages():
        c[e.key]=e.count//10; tm[e.key]=e.self_cpu_time_total/10
    print(n, 'ops', sum(c[k] for k in c if k.startswith('aten::')), 'selfcpu ms', round(sum(tm.values())/1e3,2))
    globals()['C_'+n]=(c,tm)
b=C_bart; f=C_full
keys=set(b[0])|set(f[0])
for k in sorted(keys,key=lambda k: -abs(f[1][k]-b[1][k]))[:25]:
    print(f"{k:60s} bart {b[0][k]:4d} {b[1][k]/1e3:7.3f}  full {f[0][k]:4d} {f[1][k]/1e3:7.3f}")
print("----- mm by shape")
for n in ('bart','full'):
    for _ in range(3): run_dec(n)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
        for _ in range(20): run_dec(n)
    rows=[]
    for e in p.key_averages(group_by_input_shape=True):
        if e.key in ('aten::mm','aten::addmm'):
            rows.append((str(e.input_shapes), e.key, e.count//20, round(e.self_cpu_time_total/20/1e3,3)))
    for r in sorted(rows): print(n, r)
