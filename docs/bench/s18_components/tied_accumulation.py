"""Session 18 (2026-11-25): does autograd add a tied weight's gradients in place? An LM head whose weight
gradient is a fresh tensor, with dense lookups (yes: the head's buffer becomes .grad) and with sparse
lookup gradients (no: the dense + sparse sum is a new tensor). Call: `python docs/bench/s18_components/tied_accumulation.py`."""
import torch
V,D,R=8000,512,128
torch.manual_seed(0)
W=torch.nn.Parameter(torch.randn(V,D)*0.02)
ids1=torch.randint(0,V,(R,)); ids2=torch.randint(0,V,(R,)); labels=torch.randint(0,V,(R,))
PTR={}
class Head(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w):
        ctx.save_for_backward(h, w); return h @ w.t()
    @staticmethod
    def backward(ctx, g):
        h, w = ctx.saved_tensors
        dw=torch.mm(g.t(), h); PTR['head']=dw.data_ptr(); return g @ w, dw
class Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, w):
        ctx.save_for_backward(ids); ctx.shape=w.shape; return w[ids]
    @staticmethod
    def backward(ctx, g):
        ids,=ctx.saved_tensors
        sp=torch.sparse_coo_tensor(ids[None], g, ctx.shape)
        PTR.setdefault('order',[]).append('lookup'); return None, sp
for sparse in (False,True):
    PTR.clear(); W.grad=None
    if sparse: e1=Lookup.apply(ids1,W); e2=Lookup.apply(ids2,W)
    else: e1=torch.nn.functional.embedding(ids1,W); e2=torch.nn.functional.embedding(ids2,W)
    h=torch.tanh(e1+e2); loss=torch.nn.functional.cross_entropy(Head.apply(h,W),labels)
    loss.backward()
    print(sparse, 'in place:', W.grad.data_ptr()==PTR['head'], W.grad.layout)
