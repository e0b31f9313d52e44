"""Paired A/B timing of whole training steps (docs/benchmarks.md, "Short inputs"): the benchmark's
32 + 32-token seq2seq shape and batch, 2 threads, the allocator kept warm, one training step with
fused AdamW, and `compare`, which times every variant once per round and reports each one's paired
ratio to the first with a 95% bootstrap interval. Run the scripts of this folder from the repository
root, e.g. `python docs/bench/ab/tied_embeddings.py zformer_plain,zformer 150`."""
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the checkout: benchmarks/ beside hf_zformer/

import torch  # noqa: E402

from benchmarks import paired_ratio_interval  # noqa: E402
from benchmarks.seq2seq import Seq2SeqShape, build_seq2seq  # noqa: E402
from hf_zformer.memory import retain_freed_memory  # noqa: E402
from hf_zformer.modeling import attention as A  # noqa: E402

retain_freed_memory()
torch.set_num_threads(2)
SHAPE = Seq2SeqShape(batch=4, source_length=32, target_length=32, width=512, layers=6, heads=8, ffn=2048, vocab=8000)
_generator = torch.Generator().manual_seed(0)
SOURCE = torch.randint(3, 8000, (4, 32), generator=_generator)
LABELS = torch.randint(3, 8000, (4, 32), generator=_generator)


class Patched:
    """A model whose forward runs with `cls.name` replaced by `function` (the backward follows the graph)."""

    def __init__(self, model, cls, name, function):
        self.model, self.cls, self.name, self.function = model, cls, name, function

    def __call__(self, **inputs):
        current = getattr(self.cls, self.name)
        setattr(self.cls, self.name, self.function)
        try:
            return self.model(**inputs)
        finally:
            setattr(self.cls, self.name, current)

    def __getattr__(self, key):
        return getattr(self.model, key)


class FusedLookup:
    """One embedding lookup for source and target (shifted labels) together, passed as embeddings."""

    def __init__(self, model):
        self.model = model

    def __call__(self, input_ids, attention_mask, labels):
        m = self.model
        decoder_ids = m.prepare_decoder_input_ids_from_labels(labels)
        weight = m.encoder.embeddings.word_embeddings.weight
        both = torch.nn.functional.embedding(torch.cat([input_ids.reshape(-1), decoder_ids.reshape(-1)]), weight,
                                             m.config.pad_token_id)
        source, target = both.split([input_ids.numel(), decoder_ids.numel()])
        return m(inputs_embeds=source.view(*input_ids.shape, -1), attention_mask=attention_mask,
                 decoder_inputs_embeds=target.view(*decoder_ids.shape, -1), labels=labels)

    def __getattr__(self, key):
        return getattr(self.model, key)


def _sparse(model, decoder_too):
    model.encoder.embeddings.word_embeddings.sparse = True
    model.decoder.embeddings.word_embeddings.sparse = decoder_too
    return model


# name -> builder of the model to time (each built from seed 0)
VARIANTS = {
    **{name: (lambda name=name: build_seq2seq(name, SHAPE)[0]) for name in ("bart", "full", "zformer", "fastformer")},
    # sparse embedding gradients: the encoder's lookup only, or both lookups
    "full_sparse_encoder": lambda: _sparse(build_seq2seq("full", SHAPE)[0], decoder_too=False),
    "zformer_sparse_encoder": lambda: _sparse(build_seq2seq("zformer", SHAPE)[0], decoder_too=False),
    "full_sparse": lambda: _sparse(build_seq2seq("full", SHAPE)[0], decoder_too=True),
    "zformer_sparse": lambda: _sparse(build_seq2seq("zformer", SHAPE)[0], decoder_too=True),
    "full_fused": lambda: FusedLookup(build_seq2seq("full", SHAPE)[0]),
    "zformer_fused": lambda: FusedLookup(build_seq2seq("zformer", SHAPE)[0]),
}


def build(names):
    """{name: (model, fused AdamW)} of `names` (keys of VARIANTS), each in train mode."""
    runners = {}
    for name in names:
        torch.manual_seed(0)
        model = VARIANTS[name]()
        model.train()
        runners[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))
    return runners


def step(runner, source=SOURCE, labels=LABELS):
    """One training step (forward with labels, backward, AdamW step, gradients dropped)."""
    model, optimizer = runner
    model(input_ids=source, attention_mask=torch.ones_like(source), labels=labels).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _generate(model, source):
    """Greedy generation of 32 tokens (as the level's rounds run between training steps)."""
    model.eval()
    with torch.inference_mode():
        model.generate(input_ids=source, attention_mask=torch.ones_like(source), max_new_tokens=32,
                       min_new_tokens=32, num_beams=1, do_sample=False)


def compare(names, rounds, runners=None, source=SOURCE, labels=LABELS, generate=False):
    """Time one training step of every variant in `names` per round (3 warm-up rounds first); print each
    one's median and its paired ratio to the first, with a 95% interval. `runners`: {name: (model,
    optimizer)} already built (default: `build(names)`); `generate`: each round also runs every model's
    greedy generation after the training steps, untimed, as the benchmark level does."""
    runners = runners or build(names)
    times = {name: [] for name in names}
    for index in range(rounds + 3):  # 3 warm-up rounds
        for name in names:
            start = time.perf_counter()
            step(runners[name], source, labels)
            if index >= 3:
                times[name].append(time.perf_counter() - start)
        if generate:
            for name in names:
                _generate(runners[name][0], source)
    for name in names:
        ratio = paired_ratio_interval(times[names[0]], times[name])
        print(name, f"{statistics.median(times[name]) * 1e3:.1f} ms", "vs", names[0], [round(v, 3) for v in ratio])
