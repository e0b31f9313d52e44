"""Sequence-classification level of the benchmark: our `ZformerForSequenceClassification` (full,
zformer, fastformer, optionally xformer attention) against transformers'
`BertForSequenceClassification` of identical size, side by side: inference and training tokens/s
over lengths, with nominal (and executed) FLOP ratios next to the time ratios."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from hf_zformer.cpu_speedups import enable_cpu_speedups
from hf_zformer.modeling.configuration_zformer import ZformerConfig
from .cases import DTYPES, ModelRow, ModelShape, folds_under_autocast, ratios_to_baseline
from .flops import model_flops, step_flops
from .seq2seq import build_runners, optimizer_step, time_alternating

#: Our models that are one attention type with options: name -> (attention type, config fields).
#: "zformer-hedgehog": the learned feature map; "fastformer-conv5": a 5-tap input convolution per layer.
CLASSIFICATION_VARIANTS = {
    "zformer-hedgehog": ("zformer", {"zformer_feature_map": "hedgehog"}),
    "fastformer-conv5": ("fastformer", {"encoder_conv_size": 5}),
}
CLASSIFICATION_MODELS = ("bert", "full", "zformer", "zformer-hedgehog", "xformer", "fastformer", "fastformer-conv5")
CLASSIFICATION_KINDS = ("forward", "train")


@dataclass
class ClassificationShape(ModelShape):
    batch: int = 8
    lengths: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096)
    labels: int = 2


@dataclass
class ClassificationResult(ModelRow):
    kind: str  # "forward": under inference_mode, eval(); "train": forward with labels, backward, AdamW step
    length: int
    time_ms: float | None = None
    tokens_per_s: float | None = None  # batch x length / time
    speedup_vs_bert: float | None = None  # tokens/s over BERT's at the same kind and length
    flops: int | None = None  # nominal FLOPs of one timed call (`classification_flops`)
    flops_ratio_vs_bert: float | None = None  # flops / BERT's: the FLOP count alone predicts a 1/this speedup
    executed_flops: int | None = None  # what hf_zformer executes (folded zformer/fastformer forms: fewer)
    executed_flops_ratio_vs_bert: float | None = None
    times_ms: list = field(default_factory=list)


def _attention_type(model: str) -> str:
    if model in CLASSIFICATION_VARIANTS:
        return CLASSIFICATION_VARIANTS[model][0]
    return "full" if model == "bert" else model


def _zformer_config(model: str, shape: ClassificationShape) -> ZformerConfig:
    """Our config for `model` attention, matching BERT exactly where the config allows: post-LayerNorm
    layers, embedding LayerNorm, 2 token types, learned positions, unscaled embeddings, BERT's
    LayerNorm epsilon, exact GELU, and BERT's pooler (first token, dense, tanh) before the classifier."""
    return ZformerConfig(
        vocab_size=shape.vocab, hidden_size=shape.width, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, intermediate_size=shape.ffn, max_position_embeddings=max(shape.lengths),
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attention_type=_attention_type(model),
        num_labels=shape.labels, attn_implementation="sdpa", hidden_act="gelu", layer_norm_eps=1e-12,
        layer_norm_position="post", embedding_layer_norm=True, type_vocab_size=2, position_embedding_type="learned",
        scale_embedding=False, classifier_pooling="pooler", pooler_activation="tanh",
        **CLASSIFICATION_VARIANTS.get(model, (None, {}))[1],
    )


def build_classifier(model: str, shape: ClassificationShape):
    """(model, description): transformers' `BertForSequenceClassification` (SDPA, dropout off, exact
    GELU, `max_position_embeddings` = the longest length), or our `ZformerForSequenceClassification`
    with `model` attention in every layer and BERT's architecture around it (`_zformer_config`):
    with `full` attention the two have the same parameters, one for one."""
    if model == "bert":
        from transformers import BertConfig, BertForSequenceClassification

        config = BertConfig(
            vocab_size=shape.vocab, hidden_size=shape.width, num_hidden_layers=shape.layers,
            num_attention_heads=shape.heads, intermediate_size=shape.ffn, hidden_act="gelu",
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=max(shape.lengths),
            type_vocab_size=2, num_labels=shape.labels, pad_token_id=0, attn_implementation="sdpa",
        )
        return BertForSequenceClassification(config), "transformers BertForSequenceClassification (sdpa)"
    if model not in CLASSIFICATION_MODELS:
        raise ValueError(f"unknown classification model {model!r}; choose from {list(CLASSIFICATION_MODELS)}")
    from hf_zformer.modeling.modeling_zformer import ZformerForSequenceClassification

    description = (f"ZformerForSequenceClassification: {shape.layers} {model} layers, BERT's post-LayerNorm, "
                   "embeddings (LayerNorm, token types, learned positions) and tanh pooler")
    return enable_cpu_speedups(ZformerForSequenceClassification(_zformer_config(model, shape))), description


def classification_flops(model: str, kind: str, length: int, shape: ClassificationShape, config=None,
                         executed: bool = False, dtype: str = "fp32", device: str = "cpu") -> int:
    """FLOPs of one timed call on batch x length tokens: per encoder layer attention
    (`attention_flops`, or with `executed` the `executed_attention_flops` that hf_zformer runs:
    folded zformer/fastformer forms on long fp32 inputs) + output projection 2 B N D^2 (folded
    into the attention's per-sequence map when folded and N > D: 2 B D^3) + FFN 4 B N D I
    (`flops.model_flops`, with an input convolution where the config has one); then the pooler
    2 B D^2 and the classifier 2 B D labels. Embeddings, LayerNorms, softmax and the loss ignored;
    train = 3 x forward. BERT counts as `full`."""
    config = config if config is not None else _zformer_config(model, shape)
    b, d = shape.batch, shape.width
    attention_type = _attention_type(model)
    layer = model_flops(attention_type, b, length, d, shape.heads, config, executed=executed, dtype=dtype,
                        under_autocast=folds_under_autocast(attention_type, torch.device(device).type))
    forward = shape.layers * layer + 2 * b * d * d + 2 * b * d * shape.labels
    return step_flops(forward, kind)


def classification_benchmark(models: Iterable[str], shape: ClassificationShape,
                             kinds: Iterable[str] = CLASSIFICATION_KINDS, device: str = "cpu", dtype: str = "fp32", warmup: int = 1, repeats: int = 5,
                             progress: bool = True) -> list[ClassificationResult]:
    """For each length and kind: `forward` (model.eval(), under `torch.inference_mode`) or `train`
    (model.train(), forward with labels, backward, AdamW step), on random token ids with an
    all-ones attention mask (passed, as users do) and random labels; all models side by side:
    their timed calls alternate, so load from other processes hits all alike."""
    models, kinds = list(models), list(kinds)
    device_ = torch.device(device)
    autocast_dtype = DTYPES[dtype]
    use_autocast = autocast_dtype != torch.float32
    generator = torch.Generator().manual_seed(0)
    ids = {n: torch.randint(3, shape.vocab, (shape.batch, n), generator=generator).to(device_) for n in shape.lengths}
    labels = torch.randint(0, shape.labels, (shape.batch,), generator=generator).to(device_)
    runners = build_runners(models, build_classifier, shape, device_)

    def forward(name, n):
        model = runners[name][0]
        model.eval()
        with torch.inference_mode(), torch.autocast(device_.type, dtype=autocast_dtype, enabled=use_autocast):
            model(input_ids=ids[n], attention_mask=torch.ones_like(ids[n]))

    def train_step(name, n):
        optimizer_step(*runners[name][::2], autocast_dtype, input_ids=ids[n], attention_mask=torch.ones_like(ids[n]),
                    labels=labels)

    calls = {"forward": forward, "train": train_step}
    functions = {f"{kind} {n}": (lambda name, n=n, call=calls[kind]: call(name, n))
                 for n in shape.lengths for kind in kinds}
    times = time_alternating(functions, models, warmup, repeats, device_, progress, desc="classification")
    results = []
    for key in functions:
        kind, n = key.split()[0], int(key.split()[1])
        for name in models:
            results.append(_result(name, *runners[name][:2], kind, n, shape, dtype, device, times[name][key]))
    ratios_to_baseline(results, "bert", lambda r: (r.kind, r.length), {
        "speedup_vs_bert": "tokens_per_s", "flops_ratio_vs_bert": "flops",
        "executed_flops_ratio_vs_bert": "executed_flops"})
    return results


def _result(name, model, description, kind, n, shape, dtype, device, seconds) -> ClassificationResult:
    median = statistics.median(seconds)
    config = _zformer_config(name, shape)
    return ClassificationResult(
        model=name, description=description, parameters=sum(p.numel() for p in model.parameters()), kind=kind,
        length=n, **shape.size(), dtype=dtype, device=device, time_ms=median * 1e3,
        tokens_per_s=shape.batch * n / median,
        flops=classification_flops(name, kind, n, shape, config),
        executed_flops=classification_flops(name, kind, n, shape, config, executed=True, dtype=dtype, device=device),
        times_ms=[t * 1e3 for t in seconds],
    )
