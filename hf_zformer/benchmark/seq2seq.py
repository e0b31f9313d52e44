"""Encoder-decoder level of the benchmark: our translation model against transformers' BART of
identical size (training tokens/s and greedy-generation sentences/s)."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from ..modeling.configuration_zformer import ZformerConfig
from .cases import DTYPES
from .harness import _timed_call

SEQ2SEQ_MODELS = ("bart", "full", "zformer", "fastformer")


@dataclass
class Seq2SeqShape:
    batch: int = 16
    source_length: int = 32
    target_length: int = 32
    width: int = 512
    layers: int = 6
    heads: int = 8
    ffn: int = 2048
    vocab: int = 8000


@dataclass
class Seq2SeqResult:
    model: str
    description: str
    parameters: int
    batch: int
    source_length: int
    target_length: int
    width: int
    layers: int
    heads: int
    ffn: int
    vocab: int
    dtype: str
    device: str
    train_step_ms: float | None = None
    train_tokens_per_s: float | None = None
    train_speedup_vs_bart: float | None = None
    generate_ms: float | None = None
    sentences_per_s: float | None = None
    generate_speedup_vs_bart: float | None = None
    train_times_ms: list = field(default_factory=list)
    generate_times_ms: list = field(default_factory=list)


def build_seq2seq(model: str, shape: Seq2SeqShape):
    """(model, description): transformers' `BartForConditionalGeneration`, or our
    `ZformerForConditionalGeneration` with the same width, depth, heads, FFN and vocabulary, dropout
    off. `full`: softmax attention everywhere (fused SDPA); `zformer`: zformer encoder, causal
    decoder and cross-attention; `fastformer`: fastformer encoder and causal decoder, full
    cross-attention (fastformer has no cross-attention form)."""
    positions = max(shape.source_length, shape.target_length) + 2
    if model == "bart":
        from transformers import BartConfig, BartForConditionalGeneration

        config = BartConfig(
            vocab_size=shape.vocab, d_model=shape.width, encoder_layers=shape.layers, decoder_layers=shape.layers,
            encoder_attention_heads=shape.heads, decoder_attention_heads=shape.heads, encoder_ffn_dim=shape.ffn,
            decoder_ffn_dim=shape.ffn, max_position_embeddings=positions, dropout=0.0, attention_dropout=0.0,
            activation_dropout=0.0, activation_function="gelu", scale_embedding=True, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, forced_eos_token_id=None,
            tie_word_embeddings=True, attn_implementation="sdpa",
        )
        return BartForConditionalGeneration(config), "transformers BartForConditionalGeneration (sdpa)"
    if model not in SEQ2SEQ_MODELS:
        raise ValueError(f"unknown seq2seq model {model!r}; choose from {list(SEQ2SEQ_MODELS)}")
    from ..modeling.modeling_zformer import ZformerForConditionalGeneration

    cross = "zformer" if model == "zformer" else "full"
    config = ZformerConfig(
        vocab_size=shape.vocab, hidden_size=shape.width, num_hidden_layers=shape.layers,
        num_decoder_layers=shape.layers, num_attention_heads=shape.heads, intermediate_size=shape.ffn,
        max_position_embeddings=positions, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attention_type=model, decoder_attention_type=model, cross_attention_type=cross,
        attn_implementation="sdpa",
    )
    description = f"ZformerForConditionalGeneration: {model} encoder, causal {model} decoder, {cross} cross-attention"
    return ZformerForConditionalGeneration(config), description


def seq2seq_benchmark(models: Iterable[str], shape: Seq2SeqShape, device: str = "cpu", dtype: str = "fp32",
                      warmup: int = 1, repeats: int = 5, progress: bool = True) -> list[Seq2SeqResult]:
    """Training steps (forward, backward, AdamW step on random token ids) and greedy generation of
    exactly `target_length` tokens (EOS suppressed, so every model does the same work), all models
    measured side by side: their timed calls alternate, so load from other processes hits all alike.
    tokens/s counts source + target tokens of a training batch; sentences/s = batch / generate time."""
    models = list(models)
    device_ = torch.device(device)
    autocast_dtype = DTYPES[dtype]
    use_autocast = autocast_dtype != torch.float32
    generator = torch.Generator().manual_seed(0)
    source = torch.randint(3, shape.vocab, (shape.batch, shape.source_length), generator=generator).to(device_)
    source_mask = torch.ones_like(source)
    labels = torch.randint(3, shape.vocab, (shape.batch, shape.target_length), generator=generator).to(device_)

    runners = {}
    for name in models:
        torch.manual_seed(0)
        model, description = build_seq2seq(name, shape)
        model.to(device_)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        runners[name] = (model, description, optimizer)

    def train_step(name):
        model, _, optimizer = runners[name]
        model.train()
        with torch.autocast(device_.type, dtype=autocast_dtype, enabled=use_autocast):
            loss = model(input_ids=source, attention_mask=source_mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def generate(name):
        model = runners[name][0]
        model.eval()
        with torch.inference_mode(), torch.autocast(device_.type, dtype=autocast_dtype, enabled=use_autocast):
            output = model.generate(
                input_ids=source, attention_mask=source_mask, max_new_tokens=shape.target_length,
                min_new_tokens=shape.target_length, num_beams=1, do_sample=False,
            )
        if output.shape[1] < shape.target_length:  # pragma: no cover - min_new_tokens guarantees it
            raise RuntimeError(f"{name} generated {output.shape[1]} tokens, fewer than {shape.target_length}")

    times = _time_alternating({"train": train_step, "generate": generate}, models, warmup, repeats, device_, progress)
    results = [_result(name, *runners[name][:2], shape, dtype, device, times[name]) for name in models]
    base = next((r for r in results if r.model == "bart"), None)
    for r in results:
        if base is not None:
            r.train_speedup_vs_bart = r.train_tokens_per_s / base.train_tokens_per_s
            r.generate_speedup_vs_bart = r.sentences_per_s / base.sentences_per_s
    return results


def _time_alternating(functions: dict, models: list[str], warmup: int, repeats: int, device: torch.device,
                      progress: bool, desc: str = "seq2seq") -> dict[str, dict[str, list[float]]]:
    """``{model: {kind: seconds of each timed call}}``: for each kind (``function(model)``), the
    calls of all models alternate, warm-up calls first (not kept)."""
    from tqdm.auto import tqdm

    times = {name: {kind: [] for kind in functions} for name in models}
    bar = tqdm(total=len(functions) * (warmup + repeats) * len(models), disable=not progress, desc=desc,
               dynamic_ncols=True)
    for kind, function in functions.items():
        for index in range(warmup + repeats):
            for name in models:
                bar.set_postfix_str(f"{kind} {name}")
                elapsed = _timed_call(lambda: function(name), device)
                if index >= warmup:
                    times[name][kind].append(elapsed)
                bar.update(1)
    bar.close()
    return times


def _result(name: str, model, description: str, shape: Seq2SeqShape, dtype: str, device: str,
            times: dict[str, list[float]]) -> Seq2SeqResult:
    train = statistics.median(times["train"])
    gen = statistics.median(times["generate"])
    return Seq2SeqResult(
        model=name, description=description, parameters=sum(p.numel() for p in model.parameters()),
        batch=shape.batch, source_length=shape.source_length, target_length=shape.target_length,
        width=shape.width, layers=shape.layers, heads=shape.heads, ffn=shape.ffn, vocab=shape.vocab,
        dtype=dtype, device=device, train_step_ms=train * 1e3,
        train_tokens_per_s=shape.batch * (shape.source_length + shape.target_length) / train,
        generate_ms=gen * 1e3, sentences_per_s=shape.batch / gen,
        train_times_ms=[t * 1e3 for t in times["train"]],
        generate_times_ms=[t * 1e3 for t in times["generate"]],
    )
