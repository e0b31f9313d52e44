"""Session 18 (2026-11-25): the variants this folder adds to s17_components/common.VARIANTS (importing this
module registers them; it also puts both folders on sys.path):

- `zformer_fused`: zformer whose short form runs as one autograd Function (short_context_function.py);
- `zformer_cs`: zformer whose head-batch copies are `channel_shuffle`s (channel_shuffle_heads.py);
- `full_views17`, `full_views68`: our full model with 17 / 68 no-op views per attention module (extra_views.py).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "s17_components"), HERE]

import common  # noqa: E402
from channel_shuffle_heads import PatchedFns  # noqa: E402
from common import A, SHAPE, Patched, build_seq2seq  # noqa: E402
from extra_views import ExtraViews  # noqa: E402
from short_context_function import new_short_context  # noqa: E402

common.VARIANTS.update({
    "zformer_fused": lambda: Patched(build_seq2seq("zformer", SHAPE)[0], A.ZformerAttention, "_short_context",
                                     new_short_context),
    "zformer_cs": lambda: PatchedFns(build_seq2seq("zformer", SHAPE)[0]),
    "full_views17": lambda: ExtraViews(build_seq2seq("full", SHAPE)[0], 17),
    "full_views68": lambda: ExtraViews(build_seq2seq("full", SHAPE)[0], 68),
})
