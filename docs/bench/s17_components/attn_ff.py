# Session 17 (2026-11-25): fastformer score timing behind docs/benchmarks.md, 'Fastformer's pooling scores'. Ad-hoc script, kept as run.
import torch, time, statistics
from hf_zformer.modeling.configuration_zformer import ZformerConfig
from hf_zformer.modeling.attention import ATTENTION_CLASSES
from hf_zformer.memory import retain_freed_memory; retain_freed_memory()
torch.set_num_threads(2)
mods={}
for t in ('full','fastformer'):
    cfg=ZformerConfig(hidden_size=512,num_attention_heads=8,attention_type=t,attn_implementation="sdpa",attention_probs_dropout_prob=0.0)
    for role in ('self','causal'):
        torch.manual_seed(0)
        mods[t,role]=ATTENTION_CLASSES[t](cfg,is_causal=role=='causal',layer_idx=0).train()
lin=torch.nn.Linear(512,512)
x=torch.randn(4,32,512)
def run(t,role):
    h=x.clone().requires_grad_(True)
    if t=='lin': out=lin(h)
    else: out=mods[t,role](h)[0]
    out.backward(torch.ones_like(out))
keys=list(mods)+[('lin','x')]
T={k:[] for k in keys}
for it in range(230):
    for k in keys:
        t0=time.perf_counter(); run(*k); d=time.perf_counter()-t0
        if it>=30: T[k].append(d)
for k in keys: print(k, round(statistics.median(T[k])*1e3,3))
