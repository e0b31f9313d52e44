"""Session 19 (2026-11-25): paired A/B of 32 + 32-token training steps (s17_components/common.compare) with
this folder's variants: `<model>_plain` is `<model>` with `tied_lookups` switched off (the tied embedding's
gradient by plain autograd: a zero-filled vocab x width buffer per lookup, added to the LM head's).
Run: `python docs/bench/s19_components/ab.py bart,full,full_plain,zformer,zformer_plain 60`."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "s17_components"), HERE]

import common  # noqa: E402
from common import SHAPE, build_seq2seq, compare  # noqa: E402

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


common.VARIANTS.update({f"{name}_plain": (lambda name=name: Plain(build_seq2seq(name, SHAPE)[0]))
                        for name in ("full", "zformer", "fastformer")})

if __name__ == "__main__":
    compare(sys.argv[1].split(","), int(sys.argv[2]))
