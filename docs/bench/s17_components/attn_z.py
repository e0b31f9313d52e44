# Session 17 (2026-11-25): zformer's scale on the scores, behind docs/benchmarks.md. Ad-hoc script: python docs/bench/s17_components/attn_z.py
import torch, time, statistics, sys
from hf_zformer.modeling.configuration_zformer import ZformerConfig
from hf_zformer.modeling import attention as A
from hf_zformer.memory import retain_freed_memory; retain_freed_memory()
torch.set_num_threads(2)
NEW=A.ZformerAttention._short_context
from common import old_zformer_short_context as OLD
mods={}
cfg=ZformerConfig(hidden_size=512,num_attention_heads=8,attention_type='zformer',attn_implementation="sdpa")
for role in ('self','causal','cross'):
    torch.manual_seed(0)
    mods[role]=A.ZformerAttention(cfg,is_causal=role=='causal',is_cross=role=='cross',layer_idx=0).train()
x=torch.randn(4,32,512); mem=torch.randn(4,32,512)
def run(role, impl):
    A.ZformerAttention._short_context = impl
    h=x.clone().requires_grad_(True)
    if role=='cross':
        e=mem.clone().requires_grad_(True); out=mods[role](h,None,memory=e)[0]
    else: out=mods[role](h)[0]
    out.backward(torch.ones_like(out))
keys=[(r,i) for r in mods for i in ('old','new')]
impls=dict(old=OLD,new=NEW)
T={k:[] for k in keys}
for it in range(330):
    for r,i in keys:
        t0=time.perf_counter(); run(r, impls[i]); d=time.perf_counter()-t0
        if it>=30: T[r,i].append(d)
from hf_zformer.benchmark import paired_ratio_interval
for r in mods: print(r, {i: round(statistics.median(T[r,i])*1e3,3) for i in ('old','new')}, 'old/new', [round(v,3) for v in paired_ratio_interval(T[r,'old'],T[r,'new'])])
