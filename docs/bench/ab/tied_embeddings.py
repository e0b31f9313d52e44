"""Paired A/B of 32 + 32-token training steps (`common.compare`) with these variants:

- `<model>_plain`: `<model>` with `tied_lookups` switched off (the tied embedding's gradient by plain
  autograd: a zero-filled vocab x width buffer per lookup, added to the LM head's);
- `zformer_T` (tried, not kept): every projection with in <= out features in `FewRowsLinear`'s transposed form
  (the policy's `few_rows` unlimited), which single products at 128 rows favour.

Runs: `python docs/bench/ab/tied_embeddings.py zformer_plain,zformer 150`,
`... bart,zformer,full,fastformer,zformer_plain 150`, `... bart,zformer,zformer_T 40`;
with every model's greedy generation between the training steps of a round, as the benchmark level does:
`... bart,full,zformer,fastformer 40 generate`."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import common  # noqa: E402
from common import SHAPE, build_seq2seq, compare  # noqa: E402

from hf_zformer.modeling.policy import use_policy  # noqa: E402
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
    """A model whose forward runs with `FewRowsLinear`'s transposed form at any number of rows."""

    def __call__(self, **inputs):
        with use_policy(few_rows=10**9):
            return self.model(**inputs)


common.VARIANTS.update({f"{name}_plain": (lambda name=name: Plain(build_seq2seq(name, SHAPE)[0]))
                        for name in ("full", "zformer", "fastformer")})
common.VARIANTS.update({
    "zformer_T": lambda: ManyRowsTransposed(build_seq2seq("zformer", SHAPE)[0]),
})

if __name__ == "__main__":
    compare(sys.argv[1].split(","), int(sys.argv[2]), generate=sys.argv[3:] == ["generate"])
