# Session 17 (2026-11-25) component timing behind docs/benchmarks.md, 'The 32-token level on Zen 4'.
# Ad-hoc measurement script, kept as run (AMD EPYC Zen 4, 2 threads); run from the repository root.
import torch, time, statistics, sys
from hf_zformer.modeling.configuration_zformer import ZformerConfig
from hf_zformer.modeling.attention import ATTENTION_CLASSES
from hf_zformer.memory import retain_freed_memory; retain_freed_memory()
torch.set_num_threads(2)
mods={}
for t in ('full','zformer'):
    cfg=ZformerConfig(hidden_size=512,num_attention_heads=8,attention_type=t,attn_implementation="sdpa",attention_probs_dropout_prob=0.0)
    for role in ('self','causal','cross'):
        torch.manual_seed(0)
        mods[t,role]=ATTENTION_CLASSES[t](cfg,is_causal=role=='causal',is_cross=role=='cross',layer_idx=0).train()
x=torch.randn(4,32,512); mem=torch.randn(4,32,512)
def run(t,role):
    h=x.clone().requires_grad_(True)
    if role=='cross':
        e=mem.clone().requires_grad_(True); out=mods[t,role](h,None,memory=e)[0]
    else: out=mods[t,role](h)[0]
    out.sum().backward()
T={k:[] for k in mods}
for it in range(230):
    for k in mods:
        t0=time.perf_counter(); run(*k); d=time.perf_counter()-t0
        if it>=30: T[k].append(d)
for role in ('self','causal','cross'):
    print(role, {t: round(statistics.median(T[t,role])*1e3,3) for t in ('full','zformer')})
