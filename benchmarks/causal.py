"""Decoder-only level of the benchmark: our causal LM (full, zformer, fastformer layers) against
transformers' `GPT2LMHeadModel` of identical size, side by side: training tokens/s and greedy
generation tokens/s with the cache, the cache's size at the end of generation, and nominal FLOP
ratios next to the time ratios."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from hf_zformer.cpu_speedups import enable_cpu_speedups
from hf_zformer.modeling.configuration_zformer import ZformerConfig
from hf_zformer.modeling.modeling_zformer import CACHE_FIELD
from .cases import DTYPES, ModelRow, ModelShape, ratios_to_baseline
from .flops import dense_flops, layer_flops, token_attention_flops
from .seq2seq import build_runners, optimizer_step, time_alternating

CAUSAL_MODELS = ("gpt2", "full", "zformer", "fastformer")
CAUSAL_KINDS = ("train", "generate")


@dataclass
class CausalShape(ModelShape):
    lengths: tuple[int, ...] = (64, 512, 2048, 8192)  # training length; generation prompt + output (half each)


@dataclass
class CausalResult(ModelRow):
    kind: str  # "train": forward + backward + AdamW step on batch x length; "generate": greedy, with the cache
    length: int  # train: tokens per row; generate: prompt + generated tokens
    prompt_length: int | None
    new_tokens: int | None
    time_ms: float | None = None
    tokens_per_s: float | None = None  # train: batch x length; generate: batch x new tokens, per second
    speedup_vs_gpt2: float | None = None  # tokens/s over GPT-2's at the same kind and length
    flops: int | None = None  # nominal FLOPs of one timed call (`causal_flops`)
    flops_ratio_vs_gpt2: float | None = None  # flops / GPT-2's: the speedup the FLOP count alone predicts is 1/this
    cache_mb: float | None = None  # generate: bytes of the cache's tensors at the end of generation / 2**20
    times_ms: list = field(default_factory=list)


def build_causal(model: str, shape: CausalShape):
    """(model, description): transformers' `GPT2LMHeadModel`, or our `ZformerForCausalLM` with
    `model` attention in every layer, of the same width, depth, heads, FFN width (GPT-2's
    `n_inner`), vocabulary and positions (`max(shape.lengths)`), exact GELU, tied embeddings and
    dropout off. The parameter counts then differ only by what the architectures differ in: GPT-2
    learns its position embeddings (positions x width; ours are sinusoidal, no parameters); a
    zformer layer adds its scale s (1), a fastformer layer its W_r with bias (D^2 + D) and two
    pooling vectors (2 D). LayerNorms, biases and the tied LM head are the same on both sides."""
    positions = max(shape.lengths)
    if model == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=shape.vocab, n_positions=positions, n_embd=shape.width, n_layer=shape.layers,
            n_head=shape.heads, n_inner=shape.ffn, activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
            attn_implementation="sdpa",
        )
        return GPT2LMHeadModel(config), "transformers GPT2LMHeadModel (sdpa, learned positions)"
    if model not in CAUSAL_MODELS:
        raise ValueError(f"unknown causal model {model!r}; choose from {list(CAUSAL_MODELS)}")
    from hf_zformer.modeling.modeling_zformer import ZformerForCausalLM

    config = ZformerConfig(
        vocab_size=shape.vocab, hidden_size=shape.width, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, intermediate_size=shape.ffn, max_position_embeddings=positions,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attention_type=model, attn_implementation="sdpa",
    )
    return enable_cpu_speedups(ZformerForCausalLM(config)), f"ZformerForCausalLM: {shape.layers} causal {model} layers"


def cache_bytes(cache) -> int:
    """Bytes held by the tensors of a generation cache: keys/values of transformers' `DynamicLayer`s
    (GPT-2, our `full` layers), the fixed-size states of our `zformer` / `fastformer` layers."""
    total = 0
    for layer in cache.layers:
        if hasattr(layer, "tensors"):
            tensors = layer.tensors()
        else:
            tensors = [layer.keys, layer.values] if getattr(layer, "is_initialized", False) else []
        total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total


def _attention_type(model: str) -> str:
    return "full" if model == "gpt2" else model


def _token_flops(model: str, context: int, shape: CausalShape, config) -> int:
    """Nominal forward FLOPs of one new token in one layer that attends to `context` tokens:
    attention (`token_attention_flops`), output projection 2 D^2, FFN 4 D I."""
    return token_attention_flops(_attention_type(model), context, shape.width, shape.heads, config) + dense_flops(
        1, 1, shape.width, shape.ffn)


def causal_flops(model: str, kind: str, length: int, shape: CausalShape, config=None) -> int:
    """Nominal FLOPs (the design's equations, `flops.attention_flops`; embeddings, LayerNorms and
    softmax ignored; full attention counts its whole N x N product, as GPT-2's fused kernel may)
    of one timed call. train: 3 x the forward over batch x length (layers + LM head 2 N D V).
    generate: the forward of the prompt (half the length) and one token step for each further
    generated token, each with its LM head; the prompt's LM head is counted once (last position)."""
    config = config if config is not None else ZformerConfig(
        hidden_size=shape.width, num_attention_heads=shape.heads, attention_type=_attention_type(model))
    b, d = shape.batch, shape.width
    head = 2 * d * shape.vocab
    n = length if kind == "train" else length // 2  # the prompt, when generating
    forward = shape.layers * layer_flops(_attention_type(model), b, n, d, shape.heads, shape.ffn, config)
    if kind == "train":
        return 3 * (forward + b * n * head)
    steps = sum(shape.layers * _token_flops(model, context, shape, config) + head for context in range(n + 1, length))
    return forward + b * head + b * steps


def causal_benchmark(models: Iterable[str], shape: CausalShape, device: str = "cpu", dtype: str = "fp32",
                     warmup: int = 1, repeats: int = 5, progress: bool = True) -> list[CausalResult]:
    """For each length: training steps (forward, backward, AdamW step on random ids of batch x
    length) and greedy generation from a prompt of half the length to the full length (EOS
    suppressed with `min_new_tokens`, so every model does the same work; the cache on), all models
    side by side: their timed calls alternate, so load from other processes hits all alike."""
    models = list(models)
    device_ = torch.device(device)
    autocast_dtype = DTYPES[dtype]
    use_autocast = autocast_dtype != torch.float32
    generator = torch.Generator().manual_seed(0)
    ids = {n: torch.randint(3, shape.vocab, (shape.batch, n), generator=generator).to(device_) for n in shape.lengths}
    runners = build_runners(models, build_causal, shape, device_)
    cache_sizes: dict[tuple[str, int], int] = {}

    def train_step(name, n):
        optimizer_step(*runners[name][::2], autocast_dtype, input_ids=ids[n], labels=ids[n])

    def generate(name, n):
        model, prompt, new = runners[name][0], ids[n][:, : n // 2], n - n // 2
        model.eval()
        with torch.inference_mode(), torch.autocast(device_.type, dtype=autocast_dtype, enabled=use_autocast):
            output = model.generate(
                input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new,
                num_beams=1, do_sample=False, use_cache=True, return_dict_in_generate=True, pad_token_id=0,
            )
        cache_sizes[name, n] = cache_bytes(getattr(output, CACHE_FIELD))

    functions = {}
    for n in shape.lengths:
        functions[f"train {n}"] = lambda name, n=n: train_step(name, n)
        functions[f"generate {n}"] = lambda name, n=n: generate(name, n)
    times = time_alternating(functions, models, warmup, repeats, device_, progress, desc="causal")
    results = []
    for name in models:
        model, description, _ = runners[name]
        for key, seconds in times[name].items():
            kind, n = key.split()[0], int(key.split()[1])
            results.append(_result(name, model, description, kind, n, shape, dtype, device, seconds,
                                   cache_sizes.get((name, n)) if kind == "generate" else None))
    ratios_to_baseline(results, "gpt2", lambda r: (r.kind, r.length), {
        "speedup_vs_gpt2": "tokens_per_s", "flops_ratio_vs_gpt2": "flops"})
    return results


def _result(name, model, description, kind, n, shape, dtype, device, seconds, cache) -> CausalResult:
    median = statistics.median(seconds)
    prompt, new = (n // 2, n - n // 2) if kind == "generate" else (None, None)
    config = model.config if name != "gpt2" else None
    return CausalResult(
        model=name, description=description, parameters=sum(p.numel() for p in model.parameters()), kind=kind,
        length=n, prompt_length=prompt, new_tokens=new, **shape.size(), dtype=dtype, device=device, time_ms=median * 1e3,
        tokens_per_s=shape.batch * (n if kind == "train" else new) / median,
        flops=causal_flops(name, kind, n, shape, config),
        cache_mb=None if cache is None else cache / 2**20, times_ms=[t * 1e3 for t in seconds],
    )
