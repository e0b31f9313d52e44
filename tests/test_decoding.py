"""Fixed-shape greedy decoding (`hf_zformer.decoding`): the same tokens as `generate()` for causal
LMs and encoder-decoders (padded prompts, every recurrent type, the Hedgehog map), end of sequence,
the cache left as generate() leaves it, refusals; on CUDA, graph replays equal eager steps."""

import pytest
import torch
from conftest import random_batch
from test_causal_lm import causal_lm
from test_modeling import left_pad
from test_seq2seq import seq2seq

from hf_zformer.decoding import StepDecoder, greedy_generate

CAUSAL = {
    "zformer": dict(attention_type="zformer"),
    "fastformer": dict(attention_type="fastformer"),
    "hedgehog": dict(attention_type="zformer", zformer_feature_map="hedgehog"),
    "mixed": dict(attention_type=["zformer", "fastformer"]),
}


def _reference(model, ids, mask, new_tokens, **kwargs):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                          num_beams=1, **kwargs)


@pytest.mark.parametrize("options", CAUSAL.values(), ids=CAUSAL.keys())
def test_causal_lm_decodes_what_generate_does(options):
    model = causal_lm(**options)
    ids, mask = left_pad(*random_batch([9, 5, 7], seed=1))
    expected = _reference(model, ids, mask, 12, eos_token_id=None)
    got = greedy_generate(model, ids, mask, max_new_tokens=12, eos_token_id=None, graphs=False)
    assert torch.equal(got, expected)


def test_encoder_decoder_decodes_what_generate_does():
    for cross in ("full", "zformer"):
        model = seq2seq("zformer", "fastformer", cross_attention_type=cross)
        ids, mask = random_batch([9, 5, 7], seed=2)
        expected = _reference(model, ids, mask, 10, eos_token_id=None)
        assert torch.equal(greedy_generate(model, ids, mask, max_new_tokens=10, eos_token_id=None, graphs=False),
                           expected)


def test_encoder_decoder_continues_a_decoder_prefix_as_generate_does():
    """With `decoder_prefix` the decoder first reads the start token and the prefix: the tokens that
    follow are generate()'s from the same decoder input."""
    model = seq2seq("zformer", "fastformer")
    ids, mask = random_batch([9, 5, 7], seed=2)
    prefix = torch.randint(5, 50, (3, 4), generator=torch.Generator().manual_seed(0))
    start = torch.full((3, 1), model.config.decoder_start_token_id)
    expected = model.generate(input_ids=ids, attention_mask=mask, decoder_input_ids=torch.cat([start, prefix], 1),
                              max_new_tokens=6, do_sample=False, num_beams=1, eos_token_id=None)[:, 5:]
    decoder = StepDecoder(model, ids, mask, max_new_tokens=6, graphs=False, decoder_prefix=prefix)
    got = torch.cat([decoder.tokens.clone()] + [decoder.step().clone() for _ in range(5)], 1)
    assert torch.equal(got, expected)
    assert decoder.cache.get_seq_length() == 1 + 4 + 5
    with pytest.raises(ValueError, match="decoder_prefix is an encoder-decoder's"):
        StepDecoder(causal_lm("zformer"), random_batch([4])[0], max_new_tokens=2, graphs=False, decoder_prefix=prefix)


def test_end_of_sequence_pads_the_row_and_stops_when_all_have_ended():
    model = causal_lm("zformer")
    ids, mask = left_pad(*random_batch([9, 5, 7], seed=1))
    free = _reference(model, ids, mask, 12, eos_token_id=None)
    eos = int(free[0, ids.shape[1] + 3])  # a token row 0 produces at its 4th step
    expected = _reference(model, ids, mask, 12, eos_token_id=eos, pad_token_id=0)
    got = greedy_generate(model, ids, mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=0, graphs=False)
    assert torch.equal(got, expected)
    first = int(free[0, ids.shape[1]])  # every row stops where its first token is the end
    stopped = greedy_generate(model, ids, mask, max_new_tokens=12, eos_token_id=first, pad_token_id=0, graphs=False)
    assert torch.equal(stopped, _reference(model, ids, mask, 12, eos_token_id=first, pad_token_id=0))


def test_the_cache_counts_every_token_and_generate_continues_from_it():
    model = causal_lm("fastformer")
    ids = random_batch([6, 6], seed=3)[0]
    decoder = StepDecoder(model, ids, max_new_tokens=5, graphs=False)
    tokens = [decoder.tokens.clone()] + [decoder.step().clone() for _ in range(4)]
    assert decoder.cache.get_seq_length() == 6 + 4  # the prompt and the four tokens fed
    expected = _reference(model, ids, None, 5, eos_token_id=None)
    assert torch.equal(torch.cat([ids, *tokens], 1), expected)


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match=r"decoder layers \[1\] have full self-attention"):
        StepDecoder(causal_lm(["zformer", "full"]), random_batch([4])[0], max_new_tokens=2, graphs=False)
    with pytest.raises(ValueError, match="past max_position_embeddings=64"):
        StepDecoder(causal_lm("zformer"), random_batch([10])[0], max_new_tokens=60, graphs=False)
    windowed = causal_lm("zformer", zformer_feature_map="hedgehog", attention_window=4)
    with pytest.raises(ValueError, match=r"decoder layers \[0, 1\] have a softmax window"):
        StepDecoder(windowed, random_batch([4])[0], max_new_tokens=2, graphs=False)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        StepDecoder(causal_lm("zformer"), random_batch([4])[0], max_new_tokens=0, graphs=False)
    with pytest.raises(ValueError, match="graphs=True needs a CUDA device"):
        StepDecoder(causal_lm("zformer"), random_batch([4])[0], max_new_tokens=2, graphs=True)
    with pytest.raises(TypeError, match="not Linear"):
        StepDecoder(torch.nn.Linear(2, 2), random_batch([4])[0], max_new_tokens=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("options", [dict(attention_type="zformer"), dict(attention_type="fastformer"),
                                     dict(attention_type="fastformer", decoder_conv_size=3)],
                         ids=["zformer", "fastformer", "fastformer-conv"])
def test_graph_replays_decode_what_eager_steps_do(options):
    """Replays read and write only the fixed buffers (recurrent states, convolution inputs): a state
    left outside them would freeze at its captured value and change the tokens."""
    model = causal_lm(**options).cuda()
    ids, mask = (t.cuda() for t in left_pad(*random_batch([9, 5, 7], seed=1)))
    eager = greedy_generate(model, ids, mask, max_new_tokens=20, eos_token_id=None, graphs=False)
    graphed = greedy_generate(model, ids, mask, max_new_tokens=20, eos_token_id=None, graphs=True)
    assert torch.equal(graphed, eager)
