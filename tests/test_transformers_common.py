"""transformers' own common tests on every public hf_zformer class: ModelTesterMixin, ConfigTester and
TrainingTesterMixin from the transformers sdist that matches the installed version (fetched once from PyPI
and cached, tests/transformers_sdist.py), plus our generate() checks in the form of transformers'
GenerationTesterMixin, which the sdist lacks (tests/common_generation_checks.py).

One tester per form, each on a tiny config: the encoder of each attention type (with its heads),
seq2seq with zformer (Hedgehog map, causal convolution), fastformer and mixed decoders, both causal LMs
(the zformer one windowed, with sinks and a convolution) and a mixed one with an untied head,
ZformerLlama all-linear and mixed. The only skips are the features the models document as
missing (docs/models.md, "transformers' common tests"): transformers' tests skip themselves where a
model declares no attention weights (`has_attentions = False`), and the other skips they make are
their own (a GPU, flash-attn, a multi-device setup, a model kind these are not).
"""

import copy
import inspect
import types
import unittest

import pytest
import torch
import transformers_sdist
from common_generation_checks import GenerationChecks
from transformers import PreTrainedConfig
from transformers.models.auto import modeling_auto

from hf_zformer import (
    FastformerConfig,
    FastformerForCausalLM,
    FastformerForConditionalGeneration,
    FastformerForMaskedLM,
    FastformerForSequenceClassification,
    FastformerModel,
    ZformerConfig,
    ZformerForCausalLM,
    ZformerForConditionalGeneration,
    ZformerForMaskedLM,
    ZformerForSequenceClassification,
    ZformerLlamaConfig,
    ZformerLlamaForCausalLM,
    ZformerLlamaModel,
    ZformerModel,
)


class ExportTesterMixin:
    """torch.export in the place of transformers' export tester, which the sdist lacks (ModelTesterMixin
    derives from it): every class exports with the tester's inputs, and the exported program gives the
    eager model's outputs."""

    def test_torch_export(self):
        if not self.test_torch_exportable:
            self.skipTest("the tester marks its model as not exportable")
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            with self.subTest(model_class.__name__):
                model = model_class(copy.deepcopy(config)).eval()
                takes_cache = "use_cache" in inspect.signature(model.forward).parameters
                kwargs = dict(inputs, use_cache=False) if takes_cache else dict(inputs)  # (a cache is no tensor)
                with torch.no_grad():
                    eager = model(**kwargs)
                    exported = torch.export.export(model, args=(), kwargs=kwargs, strict=False).module()(**kwargs)
                for name, value in eager.items():
                    if isinstance(value, torch.Tensor):
                        torch.testing.assert_close(exported[name], value, msg=name)


# Every public attribute PreTrainedConfig sets, each with a value other than its default, for
# ConfigTester.check_config_arguments_init (transformers keeps its own list outside the sdist).
CONFIG_COMMON_KWARGS = {
    "return_dict": False,
    "output_hidden_states": True,
    "output_attentions": True,
    "dtype": "float16",
    "chunk_size_feed_forward": 5,
    "architectures": ["BertModel"],
    "id2label": {0: "label"},
    "label2id": {"label": "0"},
    "problem_type": "regression",
}


def _module(name, **attributes):
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    return module


try:
    _sdist = transformers_sdist.load(transformers_sdist.sdist_tests(), {
        "generation.test_utils": _module("generation.test_utils", GenerationTesterMixin=GenerationChecks),
        "exporters.test_export": _module("exporters.test_export", ExportTesterMixin=ExportTesterMixin),
        "utils.test_configuration_utils": _module("utils.test_configuration_utils",
                                                   config_common_kwargs=CONFIG_COMMON_KWARGS),
    })
except transformers_sdist.SdistUnavailable as error:
    if transformers_sdist.required():
        raise
    pytest.skip(f"transformers' common test modules are unavailable: {error}", allow_module_level=True)
except ModuleNotFoundError as error:  # what they import beyond transformers (`parameterized`: the dev extra)
    if transformers_sdist.required():
        raise
    pytest.skip(f"transformers' common test modules need {error.name} (pip install -e '.[dev]')",
                allow_module_level=True)

ModelTesterMixin = _sdist["test_modeling_common"].ModelTesterMixin
ids_tensor = _sdist["test_modeling_common"].ids_tensor
ConfigTester = _sdist["test_configuration_common"].ConfigTester
TrainingTesterMixin = _sdist["test_training_mixin"].TrainingTesterMixin if "test_training_mixin" in _sdist else None

# ModelTesterMixin finds a class's task through transformers' auto mappings (which head gets labels,
# which class is the base model); hf_zformer registers its classes with the Auto classes, whose
# name mappings these are.
for _type, (_base, _clm, _mlm, _s2s, _cls) in {
    "zformer": ("ZformerModel", "ZformerForCausalLM", "ZformerForMaskedLM", "ZformerForConditionalGeneration",
                "ZformerForSequenceClassification"),
    "fastformer": ("FastformerModel", "FastformerForCausalLM", "FastformerForMaskedLM",
                   "FastformerForConditionalGeneration", "FastformerForSequenceClassification"),
}.items():
    modeling_auto.MODEL_MAPPING_NAMES.setdefault(_type, _base)
    modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(_type, _clm)
    modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES.setdefault(_type, _mlm)
    modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.setdefault(_type, _s2s)
    modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.setdefault(_type, _cls)
modeling_auto.MODEL_MAPPING_NAMES.setdefault("zformer_llama", "ZformerLlamaModel")
modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault("zformer_llama", "ZformerLlamaForCausalLM")


class ModelTester:
    """The tiny config and inputs of one tester (the attributes ModelTesterMixin and TrainingTesterMixin read)."""

    batch_size, seq_length, vocab_size, num_hidden_layers, is_training, num_labels = 2, 7, 61, 2, True, 3
    encoder_seq_length = decoder_seq_length = seq_length

    def __init__(self, parent, config_class, fields, seq2seq=False, causal_lm_class=None):
        self.parent, self.config_class, self.fields, self.seq2seq = parent, config_class, fields, seq2seq
        self.causal_lm_class = causal_lm_class
        llama = config_class is ZformerLlamaConfig
        self.hidden_size, self.num_attention_heads = (32, 4) if llama else (16, 2)

    def config_kwargs(self):
        common = dict(vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=2,
                      num_attention_heads=self.num_attention_heads, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        if self.config_class is ZformerLlamaConfig:
            return dict(common, intermediate_size=48, num_key_value_heads=2, **self.fields)
        seq2seq = dict(is_encoder_decoder=True, decoder_start_token_id=1) if self.seq2seq else {}
        return dict(common, **seq2seq, num_decoder_layers=2, intermediate_size=32, max_position_embeddings=64,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=self.num_labels,
                    **self.fields)

    def get_config(self):
        if self.seq2seq:  # (the seq2seq training batch of the tester below relies on it)
            assert self.config_kwargs()["decoder_start_token_id"] == 1
        return self.config_class(**self.config_kwargs())

    def prepare_config_and_inputs_for_common(self):
        torch.manual_seed(0)
        ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size - 3) + 3  # no special ids
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if self.seq2seq:
            inputs["decoder_input_ids"] = ids_tensor([self.batch_size, self.seq_length], self.vocab_size - 3) + 3
        return self.get_config(), inputs


def make_tester(name, config_class, fields, classes, seq2seq=False, has_attentions=False):
    """A TestCase running transformers' common tests (and ours for generate()) on `classes`."""
    generative = any(c.can_generate() for c in classes)
    bases = [ModelTesterMixin] + ([GenerationChecks] if generative else [])
    bases += [TrainingTesterMixin] if TrainingTesterMixin is not None else []
    causal_lm = next((c for c in classes if c.__name__.endswith("ForCausalLM")), None)
    masked_lm = next((c for c in classes if c.__name__.endswith("ForMaskedLM")), None)

    class Test(*bases, unittest.TestCase):
        all_model_classes = classes
        is_encoder_decoder = seq2seq
        test_can_init_all_missing_weights_before_2023 = True
        model_tester = None  # (set per test in setUp; TrainingTesterMixin declares it abstract)
        # The mixin's 300 steps at 1e-3 over 64 tokens leave these tiny models (hidden size 16) short of
        # its 90% fall of the gradient norm; 150 steps at 5e-3 over 16 tokens pass it, in a fifth of the time.
        training_overfit_learning_rate = 5e-3
        training_overfit_seq_length = 16
        training_overfit_steps = 150

        def setUp(self):
            self.model_tester = ModelTester(self, config_class, fields, seq2seq, causal_lm)

        def test_config(self):
            kwargs = self.model_tester.config_kwargs()
            kwargs.pop("num_labels", None)  # (not an attribute: the config derives it from id2label)
            ConfigTester(self, config_class=config_class, **kwargs).run_common_tests()

        if seq2seq:
            def _create_text_training_batch(self, batch_size, seq_length, vocab_size):
                # The mixin trains on a repeated sequence, then checks that generating from its first
                # token gives the whole sequence. An encoder-decoder reads that first token as its source
                # and starts its output with the decoder start token (1, the sequence's first token too):
                # so the target is the sequence after its first token, and the rows after the first have
                # the first token alone as their source (the rest padding), as generation will.
                batch = super()._create_text_training_batch(batch_size, seq_length, vocab_size)
                ids, mask = batch["input_ids"].clone(), torch.ones_like(batch["input_ids"])
                ids[1:, 1:], mask[1:, 1:] = self.model_tester.get_config().pad_token_id, 0
                return {"input_ids": ids, "attention_mask": mask, "labels": batch["input_ids"][:, 1:].clone()}

        def _get_trainable_model_class(self):
            # An encoder trains as the masked LM: labels are the inputs, which the mixin's batch gives.
            return masked_lm or super()._get_trainable_model_class()

    Test.has_attentions = has_attentions
    Test.__name__ = Test.__qualname__ = name
    return Test


# has_attentions: only full attention forms an attention matrix; `output_attentions=True` raises
# ValueError for any zformer/xformer/fastformer layer, for every encoder-decoder, and in ZformerLlama.
ENCODERS = (ZformerModel, ZformerForMaskedLM, ZformerForSequenceClassification)
FAST_ENCODERS = (FastformerModel, FastformerForMaskedLM, FastformerForSequenceClassification)
LLAMA = (ZformerLlamaModel, ZformerLlamaForCausalLM)

EncoderFull = make_tester("EncoderFull", ZformerConfig, dict(attention_type="full"), ENCODERS, has_attentions=True)
EncoderZformer = make_tester("EncoderZformer", ZformerConfig, dict(attention_type="zformer"), ENCODERS)
EncoderXformer = make_tester("EncoderXformer", ZformerConfig, dict(attention_type="xformer"), ENCODERS)
EncoderFastformer = make_tester("EncoderFastformer", FastformerConfig, dict(attention_type="fastformer"), FAST_ENCODERS)
# The Hedgehog map in an encoder and a decoder, with the decoder's causal convolution (a state of its own)
Seq2SeqZformer = make_tester("Seq2SeqZformer", ZformerConfig,
                             dict(attention_type="zformer", decoder_attention_type="zformer",
                                  zformer_feature_map="hedgehog", decoder_conv_size=2),
                             (ZformerForConditionalGeneration,), seq2seq=True)
Seq2SeqFastformer = make_tester("Seq2SeqFastformer", FastformerConfig,
                                dict(attention_type="fastformer", decoder_attention_type="fastformer"),
                                (FastformerForConditionalGeneration,), seq2seq=True)
Seq2SeqMixed = make_tester("Seq2SeqMixed", ZformerConfig,
                           dict(attention_type=["zformer", "xformer"], decoder_attention_type=["full", "fastformer"],
                                cross_attention_type="zformer"), (ZformerForConditionalGeneration,), seq2seq=True)
# The Hedgehog map with a softmax window (shorter than the 7 tokens), a sink and the causal convolution
CausalZformer = make_tester("CausalZformer", ZformerConfig,
                            dict(attention_type="zformer", zformer_feature_map="hedgehog", attention_window=3,
                                 attention_sinks=1, decoder_conv_size=2), (ZformerForCausalLM,))
CausalFastformer = make_tester("CausalFastformer", FastformerConfig, dict(attention_type="fastformer"),
                               (FastformerForCausalLM,))
CausalMixedUntied = make_tester("CausalMixedUntied", ZformerConfig,
                                dict(attention_type=["zformer", "full"], tie_word_embeddings=False),
                                (ZformerForCausalLM,))
# ZformerLlama: all-linear with an untied head (the Llama default), and mixed with a tied head and a window
LlamaLinear = make_tester("LlamaLinear", ZformerLlamaConfig, dict(attention_type=["zformer", "fastformer"]), LLAMA)
LlamaMixed = make_tester("LlamaMixed", ZformerLlamaConfig,
                         dict(attention_type=["zformer", "full"], attention_window=[3, 0], attention_sinks=1,
                              tie_word_embeddings=True), LLAMA)

def test_config_common_kwargs_cover_the_base_config():
    """CONFIG_COMMON_KWARGS sets every public attribute of PreTrainedConfig, none at its default."""
    base = PreTrainedConfig()
    public = {k.lstrip("_") for k in vars(base) if not k.startswith("_") or k == "_output_attentions"}
    assert public - {"is_encoder_decoder", "transformers_version"} == set(CONFIG_COMMON_KWARGS)
    assert not [k for k, v in CONFIG_COMMON_KWARGS.items() if k != "dtype" and getattr(base, k) == v]


def test_every_public_class_has_a_tester():
    import hf_zformer

    tested = {c for t in globals().values() if isinstance(t, type) and issubclass(t, unittest.TestCase)
              for c in getattr(t, "all_model_classes", ())}
    public = [getattr(hf_zformer, n) for n in dir(hf_zformer)]
    models = {c for c in public if isinstance(c, type) and issubclass(c, torch.nn.Module)
              and hasattr(c, "config_class") and not c.__name__.endswith("PreTrainedModel")}
    assert models and models <= tested, sorted(c.__name__ for c in models - tested)
