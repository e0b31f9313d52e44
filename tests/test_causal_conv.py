"""The decoder's causal convolution (`decoder_conv_size`): its formula, the
encoder-decoder's decoding state and gradients, the fixed-shape step decoder, save/load and
remote code, and bad values. Padding, causality and cache-equals-no-cache of causal LMs with it are
in test_causal_lm.py (its `conv` and `windowed-conv` kinds), its identity start in test_short_conv.py."""

import pytest
import torch
from conftest import TINY, assert_same_generations_in_clean_process
from test_causal_lm import _batch, causal_lm
from test_modeling import left_pad
from test_seq2seq import _source, seq2seq
from transformers import AutoModelForCausalLM

from hf_zformer import ZformerConfig
from hf_zformer.decoding import greedy_generate
from hf_zformer.modeling.modeling_zformer import ZformerCausalConv

SIZE = 3


def conv_lm(attention_type):
    return causal_lm(attention_type, decoder_conv_size=SIZE)


def test_formula_against_conv1d():
    """output_i = sum_k w_k x_{i-k} with zeros before the first token and at (left) padding."""
    config = ZformerConfig(**{**TINY, "decoder_conv_size": 4})
    conv = ZformerCausalConv(config, layer_idx=0)
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


@pytest.mark.parametrize("attention_type", ["zformer", "fastformer"])
def test_step_decoder_carries_the_convolution(attention_type):
    """The fixed-shape step keeps the convolution's last inputs in fixed buffers: the same tokens as
    generate() from a left-padded batch."""
    model = conv_lm(attention_type)
    ids, mask = left_pad(*_batch())
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, num_beams=1,
                              eos_token_id=None)
    assert torch.equal(greedy_generate(model, ids, mask, max_new_tokens=10, eos_token_id=None, graphs=False),
                       expected)


@pytest.mark.parametrize("decoder", ["zformer", "fastformer"])
def test_seq2seq_state_is_fixed_and_every_tap_learns(decoder):
    model = seq2seq("fastformer", decoder, decoder_conv_size=SIZE)
    src, mask = _source()
    # cache-equals-no-cache with the convolution: test_seq2seq.py::test_cache_equals_no_cache
    state = model.generate(input_ids=src, attention_mask=mask, max_new_tokens=8, min_new_tokens=8,
                           return_dict_in_generate=True).past_key_values
    # the convolution's window is part of the decoding state, and the state does not grow
    assert [tuple(layer.value.shape) for layer in state.conv_layers] == [(3, SIZE - 1, TINY["hidden_size"])] * 2
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
