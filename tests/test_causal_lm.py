"""Decoder-only language models through AutoModelForCausalLM: every causal attention type and a
hybrid stack; padding (left and right), causality, generation with and without the cache, the
fixed-size state of linear layers, pipelines, Trainer and remote-code loading."""

import pytest
import torch
from conftest import TINY, assert_same_generations_in_clean_process, random_batch
from test_modeling import left_pad
from transformers import AutoConfig, AutoModelForCausalLM

from hf_zformer import FastformerForCausalLM, ZformerCache, ZformerForCausalLM
from hf_zformer.modeling.modeling_zformer import CACHE_FIELD

HYBRID = ["zformer", "full", "fastformer"]
# hedgehog zformer layers, the first with a softmax window of 3 tokens, and a full layer on top
WINDOWED = dict(attention_type=["zformer", "zformer", "full"], zformer_feature_map="hedgehog",
                attention_window=[3, 0, 0])
# the same with the first 2 real tokens of each sequence kept as softmax keys (attention sinks)
SINKS = {**WINDOWED, "attention_sinks": 2}
# a 3-tap causal convolution ahead of every self-attention (its last inputs are decoding state)
CONV = dict(attention_type=["fastformer", "full"], decoder_conv_size=3)
WINDOWED_CONV = {**WINDOWED, "decoder_conv_size": 3}
TYPES = ["full", "zformer", "fastformer", HYBRID, WINDOWED, SINKS, CONV, WINDOWED_CONV]
IDS = ["full", "zformer", "fastformer", "hybrid", "windowed", "windowed-sinks", "conv", "windowed-conv"]


def causal_lm(attention_type="zformer", model_type="zformer", **overrides):
    """A tiny causal LM: `attention_type` a type, a list of them, or a dict of config fields."""
    if isinstance(attention_type, dict):
        overrides = {**attention_type, **overrides}
        attention_type = overrides.pop("attention_type")
    layers = len(attention_type) if isinstance(attention_type, list) else TINY["num_hidden_layers"]
    config = AutoConfig.for_model(
        model_type, **{**TINY, "attention_type": attention_type, "num_hidden_layers": layers, **overrides}
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    # Wider weights than the default init: every output depends on the whole prefix.
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(std=0.2)
    return model


def _batch():
    return random_batch([9, 5, 7], seed=1)  # right-padded, pad id 0


def _generate(model, ids, mask, **kwargs):
    # special tokens suppressed so that the random model produces varied tokens to the end
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8,
                          suppress_tokens=[0, 1, 2, 3, 4], no_repeat_ngram_size=2, **kwargs)


@pytest.mark.parametrize("attention_type", TYPES, ids=IDS)
def test_padding_invariance_left_and_right(attention_type):
    model = causal_lm(attention_type)
    ids, mask = _batch()
    right = model(input_ids=ids, attention_mask=mask).logits
    left_ids, left_mask = left_pad(ids, mask)
    left = model(input_ids=left_ids, attention_mask=left_mask).logits
    for row, length in enumerate(mask.sum(1).tolist()):
        alone = model(input_ids=ids[row : row + 1, :length]).logits[0]
        torch.testing.assert_close(right[row, :length], alone, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(left[row, ids.shape[1] - length :], alone, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("attention_type", TYPES, ids=IDS)
def test_no_peeking(attention_type):
    model = causal_lm(attention_type)
    ids = torch.randint(5, TINY["vocab_size"], (2, 12))
    base = model(input_ids=ids).logits
    changed = ids.clone()
    changed[:, 7:] = torch.randint(5, TINY["vocab_size"], (2, 5))
    logits = model(input_ids=changed).logits
    torch.testing.assert_close(logits[:, :7], base[:, :7], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits[:, 7:], base[:, 7:])


@pytest.mark.parametrize("attention_type", TYPES, ids=IDS)
def test_cache_equals_no_cache(attention_type, few_row_form):
    model = few_row_form(causal_lm(attention_type))  # decoding steps of 2 rows: the transposed product against the plain one
    ids, mask = left_pad(*_batch())
    # logits: one pass vs a prompt then token by token through the cache (mask of past + new tokens)
    full = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    out = model(input_ids=ids[:, :4], attention_mask=mask[:, :4], use_cache=True)
    cache, steps = out.past_key_values, [out.logits]
    for i in range(4, ids.shape[1]):
        out = model(input_ids=ids[:, i : i + 1], attention_mask=mask[:, : i + 1], past_key_values=cache)
        steps.append(out.logits)
    assert isinstance(cache, ZformerCache) and cache.get_seq_length() == ids.shape[1]
    real = mask.bool()
    torch.testing.assert_close(torch.cat(steps, 1)[real], full[real], atol=1e-4, rtol=1e-4)
    # tokens: greedy and beam search with and without the cache, on a left-padded batch
    for kwargs in (dict(num_beams=1, do_sample=False), dict(num_beams=3, do_sample=False)):
        cached = _generate(model, ids, mask, use_cache=True, **kwargs)
        assert torch.equal(cached, _generate(model, ids, mask, use_cache=False, **kwargs)), kwargs
        assert len(set(cached[0, ids.shape[1] :].tolist())) > 1  # a real, varied continuation


@pytest.mark.parametrize("attention_type", TYPES, ids=IDS)
def test_left_padded_batch_generates_like_each_row_alone(attention_type):
    """Each row's positions continue from its own length while generating."""
    model = causal_lm(attention_type)
    ids, mask = _batch()
    left_ids, left_mask = left_pad(ids, mask)
    generated = _generate(model, left_ids, left_mask, num_beams=2)
    for row, length in enumerate(mask.sum(1).tolist()):
        alone = _generate(model, ids[row : row + 1, :length], mask[row : row + 1, :length], num_beams=2)
        assert torch.equal(generated[row, ids.shape[1] :], alone[0, length:]), row


@pytest.mark.parametrize("attention_type", TYPES, ids=IDS)
def test_linear_layers_keep_a_constant_state(attention_type):
    model = causal_lm(attention_type, max_position_embeddings=256)
    ids, mask = _batch()
    sizes = {}
    for length in (8, 120):
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=length, min_new_tokens=length,
                             return_dict_in_generate=True)
        assert out.sequences.shape[1] == ids.shape[1] + length
        cache = out.past_key_values
        assert cache.get_seq_length() == ids.shape[1] + length - 1  # the last token is never fed back
        sizes[length] = [sum(t.numel() for t in _layer_tensors(layer)) for layer in cache.layers]
    for kind, short, long in zip(model.decoder.layer_types, sizes[8], sizes[120], strict=True):
        assert (short == long > 0) if kind != "full" else (long > short > 0), (kind, short, long)


def _layer_tensors(layer):
    return layer.tensors() if hasattr(layer, "tensors") else [layer.keys, layer.values]


def test_every_linear_cache_counts_its_tokens():
    cache = causal_lm(["zformer", "fastformer"]).decoder.new_cache()
    assert cache.get_seq_length() == 0
    model = causal_lm(["zformer", "fastformer"])
    out = model(input_ids=torch.randint(5, 97, (2, 6)), past_key_values=cache)
    assert out.past_key_values is cache and cache.get_seq_length() == 6


def test_labels_are_shifted_inside():
    model = causal_lm("zformer")
    ids, mask = _batch()
    labels = ids.masked_fill(mask == 0, -100)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    expected = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, TINY["vocab_size"]),
                                                 labels[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, expected)
    summed = model(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=10).loss
    count = int((labels[:, 1:] != -100).sum())
    torch.testing.assert_close(summed, expected * count / 10)


@pytest.mark.parametrize("model_type", ["zformer", "fastformer"])
def test_shift_labels_are_the_targets_of_the_logits(model_type):
    """Targets shifted before the call (what Trainer passes under sequence or context parallelism,
    where the shift spans shards) score logits[i] against shift_labels[i]; `labels` are then unread."""
    model = causal_lm("zformer", model_type=model_type)
    ids, mask = _batch()
    shift_labels = torch.randint(0, TINY["vocab_size"], ids.shape)
    shift_labels[0, -2:] = -100
    for labels in (ids, torch.zeros_like(ids), None):
        out = model(input_ids=ids, attention_mask=mask, labels=labels, shift_labels=shift_labels)
        expected = torch.nn.functional.cross_entropy(out.logits.reshape(-1, TINY["vocab_size"]),
                                                     shift_labels.reshape(-1))
        torch.testing.assert_close(out.loss, expected)
    count = int((shift_labels != -100).sum())
    summed = model(input_ids=ids, attention_mask=mask, shift_labels=shift_labels, num_items_in_batch=10).loss
    torch.testing.assert_close(summed, expected * count / 10)


GENERATE = dict(do_sample=False, suppress_tokens=[0, 1, 2, 3, 4])  # no n-gram rule: it would not see an embedded prompt


@pytest.mark.parametrize("model_type", ["zformer", "fastformer"])
@pytest.mark.parametrize("attention_type", [HYBRID, WINDOWED_CONV, SINKS], ids=["hybrid", "windowed-conv", "sinks"])
def test_generate_from_inputs_embeds_and_continue_from_them(attention_type, model_type):
    """A prompt given as embeddings generates what its tokens generate (the new tokens only, as
    transformers returns them), and a generation continues from embeddings of the prompt and the
    tokens so far with the cache of the earlier call."""
    model = causal_lm(attention_type, model_type=model_type)
    ids, mask = left_pad(*_batch())
    embeds = model.get_input_embeddings()(ids)
    tokens = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, **GENERATE)
    assert torch.equal(model.generate(input_ids=ids, inputs_embeds=embeds, attention_mask=mask, max_new_tokens=6,
                                      min_new_tokens=6, **GENERATE), tokens)
    from_embeds = model.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=6, min_new_tokens=6,
                                 **GENERATE)
    assert torch.equal(from_embeds, tokens[:, ids.shape[1]:])

    def embedded(new_tokens, **kwargs):
        return model.generate(inputs_embeds=kwargs.pop("inputs_embeds", embeds), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, return_dict_in_generate=True, do_sample=False, **kwargs)

    whole, first = embedded(4), embedded(3)
    continued = torch.cat([embeds, model.get_input_embeddings()(first.sequences)], 1)
    rest = embedded(1, inputs_embeds=continued, **{CACHE_FIELD: getattr(first, CACHE_FIELD)})
    assert torch.equal(torch.cat([first.sequences, rest.sequences], 1), whole.sequences)


def test_an_embedded_prompt_counts_against_the_positions():
    model = causal_lm("zformer", max_position_embeddings=20)
    embeds = model.get_input_embeddings()(torch.randint(5, TINY["vocab_size"], (1, 15)))
    assert model.generate(inputs_embeds=embeds, max_new_tokens=5, min_new_tokens=5).shape == (1, 5)
    with pytest.raises(ValueError, match=r"would reach 21 tokens \(15 prompt tokens \+ max_new_tokens=6\).*at most 5"):
        model.generate(inputs_embeds=embeds, max_new_tokens=6)
    model.generation_config.max_length = None  # the library default (20 new tokens), cut to the positions
    assert model.generate(inputs_embeds=embeds, eos_token_id=None).shape == (1, 5)
    with pytest.raises(ValueError, match="a prompt of 20 tokens"):
        model.generate(inputs_embeds=model.get_input_embeddings()(torch.ones(1, 20, dtype=torch.long)))


def test_tied_embeddings_sampling_and_model_types():
    model = causal_lm("fastformer")
    assert type(model) is ZformerForCausalLM
    assert model.lm_head.weight is model.get_input_embeddings().weight
    ids, mask = _batch()
    torch.manual_seed(3)
    first = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_k=10, max_new_tokens=6)
    torch.manual_seed(3)
    assert torch.equal(first, model.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_k=10,
                                             max_new_tokens=6))
    assert type(causal_lm(model_type="fastformer", attention_type="fastformer")) is FastformerForCausalLM
    assert "AutoModelForCausalLM" in model.config.auto_map


def test_xformer_layer_raises():
    with pytest.raises(ValueError, match="attention_type=.*xformer.*cannot be causal"):
        causal_lm(["zformer", "xformer"])


def test_window_covering_every_token_is_softmax_attention():
    """With a window past the text and the softmax share at 1, a windowed zformer layer is softmax
    attention: the full model with the same weights."""
    windowed = causal_lm("zformer", zformer_feature_map="hedgehog", attention_window=64).double()
    full = causal_lm("full").double()
    with torch.no_grad():
        for layer in windowed.decoder.layers:
            layer.self_attention.window_gate.fill_(40.0)  # sigmoid: 1 to fp64's precision
    missing, unexpected = full.load_state_dict(windowed.state_dict(), strict=False)
    assert not missing and all("query_map" in k or "key_map" in k or "window_gate" in k for k in unexpected)
    ids, mask = _batch()
    real = mask.bool()  # padded queries: zero from the window, something else from full attention
    torch.testing.assert_close(windowed(input_ids=ids, attention_mask=mask).logits[real],
                               full(input_ids=ids, attention_mask=mask).logits[real], atol=1e-9, rtol=1e-9)


def test_windowed_layer_keeps_the_last_window_tokens():
    model = causal_lm(WINDOWED)
    ids = torch.randint(5, TINY["vocab_size"], (2, 10))
    cache = model(input_ids=ids, use_cache=True).past_key_values
    window_layer = cache.layers[0]
    assert type(window_layer).__name__ == "WindowedStateLayer" and window_layer.keys.shape[2] == 2  # W - 1
    assert type(cache.layers[1]).__name__ == "ZformerStateLayer"
    assert {n for n, _ in model.named_parameters() if "window_gate" in n} == {
        "decoder.layers.0.self_attention.window_gate"}


def test_a_window_added_at_loading_starts_at_half_share(tmp_path):
    """A checkpoint without a softmax window loaded with one: the window gates it lacks start as a
    new model's do (0: a softmax share of 0.5 per head), not as whatever memory they were given."""
    causal_lm("zformer", zformer_feature_map="hedgehog").save_pretrained(tmp_path)
    model, info = ZformerForCausalLM.from_pretrained(tmp_path, attention_window=3, output_loading_info=True)
    gates = {n: p for n, p in model.named_parameters() if "window_gate" in n}
    assert gates and set(gates) <= set(info["missing_keys"])
    for gate in gates.values():
        torch.testing.assert_close(gate.detach(), torch.zeros_like(gate))


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(attention_type="zformer", attention_window=4), "only zformer layers with the hedgehog map"),
    (dict(attention_type="fastformer", attention_window=4), "only zformer layers with the hedgehog map"),
    (dict(attention_type="zformer", zformer_feature_map="hedgehog", attention_window=-1), "non-negative"),
    (dict(attention_type="zformer", zformer_feature_map="hedgehog", attention_window=[4]), "1 entries"),
    (dict(attention_type="zformer", zformer_feature_map="hedgehog", attention_sinks=4), "needs a softmax window"),
    (dict(attention_type="zformer", zformer_feature_map="hedgehog", attention_window=4, attention_sinks=-2),
     "attention_sinks=-2 must be a non-negative integer"),
])
def test_window_refusals(overrides, message):
    with pytest.raises(ValueError, match=message):
        AutoConfig.for_model("zformer", **{**TINY, **overrides})


def test_encoders_refuse_a_window():
    from transformers import AutoModel, AutoModelForSeq2SeqLM

    config = AutoConfig.for_model("zformer", **{**TINY, "zformer_feature_map": "hedgehog", "attention_window": 4})
    for auto in (AutoModel, AutoModelForSeq2SeqLM):
        with pytest.raises(ValueError, match="a causal language model's option"):
            auto.from_config(config)


def test_positions_reach_the_configured_length():
    """The sinusoidal default works at any configured length: 8192 positions, and a clear error beyond."""
    model = causal_lm("zformer", max_position_embeddings=8192)
    ids = torch.randint(5, TINY["vocab_size"], (1, 8192))
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    assert logits.shape == (1, 8192, TINY["vocab_size"]) and torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="max_position_embeddings=8192"):
        model(input_ids=torch.randint(5, TINY["vocab_size"], (1, 8193)))


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>", "<mask>"] + [f"w{i}" for i in range(TINY["vocab_size"] - 5)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()  # tokens joined by spaces
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", padding_side="left",
                                   model_input_names=["input_ids", "attention_mask"])


def test_text_generation_pipeline():
    from transformers import pipeline

    model = causal_lm(HYBRID)
    tokenizer = _tokenizer()
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    prompts = ["w1 w2 w3 w4", "w5 w6"]
    options = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, suppress_tokens=[0, 1, 2, 3, 4],
                   return_full_text=False)
    results = generator(prompts, batch_size=2, **options)
    for prompt, result in zip(prompts, results):
        text = result[0]["generated_text"]
        assert len(text.split()) == 5, text
        assert text == generator(prompt, **options)[0]["generated_text"]  # left padding in the batch changes nothing


def test_trainer_one_step(tmp_path):
    from datasets import Dataset
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    model = causal_lm(HYBRID).train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = Dataset.from_list([{"input_ids": list(range(5, 5 + n))} for n in (4, 7, 5, 9)])
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, use_cpu=True,
                             report_to=[], save_strategy="no", learning_rate=1e-2)
    collator = DataCollatorForLanguageModeling(_tokenizer(), mlm=False)
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collator)
    assert trainer.train().global_step == 1
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert "decoder.layers.0.self_attention.output.weight" in changed
    assert "decoder.embeddings.word_embeddings.weight" in changed  # tied: the output projection too
    assert model.lm_head.weight is model.get_input_embeddings().weight


def test_remote_code_generations_in_clean_process(tmp_path):
    ids, mask = left_pad(*_batch())
    models = {name: causal_lm(attention_type) for name, attention_type in zip(IDS, TYPES)}
    models["fastformer-type"] = causal_lm("fastformer", model_type="fastformer")
    assert_same_generations_in_clean_process(
        tmp_path, "AutoModelForCausalLM", models, dict(input_ids=ids, attention_mask=mask), num_beams=2,
        max_new_tokens=8, min_new_tokens=8, suppress_tokens=[0, 1, 2, 3, 4], no_repeat_ngram_size=2,
    )
