"""The decoder's short convolution (`decoder_conv_size`): its formula, identity start, padding
invariance, causality, cache-equals-no-cache (greedy and beam search), fixed-size state, gradients,
save/load and remote code, and bad values."""

import pytest
import torch
from conftest import TINY, assert_same_generations_in_clean_process
from test_causal_lm import _batch, _generate, causal_lm
from test_modeling import left_pad
from test_seq2seq import _greedy, _source, seq2seq
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

from hf_zformer import ZformerConfig
from hf_zformer.modeling.modeling_zformer import ZformerShortConv

SIZE = 3
TYPES = ["zformer", "fastformer", "full", ["fastformer", "full"]]
IDS = ["zformer", "fastformer", "full", "hybrid"]


def conv_lm(attention_type):
    return causal_lm(attention_type, decoder_conv_size=SIZE)


def test_formula_against_conv1d():
    """output_i = sum_k w_k x_{i-k} with zeros before the first token and at (left) padding."""
    config = ZformerConfig(**{**TINY, "decoder_conv_size": 4})
    conv = ZformerShortConv(config, layer_idx=0)
    with torch.no_grad():
        conv.weight.normal_()
    x = torch.randn(2, 7, TINY["hidden_size"], dtype=torch.float64)
    mask = torch.tensor([[1] * 7, [0, 0, 1, 1, 1, 1, 1]])
    conv = conv.double()
    masked = x * mask[:, :, None]
    # conv1d correlates: tap j of its (flipped) kernel meets x_{i - 3 + j}
    kernel = conv.weight.flip(0).t()[:, None, :]  # (D, 1, 4)
    expected = torch.nn.functional.conv1d(
        torch.nn.functional.pad(masked.transpose(1, 2), (3, 0)), kernel, groups=TINY["hidden_size"]
    ).transpose(1, 2)
    actual = conv(x, mask)
    torch.testing.assert_close(actual[mask.bool()], expected[mask.bool()])


@pytest.mark.parametrize("model_class", [AutoModelForCausalLM, AutoModelForSeq2SeqLM])
def test_starts_as_the_identity(model_class):
    """A fresh model with the convolution computes what the same weights compute without it (at the
    real tokens: the convolution zeroes padding's inputs)."""
    overrides = dict(attention_type="fastformer", decoder_attention_type="fastformer", num_decoder_layers=2)
    torch.manual_seed(0)
    with_conv = model_class.from_config(AutoConfig.for_model("zformer", **TINY, **overrides, decoder_conv_size=SIZE))
    plain = model_class.from_config(AutoConfig.for_model("zformer", **TINY, **overrides)).eval()
    missing, unexpected = plain.load_state_dict(with_conv.state_dict(), strict=False)
    assert not missing and unexpected and all("short_conv.weight" in key for key in unexpected)
    with_conv.eval()
    ids, mask = _batch()
    inputs = dict(input_ids=ids, attention_mask=mask)
    real = mask.bool()
    if model_class is AutoModelForSeq2SeqLM:
        inputs["decoder_input_ids"] = ids[:, :6]
        real = torch.ones(3, 6, dtype=torch.bool)
    torch.testing.assert_close(with_conv(**inputs).logits[real], plain(**inputs).logits[real])


@pytest.mark.parametrize("attention_type", TYPES, ids=IDS)
def test_padding_invariance_and_no_peeking(attention_type):
    model = conv_lm(attention_type)
    ids, mask = _batch()
    right = model(input_ids=ids, attention_mask=mask).logits
    left_ids, left_mask = left_pad(ids, mask)
    left = model(input_ids=left_ids, attention_mask=left_mask).logits
    for row, length in enumerate(mask.sum(1).tolist()):
        alone = model(input_ids=ids[row : row + 1, :length]).logits[0]
        torch.testing.assert_close(right[row, :length], alone, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(left[row, ids.shape[1] - length :], alone, atol=1e-4, rtol=1e-4)
    changed = ids.clone()
    changed[:, 4:] = torch.randint(5, TINY["vocab_size"], (3, ids.shape[1] - 4))
    logits = model(input_ids=changed).logits
    torch.testing.assert_close(logits[:, :4], model(input_ids=ids).logits[:, :4], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits[:, 4:], model(input_ids=ids).logits[:, 4:])


@pytest.mark.parametrize("attention_type", TYPES, ids=IDS)
def test_cache_equals_no_cache(attention_type):
    """A left-padded prompt, then token by token: the convolution's window crosses the calls."""
    model = conv_lm(attention_type)
    ids, mask = left_pad(*_batch())
    full = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    out = model(input_ids=ids[:, :4], attention_mask=mask[:, :4], use_cache=True)
    cache, steps = out.past_key_values, [out.logits]
    for i in range(4, ids.shape[1]):
        out = model(input_ids=ids[:, i : i + 1], attention_mask=mask[:, : i + 1], past_key_values=cache)
        steps.append(out.logits)
    real = mask.bool()
    torch.testing.assert_close(torch.cat(steps, 1)[real], full[real], atol=1e-4, rtol=1e-4)
    for kwargs in (dict(num_beams=1, do_sample=False), dict(num_beams=3, do_sample=False)):
        cached = _generate(model, ids, mask, use_cache=True, **kwargs)
        assert torch.equal(cached, _generate(model, ids, mask, use_cache=False, **kwargs)), kwargs
    # each row of a left-padded batch generates what it generates alone
    plain_ids, plain_mask = _batch()
    generated = _generate(model, ids, mask, num_beams=2)
    for row, length in enumerate(plain_mask.sum(1).tolist()):
        alone = _generate(model, plain_ids[row : row + 1, :length], plain_mask[row : row + 1, :length], num_beams=2)
        assert torch.equal(generated[row, ids.shape[1] :], alone[0, length:]), row


@pytest.mark.parametrize("decoder", ["zformer", "fastformer"])
def test_seq2seq_cache_state_and_gradients(decoder):
    model = seq2seq("fastformer", decoder, decoder_conv_size=SIZE)
    src, mask = _source()
    target = torch.randint(5, TINY["vocab_size"], (3, 8))
    full = model(input_ids=src, attention_mask=mask, decoder_input_ids=target, use_cache=False).logits
    encoder_outputs = model.get_encoder()(input_ids=src, attention_mask=mask)
    state, steps = None, []
    for i in range(target.shape[1]):
        out = model(encoder_outputs=encoder_outputs, attention_mask=mask, decoder_input_ids=target[:, i : i + 1],
                    past_key_values=state, use_cache=True)
        state, _ = out.past_key_values, steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=1e-4)
    # the convolution's window is part of the decoding state, and the state does not grow
    assert [tuple(layer.state.shape) for layer in state.conv_layers] == [(3, SIZE - 1, TINY["hidden_size"])] * 2
    for kwargs in (dict(num_beams=1), dict(num_beams=3)):
        assert torch.equal(_greedy(model, src, mask, use_cache=True, **kwargs),
                           _greedy(model, src, mask, use_cache=False, **kwargs)), kwargs
    sizes = [model.generate(input_ids=src, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                            return_dict_in_generate=True).past_key_values.self_attention_numel() for n in (8, 40)]
    assert sizes[0] == sizes[1] > 0
    # every tap learns
    model.train()
    labels = torch.randint(5, TINY["vocab_size"], (3, 6))
    model(input_ids=src, attention_mask=mask, labels=labels).loss.backward()
    for layer in model.decoder.layers:
        assert layer.short_conv.weight.grad is not None and (layer.short_conv.weight.grad != 0).all()


def test_save_load_and_remote_code(tmp_path):
    model = conv_lm(["fastformer", "zformer"])
    model.save_pretrained(tmp_path / "saved")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    assert loaded.config.decoder_conv_size == SIZE
    ids, mask = left_pad(*_batch())
    torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask).logits,
                               model(input_ids=ids, attention_mask=mask).logits)
    assert_same_generations_in_clean_process(
        tmp_path / "remote", "AutoModelForCausalLM", {"conv": model}, dict(input_ids=ids, attention_mask=mask),
        num_beams=2, max_new_tokens=6, min_new_tokens=6, suppress_tokens=[0, 1, 2, 3, 4], no_repeat_ngram_size=2,
    )


@pytest.mark.parametrize("value, message", [
    (1, "decoder_conv_size=1 would only rescale"),
    (-2, "decoder_conv_size=-2 must be a non-negative integer"),
    (2.5, "decoder_conv_size=2.5 must be a non-negative integer"),
])
def test_bad_sizes_raise(value, message):
    with pytest.raises(ValueError, match=message):
        ZformerConfig(**TINY, decoder_conv_size=value)
