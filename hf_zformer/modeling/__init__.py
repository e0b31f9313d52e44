"""Modeling: everything that ships to the Hub with a checkpoint (flat, self-contained).
May import: torch and transformers, and its own modules (``from .sibling import X``); nothing else of ``hf_zformer``."""

from .attention import (
    ATTENTION_CLASSES,
    FastformerAttention,
    FullAttention,
    XformerAttention,
    ZformerAttention,
)
from .attention_registry import attention_types, register_attention, unregister_attention
from .cache_zformer import ZformerCache
from .configuration_zformer import FastformerConfig, ZformerConfig
from .configuration_zformer_llama import ZformerLlamaConfig
from .modeling_zformer import (
    FastformerForCausalLM,
    FastformerForConditionalGeneration,
    FastformerForMaskedLM,
    FastformerForSequenceClassification,
    FastformerModel,
    ZformerForCausalLM,
    ZformerForConditionalGeneration,
    ZformerForMaskedLM,
    ZformerForSequenceClassification,
    ZformerModel,
    ZformerPreTrainedModel,
    position_ids_from_mask,
    register_auto_classes,
)
from .modeling_zformer_llama import (
    ZformerLlamaCache,
    ZformerLlamaForCausalLM,
    ZformerLlamaModel,
    register_llama_auto_classes,
)
from .policy import Policy, use_policy
