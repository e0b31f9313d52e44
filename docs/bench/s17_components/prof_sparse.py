# Session 17 (2026-11-25): behind docs/benchmarks.md, 'Fastformer's pooling scores, and what else was tried'. Ad-hoc script, kept as run; it may read other scripts of this folder from /tmp.
exec(open('/tmp/ab3.py').read().split("T={n:[] for n in names}")[0])
from torch.profiler import profile, ProfilerActivity
import collections
for n in names:
    m,opt=R[n]
    for _ in range(3):
        loss=m(input_ids=src,attention_mask=am,labels=lab).loss; loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    agg=collections.Counter(); cnt=collections.Counter()
    for r in range(5):
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
            loss=m(input_ids=src,attention_mask=am,labels=lab).loss; loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        for e in p.key_averages(group_by_input_shape=True):
            if '8000' in str(e.input_shapes):
                agg[(e.key,str(e.input_shapes)[:70])]+=e.self_cpu_time_total/5/1e3; cnt[(e.key,str(e.input_shapes)[:70])]+=e.count/5
    print(n)
    for k,v in sorted(agg.items(), key=lambda kv:-kv[1])[:14]: print('   ',k, round(v,2),'ms', cnt[k])
