"""Session 18 (2026-11-25): per-operator times of one attention module (full with SDPA against zformer),
forward + backward, 4 x 32 tokens, interleaved. Calls as run: `python docs/bench/s18_components/module_ops.py causal` and `... self`."""
import torch, sys, time, statistics, collections
from torch.utils._python_dispatch import TorchDispatchMode
from hf_zformer.modeling.configuration_zformer import ZformerConfig
from hf_zformer.modeling.attention import ATTENTION_CLASSES
from hf_zformer.memory import retain_freed_memory; retain_freed_memory()
torch.set_num_threads(2)
role=sys.argv[1]
mods={}
for t in ('full','zformer'):
    cfg=ZformerConfig(hidden_size=512,num_attention_heads=8,attention_type=t,attn_implementation="sdpa",attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    mods[t]=ATTENTION_CLASSES[t](cfg,is_causal=role=='causal',is_cross=role=='cross',layer_idx=0).train()
x=torch.randn(4,32,512); mem=torch.randn(4,32,512)
acc=None
class Timer(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0=time.perf_counter(); r=func(*args, **(kwargs or {})); d=time.perf_counter()-t0
        acc[str(func.overloadpacket.__name__)]+=d
        return r
def run(t):
    for p in mods[t].parameters(): p.grad=None
    h=x.clone().requires_grad_(True)
    if role=='cross':
        e=mem.clone().requires_grad_(True); out=mods[t](h,None,memory=e)[0]
    else: out=mods[t](h)[0]
    out.sum().backward()
res={t:collections.defaultdict(list) for t in mods}
for it in range(230):
    for t in mods:
        acc=collections.defaultdict(float)
        with Timer(): run(t)
        if it>=30:
            for k,v in acc.items(): res[t][k].append(v)
            res[t]['TOTAL'].append(sum(acc.values()))
keys=sorted(set(res['full'])|set(res['zformer']), key=lambda k:-statistics.median(res['zformer'].get(k,[0])))
for k in keys[:14]:
    print(f"{k:40s}", *(f"{statistics.median(res[t][k])*1e3 if k in res[t] else 0:8.3f}" for t in mods))
