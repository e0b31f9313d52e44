"""One attention protocol for both model families: a new attention type, defined here and registered
through the public registry (`attention_registry.register_attention`) without editing the package,
is a valid choice of every config and builds in an encoder, an encoder-decoder's decoder, a causal
language model and a Llama-family decoder, whose cached decoding gives what the whole sequence gives;
and every list of types is a view of the one registry."""

import pytest
import torch
from conftest import TINY, random_batch
from torch import nn
from transformers import initialization as init

from hf_zformer import (
    ZformerConfig,
    ZformerForCausalLM,
    ZformerForConditionalGeneration,
    ZformerLlamaConfig,
    ZformerLlamaForCausalLM,
    ZformerModel,
)
from hf_zformer.modeling import attention_registry
from hf_zformer.modeling.attention import ATTENTION_CLASSES, Attention
from hf_zformer.modeling.attention_llama import LLAMA_ATTENTION_CLASSES, RotaryAttention
from hf_zformer.modeling.blocks import merge_heads, new_tokens_mask, split_heads
from hf_zformer.modeling.cache_zformer import RecurrentLayer
from hf_zformer.modeling.configuration_zformer import (
    ATTENTION_TYPES,
    CAUSAL_ATTENTION_TYPES,
    CROSS_ATTENTION_TYPES,
    PROBABILITY_ATTENTION_TYPES,
)
from hf_zformer.modeling.configuration_zformer_llama import LLAMA_ATTENTION_TYPES

LLAMA = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)


class MeanStateLayer(RecurrentLayer):
    """The toy type's decoding state: the sum of the values so far (B, H, 1, d) and their count (B, 1, 1, 1)."""

    def __init__(self):
        super().__init__()
        self.total = self.count = None

    def store(self, total, count, new_tokens):
        if not self.is_initialized:
            self.lazy_initialization(total)
        self.total, self.count = total, count
        self.num_tokens += new_tokens

    def tensors(self):
        return [] if self.total is None else [self.total, self.count]

    def _map(self, function):
        if self.total is not None:
            self.total, self.count = function(self.total), function(self.count)


class MeanAttention(Attention):
    """A toy type: each head's output is the mean of the values of the real tokens it sees (all of
    them, or j <= i when causal), times a learned scale per head. No cross form."""

    CAN_BE_CROSS = False
    HAS_ATTENTION_DROPOUT = False

    def build_projections(self, config):
        self.value = nn.Linear(config.hidden_size, config.hidden_size)

    def build_parameters(self, config):
        self.head_scale = nn.Parameter(torch.empty(self.num_heads))

    def init_parameters(self, std):
        init.ones_(self.head_scale)

    def context(self, hidden_states, attention_mask=None, memory=None, memory_mask=None, cache=None,
                position_ids=None):
        value = split_heads(self.value(hidden_states), self.num_heads)
        if self.is_causal:
            return self.causal_context(value, value, value, attention_mask, cache)
        weight = torch.ones_like(value[:, :1, :, :1]) if attention_mask is None else \
            attention_mask.to(value.dtype)[:, None, :, None]
        mean = (value * weight).sum(2, keepdim=True) / weight.sum(2, keepdim=True).clamp_min(1)
        return merge_heads((mean * self.head_scale[:, None, None]).expand_as(value))

    def causal_context(self, query, key, value, attention_mask, cache, rotate=None):
        value = value.repeat_interleave(self.groups, 1)  # a Llama decoder's grouped heads
        length = value.shape[2]
        mask = new_tokens_mask(attention_mask, length)
        weight = torch.ones_like(value[:, :1, :, :1]) if mask is None else mask.to(value.dtype)[:, None, :, None]
        layer = None if cache is None else cache.layers[self.layer_idx]
        total = (value * weight).cumsum(2)
        count = weight.cumsum(2)
        if layer is not None and layer.total is not None:
            total, count = total + layer.total, count + layer.count
        if layer is not None:
            layer.store(total[:, :, -1:], count[:, :, -1:], length)
        return merge_heads(total / count.clamp_min(1) * self.head_scale[:, None, None])


@pytest.fixture
def mean_type():
    entry = attention_registry.register_attention("mean", MeanAttention, cache_layer=MeanStateLayer)
    yield entry
    attention_registry.unregister_attention("mean")


def test_every_type_list_is_a_view_of_the_registry(mean_type):
    assert list(ATTENTION_TYPES) == ["full", "zformer", "xformer", "fastformer", "mean"]
    assert list(CAUSAL_ATTENTION_TYPES) == list(LLAMA_ATTENTION_TYPES) == ["full", "zformer", "fastformer", "mean"]
    assert CROSS_ATTENTION_TYPES == ("full", "zformer") and PROBABILITY_ATTENTION_TYPES == ("full", "xformer")
    assert ATTENTION_CLASSES["mean"] is MeanAttention and MeanAttention.ATTENTION_TYPE == "mean"
    llama_class = LLAMA_ATTENTION_CLASSES["mean"]
    assert issubclass(llama_class, RotaryAttention) and issubclass(llama_class, MeanAttention)
    with pytest.raises(ValueError, match="built in"):
        attention_registry.unregister_attention("full")


def test_after_unregistering_the_type_is_refused_by_name():
    assert "mean" not in ATTENTION_TYPES
    with pytest.raises(ValueError, match="attention_type='mean' is not supported"):
        ZformerConfig(**TINY, attention_type="mean")


def test_encoder_and_encoder_decoder(mean_type):
    ids, mask = random_batch([7, 4])
    torch.manual_seed(0)
    model = ZformerModel(ZformerConfig(**TINY, attention_type=["mean", "full"])).eval()
    assert isinstance(model.encoder.layers[0].attention, MeanAttention)
    assert torch.equal(model.encoder.layers[0].attention.head_scale, torch.ones(4))
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
        padded = model(input_ids=torch.nn.functional.pad(ids, (0, 3)),
                       attention_mask=torch.nn.functional.pad(mask, (0, 3))).last_hidden_state
    torch.testing.assert_close(padded[:, :7][mask.bool()], out[mask.bool()])
    with pytest.raises(ValueError, match=r"cross_attention_type='mean' is not supported; choose one of \['full', 'zformer'\]"):
        ZformerConfig(**TINY, cross_attention_type="mean")
    seq2seq = ZformerForConditionalGeneration(ZformerConfig(**TINY, attention_type="mean",
                                                            decoder_attention_type="mean")).eval()
    with torch.no_grad():
        logits = seq2seq(input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :3]).logits
    assert logits.shape == (2, 3, 97) and torch.isfinite(logits).all()


def _decodes_as_one_pass(model, ids, mask, new_cache):
    """Logits of a chunk of 3 tokens, then one token at a time through the cache, against one pass."""
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        cache, steps = new_cache(), []
        for start, stop in [(0, 3), (3, 4), (4, 5), (5, 6)]:
            steps.append(model(input_ids=ids[:, start:stop], attention_mask=mask[:, :stop],
                               past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(steps, 1), full[:, :6], atol=1e-5, rtol=1e-5)
    return cache


@pytest.mark.parametrize("family", ["causal_lm", "llama"])
def test_causal_models_decode_with_the_types_cache_layer(mean_type, family):
    ids = torch.randint(5, 97, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    torch.manual_seed(0)
    if family == "llama":
        model = ZformerLlamaForCausalLM(ZformerLlamaConfig(**LLAMA, attention_type=["mean", "full"])).eval()
        assert isinstance(model.model.layers[0].self_attn, MeanAttention)
        assert torch.equal(model.model.layers[0].self_attn.head_scale, torch.ones(4))
        new_cache = model.model.new_cache
    else:
        model = ZformerForCausalLM(ZformerConfig(**TINY, attention_type=["mean", "full"])).eval()
        new_cache = model.decoder.new_cache
    cache = _decodes_as_one_pass(model, ids, mask, new_cache)
    assert isinstance(cache.layers[0], MeanStateLayer) and cache.layers[0].num_tokens == 6
    options = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cached = model.generate(input_ids=ids[:, :3], use_cache=True, **options)
        assert torch.equal(cached, model.generate(input_ids=ids[:, :3], use_cache=False, **options))


def test_a_class_that_disagrees_with_its_declared_type_is_refused():
    class CausalXformer(MeanAttention):
        CAN_BE_CAUSAL, CAN_BE_CROSS, HAS_ATTENTION_DROPOUT = True, False, True

    with pytest.raises(ValueError, match="disagrees with the declared type"):
        attention_registry.register_attention("xformer", CausalXformer)
    assert ATTENTION_CLASSES["xformer"] is not CausalXformer
