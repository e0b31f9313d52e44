"""Session 18 (2026-11-25): paired A/B of 32 + 32-token training steps, as s17_components/ab.py, with one
more variant: `zformer_fused`, zformer whose short form runs as one autograd Function
(short_context_function.py). Calls as run: `python docs/bench/s18_components/ab.py bart,full,zformer,zformer_fused 30`,
`... zformer,zformer_fused 100`, `... full,zformer,zformer_fused,bart 60`, `... zformer,zformer_fused,full,bart 100`, `... zformer,zformer_cs 100`, `... full,full_views17,full_views68 60`."""
import sys, statistics, time
import os
HERE=os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0,os.path.join(HERE,'..','s17_components')); sys.path.insert(0,HERE)
import common
from common import build, step, Patched, build_seq2seq, SHAPE, A
from short_context_function import new_short_context
from hf_zformer.benchmark import paired_ratio_interval
from channel_shuffle_heads import PatchedFns
from extra_views import ExtraViews
common.VARIANTS['full_views17']=lambda: ExtraViews(build_seq2seq('full', SHAPE)[0], 17)
common.VARIANTS['full_views68']=lambda: ExtraViews(build_seq2seq('full', SHAPE)[0], 68)
common.VARIANTS['zformer_cs']=lambda: PatchedFns(build_seq2seq('zformer', SHAPE)[0])
common.VARIANTS['zformer_fused']=lambda: Patched(build_seq2seq("zformer", SHAPE)[0], A.ZformerAttention, "_short_context", new_short_context)
names, rounds = sys.argv[1].split(","), int(sys.argv[2])
runners = build(names)
times = {name: [] for name in names}
for index in range(rounds + 3):
    for name in names:
        start = time.perf_counter(); step(runners[name])
        if index >= 3: times[name].append(time.perf_counter() - start)
for name in names:
    print(name, f"{statistics.median(times[name]) * 1e3:.1f} ms", "vs", names[0], [round(v, 3) for v in paired_ratio_interval(times[names[0]], times[name])])
