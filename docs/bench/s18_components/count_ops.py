"""Session 18 (2026-11-25): the ATen operators one causal attention module dispatches, forward and backward
(4 x 32 tokens): full (SDPA), zformer, and zformer with short_context_function.py. Call as run:
`python docs/bench/s18_components/count_ops.py`."""
import sys, torch, collections
import os; sys.path.insert(0,os.path.dirname(os.path.abspath(__file__)))
from torch.utils._python_dispatch import TorchDispatchMode
from hf_zformer.modeling.configuration_zformer import ZformerConfig
from hf_zformer.modeling.attention import ATTENTION_CLASSES, ZformerAttention
import short_context_function as fused
seq=[]
class Log(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        seq.append(str(func.overloadpacket.__name__)); return func(*args, **(kwargs or {}))
x=torch.randn(4,32,512)
variants=[('full',None),('zformer',None),('zformer_fused',fused.new_short_context)]
if len(sys.argv)>1:
    import importlib; mod=importlib.import_module(sys.argv[1]); variants.append((sys.argv[1],mod.new_short_context))
old=ZformerAttention._short_context
for name,f in variants:
    t='full' if name=='full' else 'zformer'
    cfg=ZformerConfig(hidden_size=512,num_attention_heads=8,attention_type=t,attn_implementation="sdpa",attention_probs_dropout_prob=0.0)
    m=ATTENTION_CLASSES[t](cfg,is_causal=True,layer_idx=0)
    ZformerAttention._short_context=f or old
    h=x.clone().requires_grad_(True)
    seq.clear()
    with Log(): out=m(h)[0]
    nf=len(seq); fwd=list(seq); seq.clear()
    g=torch.ones_like(out)
    with Log(): out.backward(g)
    print(name,'fwd',nf,'bwd',len(seq)); print('   F:',' '.join(fwd)); print('   B:',' '.join(seq))
