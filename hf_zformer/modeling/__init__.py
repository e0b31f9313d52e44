"""Everything that ships to the Hub with a checkpoint (flat, self-contained)."""

from .attention import (
    ATTENTION_CLASSES,
    FastformerAttention,
    FullAttention,
    XformerAttention,
    ZformerAttention,
)
from .configuration_zformer import FastformerConfig, ZformerConfig
from .modeling_zformer import (
    FastformerForConditionalGeneration,
    FastformerForMaskedLM,
    FastformerForSequenceClassification,
    FastformerModel,
    ZformerDecodingState,
    ZformerForConditionalGeneration,
    ZformerForMaskedLM,
    ZformerForSequenceClassification,
    ZformerModel,
    ZformerPreTrainedModel,
    position_ids_from_mask,
)
