"""Warm start: the BERT-family architecture options, and converting BERT / RoBERTa / DistilBERT
checkpoints into Zformer-family models (hf_zformer.convert_pretrained)."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from conftest import ATTENTION_TYPES, random_batch, tiny_config

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def test_checkpoint_saved_before_the_bert_options_loads_with_identical_outputs():
    """tests/fixtures/zformer-c2c5a7e was saved by the code at commit c2c5a7e (before post-LayerNorm,
    token types, embedding LayerNorm, position offsets and the pooler head existed; made by
    make_zformer_c2c5a7e.py): its config lacks every new field and must give the same outputs."""
    folder = FIXTURES / "zformer-c2c5a7e"
    expected = json.loads((folder / "expected.json").read_text())
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(expected["input_ids"]),
            attention_mask=torch.tensor(expected["attention_mask"]),
            output_hidden_states=True,
        )
    torch.testing.assert_close(out.logits, torch.tensor(expected["logits"]), rtol=0, atol=1e-6)
    torch.testing.assert_close(out.hidden_states[-1], torch.tensor(expected["last_hidden_state"]), rtol=0, atol=1e-6)

BERT_OPTIONS = dict(layer_norm_position="post", type_vocab_size=2, embedding_layer_norm=True, position_offset=2,
                    position_embedding_type="learned", scale_embedding=False, classifier_pooling="pooler",
                    activation_dropout=0.0)


@pytest.mark.parametrize(
    "field, value",
    [("layer_norm_position", "middle"), ("type_vocab_size", -1), ("type_vocab_size", 1.5),
     ("embedding_layer_norm", "yes"), ("position_offset", -2), ("position_offset", 64),
     ("classifier_pooling", "cls"), ("pooler_activation", "sigmoid"), ("activation_dropout", 1.5)],
)
def test_bert_option_validation_names_field_and_value(field, value):
    with pytest.raises(ValueError, match=f"{field}.*{value}|{field}={value!r}"):
        tiny_config(**{field: value})


def _left_padded(ids, mask):
    """The same rows with their padding moved to the left."""
    lengths = mask.sum(1)
    left_ids, left_mask = torch.zeros_like(ids), torch.zeros_like(mask)
    for row, n in enumerate(lengths.tolist()):
        left_ids[row, ids.shape[1] - n :], left_mask[row, ids.shape[1] - n :] = ids[row, :n], 1
    return left_ids, left_mask


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_bert_options_are_padding_invariant(attention_type):
    """Post-LayerNorm, token types, embedding LayerNorm, offset positions and the pooler head: outputs
    at real positions do not depend on padding, right or left, for every attention type."""
    model = AutoModelForSequenceClassification.from_config(
        tiny_config(attention_type=attention_type, num_labels=3, **BERT_OPTIONS)
    ).eval()
    assert model.zformer.encoder.final_norm is None
    ids, mask = random_batch([9, 4, 6], pad_to=12)
    types = (torch.arange(12) >= 3).long().expand(3, -1) * mask
    with torch.no_grad():
        alone = [model(input_ids=ids[i : i + 1, :n], attention_mask=mask[i : i + 1, :n],
                       token_type_ids=types[i : i + 1, :n]).logits[0] for i, n in enumerate((9, 4, 6))]
        right = model(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
        left_ids, left_mask = _left_padded(ids, mask)
        left_types, _ = _left_padded(types, mask)
        left = model(input_ids=left_ids, attention_mask=left_mask, token_type_ids=left_types).logits
    torch.testing.assert_close(right, torch.stack(alone), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(left, torch.stack(alone), atol=1e-5, rtol=1e-5)


def test_token_types_change_outputs_and_are_checked():
    model = AutoModelForSequenceClassification.from_config(tiny_config(num_labels=2, **BERT_OPTIONS)).eval()
    ids, mask = random_batch([6, 6])
    with torch.no_grad():
        none = model(input_ids=ids, attention_mask=mask).logits
        zeros = model(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids)).logits
        ones = model(input_ids=ids, attention_mask=mask, token_type_ids=torch.ones_like(ids)).logits
    torch.testing.assert_close(none, zeros, rtol=0, atol=0)
    assert not torch.allclose(ones, zeros)
    with pytest.raises(ValueError, match=r"token_type_ids holds 2, outside \[0, type_vocab_size=2\)"):
        model(input_ids=ids, attention_mask=mask, token_type_ids=torch.full_like(ids, 2))


def test_position_offset_shifts_the_table_and_the_length_limit():
    config = tiny_config(position_embedding_type="learned", position_offset=2)
    model = AutoModelForSequenceClassification.from_config(config).eval()
    ids, mask = random_batch([62])
    model(input_ids=ids, attention_mask=mask)  # 62 tokens use positions 2..63
    ids, mask = random_batch([63])
    with pytest.raises(ValueError, match="a sequence of 63 tokens from position_offset=2"):
        model(input_ids=ids, attention_mask=mask)


@pytest.mark.parametrize("decoder_attention_type", ["full", "zformer", "fastformer"])
def test_seq2seq_with_post_layer_norm_decodes_as_it_trains(decoder_attention_type):
    """Post-LayerNorm (and the other options) in the encoder-decoder: greedy decoding with the state
    gives the tokens of decoding without it."""
    from transformers import AutoModelForSeq2SeqLM

    options = {k: v for k, v in BERT_OPTIONS.items() if k != "classifier_pooling"}
    model = AutoModelForSeq2SeqLM.from_config(tiny_config(
        num_decoder_layers=2, decoder_attention_type=decoder_attention_type, **options
    )).eval()
    assert model.decoder.final_norm is None and model.decoder.layers[0].post_norm
    ids, mask = random_batch([7, 5])
    cached = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    uncached = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)
