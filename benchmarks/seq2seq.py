"""Encoder-decoder level of the benchmark: our translation model against transformers' BART of
identical size (training tokens/s and greedy-generation sentences/s, with nominal FLOP ratios),
at one source/target length or swept over lengths (source = target = n), all models side by side."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from hf_zformer.cpu_speedups import enable_cpu_speedups
from hf_zformer.modeling.configuration_zformer import ZformerConfig
from .cases import DTYPES, ModelRow, ModelShape, ratios_to_baseline
from .flops import attention_flops, dense_flops, layer_flops, token_attention_flops
from .harness import timed_call

SEQ2SEQ_DEFAULT_MODELS = ("bart", "full", "zformer", "fastformer")
# "fastformer-qv": fastformer with the official code's query-as-value sharing (`fastformer_share_qv`),
# one D x D projection fewer per layer; measured on request (`--seq2seq_models`).
SEQ2SEQ_MODELS = (*SEQ2SEQ_DEFAULT_MODELS, "fastformer-qv")


@dataclass
class Seq2SeqShape(ModelShape):
    batch: int = 16
    source_length: int = 32
    target_length: int = 32


@dataclass
class Seq2SeqResult(ModelRow):
    source_length: int
    target_length: int
    train_step_ms: float | None = None
    train_tokens_per_s: float | None = None
    train_speedup_vs_bart: float | None = None
    generate_ms: float | None = None
    sentences_per_s: float | None = None
    generate_speedup_vs_bart: float | None = None
    train_flops: int | None = None  # nominal FLOPs of one training step (`seq2seq_flops`)
    train_flops_ratio_vs_bart: float | None = None  # train_flops / BART's: the FLOP count predicts 1/this speedup
    generate_flops: int | None = None  # nominal FLOPs of one greedy generation
    generate_flops_ratio_vs_bart: float | None = None
    train_times_ms: list = field(default_factory=list)
    generate_times_ms: list = field(default_factory=list)


def build_seq2seq(model: str, shape: Seq2SeqShape):
    """(model, description): transformers' `BartForConditionalGeneration`, or our
    `ZformerForConditionalGeneration` with the same width, depth, heads, FFN and vocabulary, dropout
    off. `full`: softmax attention everywhere (fused SDPA); `zformer`: zformer encoder, causal
    decoder and cross-attention; `fastformer`: fastformer encoder and causal decoder, full
    cross-attention (fastformer has no cross-attention form); `fastformer-qv`: the same with the query
    projection shared as value (`fastformer_share_qv`)."""
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
    from hf_zformer.modeling.modeling_zformer import ZformerForConditionalGeneration

    attention, _, cross = _attention_types(model)
    config = ZformerConfig(
        vocab_size=shape.vocab, hidden_size=shape.width, num_hidden_layers=shape.layers,
        num_decoder_layers=shape.layers, num_attention_heads=shape.heads, intermediate_size=shape.ffn,
        max_position_embeddings=positions, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attention_type=attention, decoder_attention_type=attention, cross_attention_type=cross,
        attn_implementation="sdpa", **_model_options(model),
    )
    description = (f"ZformerForConditionalGeneration: {attention} encoder, causal {attention} decoder, {cross} "
                   f"cross-attention" + (", query projection shared as value" if config.fastformer_share_qv else ""))
    return enable_cpu_speedups(ZformerForConditionalGeneration(config)), description


def _attention_types(model: str) -> tuple[str, str, str]:
    """(encoder, decoder, cross-attention) types of a seq2seq model (as `build_seq2seq` builds them)."""
    if model == "bart":
        return "full", "full", "full"
    attention = "fastformer" if model == "fastformer-qv" else model
    return attention, attention, "zformer" if model == "zformer" else "full"


def _model_options(model: str) -> dict:
    """Config options of a seq2seq model beyond its attention types (the FLOP count needs them too)."""
    return {"fastformer_share_qv": model == "fastformer-qv"}


def seq2seq_flops(model: str, kind: str, shape: Seq2SeqShape, config=None) -> int:
    """Nominal FLOPs (the design's equations, `flops.attention_flops`; embeddings, LayerNorms and
    softmax ignored) of one timed call at `shape`'s source length S and target length T (B batch,
    D width, d_h head width, I FFN, V vocabulary, L layers each side):

    - encoder layer: self-attention (`attention_flops`) + output projection 2 B S D^2 + FFN 4 B S D I;
    - decoder layer: causal self-attention (training: `attention_flops` over T, full counting its
      whole T x T product; generating: one token step per new token, full attention's growing with
      its context, `token_attention_flops`) + cross-attention + 2 output projections + FFN;
    - cross-attention: queries 2 D^2 per token, keys and values of the memory once (4 B S D^2);
      full: scores and values 4 S D per query token; zformer: K^T V of the memory once
      (2 B S D d_h) and Q (K^T V) 2 D d_h per query token;
    - LM head 2 D V per target token.

    train: 3 x the forward (encoder, teacher-forced decoder, LM head on T tokens). generate: the
    encoder's forward once, then T decoder steps (greedy, cache on), each with its LM head.
    BART counts as `full` everywhere."""
    encoder_type, decoder_type, cross_type = _attention_types(model)
    config = config if config is not None else ZformerConfig(
        hidden_size=shape.width, num_attention_heads=shape.heads, attention_type=encoder_type, **_model_options(model))
    b, s, t, d, h, ffn = shape.batch, shape.source_length, shape.target_length, shape.width, shape.heads, shape.ffn
    head_dim = d // h
    encoder = shape.layers * layer_flops(encoder_type, b, s, d, h, ffn, config)
    memory = 4 * b * s * d * d + (2 * b * s * d * head_dim if cross_type == "zformer" else 0)

    def cross(queries: int) -> int:  # per sequence: query projection, attention over the memory, output projection
        attention = 2 * queries * d * head_dim if cross_type == "zformer" else 4 * queries * s * d
        return 2 * queries * d * d + attention + 2 * queries * d * d

    lm_head = 2 * d * shape.vocab
    if kind == "train":
        decoder_layer = (attention_flops(decoder_type, b, t, d, h, config) + dense_flops(b, t, d, ffn) + memory
                         + b * cross(t))
        return 3 * (encoder + shape.layers * decoder_layer + b * t * lm_head)
    steps = sum(
        shape.layers * (token_attention_flops(decoder_type, context, d, h, config) + dense_flops(1, 1, d, ffn)
                        + cross(1))
        + lm_head
        for context in range(1, t + 1)
    )
    return encoder + shape.layers * memory + b * steps


def seq2seq_benchmark(models: Iterable[str], shape: Seq2SeqShape, device: str = "cpu", dtype: str = "fp32",
                      warmup: int = 1, repeats: int = 5, progress: bool = True,
                      lengths: Iterable[int] | None = None) -> list[Seq2SeqResult]:
    """Training steps (forward, backward, AdamW step on random token ids) and greedy generation of
    exactly `target_length` tokens (EOS suppressed, so every model does the same work), all models
    measured side by side: their timed calls alternate, so load from other processes hits all alike.
    tokens/s counts source + target tokens of a training batch; sentences/s = batch / generate time.

    `lengths`: a sweep, source = target = n for each n (`shape`'s own lengths ignored); each length
    is measured side by side, the models built once (positions for the longest). One result per
    model and length, with time and nominal FLOP ratios (`seq2seq_flops`) against BART's."""
    models = list(models)
    pairs = [(n, n) for n in lengths] if lengths is not None else [(shape.source_length, shape.target_length)]
    longest = max(max(pair) for pair in pairs)
    device_ = torch.device(device)
    autocast_dtype = DTYPES[dtype]
    use_autocast = autocast_dtype != torch.float32
    generator = torch.Generator().manual_seed(0)
    data = {}
    for s, t in pairs:
        source = torch.randint(3, shape.vocab, (shape.batch, s), generator=generator).to(device_)
        labels = torch.randint(3, shape.vocab, (shape.batch, t), generator=generator).to(device_)
        data[s, t] = source, torch.ones_like(source), labels

    built = dataclasses.replace(shape, source_length=longest, target_length=longest) if lengths is not None else shape
    runners = build_runners(models, build_seq2seq, built, device_)

    def train_step(name, pair):
        source, source_mask, labels = data[pair]
        optimizer_step(*runners[name][::2], autocast_dtype, input_ids=source, attention_mask=source_mask, labels=labels)

    def generate(name, pair):
        model = runners[name][0]
        source, source_mask, _ = data[pair]
        target_length = pair[1]
        model.eval()
        with torch.inference_mode(), torch.autocast(device_.type, dtype=autocast_dtype, enabled=use_autocast):
            output = model.generate(
                input_ids=source, attention_mask=source_mask, max_new_tokens=target_length,
                min_new_tokens=target_length, num_beams=1, do_sample=False,
            )
        if output.shape[1] < target_length:  # pragma: no cover - min_new_tokens guarantees it
            raise RuntimeError(f"{name} generated {output.shape[1]} tokens, fewer than {target_length}")

    functions = {}
    for pair in pairs:
        functions[f"train {pair[0]} {pair[1]}"] = lambda name, pair=pair: train_step(name, pair)
        functions[f"generate {pair[0]} {pair[1]}"] = lambda name, pair=pair: generate(name, pair)
    times = time_alternating(functions, models, warmup, repeats, device_, progress)
    results = []
    for s, t in pairs:
        at = dataclasses.replace(shape, source_length=s, target_length=t)
        for name in models:
            kinds = {kind: times[name][f"{kind} {s} {t}"] for kind in ("train", "generate")}
            results.append(_result(name, *runners[name][:2], at, dtype, device, kinds))
    ratios_to_baseline(results, "bart", lambda r: (r.source_length, r.target_length), {
        "train_speedup_vs_bart": "train_tokens_per_s", "generate_speedup_vs_bart": "sentences_per_s",
        "train_flops_ratio_vs_bart": "train_flops", "generate_flops_ratio_vs_bart": "generate_flops"})
    return results


def build_runners(models: list[str], build, shape, device: torch.device) -> dict:
    """``{name: (model, description, AdamW optimizer)}``: each model built by ``build(name, shape)``
    from the same seed and moved to `device`. The optimizer is PyTorch's fused AdamW on CPU and
    CUDA, as the training scripts use (`training.make_optimizer`): one kernel per step, so the
    number of parameter tensors (more for Fastformer) does not weigh on short steps."""
    runners = {}
    for name in models:
        torch.manual_seed(0)
        model, description = build(name, shape)
        model.to(device)
        fused = device.type in ("cpu", "cuda") or None
        runners[name] = (model, description, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused))
    return runners


def optimizer_step(model, optimizer, autocast_dtype: torch.dtype, **inputs):
    """One training step: train mode, forward with `inputs` (labels included; under autocast unless
    fp32), backward, optimizer step, gradients dropped."""
    model.train()
    device_type = next(model.parameters()).device.type
    with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_dtype != torch.float32):
        loss = model(**inputs).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def time_alternating(functions: dict, models: list[str], warmup: int, repeats: int, device: torch.device,
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
                elapsed = timed_call(lambda: function(name), device)
                if index >= warmup:
                    times[name][kind].append(elapsed)
                bar.update(1)
    bar.close()
    return times


def _result(name: str, model, description: str, shape: Seq2SeqShape, dtype: str, device: str,
            times: dict[str, list[float]]) -> Seq2SeqResult:
    train = statistics.median(times["train"])
    gen = statistics.median(times["generate"])
    config = model.config if name != "bart" else None
    return Seq2SeqResult(
        model=name, description=description, parameters=sum(p.numel() for p in model.parameters()),
        **shape.size(), source_length=shape.source_length, target_length=shape.target_length,
        dtype=dtype, device=device, train_step_ms=train * 1e3,
        train_tokens_per_s=shape.batch * (shape.source_length + shape.target_length) / train,
        generate_ms=gen * 1e3, sentences_per_s=shape.batch / gen,
        train_flops=seq2seq_flops(name, "train", shape, config),
        generate_flops=seq2seq_flops(name, "generate", shape, config),
        train_times_ms=[t * 1e3 for t in times["train"]],
        generate_times_ms=[t * 1e3 for t in times["generate"]],
    )
