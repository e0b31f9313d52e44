"""Assisted (speculative) decoding and the cache as transformers sees it: every generative class gives
greedy decoding's tokens with a small draft model, rejected drafts are cropped from a constant-size
state, and the cache's layers are transformers' linear-attention and key/value layers, inspected
the way transformers' generic cache checks do (through `generate(return_dict_in_generate=True)`)."""

import pytest
import torch
from test_llama_decoder import KINDS, converted, tiny_llama
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import Cache, DynamicLayer, LinearAttentionCacheLayerMixin

from hf_zformer import (
    FastformerConfig,
    FastformerForCausalLM,
    FastformerForConditionalGeneration,
    ZformerCache,
    ZformerConfig,
    ZformerForCausalLM,
    ZformerForConditionalGeneration,
    ZformerLlamaConfig,
    ZformerLlamaForCausalLM,
)
from hf_zformer.modeling.modeling_zformer import CACHE_FIELD

VOCAB = 97
TINY = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_decoder_layers=2, num_attention_heads=2,
            intermediate_size=48, max_position_embeddings=96, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            decoder_start_token_id=1)

CAUSAL = {
    "zformer": (ZformerForCausalLM, ZformerConfig, dict(attention_type="zformer")),
    "zformer-hedgehog-window-sinks": (ZformerForCausalLM, ZformerConfig, dict(
        attention_type="zformer", zformer_feature_map="hedgehog", attention_window=3, attention_sinks=1)),
    "zformer-conv": (ZformerForCausalLM, ZformerConfig, dict(attention_type="zformer", decoder_conv_size=3)),
    "hybrid": (ZformerForCausalLM, ZformerConfig, dict(attention_type=["fastformer", "full"])),
    "fastformer": (FastformerForCausalLM, FastformerConfig, dict(attention_type="fastformer")),
}
SEQ2SEQ = {
    "zformer": (ZformerForConditionalGeneration, ZformerConfig,
                dict(attention_type="zformer", decoder_attention_type="zformer", cross_attention_type="zformer")),
    "fastformer": (FastformerForConditionalGeneration, FastformerConfig,
                   dict(attention_type="fastformer", decoder_attention_type="fastformer")),
}


def build(model_class, config_class, fields, seed=0):
    torch.manual_seed(seed)
    model = model_class(config_class(**{**TINY, **fields})).eval()
    with torch.no_grad():  # wider weights than the init: greedy tokens depend on every earlier token
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(std=0.3)
    return model


def llama_draft(seed=1):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                                        eos_token_id=2)).eval()


def prompt(length=7, seed=3):
    return torch.randint(5, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def crops(monkeypatch):
    """The token counts `ZformerCache.crop` dropped in recording mode (a rejected draft each)."""
    dropped = []
    original = ZformerCache.crop

    def crop(self, tokens_to_remove):
        if self.record_past and tokens_to_remove:
            dropped.append(-tokens_to_remove)
        return original(self, tokens_to_remove)

    monkeypatch.setattr(ZformerCache, "crop", crop)
    return dropped


def assert_assisted_is_greedy(model, draft, crops, inputs, new_tokens=16, draft_tokens=4):
    """Assisted decoding gives greedy decoding's tokens, with a draft of `draft_tokens` each step (the
    draft model's generation config holds transformers' draft settings), some of them rejected."""
    draft.generation_config.num_assistant_tokens = draft_tokens
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0  # never stop a draft early
    greedy = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    assisted = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              assistant_model=draft)
    assert torch.equal(assisted, greedy)
    assert crops, "no draft token was rejected: the crop was not exercised"
    assert max(crops) > 1, "no crop dropped more than one token"


@pytest.mark.parametrize("kind", sorted(CAUSAL))
def test_assisted_decoding_gives_greedy_tokens_causal(kind, crops):
    model = build(*CAUSAL[kind])
    assert_assisted_is_greedy(model, llama_draft(), crops, dict(input_ids=prompt()))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_assisted_decoding_gives_greedy_tokens_llama(kind, crops):
    model = converted(kind, tiny_llama()).eval()
    assert_assisted_is_greedy(model, llama_draft(), crops, dict(input_ids=prompt(length=9)))


@pytest.mark.parametrize("kind", sorted(SEQ2SEQ))
def test_assisted_decoding_gives_greedy_tokens_seq2seq(kind, crops):
    """The draft is a one-layer Zformer encoder-decoder of the same vocabulary: its own constant-size
    cache is cropped too (`generate()` records a draft model's cache)."""
    model = build(*SEQ2SEQ[kind])
    draft_fields = dict(SEQ2SEQ["zformer"][2], num_hidden_layers=1, num_decoder_layers=1)
    draft = build(ZformerForConditionalGeneration, ZformerConfig, draft_fields, seed=5)
    inputs = dict(input_ids=prompt(), attention_mask=torch.ones(1, 7, dtype=torch.long))
    assert_assisted_is_greedy(model, draft, crops, inputs)


DRAFTS = {
    "zformer": lambda: build(ZformerForCausalLM, ZformerConfig, dict(attention_type="zformer", num_hidden_layers=1),
                             seed=7),
    "fastformer": lambda: build(FastformerForCausalLM, FastformerConfig,
                                dict(attention_type="fastformer", num_hidden_layers=1), seed=7),
    "llama-window-memory": lambda: build(ZformerLlamaForCausalLM, ZformerLlamaConfig, dict(
        KINDS["zformer-window-memory"], vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2), seed=7),
}


@pytest.mark.parametrize("draft", sorted(DRAFTS))
def test_our_causal_lms_serve_as_draft_models(draft, crops):
    """Our causal LM as the draft: its cache records its one-token steps and crops across them."""
    model = converted("hybrid", tiny_llama()).eval()
    assert_assisted_is_greedy(model, DRAFTS[draft](), crops, dict(input_ids=prompt(length=9)), draft_tokens=3)


def test_a_crop_restores_the_state_of_the_kept_tokens():
    """In recording mode a crop back into the last forwards leaves the cache as if only the kept tokens
    had been read: the next step's logits, and the cache's size, are those of that cache."""
    model = build(*CAUSAL["zformer-hedgehog-window-sinks"])
    ids = prompt(length=12)
    with torch.no_grad():
        reference = model(ids[:, :8], use_cache=True)
        reference = model(ids[:, 8:9], **{CACHE_FIELD: getattr(reference, CACHE_FIELD)}, use_cache=True)
        cache = model.decoder.new_cache()
        cache.activate_past_recording(recurrent_states_to_keep=4)
        model(ids[:, :6], **{CACHE_FIELD: cache}, use_cache=True)
        cache.crop(0)  # ends the recorded span: only later forwards can be dropped
        model(ids[:, 6:9], **{CACHE_FIELD: cache}, use_cache=True)
        model(ids[:, 9:12], **{CACHE_FIELD: cache}, use_cache=True)
        cache.crop(-3)
        assert cache.get_seq_length() == 9
        expected = model(ids[:, 9:10], **{CACHE_FIELD: getattr(reference, CACHE_FIELD)}, use_cache=True).logits
        got = model(ids[:, 9:10], **{CACHE_FIELD: cache}, use_cache=True).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        model(ids[:, 10:11], **{CACHE_FIELD: cache}, use_cache=True)
    with pytest.raises(ValueError, match="only go back within them"):  # two tokens read since the last crop
        cache.crop(-3)
    cache.crop(-1)  # the refused crop kept the recorded span
    assert cache.get_seq_length() == 10
    with torch.no_grad():
        model(ids[:, 10:12], **{CACHE_FIELD: cache}, use_cache=True)
    cache.crop(-2)  # every token since the last crop: the state before them
    assert cache.get_seq_length() == 10
    with torch.no_grad():
        expected = model(ids[:, 10:11], **{CACHE_FIELD: getattr(reference, CACHE_FIELD)}, use_cache=True).logits
        got = model(ids[:, 10:11], **{CACHE_FIELD: cache}, use_cache=True).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_crop_without_recording_is_refused_by_a_fixed_size_state():
    model = build(*CAUSAL["zformer"])
    cache = model.decoder.new_cache()
    with torch.no_grad():
        model(prompt(), **{CACHE_FIELD: cache}, use_cache=True)
    assert not cache.is_croppable
    with pytest.raises(ValueError, match="cannot drop its last tokens"):
        cache.crop(-1)


def check_cache_format(cache: Cache, batch: int, length: int, config) -> None:
    """What transformers' generic check asks of a cache: transformers' layer types, batch-first tensors,
    keys and values (B, H_kv, length, d) for a key/value layer, a state that does not grow for a
    linear-attention one."""
    assert isinstance(cache, Cache)
    assert cache.get_seq_length() == length
    assert len(cache.layers) == config.get_text_config(decoder=True).num_hidden_layers or config.is_encoder_decoder
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            assert cache.has_previous_state(index)
            states = [state for state in layer.recurrent_states.values() if state is not None]
            assert states and all(state.shape[0] == batch for state in states)
            assert cache.get_recurrent_state(index) is states[0]
            assert layer.get_max_length() == -1
        else:
            assert isinstance(layer, DynamicLayer)
            assert layer.keys.shape[0] == batch and layer.keys.shape[2] == length
            assert layer.values.shape[:3] == layer.keys.shape[:3]


GENERATIVE = {
    **{f"causal-{kind}": (CAUSAL[kind], False) for kind in CAUSAL},
    **{f"seq2seq-{kind}": (SEQ2SEQ[kind], True) for kind in SEQ2SEQ},
}


@pytest.mark.parametrize("name", sorted(GENERATIVE))
@pytest.mark.parametrize("num_beams", [1, 2])
def test_generate_returns_a_cache_transformers_can_inspect(name, num_beams):
    (model_class, config_class, fields), seq2seq = GENERATIVE[name]
    model = build(model_class, config_class, fields)
    ids = torch.randint(5, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    output = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, min_new_tokens=3,
                            do_sample=False, num_beams=num_beams, return_dict_in_generate=True, output_scores=True)
    cache = getattr(output, CACHE_FIELD)
    # the last token is generated, not read: the cache holds one token fewer than the sequences
    check_cache_format(cache, 2 * num_beams if num_beams > 1 else 2, output.sequences.shape[1] - 1, model.config)
    with torch.no_grad():  # test_past_key_values_format: a forward's cache
        forward = model(input_ids=ids, **({"decoder_input_ids": ids} if seq2seq else {}), use_cache=True)
    check_cache_format(getattr(forward, CACHE_FIELD), 2, 6, model.config)


@pytest.mark.parametrize("kind", ["hybrid", "zformer-window-memory", "fastformer"])
def test_llama_cache_layers_are_transformers_layer_types(kind):
    model = converted(kind, tiny_llama()).eval()
    ids = torch.randint(5, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    output = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, min_new_tokens=3,
                            do_sample=False, return_dict_in_generate=True)
    cache = getattr(output, CACHE_FIELD)
    for index, (layer, attention) in enumerate(zip(cache.layers, model.config.layer_attention_types())):
        assert isinstance(layer, DynamicLayer if attention == "full" else LinearAttentionCacheLayerMixin)
        if attention != "full":
            assert cache.has_previous_state(index)
    if kind != "zformer-window-memory":  # a recall memory keeps one dict per row: no batched tensor to show
        check_cache_format(cache, 2, 8, model.config)


@pytest.mark.parametrize("kind", ["zformer-hedgehog-window-sinks", "fastformer"])
def test_prompt_lookup_decoding_gives_greedy_tokens(kind, crops):
    """Prompt lookup drafts from the prompt's own n-grams (no draft model) and crops the same way."""
    model = build(*CAUSAL[kind])
    ids = torch.cat([prompt(), prompt()[:, :4], prompt()], 1)  # repeated n-grams to draft from
    greedy = model.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    lookup = model.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False, prompt_lookup_num_tokens=3)
    assert torch.equal(lookup, greedy)
    assert crops, "no drafted token was rejected: the crop was not exercised"
