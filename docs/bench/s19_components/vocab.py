"""Session 19 (2026-11-25): what `tied_lookups` saves as the vocabulary grows. The 32 + 32-token zformer
seq2seq of the benchmark (batch 4, width 512, 6 + 6 layers) with vocabularies of 8,000 and 32,000 tokens,
training steps of the library's form against `tied_lookups` switched off (ab.py's `Plain`), paired rounds.
Run: `python docs/bench/s19_components/vocab.py 40`."""
import dataclasses
import statistics
import sys
import time

import torch

import ab  # noqa: F401  (puts s17_components on the path)
from ab import Plain
from common import SHAPE, build_seq2seq, paired_ratio_interval

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 40
for vocab in (8000, 32000):
    shape = dataclasses.replace(SHAPE, vocab=vocab)
    generator = torch.Generator().manual_seed(0)
    source = torch.randint(3, vocab, (4, 32), generator=generator)
    labels = torch.randint(3, vocab, (4, 32), generator=generator)
    runners = {}
    for name in ("plain", "tied"):
        torch.manual_seed(0)
        model = build_seq2seq("zformer", shape)[0].train()
        runners[name] = (Plain(model) if name == "plain" else model,
                         torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))
    times = {name: [] for name in runners}
    for index in range(rounds + 3):
        for name, (model, optimizer) in runners.items():
            start = time.perf_counter()
            model(input_ids=source, attention_mask=torch.ones_like(source), labels=labels).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if index >= 3:
                times[name].append(time.perf_counter() - start)
    ratio = paired_ratio_interval(times["plain"], times["tied"])
    print(f"vocab {vocab}: plain {statistics.median(times['plain']) * 1e3:.1f} ms, "
          f"tied {statistics.median(times['tied']) * 1e3:.1f} ms, plain / tied {[round(v, 3) for v in ratio]}")
