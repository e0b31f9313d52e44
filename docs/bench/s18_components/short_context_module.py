"""Session 18 (2026-11-25): one zformer attention module (bidirectional / causal / cross), 4 x 32 tokens,
forward + backward, `_short_context` against short_context_function.py, paired rounds; checks fp64 equality
of outputs and every gradient first. Call as run: `python docs/bench/s18_components/short_context_module.py 300`.
`compare_module(new, rounds)` does the same for any replacement `new` (session 19's head_major.py)."""
import sys, time, statistics, torch
import os; sys.path.insert(0,os.path.dirname(os.path.abspath(__file__)))
from hf_zformer.modeling.configuration_zformer import ZformerConfig
from hf_zformer.modeling.attention import ZformerAttention
from hf_zformer.memory import retain_freed_memory; retain_freed_memory()
from hf_zformer.benchmark import paired_ratio_interval
torch.set_num_threads(2)


def compare_module(new, rounds=200):
    old=ZformerAttention._short_context
    cfg=ZformerConfig(hidden_size=512,num_attention_heads=8,attention_type='zformer',attention_probs_dropout_prob=0.0)
    x=torch.randn(4,32,512); mem=torch.randn(4,32,512)
    # correctness in fp64
    for role in ('self','causal','cross'):
        torch.manual_seed(0); m=ZformerAttention(cfg,is_causal=role=='causal',is_cross=role=='cross',layer_idx=0).double()
        torch.nn.init.constant_(m.log_scale, 1.0)
        outs=[]
        for f in (old,new):
            ZformerAttention._short_context=f; m.zero_grad()
            h=x.double().clone().requires_grad_(True); e=mem.double().clone().requires_grad_(True)
            o=m(h,None,memory=e)[0] if role=='cross' else m(h)[0]
            (o*torch.linspace(-1,1,o.numel(),dtype=o.dtype).view_as(o)).sum().backward()
            outs.append([o.detach(), h.grad, e.grad if role=='cross' else None]+[p.grad.clone() for p in m.parameters()])
        for a,b in zip(*outs):
            if a is not None: torch.testing.assert_close(a,b,rtol=1e-10,atol=1e-12)
    print('fp64 equal')
    mods={}
    for role in ('self','causal','cross'):
        torch.manual_seed(0); mods[role]=ZformerAttention(cfg,is_causal=role=='causal',is_cross=role=='cross',layer_idx=0)
    def run(role):
        for p in mods[role].parameters(): p.grad=None
        h=x.clone().requires_grad_(True)
        if role=='cross': e=mem.clone().requires_grad_(True); out=mods[role](h,None,memory=e)[0]
        else: out=mods[role](h)[0]
        out.sum().backward()
    T={}
    for it in range(rounds):
        for role in mods:
            for name,f in (('old',old),('new',new)):
                ZformerAttention._short_context=f
                t0=time.perf_counter(); run(role); d=time.perf_counter()-t0
                if it>=20: T.setdefault((role,name),[]).append(d)
    for role in mods:
        print(role, round(statistics.median(T[role,'old'])*1e3,3), round(statistics.median(T[role,'new'])*1e3,3),
              [round(v,3) for v in paired_ratio_interval(T[role,'new'],T[role,'old'])])


if __name__ == '__main__':
    from short_context_function import new_short_context
    compare_module(new_short_context, int(sys.argv[1]) if len(sys.argv) > 1 else 200)
