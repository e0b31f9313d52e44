"""Session 17 (2026-11-25): shared setup of this folder's model-level scripts (behind docs/benchmarks.md,
"The 32-token level on Zen 4"): the benchmark's 32 + 32-token seq2seq shape and batch, 2 threads, the
allocator kept warm, one training step, and the implementations that session 17 replaced (kept here
so that old and new can be timed side by side). Run the scripts from the repository root."""
import statistics
import time

import torch

from hf_zformer.benchmark import paired_ratio_interval
from hf_zformer.benchmark.seq2seq import Seq2SeqShape, build_seq2seq
from hf_zformer.memory import retain_freed_memory
from hf_zformer.modeling import attention as A
from hf_zformer.modeling.configuration_zformer import ZformerConfig
from hf_zformer.modeling.modeling_zformer import ZformerForConditionalGeneration

retain_freed_memory()
torch.set_num_threads(2)
SHAPE = Seq2SeqShape(batch=4, source_length=32, target_length=32, width=512, layers=6, heads=8, ffn=2048, vocab=8000)
_generator = torch.Generator().manual_seed(0)
SOURCE = torch.randint(3, 8000, (4, 32), generator=_generator)
LABELS = torch.randint(3, 8000, (4, 32), generator=_generator)


def old_fastformer_scores(self, x, weight):
    """FastformerAttention._scores before session 17: a per-head matrix-vector `bmm`."""
    batch, heads, length, dim = x.shape
    if weight is None:
        return x.new_zeros(batch, heads, length, 1)
    weight = (weight * self.head_dim**-0.5)[:, :, None]
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    scores = torch.bmm(x.transpose(0, 1).reshape(heads, batch * length, dim), weight)
    return scores.view(heads, batch, length, 1).transpose(0, 1)


def old_zformer_short_context(self, hidden_states, source, source_mask):
    """ZformerAttention._short_context before session 17: the scale on the queries."""
    heads = self.num_heads
    query = self._scaled_queries(hidden_states)
    key = A._head_batches(A._zero_padding(self.key(source), source_mask), heads)
    value = A._head_batches(self.value(source), heads)
    with A._no_autocast(hidden_states.device.type):
        query_fp32, key, value = A._fp32(A._head_batches(query, heads), key, value)
        scores = torch.bmm(query_fp32, key.transpose(1, 2))
        if self.is_causal and scores.shape[1] > 1:
            scores = scores.tril_()
        context = torch.bmm(scores, value)
    if context.dtype != query.dtype:
        context = context.to(query.dtype)
    return A._merge_head_batches(context, hidden_states.shape[0])


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


def _parts(encoder, decoder, cross):
    config = ZformerConfig(
        vocab_size=8000, hidden_size=512, num_hidden_layers=6, num_decoder_layers=6, num_attention_heads=8,
        intermediate_size=2048, max_position_embeddings=34, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attention_type=encoder, decoder_attention_type=decoder, cross_attention_type=cross, attn_implementation="sdpa")
    return ZformerForConditionalGeneration(config)


# name -> builder of the model to time (each built from seed 0)
VARIANTS = {
    **{name: (lambda name=name: build_seq2seq(name, SHAPE)[0]) for name in ("bart", "full", "zformer", "fastformer")},
    # sparse embedding gradients: the encoder's lookup only (the first try), or both lookups
    "full_sparse_encoder": lambda: _sparse(build_seq2seq("full", SHAPE)[0], decoder_too=False),
    "zformer_sparse_encoder": lambda: _sparse(build_seq2seq("zformer", SHAPE)[0], decoder_too=False),
    "full_sparse": lambda: _sparse(build_seq2seq("full", SHAPE)[0], decoder_too=True),
    "zformer_sparse": lambda: _sparse(build_seq2seq("zformer", SHAPE)[0], decoder_too=True),
    "full_fused": lambda: FusedLookup(build_seq2seq("full", SHAPE)[0]),
    "zformer_fused": lambda: FusedLookup(build_seq2seq("zformer", SHAPE)[0]),
    "fastformer_old": lambda: Patched(build_seq2seq("fastformer", SHAPE)[0], A.FastformerAttention, "_scores",
                                      old_fastformer_scores),
    "zformer_old": lambda: Patched(build_seq2seq("zformer", SHAPE)[0], A.ZformerAttention, "_short_context",
                                   old_zformer_short_context),
    # zformer in one part of our full model at a time
    "z_enc": lambda: _parts("zformer", "full", "full"),
    "z_dec": lambda: _parts("full", "zformer", "full"),
    "z_cross": lambda: _parts("full", "full", "zformer"),
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
