"""The encoder's short convolution (`encoder_conv_size`): its formula, identity start, padding
invariance (left and right), that it mixes neighbours, gradients, save/load and remote code, and
bad values."""

import pytest
import torch
from conftest import TINY, run_isolated
from test_modeling import _check_padding_invariance, _output, _real, left_pad
from transformers import (AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM,
                          AutoModelForSequenceClassification)

from hf_zformer import ZformerConfig
from hf_zformer.modeling.modeling_zformer import ZformerShortConv

SIZE = 3
TYPES = ["zformer", "fastformer", "full", "xformer", ["fastformer", "full"]]
IDS = ["zformer", "fastformer", "full", "xformer", "hybrid"]


def _batch():
    torch.manual_seed(1)
    ids = torch.randint(5, TINY["vocab_size"], (3, 9))
    mask = torch.tensor([[1] * 9, [1] * 6 + [0] * 3, [1] * 2 + [0] * 7])
    return ids * mask, mask


def _trained_like(model):
    """Random taps, so that the convolution is not the identity it starts as."""
    torch.manual_seed(2)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, ZformerShortConv):
                module.weight.normal_(0.0, 0.5)
    return model.eval()


def encoder(attention_type, model_class=AutoModel, **overrides):
    config = AutoConfig.for_model("zformer", **{**TINY, "attention_type": attention_type,
                                                "encoder_conv_size": SIZE, **overrides})
    torch.manual_seed(0)
    return _trained_like(model_class.from_config(config))


@pytest.mark.parametrize("size", [3, 5])
def test_formula_against_conv1d(size):
    """output_i = sum_k w_k x_{i+k-c} with zeros beyond the ends and at padding (left or right)."""
    config = ZformerConfig(**{**TINY, "encoder_conv_size": size})
    conv = ZformerShortConv(config).double()
    with torch.no_grad():
        conv.weight.normal_()
    x = torch.randn(3, 7, TINY["hidden_size"], dtype=torch.float64)
    mask = torch.tensor([[1] * 7, [0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0]])
    masked = (x * mask[:, :, None]).transpose(1, 2)
    kernel = conv.weight.t()[:, None, :]  # (D, 1, size): conv1d correlates, tap k meets x_{i+k-c}
    expected = torch.nn.functional.conv1d(masked, kernel, padding=size // 2, groups=TINY["hidden_size"])
    actual = conv(x, mask)
    torch.testing.assert_close(actual[mask.bool()], expected.transpose(1, 2)[mask.bool()])
    torch.testing.assert_close(conv(x), torch.nn.functional.conv1d(
        x.transpose(1, 2), kernel, padding=size // 2, groups=TINY["hidden_size"]).transpose(1, 2))


@pytest.mark.parametrize("model_class, conv", [
    (AutoModel, dict(encoder_conv_size=5)), (AutoModelForSeq2SeqLM, dict(encoder_conv_size=5)),
    (AutoModelForSeq2SeqLM, dict(decoder_conv_size=3)), (AutoModelForCausalLM, dict(decoder_conv_size=3)),
])
def test_starts_as_the_identity(model_class, conv):
    """A fresh model with either convolution (the encoder's centred one, the decoder's causal one)
    computes what the same weights compute without it (at the real tokens: a convolution zeroes
    padding's inputs)."""
    overrides = dict(attention_type="fastformer", decoder_attention_type="fastformer", num_decoder_layers=2)
    torch.manual_seed(0)
    with_conv = model_class.from_config(AutoConfig.for_model("zformer", **TINY, **overrides, **conv))
    plain = model_class.from_config(AutoConfig.for_model("zformer", **TINY, **overrides)).eval()
    missing, unexpected = plain.load_state_dict(with_conv.state_dict(), strict=False)
    assert not missing and unexpected and all("short_conv.weight" in key for key in unexpected)
    with_conv.eval()
    ids, mask = _batch()
    inputs = dict(input_ids=ids, attention_mask=mask)
    real = mask.bool()
    if model_class is AutoModelForSeq2SeqLM:
        inputs["decoder_input_ids"] = ids[:, :4]
        real = torch.ones(3, 4, dtype=torch.bool)
    output = "last_hidden_state" if model_class is AutoModel else "logits"
    torch.testing.assert_close(getattr(with_conv(**inputs), output)[real], getattr(plain(**inputs), output)[real])


@pytest.mark.parametrize("attention_type", TYPES, ids=IDS)
def test_padding_invariance(attention_type):
    """Each row's real tokens get the same states with more padding, alone, and padded left."""
    model = encoder(attention_type)
    _check_padding_invariance(model)
    ids, mask = _batch()
    left_ids, left_mask = left_pad(ids, mask)
    torch.testing.assert_close(_real(_output(model, left_ids, left_mask), left_mask),
                               _real(_output(model, ids, mask), mask), atol=1e-5, rtol=1e-5)


def _change_at(model, ids, position, watched=4):
    """How far token `watched`'s output moves when the token at `position` changes."""
    other = ids.clone()
    other[0, position] = (other[0, position] + 7) % TINY["vocab_size"]
    return (model(input_ids=other).last_hidden_state[0, watched] - model(input_ids=ids).last_hidden_state[0, watched]).norm()


def test_mixes_neighbours_within_one_layer():
    """In one fastformer layer a token sees the others only through pooled vectors, so a neighbour
    and a distant token weigh alike; with the convolution the neighbour weighs far more."""
    ids = _batch()[0][:1]
    with_conv = encoder("fastformer", num_hidden_layers=1)
    torch.manual_seed(0)
    plain = _trained_like(AutoModel.from_config(AutoConfig.for_model(
        "zformer", **{**TINY, "attention_type": "fastformer", "num_hidden_layers": 1})))
    assert _change_at(with_conv, ids, 5) > 3 * _change_at(with_conv, ids, 8)
    assert _change_at(plain, ids, 5) < 3 * _change_at(plain, ids, 8)


def test_gradients_reach_the_taps_and_padding_gets_none():
    model = encoder("fastformer", AutoModelForSequenceClassification).train()
    ids, mask = _batch()
    embeddings = model.get_input_embeddings()(ids).detach().requires_grad_()
    loss = model(inputs_embeds=embeddings, attention_mask=mask, labels=torch.tensor([0, 1, 0])).loss
    loss.backward()
    taps = [layer.short_conv.weight.grad for layer in model.zformer.encoder.layers]
    assert all(grad is not None and grad.abs().sum() > 0 for grad in taps)
    assert embeddings.grad[~mask.bool()].abs().max() == 0


def test_save_load_and_remote_code(tmp_path):
    model = encoder("fastformer", AutoModelForSequenceClassification)
    model.save_pretrained(tmp_path / "model")
    ids, mask = _batch()
    expected = model(input_ids=ids, attention_mask=mask).logits
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "model").eval()
    assert loaded.config.encoder_conv_size == SIZE
    torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask).logits, expected)
    torch.save({"ids": ids, "mask": mask, "expected": expected}, tmp_path / "inputs.pt")
    run_isolated(
        """
        import torch, transformers
        saved = torch.load("inputs.pt")
        model = transformers.AutoModelForSequenceClassification.from_pretrained("model", trust_remote_code=True)
        assert model.__module__.startswith("transformers_modules"), model.__module__
        logits = model.eval()(input_ids=saved["ids"], attention_mask=saved["mask"]).logits
        torch.testing.assert_close(logits, saved["expected"])
        """,
        cwd=tmp_path,
    )


@pytest.mark.parametrize("value", [1, 2, 4, -3, 3.0, True])
def test_bad_sizes_are_refused_by_name(value):
    with pytest.raises(ValueError, match=f"encoder_conv_size={value!r}"):
        ZformerConfig(**{**TINY, "encoder_conv_size": value})
