"""Every model kind x attention type, as tiny models and batches: shared by the distributed, compile and
checkpoint-shape tests (and by tests/distributed_worker.py, which imports it from a torchrun process)."""

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
)

import hf_zformer  # noqa: F401  (registers the Auto classes)

AUTO_CLASSES = {
    "classification": AutoModelForSequenceClassification,
    "masked": AutoModelForMaskedLM,
    "seq2seq": AutoModelForSeq2SeqLM,
    "causal": AutoModelForCausalLM,
}
ATTENTIONS = ("full", "zformer", "xformer", "fastformer", "hybrid")
ENCODER_HYBRID = ["zformer", "xformer"]  # one entry per layer
DECODER_HYBRID = ["fastformer", "zformer"]  # causal types only

TINY = dict(
    vocab_size=61,
    hidden_size=16,
    num_hidden_layers=2,
    num_decoder_layers=2,
    num_attention_heads=2,
    intermediate_size=32,
    max_position_embeddings=32,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)


def cases():
    """(kind, attention) pairs: xformer is not causal, so a causal LM has none."""
    return [(kind, attention) for kind in AUTO_CLASSES for attention in ATTENTIONS
            if not (kind == "causal" and attention == "xformer")]


def config(kind: str, attention: str, **overrides):
    """A tiny config of `kind` whose layers use `attention` ("hybrid": a different type per layer). A
    seq2seq decoder takes zformer where the encoder's type has no causal form (xformer)."""
    if kind == "causal":
        fields = dict(attention_type=DECODER_HYBRID if attention == "hybrid" else attention)
    else:
        fields = dict(attention_type=ENCODER_HYBRID if attention == "hybrid" else attention)
    if kind == "seq2seq":
        decoder = {"hybrid": DECODER_HYBRID, "xformer": "zformer"}.get(attention, attention)
        fields.update(
            decoder_attention_type=decoder,
            cross_attention_type="zformer" if attention in ("zformer", "hybrid") else "full",
        )
    if kind == "classification":
        fields.update(num_labels=3)
    return AutoConfig.for_model("zformer", **{**TINY, **fields, **overrides})


def model(kind: str, attention: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return AUTO_CLASSES[kind].from_config(config(kind, attention, **overrides))


def _ids(lengths, generator, vocab_size):
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, :length] = torch.randint(5, vocab_size, (length,), generator=generator)
        mask[row, :length] = 1
    return ids, mask


def batch(kind: str, rows: int = 4, seed: int = 0) -> dict:
    """A right-padded batch of `rows` sequences with labels for `kind`'s loss."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 12, (rows,), generator=generator).tolist()
    ids, mask = _ids(lengths, generator, TINY["vocab_size"])
    inputs = dict(input_ids=ids, attention_mask=mask)
    if kind == "classification":
        inputs["labels"] = torch.randint(0, 3, (rows,), generator=generator)
    elif kind == "seq2seq":
        targets, target_mask = _ids(torch.randint(2, 9, (rows,), generator=generator).tolist(), generator,
                                    TINY["vocab_size"])
        inputs["labels"] = targets.masked_fill(target_mask == 0, -100)
    else:
        labels = ids.masked_fill(mask == 0, -100)
        if kind == "masked":
            labels[:, ::2] = -100
        inputs["labels"] = labels
    return inputs


def rows(inputs: dict, start: int, stop: int) -> dict:
    """Rows start:stop of every tensor in `inputs`."""
    return {name: value[start:stop] for name, value in inputs.items()}
