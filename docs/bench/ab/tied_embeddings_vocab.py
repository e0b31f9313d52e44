"""What `tied_lookups` saves as the vocabulary grows. The 32 + 32-token zformer
seq2seq of the benchmark (batch 4, width 512, 6 + 6 layers) with vocabularies of 8,000 and 32,000 tokens,
training steps of the library's form against `tied_lookups` switched off (`tied_embeddings.Plain`), paired
rounds. Run: `python docs/bench/ab/tied_embeddings_vocab.py 40`."""
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SHAPE, build_seq2seq, compare  # noqa: E402
from tied_embeddings import Plain  # noqa: E402

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
    print(f"vocabulary {vocab}:")
    compare(["plain", "tied"], rounds, runners, source, labels)  # tied vs plain: plain time / tied time
