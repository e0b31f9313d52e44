"""Session 18 (2026-11-25), tried and not kept: the head-batch copies of `_short_context` as one
`channel_shuffle` each (bit-identical to `_head_batches` / `_merge_head_batches`); `PatchedFns` swaps them in
during a forward (the backward follows the graph). Used by ab.py as `zformer_cs`."""
import torch
from hf_zformer.modeling import attention as A
def head_batches_cs(x, num_heads):
    batch, length, width = x.shape
    return torch.nn.functional.channel_shuffle(x.reshape(batch, length * num_heads, width // num_heads), length).view(batch * num_heads, length, -1)
def merge_head_batches_cs(x, batch):
    bh, length, dim = x.shape
    heads = bh // batch
    return torch.nn.functional.channel_shuffle(x.reshape(batch, heads * length, dim), heads).view(batch, length, heads * dim)
class PatchedFns:
    def __init__(self, model): self.model=model
    def __call__(self, **inputs):
        old=(A._head_batches, A._merge_head_batches)
        A._head_batches, A._merge_head_batches = head_batches_cs, merge_head_batches_cs
        try: return self.model(**inputs)
        finally: A._head_batches, A._merge_head_batches = old
    def __getattr__(self, k): return getattr(self.model, k)
