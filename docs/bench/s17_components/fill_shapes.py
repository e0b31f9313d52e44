# Session 17 (2026-11-25): behind docs/benchmarks.md, 'Fastformer's pooling scores, and what else was tried'. Ad-hoc script, kept as run; it may read other scripts of this folder from /tmp.
exec(open('/tmp/prof_alt.py').read().split("S={n:collections.Counter()")[0])
for n in names:
    agg=collections.Counter(); cnt=collections.Counter()
    for r in range(5):
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p: step(n)
        for e in p.key_averages(group_by_input_shape=True):
            if e.key in ('aten::fill_','aten::zero_','aten::zeros','aten::fused_adamw_','aten::_fused_adamw_'):
                agg[(e.key,str(e.input_shapes)[:80])]+=e.self_cpu_time_total/5/1e3; cnt[(e.key,str(e.input_shapes)[:80])]+=e.count/5
    print(n)
    for k,v in sorted(agg.items(), key=lambda kv:-kv[1])[:12]: print('   ',k, round(v,2),'ms', cnt[k])
