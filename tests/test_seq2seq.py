"""The encoder-decoder: all 12 encoder x decoder combinations through AutoModelForSeq2SeqLM."""

import itertools

import pytest
import torch
from conftest import ATTENTION_TYPES, TINY, assert_same_generations_in_clean_process, random_batch, repad
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

from hf_zformer import ZformerCache
from hf_zformer.modeling.modeling_zformer import shift_tokens_right

DECODER_TYPES = ["full", "zformer", "fastformer"]
COMBINATIONS = list(itertools.product(ATTENTION_TYPES, DECODER_TYPES))


def seq2seq(encoder="zformer", decoder="zformer", attn_implementation=None, **overrides):
    config = AutoConfig.for_model(
        "zformer",
        **{**TINY, "attention_type": encoder, "decoder_attention_type": decoder, "num_decoder_layers": 2, **overrides},
    )
    torch.manual_seed(0)
    model = AutoModelForSeq2SeqLM.from_config(config, attn_implementation=attn_implementation).eval()
    # The small default init makes a random decoder repeat its input token; wider weights make
    # every output depend on the source and on the whole target prefix.
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2 and "sequence_projection" not in name:
                parameter.normal_(std=0.2)
    return model


def _source():
    return random_batch([9, 5, 7], seed=1)


def _greedy(model, src, mask, **kwargs):
    # special tokens suppressed so that the random model produces 10 varied tokens
    return model.generate(input_ids=src, attention_mask=mask, max_new_tokens=10, min_new_tokens=10,
                          suppress_tokens=[0, 1, 2, 3, 4], no_repeat_ngram_size=2, **kwargs)


@pytest.mark.parametrize("encoder, decoder, overrides", [(*pair, {}) for pair in COMBINATIONS] + [
    ("fastformer", decoder, {"decoder_conv_size": 3}) for decoder in ("zformer", "fastformer")])
def test_cache_equals_no_cache(encoder, decoder, overrides, few_row_form):
    """`overrides`: also with a causal convolution ahead of each decoder self-attention, whose last
    inputs the cache carries across the steps."""
    model = few_row_form(seq2seq(encoder, decoder, **overrides))  # decoding steps of 3 rows: the transposed product
    src, mask = _source()
    # logits: one pass over the whole target vs token by token through the decoding state
    target = torch.randint(5, TINY["vocab_size"], (3, 8))
    full = model(input_ids=src, attention_mask=mask, decoder_input_ids=target, use_cache=False).logits
    encoder_outputs = model.get_encoder()(input_ids=src, attention_mask=mask)
    state, steps = None, []
    for i in range(target.shape[1]):
        out = model(encoder_outputs=encoder_outputs, attention_mask=mask, decoder_input_ids=target[:, i : i + 1],
                    past_key_values=state, use_cache=True)
        state = out.past_key_values
        steps.append(out.logits)
    assert isinstance(state, ZformerCache) and state.get_seq_length() == 8
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=1e-4)
    # tokens: greedy and beam search with and without the cache
    for kwargs in (dict(num_beams=1, do_sample=False), dict(num_beams=3, do_sample=False)):
        cached = _greedy(model, src, mask, use_cache=True, **kwargs)
        uncached = _greedy(model, src, mask, use_cache=False, **kwargs)
        assert torch.equal(cached, uncached), kwargs
        assert len(set(cached[0, 1:].tolist())) > 1  # a real, varied output


@pytest.mark.parametrize("encoder, decoder", COMBINATIONS)
def test_no_peeking_and_source_padding(encoder, decoder):
    model = seq2seq(encoder, decoder)
    src, mask = _source()
    target = torch.randint(5, TINY["vocab_size"], (3, 9))
    base = model(input_ids=src, attention_mask=mask, decoder_input_ids=target).logits
    # changing future target tokens never changes earlier logits
    changed = target.clone()
    changed[:, 5:] = torch.randint(5, TINY["vocab_size"], (3, 4))
    logits = model(input_ids=src, attention_mask=mask, decoder_input_ids=changed).logits
    torch.testing.assert_close(logits[:, :5], base[:, :5], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits[:, 5:], base[:, 5:])
    # extra source padding changes nothing
    padded_src, padded_mask = repad(src, mask, 20)
    padded = model(input_ids=padded_src, attention_mask=padded_mask, decoder_input_ids=target).logits
    torch.testing.assert_close(padded, base, atol=1e-4, rtol=1e-4)
    # nor does it change beam search
    assert torch.equal(_greedy(model, src, mask, num_beams=3), _greedy(model, padded_src, padded_mask, num_beams=3))


@pytest.mark.parametrize("decoder", ["zformer", "fastformer"])
def test_decoding_state_does_not_grow(decoder):
    model = seq2seq("full", decoder, max_position_embeddings=256)
    src, mask = _source()
    sizes = {}
    for length in (8, 200):
        out = model.generate(input_ids=src, attention_mask=mask, max_new_tokens=length, min_new_tokens=length,
                             return_dict_in_generate=True)
        assert out.sequences.shape[1] == length + 1
        sizes[length] = out.past_key_values.self_attention_numel()
    assert sizes[8] == sizes[200] > 0


def test_full_decoder_cache_grows_with_output():
    model = seq2seq("full", "full", max_position_embeddings=256)
    src, mask = _source()
    out = [model.generate(input_ids=src, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                          return_dict_in_generate=True).past_key_values.self_attention_numel() for n in (8, 40)]
    assert out[1] > out[0]


def test_hybrid_decoder_and_zformer_cross_attention():
    model = seq2seq(["xformer", "fastformer"], ["zformer", "full"], cross_attention_type="zformer")
    src, mask = _source()
    assert type(model.decoder.layers[0].cross_attention).__name__ == "ZformerAttention"
    for kwargs in (dict(num_beams=1), dict(num_beams=3)):
        assert torch.equal(_greedy(model, src, mask, **kwargs), _greedy(model, src, mask, use_cache=False, **kwargs))


def test_labels_shift_loss_and_sampling():
    model = seq2seq(label_smoothing=0.1)
    src, mask = _source()
    labels = torch.randint(5, TINY["vocab_size"], (3, 6))
    labels[2, 4:] = -100
    decoder_inputs = shift_tokens_right(labels, 0, 1)
    assert decoder_inputs[:, 0].tolist() == [1, 1, 1] and decoder_inputs[2, 5] == 0
    assert torch.equal(decoder_inputs[:, 1:4], labels[:, :3])
    out = model(input_ids=src, attention_mask=mask, labels=labels)
    explicit = model(input_ids=src, attention_mask=mask, decoder_input_ids=decoder_inputs).logits
    torch.testing.assert_close(out.logits, explicit)
    smoothed = torch.nn.functional.cross_entropy(explicit.view(-1, TINY["vocab_size"]), labels.view(-1),
                                                 label_smoothing=0.1)
    torch.testing.assert_close(out.loss, smoothed)
    # sampling is reproducible under a seed
    torch.manual_seed(3)
    first = model.generate(input_ids=src, attention_mask=mask, do_sample=True, top_k=10, max_new_tokens=8)
    torch.manual_seed(3)
    second = model.generate(input_ids=src, attention_mask=mask, do_sample=True, top_k=10, max_new_tokens=8)
    assert torch.equal(first, second)
    # shared embeddings: source, target and output projection are one matrix
    shared = model.get_input_embeddings().weight
    assert model.decoder.embeddings.word_embeddings.weight is shared and model.lm_head.weight is shared


def test_every_parameter_gets_a_gradient():
    for encoder, decoder, cross in [("xformer", "fastformer", "zformer"), ("zformer", "zformer", "full")]:
        model = seq2seq(encoder, decoder, cross_attention_type=cross).train()
        src, mask = _source()
        model(input_ids=src, attention_mask=mask, labels=torch.randint(5, 97, (3, 6))).loss.backward()
        missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
        assert not missing


def test_seq2seq_trainer_predict_with_generate(tmp_path):
    from datasets import Dataset
    from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainer, Seq2SeqTrainingArguments

    model = seq2seq("fastformer", "zformer")
    rows = [{"input_ids": list(range(5, 5 + n)), "labels": list(range(20, 20 + n))} for n in (3, 6, 4, 8)]
    data = Dataset.from_list(rows)

    class PadOnly:  # DataCollatorForSeq2Seq needs only a tokenizer's `pad`
        pad_token_id = 0
        padding_side = "right"

        def pad(self, features, return_tensors="pt", **kwargs):
            width = max(len(f["input_ids"]) for f in features)
            ids = [f["input_ids"] + [0] * (width - len(f["input_ids"])) for f in features]
            mask = [[1] * len(f["input_ids"]) + [0] * (width - len(f["input_ids"])) for f in features]
            return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}

    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, per_device_eval_batch_size=2, max_steps=2,
        predict_with_generate=True, generation_max_length=6, use_cpu=True, report_to=[], save_strategy="no",
    )
    trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=data, eval_dataset=data,
                             data_collator=DataCollatorForSeq2Seq(PadOnly(), model=model))
    assert trainer.train().global_step == 2
    prediction = trainer.predict(data)
    assert prediction.predictions.shape[0] == 4
    assert (prediction.predictions[:, 0] == model.config.decoder_start_token_id).all()  # generated sequences
    assert "test_loss" in prediction.metrics


def test_remote_code_generate_in_clean_process(tmp_path):
    src, mask = _source()
    pairs = [("xformer", "zformer"), ("fastformer", "fastformer"), ("zformer", "full")]
    models = {f"{encoder}-{decoder}": seq2seq(encoder, decoder) for encoder, decoder in pairs}
    models["fastformer-type"] = AutoModelForSeq2SeqLM.from_config(AutoConfig.for_model("fastformer", **TINY)).eval()
    assert_same_generations_in_clean_process(
        tmp_path, "AutoModelForSeq2SeqLM", models, dict(input_ids=src, attention_mask=mask), num_beams=3,
        max_new_tokens=10, min_new_tokens=10, suppress_tokens=[0, 1, 2, 3, 4], no_repeat_ngram_size=2,
    )


@pytest.mark.parametrize("decoder", DECODER_TYPES)
def test_bf16_autocast_keeps_fp32_residual_streams(decoder):
    """Under autocast the layers' branch outputs are bf16; the encoder and decoder streams they are
    added to stay fp32, and the logits stay close to fp32 ones."""
    model = seq2seq("zformer", decoder, cross_attention_type="zformer" if decoder == "zformer" else "full")
    src, mask = _source()
    labels = torch.randint(5, TINY["vocab_size"], (3, 6))
    reference = model(input_ids=src, attention_mask=mask, labels=labels).logits
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=src, attention_mask=mask, labels=labels, output_hidden_states=True)
    streams = out.encoder_hidden_states + out.decoder_hidden_states
    assert [h.dtype for h in streams] == [torch.float32] * len(streams)
    torch.testing.assert_close(out.logits.float(), reference, atol=0.15, rtol=5e-2)


@pytest.mark.parametrize("encoder", ATTENTION_TYPES)
@pytest.mark.parametrize("cross, implementation", [("full", "sdpa"), ("full", "eager"), ("zformer", "sdpa")])
def test_all_padding_source_row_is_finite_and_changes_nothing(encoder, cross, implementation):
    model = seq2seq(encoder, "fastformer", cross_attention_type=cross, attn_implementation=implementation)
    src, mask = random_batch([9, 5, 0], seed=1)
    target = torch.randint(5, TINY["vocab_size"], (3, 6))
    out = model(input_ids=src, attention_mask=mask, labels=target)
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.loss)
    without = model(input_ids=src[:2], attention_mask=mask[:2], labels=target[:2]).logits
    torch.testing.assert_close(out.logits[:2], without, atol=1e-5, rtol=1e-5)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    generated = model.generate(input_ids=src, attention_mask=mask, max_new_tokens=4, min_new_tokens=4)
    alone = model.generate(input_ids=src[:2], attention_mask=mask[:2], max_new_tokens=4, min_new_tokens=4)
    assert torch.equal(generated[:2], alone)


@pytest.mark.parametrize("encoder", ATTENTION_TYPES)
def test_left_padded_source_generates_like_unpadded(encoder):
    from test_modeling import left_pad

    model = seq2seq(encoder, "zformer")
    src, mask = _source()
    left_src, left_mask = left_pad(*repad(src, mask, 12))
    generated = _greedy(model, left_src, left_mask, num_beams=2)
    for row, length in enumerate(mask.sum(1).tolist()):
        alone = _greedy(model, src[row : row + 1, :length], mask[row : row + 1, :length], num_beams=2)
        assert torch.equal(generated[row : row + 1], alone), row
    assert torch.equal(generated, _greedy(model, src, mask, num_beams=2))


def _seq2seq_batch():
    src, mask = _source()
    return dict(input_ids=src, attention_mask=mask, decoder_input_ids=torch.randint(5, TINY["vocab_size"], (3, 6)))


def test_seq2seq_unknown_keyword_argument_raises():
    with pytest.raises(TypeError, match="bogus_argument"):
        seq2seq("full", "full")(**_seq2seq_batch(), bogus_argument=1)


@pytest.mark.parametrize("name", ["head_mask", "decoder_head_mask", "cross_attn_head_mask"])
def test_seq2seq_head_masks_raise(name):
    with pytest.raises(ValueError, match=name):
        seq2seq("full", "full")(**_seq2seq_batch(), **{name: torch.ones(2, 4)})


def test_seq2seq_output_attentions_raises():
    with pytest.raises(ValueError, match="output_attentions"):
        seq2seq("full", "full")(**_seq2seq_batch(), output_attentions=True)


def test_seq2seq_token_type_ids_zeros_accepted_non_zero_raise():
    model, batch = seq2seq("full", "full"), _seq2seq_batch()
    zeros = model(**batch, token_type_ids=torch.zeros_like(batch["input_ids"])).logits
    torch.testing.assert_close(zeros, model(**batch).logits, atol=0, rtol=0)
    with pytest.raises(ValueError, match="token_type_ids"):
        model(**batch, token_type_ids=torch.ones_like(batch["input_ids"]))


def test_seq2seq_decoder_attention_mask_right_padded_only():
    model, batch = seq2seq("full", "full"), _seq2seq_batch()
    base = model(**batch).logits
    # a right-padded decoder mask is exact (causality hides later padding): accepted, real logits unchanged
    decoder_mask = torch.ones_like(batch["decoder_input_ids"])
    decoder_mask[1, 4:] = 0
    decoder_mask[2, 2:] = 0
    masked = model(**batch, decoder_attention_mask=decoder_mask).logits
    torch.testing.assert_close(masked[decoder_mask.bool()], base[decoder_mask.bool()], atol=0, rtol=0)
    # any other pattern (left padding, holes) would need masking the decoder cannot do: refused
    for bad in (decoder_mask.flip(1), torch.tensor([[1, 0, 1, 1, 1, 1]] * 3)):
        with pytest.raises(ValueError, match="decoder_attention_mask"):
            model(**batch, decoder_attention_mask=bad)
    # generate() forwards a user's decoder mask step by step (extended with ones): still accepted
    src, mask = batch["input_ids"], batch["attention_mask"]
    start = torch.ones(3, 1, dtype=torch.long)
    with_mask = _greedy(model, src, mask, decoder_input_ids=start, decoder_attention_mask=torch.ones_like(start))
    assert torch.equal(with_mask, _greedy(model, src, mask))


def test_seq2seq_loss_is_normalised_by_num_items_in_batch():
    model = seq2seq(label_smoothing=0.1)
    src, mask = _source()
    labels = torch.randint(5, TINY["vocab_size"], (3, 6))
    labels[2, 4:] = -100
    mean = model(input_ids=src, attention_mask=mask, labels=labels).loss
    count = int((labels != -100).sum())
    summed = model(input_ids=src, attention_mask=mask, labels=labels, num_items_in_batch=2 * count)
    torch.testing.assert_close(summed.loss, mean / 2)


@pytest.mark.parametrize("new_size, multiple, expected", [(120, None, 120), (50, None, 50), (100, 64, 128)])
def test_resize_token_embeddings(new_size, multiple, expected):
    model = seq2seq("zformer", "fastformer")
    model.resize_token_embeddings(new_size, pad_to_multiple_of=multiple)
    shared = model.get_input_embeddings().weight
    assert shared.shape[0] == expected == model.config.vocab_size
    assert model.decoder.embeddings.word_embeddings.weight is shared and model.lm_head.weight is shared
    src, mask = random_batch([6, 4], vocab_size=40)
    labels = torch.randint(5, 40, (2, 5))
    labels[0, 0] = expected - 1
    out = model(input_ids=src, attention_mask=mask, labels=labels)
    assert out.logits.shape == (2, 5, expected) and torch.isfinite(out.loss)
    assert model.generate(input_ids=src, attention_mask=mask, max_new_tokens=3).shape[0] == 2


@pytest.mark.parametrize("kind", ["seq2seq", "causal"])
def test_decoding_state_under_either_name(kind):
    """transformers 5.24 renamed the decoding state `past_key_values` -> `cache` (generate() passes
    `cache=`); forward takes either name, refuses both, and returns it under the installed name."""
    from test_causal_lm import causal_lm

    from hf_zformer.modeling.modeling_zformer import CACHE_FIELD

    model = seq2seq("fastformer", "zformer") if kind == "seq2seq" else causal_lm("zformer")
    src, mask = _source()
    first = dict(input_ids=src, attention_mask=mask)
    if kind == "seq2seq":
        first["decoder_input_ids"] = src[:, :1]
    logits = {}
    for name in ("past_key_values", "cache"):
        out = model(**first, use_cache=True)
        state = getattr(out, CACHE_FIELD)
        assert isinstance(state, ZformerCache)
        if kind == "seq2seq":  # the next target token, with the encoder states of the first call
            step = dict(decoder_input_ids=src[:, 1:2], encoder_outputs=(out.encoder_last_hidden_state,),
                        attention_mask=mask)
        else:  # one more token after the prompt
            step = dict(input_ids=src[:, :1], attention_mask=torch.cat([mask, torch.ones_like(mask[:, :1])], 1))
        logits[name] = model(**step, **{name: state}).logits
    torch.testing.assert_close(logits["cache"], logits["past_key_values"])
    with pytest.raises(ValueError, match="as `cache` or as `past_key_values`, not both"):
        model(**first, past_key_values=state, cache=state)


def test_labels_that_are_a_view_of_a_larger_tensor_give_the_same_loss():
    """Labels sliced out of a wider tensor (not contiguous) give the loss of a contiguous copy."""
    from conftest import tiny_config

    model = AutoModelForSeq2SeqLM.from_config(tiny_config(decoder_attention_type="zformer")).eval()
    ids = torch.randint(5, 97, (2, 9))
    labels = torch.randint(5, 97, (2, 12))[:, :6]
    assert not labels.is_contiguous()
    loss = model(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(loss, model(input_ids=ids, labels=labels.contiguous()).loss)


def test_the_encoder_is_the_base_model_and_a_saved_encoder_loads_into_it(tmp_path):
    """`base_model_prefix` names the encoder (the causal LM's: its decoder stack), so `base_model` is
    the part below the head and a saved `ZformerModel` loads into the encoder-decoder's encoder."""
    from transformers import AutoModel

    from hf_zformer import ZformerForConditionalGeneration

    model = seq2seq()
    assert model.base_model is model.encoder and not model.supports_tp_plan
    encoder = AutoModel.from_config(model.config)
    with torch.no_grad():
        for parameter in encoder.parameters():
            parameter.normal_()
    encoder.save_pretrained(tmp_path / "encoder")
    loaded, info = ZformerForConditionalGeneration.from_pretrained(tmp_path / "encoder", output_loading_info=True)
    assert not [key for key in info["missing_keys"] if key.startswith("encoder.")], info["missing_keys"]
    assert info["missing_keys"] and not info["unexpected_keys"]  # the decoder has no weights there
    for name, tensor in encoder.state_dict().items():
        torch.testing.assert_close(loaded.encoder.state_dict()[name], tensor, rtol=0, atol=0)
    causal = AutoModelForCausalLM.from_config(AutoConfig.for_model("zformer", **TINY, tie_word_embeddings=False))
    assert causal.base_model is causal.decoder and not causal.supports_tp_plan
    causal.save_pretrained(tmp_path / "causal")  # its own checkpoint loads as before
    again, info = AutoModelForCausalLM.from_pretrained(tmp_path / "causal", output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    causal.base_model.save_pretrained(tmp_path / "stack")  # the base model is a model: it saves, and loads back
    again, info = AutoModelForCausalLM.from_pretrained(tmp_path / "stack", output_loading_info=True)
    assert info["missing_keys"] == {"lm_head.weight"} and not info["unexpected_keys"], info
    torch.testing.assert_close(again.decoder.state_dict(), causal.decoder.state_dict(), rtol=0, atol=0)
