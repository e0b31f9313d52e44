"""Paired A/B of 32 + 32-token training steps (`common.compare`) with these variants:

- `<model>_plain`: `<model>` with `tied_lookups` switched off (the tied embedding's gradient by plain
  autograd: a zero-filled vocab x width buffer per lookup, added to the LM head's);
- `zformer_qkv` (tried, not kept): zformer's short form with Q, K, V (K, V for cross-attention) from one
  product with the concatenated weights;
- `zformer_T` (tried, not kept): every projection with in <= out features in `Linear`'s transposed form
  (`FEW_ROWS` unlimited), which single products at 128 rows favour.

Runs: `python docs/bench/ab/tied_embeddings.py zformer_plain,zformer 150`,
`... bart,zformer,full,fastformer,zformer_plain 150`, `... zformer,zformer_qkv,bart 60`, `... bart,zformer,zformer_T 40`;
with every model's greedy generation between the training steps of a round, as the benchmark level does:
`... bart,full,zformer,fastformer 40 generate`."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import common  # noqa: E402
import torch  # noqa: E402
from common import SHAPE, A, Patched, build_seq2seq, compare  # noqa: E402

from hf_zformer.modeling import modeling_zformer  # noqa: E402


class Plain:
    """A model whose forward runs with `tied_lookups` off."""

    def __init__(self, model):
        self.model = model

    def __call__(self, **inputs):
        current = modeling_zformer.tied_lookups
        modeling_zformer.tied_lookups = lambda head, *lookups: None
        try:
            return self.model(**inputs)
        finally:
            modeling_zformer.tied_lookups = current

    def __getattr__(self, key):
        return getattr(self.model, key)


class ManyRowsTransposed(Plain):
    """A model whose forward runs with `Linear`'s transposed form at any number of rows."""

    def __call__(self, **inputs):
        current = A.FEW_ROWS
        A.FEW_ROWS = 10**9
        try:
            return self.model(**inputs)
        finally:
            A.FEW_ROWS = current


def fused_short_context(self, hidden_states, source, source_mask):
    """`ZformerAttention._short_context` with one product for Q, K, V (self-attention) or K, V (cross)."""
    heads, width = self.num_heads, hidden_states.shape[-1]
    scale_scores = source.shape[1] <= self.head_dim
    if source is hidden_states:
        parts = (self.query, self.key, self.value)
    else:
        parts = (self.key, self.value)
    weight, bias = torch.cat([p.weight for p in parts]), torch.cat([p.bias for p in parts])
    projected = torch.nn.functional.linear(source, weight, bias).split(width, -1)
    query = projected[0] if source is hidden_states else self.query(hidden_states)
    key, value = projected[-2:]
    if not scale_scores:
        query = query * self._scale(query.dtype)
    query, key, value = (A.head_batches(t, heads) for t in (query, A.zero_padding(key, source_mask), value))
    scores = torch.bmm(query, key.transpose(1, 2))
    if scale_scores:
        scores = scores * self._scale(scores.dtype)
    if self.is_causal and scores.shape[1] > 1:
        scores = scores.tril_()
    return A.merge_head_batches(torch.bmm(scores, value), hidden_states.shape[0])


common.VARIANTS.update({f"{name}_plain": (lambda name=name: Plain(build_seq2seq(name, SHAPE)[0]))
                        for name in ("full", "zformer", "fastformer")})
common.VARIANTS.update({
    "zformer_qkv": lambda: Patched(build_seq2seq("zformer", SHAPE)[0], A.ZformerAttention, "_short_context",
                                   fused_short_context),
    "zformer_T": lambda: ManyRowsTransposed(build_seq2seq("zformer", SHAPE)[0]),
})

if __name__ == "__main__":
    compare(sys.argv[1].split(","), int(sys.argv[2]), generate=sys.argv[3:] == ["generate"])
