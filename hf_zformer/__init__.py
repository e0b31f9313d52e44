"""hf_zformer: Zformer, Xformer and Fastformer attention as Hugging Face Transformers models.

Importing the package registers the model types ``"zformer"`` and ``"fastformer"`` with the
transformers Auto classes, so ``AutoConfig.for_model("zformer", ...)`` and
``AutoModel*.from_pretrained(...)`` work without ``trust_remote_code``.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
)

from .modeling import (
    ATTENTION_CLASSES,
    FastformerAttention,
    FastformerConfig,
    FastformerForConditionalGeneration,
    FastformerForMaskedLM,
    FastformerForSequenceClassification,
    FastformerModel,
    FullAttention,
    XformerAttention,
    ZformerAttention,
    ZformerConfig,
    ZformerDecodingState,
    ZformerForConditionalGeneration,
    ZformerForMaskedLM,
    ZformerForSequenceClassification,
    ZformerModel,
    ZformerPreTrainedModel,
    position_ids_from_mask,
)
from .convert import convert_pretrained  # warm start from BERT / RoBERTa / DistilBERT checkpoints

__version__ = "0.1.0"

_REGISTRY = (
    (AutoModel, ZformerModel, FastformerModel),
    (AutoModelForSequenceClassification, ZformerForSequenceClassification, FastformerForSequenceClassification),
    (AutoModelForMaskedLM, ZformerForMaskedLM, FastformerForMaskedLM),
    (AutoModelForSeq2SeqLM, ZformerForConditionalGeneration, FastformerForConditionalGeneration),
)


def _register():
    AutoConfig.register("zformer", ZformerConfig, exist_ok=True)
    AutoConfig.register("fastformer", FastformerConfig, exist_ok=True)
    for auto_class, zformer_class, fastformer_class in _REGISTRY:
        auto_class.register(ZformerConfig, zformer_class, exist_ok=True)
        auto_class.register(FastformerConfig, fastformer_class, exist_ok=True)


_register()
