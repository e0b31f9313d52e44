# Session 17 (2026-11-25) component timing behind docs/benchmarks.md, 'The 32-token level on Zen 4'.
# Ad-hoc measurement script, kept as run (AMD EPYC Zen 4, 2 threads); run from the repository root.
import torch, time, statistics, sys
from hf_zformer.benchmark.seq2seq import build_seq2seq, Seq2SeqShape
from hf_zformer.benchmark import harness
torch.set_num_threads(2)
try:
    from hf_zformer.memory import retain_freed_memory; print("retain", retain_freed_memory())
except Exception as e: print("no retain", e)
shape=Seq2SeqShape(batch=4,source_length=32,target_length=32,width=512,layers=int(sys.argv[2]),heads=8,ffn=2048,vocab=8000)
models=['bart','full','zformer']
g=torch.Generator().manual_seed(0)
src=torch.randint(3,8000,(4,32),generator=g); lab=torch.randint(3,8000,(4,32),generator=g); am=torch.ones_like(src)
R={}
for n in models:
    torch.manual_seed(0); m,_=build_seq2seq(n,shape); m.train()
    opt=torch.optim.AdamW(m.parameters(),lr=1e-4,fused=True); R[n]=(m,opt)
T={n:{'fwd':[],'bwd':[],'opt':[]} for n in models}
for it in range(60):
    for n in models:
        m,opt=R[n]
        t0=time.perf_counter(); loss=m(input_ids=src,attention_mask=am,labels=lab).loss
        t1=time.perf_counter(); loss.backward(); t2=time.perf_counter(); opt.step(); opt.zero_grad(set_to_none=True); t3=time.perf_counter()
        if it>=3:
            T[n]['fwd'].append(t1-t0);T[n]['bwd'].append(t2-t1);T[n]['opt'].append(t3-t2)
for n in models:
    print(n, {k:round(statistics.median(v)*1e3,1) for k,v in T[n].items()})
for n in models[1:]:
    print(n,'paired ratio bart/n', {k: round(statistics.median([a/b for a,b in zip(T[models[0]][k],T[n][k])]),3) for k in ('fwd','bwd','opt')})
