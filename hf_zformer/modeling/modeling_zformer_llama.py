"""Llama-family decoders (Llama, SmolLM, Mistral, Qwen2 layouts) with Zformer-family attention per
layer: model type `"zformer_llama"` (`ZformerLlamaConfig`).

The model is Llama's, module for module and name for name (`model.embed_tokens`,
`model.layers.i.{input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm,
mlp.{gate,up,down}_proj}`, `model.norm`, `lm_head`): transformers' `LlamaRMSNorm`, `LlamaMLP` and
`LlamaRotaryEmbedding` as they are, so a Llama checkpoint loads into it directly. Only the
self-attention differs (`attention_llama`): "full" is Llama's, exactly; "zformer" and
"fastformer" decode with a constant-size state (`ZformerLlamaCache`).

This file ships to the Hugging Face Hub with every checkpoint: torch, transformers and siblings only.
"""

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import (
    LlamaForCausalLM,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from .attention import Attention, HedgehogFeatureMap
from .attention_llama import LLAMA_ATTENTION_CLASSES
from .blocks import check_inputs, drop_full_mask
from .cache_zformer import record_forward
from .cache_zformer_llama import ZformerLlamaCache
from .configuration_zformer_llama import ZformerLlamaConfig
from .modeling_zformer import CACHE_FIELD, cache_extent, causal_lm_loss, decoding_state, generation_cache


class ZformerLlamaDecoderLayer(GradientCheckpointingLayer):
    """Llama's pre-RMSNorm layer: x + Attn(RMSNorm(x)), then x + MLP(RMSNorm(x)) (gated MLP)."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.attention_type = config.layer_attention_types()[layer_idx]
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = LLAMA_ATTENTION_CLASSES[self.attention_type](config, layer_idx)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None):
        hidden_states = hidden_states + self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, attention_mask, cache)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class ZformerLlamaPreTrainedModel(PreTrainedModel):
    config: ZformerLlamaConfig
    config_class = ZformerLlamaConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["ZformerLlamaDecoderLayer"]

    def __init__(self, config, *inputs, **kwargs):
        config._validate()  # fields set after construction get the same errors
        super().__init__(config, *inputs, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, LlamaRMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, HedgehogFeatureMap):  # the identity map: W = I, b = 0
            init.copy_(module.weight, torch.eye(module.weight.shape[-1]).expand_as(module.weight))
            init.zeros_(module.bias)
        elif isinstance(module, Attention):  # each type's own parameters (the adapters' `Attention` class)
            module.init_parameters(self.config.initializer_range)


class ZformerLlamaModel(ZformerLlamaPreTrainedModel):
    """Embeddings, the decoder layers, the final RMSNorm, and the rotary position table."""

    def __init__(self, config):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(ZformerLlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def new_cache(self) -> ZformerLlamaCache:
        return ZformerLlamaCache(self.config.layer_attention_types(), self.config.layer_windows(),
                                 self.config.attention_memory)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, output_hidden_states=None, cache=None, return_dict=None):
        """input_ids (B, N) or inputs_embeds (B, N, D); attention_mask (B, N), or (B, past + N) with a
        cache, 1 at real tokens; position_ids (B, N) or (1, N), by default past, past + 1, ... as
        Llama's (`generate()` passes positions counted from the mask). `past_key_values` (or
        `cache`): the `ZformerLlamaCache` of earlier calls (a new one when `use_cache`).
        `output_hidden_states` and `return_dict` default to the config's, as in every transformers model."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        cache = decoding_state(past_key_values, cache)
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        if use_cache and cache is None:
            cache = self.new_cache()
        if not use_cache:
            cache = None
        check_inputs(input_ids, inputs_embeds, attention_mask, **cache_extent(cache))
        record_forward(cache, self.forward, (input_ids if inputs_embeds is None else inputs_embeds).shape[1],
                       tokens=dict(input_ids=input_ids, inputs_embeds=inputs_embeds, position_ids=position_ids),
                       masks=dict(attention_mask=attention_mask),
                       fixed=dict(cache=cache, use_cache=True, output_hidden_states=False, return_dict=True))
        # settled once per forward (each decoding step), not per layer: generate() passes all ones without padding
        attention_mask = drop_full_mask(attention_mask)
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(past, past + hidden_states.shape[1], device=hidden_states.device)[None]
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        all_hidden = (hidden_states,) if output_hidden_states else None
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, attention_mask, cache)
            if output_hidden_states:
                all_hidden += (hidden_states,)
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden = all_hidden[:-1] + (hidden_states,)  # Llama's last entry is after the final norm
        output = BaseModelOutputWithPast(last_hidden_state=hidden_states, hidden_states=all_hidden,
                                         **{CACHE_FIELD: cache})
        return output if return_dict else output.to_tuple()


class ZformerLlamaForCausalLM(ZformerLlamaPreTrainedModel, GenerationMixin):
    """Causal language model: `ZformerLlamaModel` and an output projection (tied to the input
    embeddings when `tie_word_embeddings`, as the source's). Generates with a `ZformerLlamaCache`:
    constant size when no layer is "full"."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    # Llama's plan for the head: transformers shards the input embeddings, so the head tied to them is sharded too
    _tp_plan = LlamaForCausalLM._tp_plan

    def __init__(self, config):
        super().__init__(config)
        self.model = ZformerLlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length):
        if model_kwargs.get(CACHE_FIELD) is None and generation_config.use_cache is not False:
            if generation_config.cache_implementation not in (None, "dynamic"):
                raise ValueError(f"cache_implementation={generation_config.cache_implementation!r} is not supported: "
                                 "this model decodes with its ZformerLlamaCache")
            model_kwargs[CACHE_FIELD] = generation_cache(self.model.new_cache(), generation_config)
            return
        super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, batch_size,
                                              max_cache_length)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, num_items_in_batch=None, use_cache=None,
                output_hidden_states=None, return_dict=None, logits_to_keep: int = 0, cache=None,
                shift_labels=None, **kwargs):
        """As `ZformerLlamaModel.forward`; labels (B, N): the input ids, -100 where not scored,
        shifted inside; or `shift_labels` (B, N), targets already shifted, which take their place
        (`causal_lm_loss`). `logits_to_keep` > 0 computes only the last ones. Returns
        `CausalLMOutputWithPast(loss, logits (B, N, vocab), the cache, hidden_states)`."""
        if kwargs.get("output_attentions"):
            raise ValueError("output_attentions=True is not supported: linear attention forms no attention matrix")
        cache = decoding_state(past_key_values, cache)
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        scored = labels is not None or shift_labels is not None
        if scored and cache is None:
            use_cache = False
        outputs = self.model(input_ids, attention_mask, position_ids, inputs_embeds=inputs_embeds, use_cache=use_cache,
                             output_hidden_states=output_hidden_states, cache=cache, return_dict=True)
        hidden_states = outputs.last_hidden_state
        kept = hidden_states[:, -logits_to_keep:] if logits_to_keep else hidden_states
        logits = self.lm_head(kept)
        loss = causal_lm_loss(logits, labels, num_items_in_batch, shift_labels) if scored else None
        output = CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                                        **{CACHE_FIELD: getattr(outputs, CACHE_FIELD)})
        return output if return_dict else output.to_tuple()


ZformerLlamaConfig.register_for_auto_class("AutoConfig")
ZformerLlamaModel.register_for_auto_class("AutoModel")
ZformerLlamaForCausalLM.register_for_auto_class("AutoModelForCausalLM")


def register_llama_auto_classes():
    """Register the "zformer_llama" model type with transformers' Auto classes (exist_ok)."""
    import transformers

    transformers.AutoConfig.register(ZformerLlamaConfig.model_type, ZformerLlamaConfig, exist_ok=True)
    transformers.AutoModel.register(ZformerLlamaConfig, ZformerLlamaModel, exist_ok=True)
    transformers.AutoModelForCausalLM.register(ZformerLlamaConfig, ZformerLlamaForCausalLM, exist_ok=True)


__all__ = ["ZformerLlamaModel", "ZformerLlamaForCausalLM", "ZformerLlamaPreTrainedModel", "ZformerLlamaCache",
           "register_llama_auto_classes"]
