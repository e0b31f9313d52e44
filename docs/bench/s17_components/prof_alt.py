# Session 17 (2026-11-25): behind docs/benchmarks.md, 'Fastformer's pooling scores, and what else was tried'. Ad-hoc script, kept as run; it may read other scripts of this folder from /tmp.
"""Interleaved profiling: one profiled training step of each model per round, op self-times summed per model."""
import torch, collections, sys
from torch.profiler import profile, ProfilerActivity
from hf_zformer.benchmark.seq2seq import build_seq2seq, Seq2SeqShape
from hf_zformer.memory import retain_freed_memory; retain_freed_memory()
torch.set_num_threads(2)
shape=Seq2SeqShape(batch=4,source_length=32,target_length=32,width=512,layers=6,heads=8,ffn=2048,vocab=8000)
g=torch.Generator().manual_seed(0)
src=torch.randint(3,8000,(4,32),generator=g); lab=torch.randint(3,8000,(4,32),generator=g); am=torch.ones_like(src)
names=sys.argv[1].split(','); rounds=int(sys.argv[2])
R={}
for n in names:
    torch.manual_seed(0); m,_=build_seq2seq(n,shape); m.train(); R[n]=(m,torch.optim.AdamW(m.parameters(),lr=1e-4,fused=True))
def step(n):
    m,opt=R[n]; loss=m(input_ids=src,attention_mask=am,labels=lab).loss; loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
for _ in range(3):
    for n in names: step(n)
S={n:collections.Counter() for n in names}; C={n:collections.Counter() for n in names}
for r in range(rounds):
    for n in names:
        with profile(activities=[ProfilerActivity.CPU]) as p: step(n)
        for e in p.key_averages():
            S[n][e.key]+=e.self_cpu_time_total/rounds/1e3; C[n][e.key]+=e.count/rounds
a,b=names[0],names[1]
print({n: round(sum(S[n].values()),1) for n in names})
keys=set(S[a])|set(S[b])
for k in sorted(keys, key=lambda k: -abs(S[b][k]-S[a][k]))[:30]:
    print(f"{k[:70]:70s} {a} {C[a][k]:6.0f} {S[a][k]:7.2f}  {b} {C[b][k]:6.0f} {S[b][k]:7.2f}  diff {S[b][k]-S[a][k]:+.2f}")
