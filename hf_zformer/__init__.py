"""hf_zformer: Zformer, Xformer and Fastformer attention as Hugging Face Transformers models.

Importing the package registers the model types ``"zformer"``, ``"fastformer"`` and ``"zformer_llama"`` with the
transformers Auto classes, so ``AutoConfig.for_model("zformer", ...)`` and
``AutoModel*.from_pretrained(...)`` work without ``trust_remote_code``.
"""

from .modeling import (
    ATTENTION_CLASSES,
    FastformerAttention,
    FastformerConfig,
    FastformerForCausalLM,
    FastformerForConditionalGeneration,
    FastformerForMaskedLM,
    FastformerForSequenceClassification,
    FastformerModel,
    FullAttention,
    XformerAttention,
    ZformerAttention,
    ZformerCache,
    ZformerConfig,
    ZformerForCausalLM,
    ZformerForConditionalGeneration,
    ZformerForMaskedLM,
    ZformerForSequenceClassification,
    ZformerLlamaCache,
    ZformerLlamaConfig,
    ZformerLlamaForCausalLM,
    ZformerLlamaModel,
    ZformerModel,
    ZformerPreTrainedModel,
    position_ids_from_mask,
    register_auto_classes,
    register_llama_auto_classes,
)
from .conversion.convert import convert_pretrained  # warm start from BERT / RoBERTa / DistilBERT checkpoints
from .conversion.distillation import Distillation, distill_attention  # fit converted attention to the source's softmax attention
from .cpu_speedups import disable_cpu_speedups, enable_cpu_speedups, use_cpu_speedups  # opt-in faster CPU layer forms
from .memory import retain_freed_memory  # CPU training: keep freed memory instead of re-faulting it

__version__ = "0.2.0"  # the one version string (setup.cfg reads it)

register_auto_classes()  # the Auto classes of both model types (modeling_zformer.AUTO_CLASSES)
register_llama_auto_classes()  # "zformer_llama": Llama-family decoders (modeling_zformer_llama)
