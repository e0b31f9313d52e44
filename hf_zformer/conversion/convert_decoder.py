"""Conversion of Llama-family causal language models (Llama, SmolLM, Mistral, Qwen2) into
`ZformerLlamaForCausalLM`: the same modules and weight names with the attention chosen per layer.

>>> model = convert_causal_lm("HuggingFaceTB/SmolLM2-135M", attention_type="zformer", attention_window=64,
...                           output_dir="runs/smollm2-hedgehog")

Every weight of the source carries over by name (the models share Llama's layout); what is new is
only the linear attention's own parameters (Hedgehog feature maps, the identity map's scale, the
window share, Fastformer's pooling vectors and W_r), at their init. With `attention_type="full"`
the converted model computes the source's function. Identity-map zformer layers and fastformer
layers are then calibrated to the size of the softmax attention they replace (as for encoders,
`hf_zformer.conversion.convert`); Hedgehog layers need no calibration (normalised weights) and are fitted to
the source by attention transfer (`hf_zformer.conversion.decoder_transfer`). docs/decoders.md has the design.
"""

from __future__ import annotations

import copy
import logging
import math

import torch

from ..modeling import ZformerLlamaConfig, ZformerLlamaForCausalLM
from .common import (  # CALIBRATION_TEXT: the identity map's scale and fastformer's size are matched on it
    CALIBRATION_TEXT,
    DECODER_SOURCE_TYPES,
    check_conversion_output,
    save_converted,
)

logger = logging.getLogger(__name__)

# LlamaConfig fields that describe the source's architecture, copied as they are
_LLAMA_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range",
                 "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "pad_token_id", "bos_token_id",
                 "eos_token_id", "attention_bias", "mlp_bias")
# fields the source's weight shapes fix
_FIXED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "attention_bias", "mlp_bias")

# what a Llama checkpoint lacks: the new attention parameters (and o_proj's bias, zero, for Qwen2)
NEW_PARAMETERS = ("query_map.weight", "query_map.bias", "key_map.weight", "key_map.bias", "log_scale", "window_gate",
                  "log_horizon", "query_score", "key_score", "transform.weight", "o_proj.bias")


def zformer_llama_config(source_config, attention_type="full", **overrides) -> ZformerLlamaConfig:
    """The `ZformerLlamaConfig` that expresses `source_config` (a Llama, Mistral or Qwen2 config)
    with `attention_type` (one type or one per layer); `overrides` (config fields) win, except those
    the weights fix."""
    family = source_config.model_type
    if family not in DECODER_SOURCE_TYPES:
        raise ValueError(f"a {family!r} model cannot be converted to a Llama-family decoder; the sources are "
                         f"{list(DECODER_SOURCE_TYPES)} (SmolLM checkpoints are 'llama')")
    fields = {name: getattr(source_config, name) for name in _LLAMA_FIELDS if hasattr(source_config, name)}
    if family == "qwen2":  # biases on q, k and v, none on o (its bias is added as zeros)
        fields.update(attention_bias=True, mlp_bias=False)
        types = set(getattr(source_config, "layer_types", None) or [])
        if getattr(source_config, "use_sliding_window", False) or "sliding_attention" in types:
            raise ValueError("the Qwen2 source uses sliding-window attention (use_sliding_window / layer_types); "
                             "only sources with full causal attention in every layer convert exactly")
    if family == "mistral":
        fields.update(attention_bias=False, mlp_bias=False)
        window = getattr(source_config, "sliding_window", None)
        if window is not None and window < source_config.max_position_embeddings:
            logger.warning(f"the Mistral source attends to the last sliding_window={window} tokens; the converted "
                           "full layers attend to all of them: the same function up to that length")
    for key, value in overrides.items():
        if key in _FIXED_FIELDS and value != fields.get(key):
            raise ValueError(f"{key}={value!r} cannot be set when converting: the pretrained weights fix it "
                             f"({key}={fields.get(key)!r} in the source)")
    fields.update(attention_type=attention_type)
    fields.update(overrides)
    return ZformerLlamaConfig(**fields)


def copy_decoder_weights(target: ZformerLlamaForCausalLM, source) -> list[str]:
    """Every weight of `source` into the same-named one of `target`; returns the names of the target's
    tensors the source lacks (the new attention parameters, and o_proj's bias for Qwen2, zero).
    Anything else missing, or a source weight with no place, is an error."""
    state = source.state_dict()
    if "lm_head.weight" not in state and getattr(source.config, "tie_word_embeddings", False):
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    result = target.load_state_dict(state, strict=False)
    missing = [name for name in result.missing_keys if not name.endswith(NEW_PARAMETERS)]
    if missing or result.unexpected_keys:
        raise ValueError(f"the source's weights do not map onto the converted model: missing {missing[:5]}, "
                         f"unexpected {result.unexpected_keys[:5]}")
    with torch.no_grad():
        for layer in target.model.layers:
            bias = layer.self_attn.o_proj.bias
            if bias is not None and f"model.layers.{layer.self_attn.layer_idx}.self_attn.o_proj.bias" not in state:
                bias.zero_()
    return list(result.missing_keys)


def attention_calls(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> dict[int, tuple]:
    """Every self-attention call of `model` (a `ZformerLlamaForCausalLM`) on a batch, by layer
    index: (positional arguments, output (B, N, D))."""
    calls, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.self_attn.register_forward_hook(
            lambda module, args, output, i=i: calls.__setitem__(i, (args, output))))
    try:
        model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return calls


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x.float().square().mean().sqrt()


@torch.no_grad()
def calibrate_decoder_sizes(model, reference, input_ids: torch.Tensor, rounds: int = 3) -> dict[int, float]:
    """Bring the output of every identity-map zformer layer (its scale s) and every fastformer layer
    (its W_q, which scales the whole output) of `model` to the root-mean-square size of the softmax
    attention it replaces in `reference` (the exact full-attention copy), on `input_ids`. Returns the
    factor per calibrated layer (s, or W_q's total factor)."""
    calls = attention_calls(reference, input_ids, None)
    factors = {}
    for i, layer in enumerate(model.model.layers):
        attention = layer.self_attn
        args, target = calls[i]
        if layer.attention_type == "zformer" and attention.log_scale is not None:
            attention.log_scale.zero_()
            scale = float(_rms(attention(*args)) / _rms(target).clamp_min(1e-12))
            attention.log_scale.fill_(math.log(max(scale, 1e-6)))
            factors[i] = scale
        elif layer.attention_type == "fastformer":
            total = 1.0
            for _ in range(rounds):
                factor = float(_rms(target) / _rms(attention(*args)).clamp_min(1e-12))
                attention.q_proj.weight.mul_(factor)
                if attention.q_proj.bias is not None:
                    attention.q_proj.bias.mul_(factor)
                total *= factor
            factors[i] = total
    return factors


def full_attention_copy(model) -> ZformerLlamaForCausalLM:
    """`model` with full attention in every layer and the same weights: the source's function (the
    reference that calibration and attention transfer compare with)."""
    fields = model.config.to_dict()
    fields.update(attention_type="full", attention_window=0, attention_sinks=0, feature_map_horizon=0,
                  rotary_feature_maps=True)
    for key in ("model_type", "architectures", "transformers_version", "auto_map"):
        fields.pop(key, None)
    reference = ZformerLlamaForCausalLM(ZformerLlamaConfig(**fields)).eval()
    reference.load_state_dict(model.state_dict(), strict=False)
    return reference.to(next(model.parameters()).dtype)


def convert_causal_lm(model_name_or_path, attention_type="full", output_dir=None, *, base_model=None,
                      overwrite: bool = False, tokenizer_name=None, source=None, tokenizer=None, **config_overrides):
    """Convert a Llama, Mistral or Qwen2 causal LM (folder or Hub id; or the model itself as
    `source`, e.g. one loaded from a GGUF file, `model_name_or_path` then naming it in the card)
    into a `ZformerLlamaForCausalLM` with `attention_type` (one type or a list with one per layer),
    and return it (eval mode, fp32). The tokenizer saved with it: `tokenizer`, else the one at
    `tokenizer_name`, else (without `source`) the source folder's.

    config_overrides: further `ZformerLlamaConfig` fields (`zformer_feature_map`, `attention_window`,
    ...). output_dir: if given, the folder gets the config, safetensors weights, the model code
    (loads with `AutoModelForCausalLM` and trust_remote_code=True), the tokenizer and a model card."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..hub import model_card

    if output_dir is not None:  # before any work: never the source or tokenizer folder, never a folder of others
        output_dir = check_conversion_output(output_dir, overwrite=overwrite, model_name_or_path=model_name_or_path,
                                             tokenizer_name=tokenizer_name)
    given = source is not None
    if source is None:
        try:
            source = AutoModelForCausalLM.from_pretrained(model_name_or_path, dtype=torch.float32)
        except Exception as error:  # no folder, no weights, a corrupt file: name the folder and the cause
            raise ValueError(f"model_name_or_path={str(model_name_or_path)!r}: its causal LM cannot be loaded "
                             f"({type(error).__name__}: {str(error).splitlines()[0]})") from error
    if any(p.dtype != torch.float32 for p in source.parameters()):  # a GGUF-loaded model is fp32 and refuses .float()
        source = source.float()
    source.eval()
    config = zformer_llama_config(source.config, attention_type, **config_overrides)
    model = ZformerLlamaForCausalLM(config).eval()
    new = copy_decoder_weights(model, source)
    if getattr(source, "generation_config", None) is not None:  # the source's decoding defaults (EOS ids, ...)
        model.generation_config = copy.deepcopy(source.generation_config)
    if new:
        logger.info(f"new attention parameters at their init: {len(new)} tensors")
    where = tokenizer_name or (None if given else model_name_or_path)  # a given source names no folder
    if tokenizer is None and where is not None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(where)
        except (OSError, ValueError, TypeError) as error:
            logger.warning(f"{where} has no loadable tokenizer ({error})")
    types = set(config.layer_attention_types())
    if "fastformer" in types or ("zformer" in types and config.zformer_feature_map == "identity"):
        reference = full_attention_copy(model)
        if tokenizer is not None:
            ids = tokenizer(CALIBRATION_TEXT, return_tensors="pt")["input_ids"]
        else:
            ids = torch.randint(0, config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0))
        factors = calibrate_decoder_sizes(model, reference, ids)
        logger.info(f"calibrated output sizes per layer: {({i: round(f, 4) for i, f in factors.items()})}")
    if output_dir is not None:
        card = model_card(config=config, task="text-generation", base_model=str(base_model or model_name_or_path),
                          model_id=str(output_dir))
        save_converted(model, tokenizer, card, output_dir)
    return model


__all__ = ["DECODER_SOURCE_TYPES", "convert_causal_lm", "zformer_llama_config", "copy_decoder_weights",
           "calibrate_decoder_sizes", "full_attention_copy", "attention_calls"]
