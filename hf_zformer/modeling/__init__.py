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
    FastformerForMaskedLM,
    FastformerForSequenceClassification,
    FastformerModel,
    ZformerForMaskedLM,
    ZformerForSequenceClassification,
    ZformerModel,
    ZformerPreTrainedModel,
)
