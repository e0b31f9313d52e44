"""Warm start: turn a pretrained BERT-family checkpoint (BERT, RoBERTa, DistilBERT; MiniLM is a
BERT) into a Zformer-family model, ready to fine-tune.

>>> model = convert_pretrained("sentence-transformers/all-MiniLM-L6-v2", attention_type="fastformer",
...                            output_dir="runs/minilm-fastformer", task="text-classification",
...                            classifier_pooling="mean")

The architecture options of `ZformerConfig` (post-LayerNorm layers, token types, embedding
LayerNorm, learned positions with RoBERTa's offset, BERT's pooler) express these encoders exactly,
so with `attention_type="full"` the converted model computes what the source computes. The other
attention types reuse what maps (see `_copy_attention`) and initialise the rest; docs/warm_start.md
has the mapping table and the reasons for every choice. Converted layers are then calibrated to the
size of the softmax attention they replace (`calibrate_zformer_scales`, `calibrate_fastformer_sizes`)
and, with `distillation=`, fitted to it (`hf_zformer.conversion.distillation`).
"""

from __future__ import annotations

import logging
import math
import os

import torch
from torch import nn

from ..hub import DISTILLATION_SETTINGS, model_card
from ..modeling import ZformerConfig
from .distillation import Distillation, encoder_attention_calls, distill_attention
from .common import CALIBRATION_TEXT, DECODER_SOURCE_TYPES, check_conversion_output, save_converted

logger = logging.getLogger(__name__)

SOURCE_MODEL_TYPES = ("bert", "roberta", "distilbert", "zformer")
# a Zformer-family source must be one of these, with full attention in every layer (the softmax reference)
ZFORMER_SOURCE_ARCHITECTURES = ("ZformerModel", "ZformerForSequenceClassification", "ZformerForMaskedLM")
# config fields of a Zformer-family source that do not carry over: they describe the saved folder, or
# (attention_type) are what the conversion sets anew
_FOLDER_FIELDS = ("architectures", "model_type", "transformers_version", "auto_map", "_name_or_path", "dtype",
                  "torch_dtype", "attention_type")
TASKS = ("feature-extraction", "text-classification", "fill-mask", "text-generation")

def task_of_architecture(architectures: list[str] | None) -> str:
    """The task of a source checkpoint from `config.architectures`: "text-classification"
    (`*ForSequenceClassification`), "fill-mask" (`*ForMaskedLM`, `*ForPreTraining`) or
    "feature-extraction" (the bare model, or anything else: only the encoder carries over)."""
    name = (architectures or [""])[0]
    if name.endswith("ForSequenceClassification"):
        return "text-classification"
    if name.endswith(("ForMaskedLM", "ForPreTraining")):
        return "fill-mask"
    return "feature-extraction"


def _auto_class(task: str):
    from transformers import AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification

    return {
        "feature-extraction": AutoModel,
        "text-classification": AutoModelForSequenceClassification,
        "fill-mask": AutoModelForMaskedLM,
    }[task]


# config fields the source's weight shapes decide: an override would make the copy fail (or mean nothing)
WEIGHT_SHAPE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
                       "max_position_embeddings", "type_vocab_size")
# config fields that decide what the source's weights compute outside the attention: another value would make
# the converted model (with attention_type="full", the "exact" copy) a different function of the same weights
COMPUTATION_FIELDS = ("hidden_act", "layer_norm_eps", "position_embedding_type", "position_offset", "scale_embedding",
                      "layer_norm_position", "embedding_layer_norm", "pooler_activation", "tie_word_embeddings")


def zformer_config(source_config, attention_type, task: str, has_pooler: bool, classifier_pooling=None,
                   num_labels=None, **overrides) -> ZformerConfig:
    """The `ZformerConfig` that expresses `source_config` (a BERT, RoBERTa or DistilBERT config, or a
    full-attention `ZformerConfig`) with the given attention type(s); `overrides` (config fields) win.
    `classifier_pooling` defaults to the source's pooling for a Zformer-family source; for the BERT
    family to "pooler" when the converted classifier carries a trained pooler (`has_pooler`), else "mean"."""
    family = source_config.model_type
    if family == "zformer":  # a fine-tuned full-attention model of ours: every architecture option carries over
        fields = {key: value for key, value in source_config.to_dict().items() if key not in _FOLDER_FIELDS}
        fields["classifier_pooling"] = classifier_pooling or source_config.classifier_pooling
    elif family == "distilbert":
        fields = dict(
            hidden_size=source_config.dim, num_hidden_layers=source_config.n_layers,
            num_attention_heads=source_config.n_heads, intermediate_size=source_config.hidden_dim,
            hidden_act=source_config.activation, hidden_dropout_prob=source_config.dropout,
            attention_probs_dropout_prob=source_config.attention_dropout, layer_norm_eps=1e-12,
            type_vocab_size=0, classifier_dropout=source_config.seq_classif_dropout, pooler_activation="relu",
        )
    else:
        fields = {name: getattr(source_config, name) for name in (
            "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act",
            "hidden_dropout_prob", "attention_probs_dropout_prob", "layer_norm_eps", "type_vocab_size",
            "classifier_dropout",
        )}
        fields["pooler_activation"] = "tanh"
        # RoBERTa's positions start at padding_idx + 1 (create_position_ids_from_input_ids)
        fields["position_offset"] = source_config.pad_token_id + 1 if family == "roberta" else 0
    if task == "text-classification":
        if task_of_architecture(source_config.architectures) == task and num_labels in (None, source_config.num_labels):
            fields.update(id2label=source_config.id2label, label2id=source_config.label2id)
            fields["problem_type"] = source_config.problem_type
        else:
            fields.pop("id2label", None), fields.pop("label2id", None)
            fields["num_labels"] = num_labels or 2
    if family == "zformer":
        fields.update(attention_type=attention_type, xformer_alpha=1)
    else:
        fields.update(_bert_family_fields(source_config, attention_type, has_pooler, classifier_pooling))
    from transformers import AutoConfig

    model_type = "fastformer" if overrides.get("attention_type", fields["attention_type"]) == "fastformer" else "zformer"
    source = AutoConfig.for_model(model_type, **fields)  # the source's values, defaults filled in
    for key, value in overrides.items():
        if key in WEIGHT_SHAPE_FIELDS + COMPUTATION_FIELDS and value != getattr(source, key):
            why = "the pretrained weights fix it" if key in WEIGHT_SHAPE_FIELDS else \
                "it changes what the pretrained weights compute"
            raise ValueError(f"{key}={value!r} cannot be set when converting: {why} ({key}={getattr(source, key)!r} "
                             "in the source)")
    return AutoConfig.for_model(model_type, **{**fields, **overrides})


def _bert_family_fields(source_config, attention_type, has_pooler: bool, classifier_pooling) -> dict:
    """The `ZformerConfig` options that express a BERT, RoBERTa or DistilBERT encoder exactly."""
    return dict(
        vocab_size=source_config.vocab_size,
        max_position_embeddings=source_config.max_position_embeddings,
        initializer_range=source_config.initializer_range,
        pad_token_id=source_config.pad_token_id,
        bos_token_id=getattr(source_config, "bos_token_id", None),
        eos_token_id=getattr(source_config, "eos_token_id", None),
        decoder_start_token_id=None,
        attention_type=attention_type,
        position_embedding_type="learned",
        scale_embedding=False,
        layer_norm_position="post",
        embedding_layer_norm=True,
        activation_dropout=0.0,  # BERT-family FFNs have no dropout after the activation
        classifier_pooling=classifier_pooling or ("pooler" if has_pooler else "mean"),
        tie_word_embeddings=getattr(source_config, "tie_word_embeddings", True),
        xformer_alpha=1,  # full-width xformer queries: the pretrained W_q maps onto them
    )


def _check_source(config, model_name_or_path):
    if config.model_type not in SOURCE_MODEL_TYPES:
        raise ValueError(
            f"{model_name_or_path} is a {config.model_type!r} model; convert_pretrained reads "
            f"{list(SOURCE_MODEL_TYPES)} checkpoints (BertModel, RobertaModel, DistilBertModel and their heads, "
            f"or a full-attention {list(ZFORMER_SOURCE_ARCHITECTURES)}) and {list(DECODER_SOURCE_TYPES)} causal LMs"
        )
    if config.model_type == "zformer":
        architecture = (config.architectures or ["ZformerModel"])[0]
        if architecture not in ZFORMER_SOURCE_ARCHITECTURES:
            raise ValueError(f"{model_name_or_path} is a {architecture}; only encoders convert "
                             f"({list(ZFORMER_SOURCE_ARCHITECTURES)})")
        types = config.layer_attention_types()
        if set(types) != {"full"}:
            raise ValueError(f"{model_name_or_path} has attention_type={types}; a Zformer-family source needs full "
                             "attention in every layer (the softmax attention the new layers are fitted to)")
        return
    if getattr(config, "position_embedding_type", "absolute") != "absolute":
        raise ValueError(
            f"{model_name_or_path} has position_embedding_type={config.position_embedding_type!r}; only "
            f"absolute (learned) positions convert"
        )
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        raise ValueError(f"{model_name_or_path} is a decoder (is_decoder/add_cross_attention); only encoders convert")


def _encoder_parts(base, family):
    """(embedding modules, per-layer modules) of a source base model, by our names."""
    if family == "zformer":  # the attention maps as for BERT; the rest carries over by name (`copy_weights`)
        return {}, [dict(query=layer.attention.query, key=layer.attention.key, value=layer.attention.value,
                         attention_output=layer.attention.output) for layer in base.encoder.layers]
    embeddings = base.embeddings
    parts = {
        "word_embeddings": embeddings.word_embeddings,
        "position_embeddings": embeddings.position_embeddings,
        "token_type_embeddings": getattr(embeddings, "token_type_embeddings", None),
        "layer_norm": embeddings.LayerNorm,
    }
    layers = []
    if family == "distilbert":
        for layer in base.transformer.layer:
            attention = layer.attention
            layers.append(dict(
                query=attention.q_lin, key=attention.k_lin, value=attention.v_lin, attention_output=attention.out_lin,
                attention_norm=layer.sa_layer_norm, intermediate=layer.ffn.lin1, output=layer.ffn.lin2,
                feed_forward_norm=layer.output_layer_norm,
            ))
    else:
        for layer in base.encoder.layer:
            attention = layer.attention
            layers.append(dict(
                query=attention.self.query, key=attention.self.key, value=attention.self.value,
                attention_output=attention.output.dense, attention_norm=attention.output.LayerNorm,
                intermediate=layer.intermediate.dense, output=layer.output.dense,
                feed_forward_norm=layer.output.LayerNorm,
            ))
    return parts, layers


def _head_parts(source, family, source_task):
    """The source's task-head modules by our names: `pooler` / `classifier` (classification),
    `lm_dense` / `lm_layer_norm` / `lm_bias` / `lm_decoder` (masked LM)."""
    if family == "zformer":  # its head carries over by name (`_copy_outside_attention`)
        return {"pooler": None}
    base = source.base_model
    parts = {"pooler": getattr(getattr(base, "pooler", None), "dense", None)}  # BERT's (and RoBERTa's) NSP pooler
    if source_task == "text-classification":
        if family == "bert":
            parts.update(classifier=source.classifier)
        elif family == "roberta":  # dropout, dense, tanh, dropout, out_proj: the "pooler" pooling
            parts.update(pooler=source.classifier.dense, classifier=source.classifier.out_proj)
        else:
            parts.update(pooler=source.pre_classifier, classifier=source.classifier)
    elif source_task == "fill-mask":
        if family == "bert":
            head = source.cls.predictions
            parts.update(lm_dense=head.transform.dense, lm_layer_norm=head.transform.LayerNorm,
                         lm_bias=head.bias, lm_decoder=head.decoder)
        elif family == "roberta":
            head = source.lm_head
            parts.update(lm_dense=head.dense, lm_layer_norm=head.layer_norm, lm_bias=head.bias, lm_decoder=head.decoder)
        else:
            parts.update(lm_dense=source.vocab_transform, lm_layer_norm=source.vocab_layer_norm,
                         lm_bias=source.vocab_projector.bias, lm_decoder=source.vocab_projector)
    return parts


def _copy(target: nn.Module, source: nn.Module):
    """Copy every parameter of `source` into the same-named parameter of `target` (shapes checked)."""
    target.load_state_dict(source.state_dict(), strict=True)


def _copy_attention(layer, parts):
    """Pretrained attention weights into a layer of any attention type:

    - full, zformer: W_q, W_k, W_v (same roles, same shapes); zformer's scale s is set afterwards by
      `calibrate_zformer_scales`. With `zformer_feature_map="hedgehog"` the feature maps keep their
      init, the identity (W = I, b = 0), and there is no scale.
    - fastformer: W_q, W_k, W_v become the query, key and value projections (the query is pooled into
      the global query, the key mixed with it, the value modulated by the global key); the pooling
      vectors w_q, w_k start at zero, so both poolings start as the plain mean over real tokens (no
      token favoured before training says which); W_r (no pretrained counterpart) keeps its fresh init.
    - xformer: keys are projected from the queries and values are the unprojected inputs, so only
      W_q maps (at xformer_alpha=1, full width); W_k and W_v have no place, and the sequence
      projection E keeps its fresh init.

    The output projection W_o maps for every type (`attention.output`)."""
    attention = layer.attention
    names = ("query",) if layer.attention_type == "xformer" else ("query", "key", "value")
    for name in names:
        target = getattr(attention, name)
        if target is not None and target.weight.shape == parts[name].weight.shape:
            _copy(target, parts[name])
        elif target is not None:
            logger.warning(f"layer {attention.layer_idx}: {name} has shape {tuple(target.weight.shape)}, the "
                           f"source's {tuple(parts[name].weight.shape)}: left at its fresh init")
    if layer.attention_type == "fastformer" and attention.additive:
        with torch.no_grad():
            attention.query_score.zero_()
            attention.key_score.zero_()
    _copy(layer.attention.output, parts["attention_output"])


def _copy_outside_attention(target, source):
    """Every parameter and buffer of `target` outside its attention modules from the same-named one of
    `source`, a Zformer-family model (the base model's prefix aside), so every architecture option
    (final LayerNorm, convolutions, pooling, heads) carries over. A tensor without a same-shaped
    counterpart (another number of labels, another pooling) keeps its fresh init, with a warning;
    an input convolution the source lacks (`encoder_conv_size` added) starts as the identity,
    silently: the model then computes what the source did."""
    target_prefix, source_prefix = target.base_model_prefix + ".", source.base_model_prefix + "."
    source_state = {(target_prefix + key[len(source_prefix):] if key.startswith(source_prefix) else key): value
                    for key, value in source.state_dict().items()}
    fresh = []
    with torch.no_grad():
        for name, tensor in target.state_dict().items():
            if ".attention." in name:
                continue
            if name in source_state and source_state[name].shape == tensor.shape:
                tensor.copy_(source_state[name])
            elif name in source_state or ".short_conv." not in name:  # a convolution new here starts as the identity
                fresh.append(name)
    if fresh:
        logger.warning(f"no counterpart in the source, left at their fresh init: {fresh}")


def copy_weights(target, source, family: str, source_task: str) -> dict[str, str]:
    """Copy the encoder and the task head of `source` into `target` (built from `zformer_config`).
    Returns the head parts of `target` the source has no weights for (they keep their random
    initial values), each with the reason."""
    base = target.base_model
    parts, source_layers = _encoder_parts(source.base_model, family)
    if family == "zformer":
        _copy_outside_attention(target, source)
        for layer, layer_parts in zip(base.encoder.layers, source_layers):
            _copy_attention(layer, layer_parts)
        return {}
    for name, module in parts.items():
        if module is not None:
            _copy(getattr(base.embeddings, name), module)
    for layer, layer_parts in zip(base.encoder.layers, source_layers):
        _copy_attention(layer, layer_parts)
        for name in ("attention_norm", "feed_forward_norm"):
            _copy(getattr(layer, name), layer_parts[name])
        _copy(layer.feed_forward.intermediate, layer_parts["intermediate"])
        _copy(layer.feed_forward.output, layer_parts["output"])

    head = _head_parts(source, family, source_task)
    fresh = {}
    pooler = getattr(target, "pooler", None)
    if pooler is not None and pooler.mode == "pooler":
        if head["pooler"] is not None:
            _copy(pooler.dense, head["pooler"])
        else:
            fresh["pooler"] = "the source has no trained pooler (classifier_pooling=\"pooler\")"
    if hasattr(target, "classifier"):
        if "classifier" not in head:
            fresh["classifier"] = f"the source is a {source_task} model, without a classifier"
        elif target.classifier.weight.shape == head["classifier"].weight.shape:
            _copy(target.classifier, head["classifier"])
        else:  # another number of labels: a new classifier (the pooler still carries over)
            fresh["classifier"] = (f"the source classifier has {head['classifier'].out_features} labels, the "
                                   f"converted model {target.classifier.out_features}")
    if hasattr(target, "lm_head") and "lm_dense" not in head:
        fresh["lm_head"] = f"the source is a {source_task} model, without a masked-LM head"
    if "lm_dense" in head and hasattr(target, "lm_head"):
        lm_head = target.lm_head
        _copy(lm_head.dense, head["lm_dense"])
        _copy(lm_head.layer_norm, head["lm_layer_norm"])
        with torch.no_grad():
            lm_head.bias.copy_(head["lm_bias"])
            if not target.config.tie_word_embeddings:
                lm_head.decoder.weight.copy_(head["lm_decoder"].weight)
    return fresh


def masked_rms(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Root mean square of x (B, N, D) over the real tokens of mask (B, N)."""
    weights = mask.to(x.dtype)[..., None]
    return ((x.square() * weights).sum() / (weights.sum() * x.shape[-1])).sqrt()


def attention_inputs(reference, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[int, torch.Tensor]:
    """The input of every attention layer of `reference` on the calibration batch, by layer index."""
    return {i: call.args[0] for i, call in encoder_attention_calls(reference, input_ids, attention_mask).items()}


@torch.no_grad()
def calibrate_zformer_scales(target, reference, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[float]:
    """Set the scale s of every zformer layer of `target` so that its attention output has the
    root-mean-square size of the softmax attention it replaces, on the calibration batch.

    Softmax attention returns a convex combination of the values, whatever the length; Zformer's
    `Q (K^T V) / s` is a sum over all N tokens of (q.k/sqrt(d_h)) v, which grows with N and with the
    typical score. A fixed s (Zformer_Pytorch's 700) is thus off by orders of magnitude for a pretrained
    model, and the residual stream after the layer would be far from what the pretrained FFN and
    LayerNorms expect. Matching sizes on real text (`CALIBRATION_TEXT`, ~128 tokens) at each layer's
    input in `reference` (the exact full-attention copy) starts s where the layer's output is of the
    right magnitude; s stays learnable (log-parametrised), so fine-tuning on other lengths adapts it.
    Layers with a feature map (`zformer_feature_map="hedgehog"`) have no s and are skipped: their
    normalised outputs are convex combinations of the values, of the right size from the start.
    Returns the scales, one per zformer layer that has one."""
    inputs = attention_inputs(reference, input_ids, attention_mask)
    scales = []
    for i, layer in enumerate(target.base_model.encoder.layers):
        if layer.attention_type != "zformer" or layer.attention.log_scale is None:
            continue
        x = inputs[i]
        softmax_context = reference.base_model.encoder.layers[i].attention.context(x, attention_mask)
        layer.attention.log_scale.zero_()  # s = 1
        linear_context = layer.attention.context(x, attention_mask)
        scale = float(masked_rms(linear_context, attention_mask) / masked_rms(softmax_context, attention_mask).clamp_min(1e-12))
        layer.attention.log_scale.fill_(math.log(max(scale, 1e-6)))
        scales.append(scale)
    return scales


@torch.no_grad()
def calibrate_fastformer_sizes(target, reference, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                               rounds: int = 3) -> list[float]:
    """Scale W_q (weight and bias) of every fastformer layer of `target` so that its attention output
    has the root-mean-square size of the softmax attention it replaces, on the calibration batch.

    With BERT's W_q copied, the residual `q_i` of `r_i = W_r u_i + q_i` is a query vector, several
    times larger than an attention output (all-MiniLM-L6-v2: 5x) and dominated by a direction all
    tokens share (the query bias). Fed into W_o and the post-LayerNorm, it swamped the residual
    stream: every review's mean-pooled embedding came out nearly the same (mean cosine 0.996
    between reviews, 0.37 for the source) and fine-tuning on IMDB stayed at chance. Shrinking the
    query scales the whole output (the global query, the mixed keys and, through them, `u_i`); with
    zero pooling vectors and W_r's zero bias (their initial values) the output is proportional to
    the factor, otherwise (shared query/value, trained pooling vectors) a few rounds of matching
    converge. Returns the factors, one per fastformer layer."""
    inputs = attention_inputs(reference, input_ids, attention_mask)
    factors = []
    for i, layer in enumerate(target.base_model.encoder.layers):
        if layer.attention_type != "fastformer":
            continue
        x, attention = inputs[i], layer.attention
        target_size = masked_rms(reference.base_model.encoder.layers[i].attention.context(x, attention_mask), attention_mask)
        total = 1.0
        for _ in range(rounds):
            factor = float(target_size / masked_rms(attention.context(x, attention_mask), attention_mask).clamp_min(1e-12))
            attention.query.weight.mul_(factor)
            attention.query.bias.mul_(factor)
            total *= factor
        factors.append(total)
    return factors


def calibration_batch(tokenizer, config):
    """(input_ids, attention_mask) of `CALIBRATION_TEXT`, or of random tokens without a tokenizer."""
    length = min(128, config.max_position_embeddings - config.position_offset)
    if tokenizer is not None:
        encoded = tokenizer(CALIBRATION_TEXT, truncation=True, max_length=length, return_tensors="pt")
        return encoded["input_ids"], encoded["attention_mask"]
    ids = torch.randint(0, config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    return ids, torch.ones_like(ids)


def _load_tokenizer(model_name_or_path, vocab_size: int):
    """``(tokenizer, None)`` for the tokenizer at ``model_name_or_path``, or ``(None, why)`` when
    there is none to use: a folder without tokenizer files gives a nearly empty tokenizer in
    transformers 5 (5 special tokens), which would turn every word into [UNK]; one with more tokens
    than the model's vocabulary does not fit it."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_name_or_path)
    except (OSError, ValueError, TypeError) as error:
        return None, f"no tokenizer loads from it ({str(error).splitlines()[0]})"
    from ..tokenization import fits_vocabulary

    if not fits_vocabulary(tokenizer, vocab_size):
        return None, f"its tokenizer has {len(tokenizer)} tokens for the model's vocabulary of {vocab_size}"
    return tokenizer, None


def _fit_to_source(model, target_class, source, family: str, source_task: str, tokenizer,
                   distillation: Distillation | None):
    """Bring the converted layers of `model` (built with the Auto class `target_class`) close to the
    softmax attention of `source`: calibrate zformer scales and fastformer sizes, then distill when
    asked. Returns the distillation's report with its settings (`DISTILLATION_SETTINGS`), or None
    without a distillation."""
    config = model.config
    types = set(config.layer_attention_types())
    report = None
    # zformer / fastformer outputs start at the size of the softmax attention they replace; distillation
    # then fits every converted layer's output to it. Both compare with an exact full-attention copy.
    if types & {"zformer", "fastformer"} or distillation is not None:
        reference_config = config.to_dict()
        reference_config.update(attention_type="full", zformer_feature_map="identity")
        reference = target_class.from_config(type(config).from_dict(reference_config)).eval()
        copy_weights(reference, source, family, source_task)
        batch = calibration_batch(tokenizer, config)
        scales = calibrate_zformer_scales(model, reference, *batch) if "zformer" in types else []
        if scales:  # none either with a feature map (no scale s)
            config.zformer_scale_init = float(sorted(scales)[len(scales) // 2])  # for reference; each layer has its own
            logger.info(f"zformer scales s per layer: {[round(s, 2) for s in scales]}")
        if "fastformer" in types:
            factors = calibrate_fastformer_sizes(model, reference, *batch)
            logger.info(f"fastformer W_q factors per layer: {[round(f, 4) for f in factors]}")
        if distillation is not None:
            report = distill_attention(model, reference, tokenizer, distillation)
            report.update({key: getattr(distillation, key) for key in DISTILLATION_SETTINGS if key not in report})
    return report


def _source_config(model_name_or_path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_name_or_path)
    except OSError as error:
        raise ValueError(f"model_name_or_path={str(model_name_or_path)!r}: no model config found there "
                         f"({str(error).splitlines()[0]}); pass a folder written by save_pretrained or a Hub id "
                         "(the Hub needs network access)") from None


def _check_decoder_request(source_config, model_name_or_path, task, **encoder_options) -> None:
    """A causal LM converts for text generation, without the options of encoders."""
    if task not in (None, "text-generation"):
        raise ValueError(f"task={task!r}: {model_name_or_path} is a causal language model "
                         f"({source_config.model_type!r}); its task is 'text-generation'")
    refused = [name for name, value in encoder_options.items() if value is not None]
    if refused:
        raise ValueError(f"{refused} apply to encoders; a causal LM converts without them (attention transfer "
                         "for decoders: hf_zformer.conversion.decoder_transfer)")


def _source_tokenizer(model_name_or_path, tokenizer_name, vocab_size: int, distillation):
    """``(tokenizer, why there is none)``; a tokenizer asked for by name must load, and distilling needs one."""
    tokenizer, no_tokenizer = _load_tokenizer(tokenizer_name or model_name_or_path, vocab_size)
    if tokenizer is None and tokenizer_name is not None:  # asked for by name: its own problem, whatever runs
        raise ValueError(f"tokenizer_name={str(tokenizer_name)!r} (--tokenizer_name) is no tokenizer of this model: "
                         f"{no_tokenizer}; pass the tokenizer the source model was trained with")
    if tokenizer is None and distillation is not None:
        raise ValueError(f"{model_name_or_path} has no tokenizer of this model ({no_tokenizer}); distillation "
                         "tokenizes its texts with it: add the tokenizer files to the folder or pass "
                         "tokenizer_name (--tokenizer_name)")
    return tokenizer, no_tokenizer


def _load_source(model_name_or_path, source_task: str, source_config):
    """The source model (eval mode) with every weight of its architecture; a pooler the checkpoint
    lacks is dropped (nothing trained to carry over)."""
    try:
        source, loading = _auto_class(source_task).from_pretrained(
            model_name_or_path, dtype=torch.float32, output_loading_info=True
        )
    except Exception as error:  # no weight file, a truncated or corrupt one: name the folder and the cause
        from ..hub import weights_failure

        raise ValueError(f"model_name_or_path={str(model_name_or_path)!r}: its weights cannot be loaded "
                         f"({weights_failure(error)})") from error
    source.eval()
    missing = [key for key in loading["missing_keys"] if "pooler" not in key]
    if missing:
        raise ValueError(f"{model_name_or_path} lacks weights of its {source_config.architectures}: {missing[:5]}")
    if any("pooler" in key for key in loading["missing_keys"]):
        source.base_model.pooler = None  # built by BertModel but not in the checkpoint
    return source


def convert_pretrained(
    model_name_or_path: str | os.PathLike,
    attention_type: str | list[str] = "full",
    output_dir: str | os.PathLike | None = None,
    *,
    task: str | None = None,
    classifier_pooling: str | None = None,
    num_labels: int | None = None,
    base_model: str | None = None,
    overwrite: bool = False,
    distillation: Distillation | None = None,
    tokenizer_name: str | os.PathLike | None = None,
    **config_overrides,
):
    """Convert a BERT, RoBERTa or DistilBERT checkpoint (folder or Hub id) into a Zformer-family
    model with `attention_type` (one type or a list with one per layer), and return it (eval mode).
    A Llama, Mistral or Qwen2 causal LM (or `task="text-generation"`) becomes a
    `ZformerLlamaForCausalLM` instead (`hf_zformer.conversion.convert_decoder.convert_causal_lm`, which takes
    the same `output_dir`, `base_model`, `overwrite`, `tokenizer_name` and config overrides).

    Args:
        task: "feature-extraction" (`ZformerModel`), "text-classification"
            (`ZformerForSequenceClassification`) or "fill-mask" (`ZformerForMaskedLM`); by default the
            task of the source architecture (`config.architectures`). A head the source has carries
            over (BERT pooler + classifier, RoBERTa's classification head, DistilBERT's pre_classifier +
            classifier; BERT / RoBERTa / DistilBERT masked-LM heads); one it lacks starts fresh.
        classifier_pooling: pooling of a classifier; default "pooler" when a trained pooler carries
            over (BERT's NSP pooler or the source classifier's), else "mean". all-MiniLM-L6-v2 was
            trained with mean pooling: pass "mean".
        num_labels: classes of a new classifier (default: the source classifier's, else 2).
        output_dir: if given, the folder gets the config, safetensors weights, the model code
            (loads with trust_remote_code=True), the tokenizer and a model card (README.md).
        base_model: the Hub id named as `base_model` in the model card (default `model_name_or_path`;
            give the Hub id when converting from a local copy).
        distillation: after conversion, fit the new attention layers to the source's softmax
            attention on these unlabeled texts (`distill_attention`); the model card records the fit.
        tokenizer_name: the tokenizer saved with the model (folder or Hub id); default the source's.
            A source without a usable one is refused when distilling (the texts need it) and
            otherwise saved without a tokenizer, with a warning.
        config_overrides: further `ZformerConfig` fields (e.g. `xformer_beta=8`), applied last.
    """
    if output_dir is not None:  # before any work: a refusal after a long distillation would throw it away
        output_dir = check_conversion_output(output_dir, overwrite=overwrite, model_name_or_path=model_name_or_path,
                                             tokenizer_name=tokenizer_name)
    requested = config_overrides.get("attention_type", attention_type)
    if distillation is not None and set([requested] if isinstance(requested, str) else requested) == {"full"}:
        raise ValueError("distillation: every layer has full attention, which is the source's exactly; "
                         "there is nothing to distill (choose another attention_type)")
    source_config = _source_config(model_name_or_path)
    if task == "text-generation" or source_config.model_type in DECODER_SOURCE_TYPES:
        # a Llama-family causal LM: the decoder converter (hf_zformer.conversion.convert_decoder)
        _check_decoder_request(source_config, model_name_or_path, task, distillation=distillation,
                               classifier_pooling=classifier_pooling, num_labels=num_labels)
        from .convert_decoder import convert_causal_lm

        return convert_causal_lm(model_name_or_path, attention_type, output_dir, base_model=base_model,
                                 overwrite=overwrite, tokenizer_name=tokenizer_name, **config_overrides)
    _check_source(source_config, model_name_or_path)
    source_task = task_of_architecture(source_config.architectures)
    task = task or source_task
    if task not in TASKS:
        raise ValueError(f"task={task!r} is not supported; choose one of {list(TASKS)}")
    tokenizer, no_tokenizer = _source_tokenizer(model_name_or_path, tokenizer_name, source_config.vocab_size,
                                                distillation)
    source = _load_source(model_name_or_path, source_task, source_config)
    family = source_config.model_type
    has_pooler = task == "text-classification" and _head_parts(source, family, source_task)["pooler"] is not None
    config = zformer_config(source_config, attention_type, task, has_pooler, classifier_pooling, num_labels,
                            **config_overrides)
    target_class = _auto_class(task)
    model = target_class.from_config(config).eval()
    fresh = copy_weights(model, source, family, source_task)
    if fresh:
        logger.warning(f"{model_name_or_path}: the converted {type(model).__name__} starts with random "
                       f"{', '.join(fresh)} ({'; '.join(fresh.values())}); train it before use")
    if tokenizer is None and output_dir is not None:
        logger.warning(f"{model_name_or_path} has no tokenizer of this model ({no_tokenizer}): {output_dir} gets "
                       "none; pass tokenizer_name (--tokenizer_name) to include one")
    report = _fit_to_source(model, target_class, source, family, source_task, tokenizer, distillation)
    if output_dir is not None:
        card = model_card(config=config, task=task, base_model=str(base_model or model_name_or_path),
                          model_id=str(output_dir), distillation=report)
        save_converted(model, tokenizer, card, check_conversion_output(
            output_dir, overwrite=overwrite, model_name_or_path=model_name_or_path, tokenizer_name=tokenizer_name))
    return model
