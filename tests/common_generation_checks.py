"""generate() checks for the common-test testers (tests/test_transformers_common.py), in the form of
transformers' GenerationTesterMixin, which transformers' sdist does not ship: dict outputs with the cache
and the cache's format, generation from inputs_embeds, left padding, and assisted decoding.

A tester class mixes `GenerationChecks` in beside ModelTesterMixin; it needs `self.model_tester`
(`prepare_config_and_inputs_for_common()`), `all_generative_model_classes` and `is_encoder_decoder`.
The checks run each generative class on the tester's tiny config, greedy, a few new tokens.
"""

import copy
import inspect

import pytest
import torch
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionCacheLayerMixin

NEW_TOKENS = 3

def check_cache_layers(test, cache, batch_size, cached_length):
    """Every layer of `cache` (of its self-attention part, for an encoder-decoder's EncoderDecoderCache)
    shows its state the way transformers' generic checks read it: a linear-attention layer
    (LinearAttentionCacheLayerMixin) its conv/recurrent state tensors, one row per sequence; any other
    layer its keys and values, (batch, heads, tokens, head_dim), all the cached tokens or, in a
    sliding-window layer, at most that many."""
    test.assertIsInstance(cache, Cache)
    cache = getattr(cache, "self_attention_cache", cache)
    test.assertGreater(len(cache.layers), 0)
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionCacheLayerMixin) and not isinstance(layer, CacheLayerMixin):
            states = [s for s in (*layer.conv_states.values(), *layer.recurrent_states.values()) if s is not None]
            test.assertGreater(len(states), 0, f"layer {index} holds no state")
            for state in states:
                test.assertEqual(state.shape[0], batch_size, f"layer {index}")
        else:
            test.assertEqual(layer.keys.shape[0], batch_size, f"layer {index}")
            if getattr(layer, "is_sliding", False):
                test.assertLessEqual(layer.keys.shape[-2], cached_length, f"layer {index}")
            else:
                test.assertEqual(layer.keys.shape[-2], cached_length, f"layer {index}")
            test.assertEqual(layer.values.shape[:-1], layer.keys.shape[:-1], f"layer {index}")
        test.assertEqual(int(cache.get_seq_length(index)), cached_length, f"layer {index}")


def positions(attention_mask):
    """Each row's positions counted over its unmasked tokens (masked ones at 1), as generate() makes them."""
    return (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)


class GenerationChecks:
    def _generation_inputs(self):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        inputs = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask")}
        return config, inputs

    def _models(self):
        config, inputs = self._generation_inputs()
        for model_class in self.all_generative_model_classes:
            torch.manual_seed(0)
            model = model_class(copy.deepcopy(config)).eval()
            yield model, inputs

    @staticmethod
    def _greedy(model, inputs, **kwargs):
        kwargs = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False, **kwargs}
        with torch.no_grad():
            return model.generate(**inputs, **kwargs)

    @staticmethod
    def _cached_length(sequences):
        """Tokens in the cache after generating `sequences` (the prompt and new tokens of a decoder-only
        model, the decoder's tokens of an encoder-decoder): the last one is never fed back."""
        return sequences.shape[1] - 1

    def test_generate_dict_outputs_follow_the_tokens(self):
        """return_dict_in_generate with output_scores gives the greedy tokens and one score row per new
        token, with and without the cache."""
        for model, inputs in self._models():
            plain = self._greedy(model, inputs, use_cache=False)
            for use_cache in (False, True):
                out = self._greedy(model, inputs, use_cache=use_cache, return_dict_in_generate=True,
                                   output_scores=True)
                torch.testing.assert_close(out.sequences, plain)
                self.assertEqual(len(out.scores), NEW_TOKENS)
                batch = inputs["input_ids"].shape[0]
                for step, score in enumerate(out.scores):
                    self.assertEqual(score.shape, (batch, model.config.get_text_config().vocab_size))
                    new = out.sequences[:, -NEW_TOKENS + step]
                    torch.testing.assert_close(score.argmax(-1), new)

    def test_greedy_generate_dict_outputs_use_cache(self):
        for model, inputs in self._models():
            out = self._greedy(model, inputs, use_cache=True, return_dict_in_generate=True, output_scores=True)
            check_cache_layers(self, out.past_key_values, inputs["input_ids"].shape[0],
                               self._cached_length(out.sequences))

    def test_beam_search_generate_dict_outputs_use_cache(self):
        for model, inputs in self._models():
            out = self._greedy(model, inputs, use_cache=True, num_beams=2, return_dict_in_generate=True,
                               output_scores=True)
            self.assertEqual(out.sequences_scores.shape, (inputs["input_ids"].shape[0],))
            check_cache_layers(self, out.past_key_values, 2 * inputs["input_ids"].shape[0],
                               self._cached_length(out.sequences))

    def test_past_key_values_format(self):
        """A forward with use_cache=True returns a cache whose layers hold the whole input."""
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_generative_model_classes:
            model = model_class(copy.deepcopy(config)).eval()
            with torch.no_grad():
                out = model(**inputs, use_cache=True)
            ids = inputs["decoder_input_ids"] if self.is_encoder_decoder else inputs["input_ids"]
            check_cache_layers(self, out.past_key_values, ids.shape[0], ids.shape[1])

    def test_generate_from_inputs_embeds(self):
        """generate(inputs_embeds=...) gives the tokens generate(input_ids=...) gives (a decoder-only
        model returns the new tokens only, an encoder-decoder the decoder's sequence)."""
        for model, inputs in self._models():
            from_ids = self._greedy(model, inputs)
            embeds = model.get_input_embeddings()(inputs["input_ids"])
            from_embeds = self._greedy(model, {"inputs_embeds": embeds, "attention_mask": inputs["attention_mask"]})
            if not self.is_encoder_decoder:
                from_ids = from_ids[:, inputs["input_ids"].shape[1]:]
            torch.testing.assert_close(from_embeds, from_ids)

    def test_left_padding_compatibility(self):
        """Left padding with its attention mask changes no logit of the real tokens' next step, nor the
        generated tokens."""
        pad = 3
        for model, inputs in self._models():
            ids, mask = inputs["input_ids"], inputs["attention_mask"]
            pad_id = model.config.get_text_config().pad_token_id
            padded = {"input_ids": torch.cat([torch.full((ids.shape[0], pad), pad_id), ids], 1),
                      "attention_mask": torch.cat([torch.zeros(mask.shape[0], pad, dtype=mask.dtype), mask], 1)}
            extra, padded_extra = {}, {}
            if self.is_encoder_decoder:
                extra["decoder_input_ids"] = self.model_tester.prepare_config_and_inputs_for_common()[1][
                    "decoder_input_ids"]
                padded_extra = extra
            elif "position_ids" in inspect.signature(model.forward).parameters:
                # as generate() gives them: each row's real tokens at positions 0, 1, ...
                extra["position_ids"] = positions(mask)
                padded_extra["position_ids"] = positions(padded["attention_mask"])
            with torch.no_grad():
                plain = model(**inputs, **extra).logits[:, -1]
                left = model(**padded, **padded_extra).logits[:, -1]
            torch.testing.assert_close(left, plain, rtol=1e-4, atol=1e-5)
            generated = self._greedy(model, padded)
            expected = self._greedy(model, inputs)
            if not self.is_encoder_decoder:
                generated = generated[:, pad:]
            torch.testing.assert_close(generated, expected)

    def test_assisted_decoding_matches_greedy_search(self):
        """Greedy decoding checked by a draft model (a tiny model of the same class, other weights)
        gives the tokens of greedy decoding alone."""
        config, inputs = self._generation_inputs()
        inputs = {k: v[:1] for k, v in inputs.items()}  # (generate() assists one sequence at a time)
        for model_class in self.all_generative_model_classes:
            torch.manual_seed(0)
            model = model_class(copy.deepcopy(config)).eval()
            torch.manual_seed(1)
            draft = model_class(copy.deepcopy(config)).eval()
            greedy = self._greedy(model, inputs)
            assisted = self._greedy(model, inputs, assistant_model=draft)
            torch.testing.assert_close(assisted, greedy)
