"""Llama-family decoders with Zformer-family attention (`ZformerLlamaForCausalLM`) and their
conversion from a tiny random `LlamaForCausalLM` (grouped key/value heads): the full conversion is
the source's function; every converted attention decodes with a cache that gives what the whole
sequence gives, constant in size, causal, with padding; save/load and remote code."""

import sys

import pytest
import torch
import warm_scripts
from conftest import REPO_ROOT, assert_same_generations_in_clean_process
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from hf_zformer import ZformerLlamaCache, ZformerLlamaConfig, ZformerLlamaForCausalLM, convert_pretrained
from hf_zformer.conversion.convert_decoder import convert_causal_lm, full_attention_copy
from hf_zformer.modeling.attention_llama import windowed_linear_attention

LLAMA = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
# every converted attention: the identity and Hedgehog maps, Hedgehog with a softmax window (and attention
# sinks), fastformer, a hybrid
KINDS = {
    "full": dict(attention_type="full"),
    "zformer-identity": dict(attention_type="zformer", zformer_feature_map="identity"),
    "zformer-hedgehog": dict(attention_type="zformer", zformer_feature_map="hedgehog"),
    "zformer-window": dict(attention_type="zformer", zformer_feature_map="hedgehog", attention_window=3),
    "zformer-window-sinks": dict(attention_type="zformer", zformer_feature_map="hedgehog", attention_window=3,
                                 attention_sinks=2),
    "zformer-window-sinks-fading": dict(attention_type="zformer", zformer_feature_map="hedgehog", attention_window=3,
                                        attention_sinks=2, feature_map_horizon=4),
    "zformer-window-unrotated-maps": dict(attention_type="zformer", zformer_feature_map="hedgehog", attention_window=3,
                                          attention_sinks=2, rotary_feature_maps=False),
    "zformer-window-memory": dict(attention_type="zformer", zformer_feature_map="hedgehog", attention_window=3,
                                  attention_sinks=2, feature_map_horizon=4, rotary_feature_maps=False, attention_memory=2,
                                  attention_memory_chunk=2),
    "zformer-window-memory-cache-positions": dict(attention_type="zformer", zformer_feature_map="hedgehog",
                                                  attention_window=3, attention_sinks=2, feature_map_horizon=4,
                                                  rotary_feature_maps=False, attention_memory=2, attention_memory_chunk=2,
                                                  attention_memory_positions="cache"),
    "fastformer": dict(attention_type="fastformer"),
    "hybrid": dict(attention_type=["zformer", "full", "fastformer"], attention_window=[4, 0, 0]),
}


def tiny_llama(tie_word_embeddings=False, seed=0):
    torch.manual_seed(seed)
    source = LlamaForCausalLM(LlamaConfig(**LLAMA, tie_word_embeddings=tie_word_embeddings)).eval()
    with torch.no_grad():  # wider weights than the init: outputs depend on every earlier token
        for parameter in source.parameters():
            if parameter.dim() == 2:
                parameter.normal_(std=0.3)
    return source


def converted(kind, source=None):
    """The tiny Llama converted to `kind`, new attention parameters moved off their init."""
    model = convert_causal_lm("tiny", source=source or tiny_llama(), **KINDS[kind])
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if any(part in name for part in ("query_map", "key_map", "window_gate", "log_horizon", "query_score",
                                             "key_score")):
                parameter.add_(0.3 * torch.randn_like(parameter))
    return model


def left_padded(seed=1):
    """(ids, mask, lengths): three rows of 9, 5 and 7 real tokens, left-padded with id 0."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [9, 5, 7]
    ids = torch.zeros(3, 9, dtype=torch.long)
    mask = torch.zeros(3, 9, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, 9 - length :] = torch.randint(5, 97, (length,), generator=generator)
        mask[row, 9 - length :] = 1
    return ids, mask, lengths


def positions(mask):
    return (mask.cumsum(-1) - 1).clamp_min(0)


def generate(model, ids, mask, **kwargs):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                          suppress_tokens=[0, 1, 2], **kwargs)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_full_conversion_is_the_source(tie):
    source = tiny_llama(tie_word_embeddings=tie)
    model = convert_causal_lm("tiny", source=source)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    ids, mask, _ = left_padded()
    with torch.no_grad():
        expected = source(input_ids=ids, output_hidden_states=True)
        got = model(input_ids=ids, output_hidden_states=True)
        torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=1e-5)
        assert len(got.hidden_states) == len(expected.hidden_states) == 4  # embeddings, then each layer
        for mine, theirs in zip(got.hidden_states, expected.hidden_states):
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
        # padded: the source with its mask and positions counted from it, at the real tokens
        expected = source(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
        got = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
    torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], atol=1e-5, rtol=1e-5)
    source.generation_config.eos_token_id = [2, 3]
    assert convert_causal_lm("tiny", source=source).generation_config.eos_token_id == [2, 3]
    # the same greedy continuation, each model with its own cache
    assert torch.equal(generate(model, ids, mask), generate(source, ids, mask))


def test_full_conversion_of_qwen2_and_mistral_layouts():
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    for config_class, model_class in ((Qwen2Config, Qwen2ForCausalLM), (MistralConfig, MistralForCausalLM)):
        torch.manual_seed(0)
        extra = dict(sliding_window=None) if config_class is MistralConfig else {}
        source = model_class(config_class(**LLAMA, **extra)).eval()
        model = convert_causal_lm("tiny", source=source)
        assert (model.model.layers[0].self_attn.q_proj.bias is not None) == (config_class is Qwen2Config)
        ids = torch.randint(5, 97, (2, 11))
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, source(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("positions", ["text", "cache"])
def test_memory_holding_every_older_token_is_softmax_attention(positions):
    """A recall memory with room for every token that leaves the window leaves the state empty: the
    softmax over the sinks, the memory and the recent tokens is the source's attention, read at
    once or in parts through the cache. Every token held in order, its place in the cache is its
    place in the text: both positions give the source's logits."""
    source = tiny_llama()
    model = convert_causal_lm("tiny", source=source, **{**KINDS["zformer-window-memory"], "attention_memory": 64,
                                                         "attention_memory_positions": positions})
    ids = torch.randint(5, 97, (2, 30))
    with torch.no_grad():
        expected = source(input_ids=ids).logits
        torch.testing.assert_close(model(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)
        cache = model.model.new_cache()
        parts = [model(input_ids=ids[:, a:b], cache=cache).logits for a, b in [(0, 11), (11, 12), (12, 30)]]
    torch.testing.assert_close(torch.cat(parts, 1), expected, atol=1e-5, rtol=1e-5)


def test_cache_positions_read_the_held_keys_at_their_places_in_the_cache():
    """With `attention_memory_positions="cache"` and the state switched off (every window share at
    1), the last token attends over the sinks, the memory slots and the recent tokens with the keys
    rotated at 0, 1, 2, ... in that order and the query at the last place: the attention of a short
    text made of the tokens the cache holds."""
    model = converted("zformer-window-memory-cache-positions")
    attention = model.model.layers[0].self_attn
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "window_gate", None) is not None:
                module.window_gate.fill_(60.0)
    torch.manual_seed(4)
    heads, d = attention.num_heads, attention.head_dim
    length = 3 + 5 * 2 + 1  # the window, five placements, one more token
    q = torch.randn(1, heads, length, d)
    k, v = (torch.randn(1, attention.num_key_value_heads, length, d) for _ in range(2))
    layer = ZformerLlamaCache(["zformer"], [3], memory=2).layers[0]
    with torch.no_grad():
        out = attention._windowed(q, k, v, None, layer, (q, k), attention.rotate_at)[0, :, -1]  # (H, d)
    row = layer.rows[0]
    assert row["placed"] == 10 and row["memory_index"].shape[1] == 2 and int(row["memory_index"].max()) < 10
    held = [torch.cat([row["sink_keys"][h], row["memory_keys"][h], row["recent_keys"][h]]) for h in range(k.shape[1])]
    held_values = [torch.cat([row["sink_values"][h], row["memory_values"][h], row["recent_values"][h]])
                   for h in range(k.shape[1])]
    total = held[0].shape[0]
    assert total == 2 + 2 + (length - 10)  # sinks, memory, the tokens not yet placed
    for head in range(heads):
        pair = head // attention.groups
        keys = attention.rotate_at(held[pair], torch.arange(total))
        query = attention.rotate_at(q[0, head, -1:], torch.tensor([total - 1]))
        weights = torch.softmax(query @ keys.T * d**-0.5, -1)
        torch.testing.assert_close(out[head], (weights @ held_values[pair])[0], atol=1e-5, rtol=1e-5)
        # the sinks are the first tokens, kept unrotated: the text's first two keys
        torch.testing.assert_close(row["sink_keys"][pair], k[0, pair, :2])


@pytest.mark.parametrize("groups", [1, 2], ids=["heads", "grouped"])
@pytest.mark.parametrize("fading", [False, True], ids=["flat", "fading"])
def test_memory_keeps_the_tokens_the_state_recalls_worst(fading, groups):
    """A placement keeps, per key/value head, the candidates (the memory and the chunk leaving) that a
    state holding all of them recalls worst, summed over the query heads that share the pair, and
    every other placed token but the sinks joins each query head's state: the state is the sum
    written out over the tokens the memory does not hold."""
    from hf_zformer.modeling.attention_memory import memory_self_attention

    torch.manual_seed(3)
    heads, d, window, chunk, slots, sinks = 4, 8, 3, 4, 2, 1
    attention = converted("zformer-window-memory").model.layers[0].self_attn
    q = torch.randn(1, heads, window + 3 * chunk, d)
    k, v = (torch.randn(1, heads // groups, window + 3 * chunk, d) for _ in range(2))
    layer = ZformerLlamaCache(["zformer"], [window], memory=slots).layers[0]
    settings = dict(window=window, sinks=sinks, slots=slots, chunk=chunk, query_map=attention.query_map,
                    key_map=attention.key_map, window_gate=torch.zeros(heads), scaling=0.5, groups=groups,
                    decay=torch.full((heads,), 0.7) if fading else None)
    features = attention.key_map(k.repeat_interleave(groups, 1))[0]  # (H, N, F)
    with torch.no_grad():
        split = window + 2 * chunk  # two placements, then the third
        memory_self_attention(q[:, :, :split], k[:, :, :split], v[:, :, :split], None, layer, **settings)
        before = dict(layer.rows[0])
        memory_self_attention(q[:, :, split:], k[:, :, split:], v[:, :, split:], None, layer, **settings)
        row = layer.rows[0]
        assert row["placed"] == 3 * chunk and row["sink_keys"].shape[1] == sinks
        for pair_head in range(heads // groups):
            candidates = before["memory_index"][pair_head].tolist() + list(range(2 * chunk, 3 * chunk))
            pairs = torch.cat([v[0, pair_head, candidates], torch.ones(len(candidates), 1)], 1)
            error = 0
            for head in range(pair_head * groups, (pair_head + 1) * groups):
                # the state with every candidate at full weight, however long a held one has waited
                holding = before["state"][head] + features[head, candidates].T @ pairs
                recalled = features[head, candidates] @ holding
                error = error + (pairs[:, :-1] - recalled[:, :-1] / recalled[:, -1:]).pow(2).sum(-1)
            worst = {candidates[i] for i in error.topk(slots).indices.tolist()}
            assert set(row["memory_index"][pair_head].tolist()) == worst, pair_head
            if fading:  # the state's faded sum is held by the tests of the whole layer (cache equals no cache)
                continue
            rest = [j for j in range(sinks, 3 * chunk) if j not in worst]
            values = torch.cat([v[0, pair_head, rest], torch.ones(len(rest), 1)], 1)
            for head in range(pair_head * groups, (pair_head + 1) * groups):
                torch.testing.assert_close(row["state"][head], features[head, rest].T @ values, atol=1e-5, rtol=1e-5)


def test_window_covering_every_token_is_softmax_attention():
    """With a window no shorter than the text, the windowed layer's weights are all softmax: the
    source's function, whatever the feature maps."""
    source = tiny_llama()
    model = converted("zformer-window", source)
    model.config.attention_window = 64
    for layer in model.model.layers:
        layer.self_attn.window = 64
    ids = torch.randint(5, 97, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, source(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sinks,fading", [(0, False), (2, False), (2, True)],
                         ids=["window", "window-and-sinks", "window-sinks-fading"])
def test_windowed_attention_against_its_weights_written_out(sinks, fading, monkeypatch):
    """The weights of each query written out: softmax inside the window (and on the sinks: the first
    real tokens of each row, here left-padded in row 1), the feature map on the other older keys
    (fading by r per token of age beyond the window with `decay`; blocks of 3 tokens, so the faded
    sums cross blocks)."""
    from hf_zformer.modeling import policy

    monkeypatch.setattr(policy, "_active", policy.active().replaced(zformer_causal_block=3))
    torch.manual_seed(0)
    batch, heads, length, dim, window = 2, 3, 11, 4, 4
    query, key, value = (torch.randn(batch, heads, length, dim, dtype=torch.float64) for _ in range(3))
    query_features, key_features = (torch.rand(batch, heads, length, 6, dtype=torch.float64) for _ in range(2))
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, :3] = 0
    sink_index = torch.tensor([[0, 1], [3, 4]])[:, :sinks]  # each row's first real tokens
    is_sink = torch.zeros(batch, length, dtype=torch.bool).scatter(1, sink_index, True)
    key_features = key_features * (mask * ~is_sink)[:, None, :, None]
    share = torch.tensor([0.2, 0.5, 0.9], dtype=torch.float64)
    at_sinks = sink_index[:, None, :, None].expand(-1, heads, -1, dim)
    given = (key.gather(2, at_sinks), value.gather(2, at_sinks), sink_index) if sinks else None
    decay = torch.tensor([0.5, 0.8, 1.0], dtype=torch.float64) if fading else None
    out, _ = windowed_linear_attention(query, key, value, query_features, key_features, mask, None, window, share, 0.5,
                                       sinks=given, decay=decay)
    expected = torch.zeros_like(out)
    for i in range(length):
        scores = (query[:, :, i : i + 1] @ key.transpose(-1, -2))[:, :, 0] * 0.5  # (B, H, N)
        real = mask.bool()[:, None, :]
        softmax = torch.tensor([[i - window < j <= i or (bool(is_sink[b, j]) and j <= i) for j in range(length)]
                                for b in range(batch)])[:, None, :] & real  # (B, 1, N)
        top = scores.masked_fill(~softmax, float("-inf")).amax(-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, 0.0)
        weights = torch.zeros_like(scores)
        for j in range(i + 1):
            linear = (1 - share) * (query_features[:, :, i] * key_features[:, :, j]).sum(-1)
            if fading and j <= i - window:
                linear = linear * decay ** (i - window - j)
            weights[:, :, j] = torch.where(softmax[:, :, j], share * torch.exp(scores[:, :, j] - top[..., 0]), linear)
        weights = weights * real
        total = weights.sum(-1, keepdim=True)
        expected[:, :, i] = torch.einsum("bhj,bhjd->bhd", weights, value) / torch.where(total > 0, total, 1.0)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("kind", list(KINDS))
def test_cache_equals_no_cache(kind, few_row_form):
    """A prompt, then a chunk of 3 tokens, then one token at a time through the cache: the logits of
    one pass over the left-padded batch; and the same tokens generated with and without the cache,
    greedy and beam search."""
    model = few_row_form(converted(kind))  # decoding steps of 2 rows: the transposed product against the plain one
    ids, mask, _ = left_padded()
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), use_cache=False).logits
        cache = model.model.new_cache()
        steps = []
        for start, stop in [(0, 4), (4, 7)] + [(i, i + 1) for i in range(7, 9)]:
            out = model(input_ids=ids[:, start:stop], attention_mask=mask[:, :stop],
                        position_ids=positions(mask)[:, start:stop], cache=cache)
            steps.append(out.logits)
    assert isinstance(cache, ZformerLlamaCache) and cache.get_seq_length() == 9
    real = mask.bool()
    torch.testing.assert_close(torch.cat(steps, 1)[real], full[real], atol=1e-4, rtol=1e-4)
    for options in (dict(num_beams=1), dict(num_beams=3)):
        cached = generate(model, ids, mask, use_cache=True, **options)
        assert torch.equal(cached, generate(model, ids, mask, use_cache=False, **options)), options
        assert len(set(cached[0, 9:].tolist())) > 1  # a real, varied continuation


def test_sinks_fill_from_the_first_real_tokens_whatever_mask_the_steps_pass():
    """Six sinks and rows of 9, 5 and 7 real tokens (left-padded): the 5-token row's sixth sink is
    the first token after its prompt, and step by step the logits are those of one pass over the text."""
    model = converted("zformer-window-sinks")
    model.config.attention_sinks = 6
    for layer in model.model.layers:
        layer.self_attn.sinks = 6
    ids, mask, _ = left_padded()
    more = torch.randint(5, 97, (3, 4), generator=torch.Generator().manual_seed(3))
    text, text_mask = torch.cat([ids, more], 1), torch.cat([mask, torch.ones_like(more)], 1)
    with torch.no_grad():
        full = model(input_ids=text, attention_mask=text_mask, position_ids=positions(text_mask)).logits
        cache = model.model.new_cache()
        steps = [model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), cache=cache).logits]
        for stop in range(10, 14):
            steps.append(model(input_ids=text[:, stop - 1 : stop], attention_mask=text_mask[:, :stop],
                               position_ids=positions(text_mask)[:, stop - 1 : stop], cache=cache).logits)
    real = text_mask.bool()
    torch.testing.assert_close(torch.cat(steps, 1)[real], full[real], atol=1e-4, rtol=1e-4)
    assert cache.layers[0].sink_index.tolist() == [[0, 1, 2, 3, 4, 5], [4, 5, 6, 7, 8, 9], [2, 3, 4, 5, 6, 7]]


def test_window_fills_up_while_decoding_from_a_prompt_shorter_than_it():
    """A 2-token prompt and a window of 8: the cache keeps every token until it holds the last 7, and
    each step's logits are those of one pass over the whole text."""
    model = convert_causal_lm("tiny", source=tiny_llama(), attention_type="zformer", zformer_feature_map="hedgehog",
                              attention_window=8)
    ids = torch.randint(5, 97, (1, 2))
    kept = []
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        cache, text = out.cache if hasattr(out, "cache") else out.past_key_values, ids
        for _ in range(12):
            token = out.logits[:, -1:].argmax(-1)
            text = torch.cat([text, token], 1)
            out = model(input_ids=token, cache=cache, use_cache=True)
            kept.append(cache.layers[0].keys.shape[2])
            torch.testing.assert_close(out.logits[:, -1], model(input_ids=text).logits[:, -1], atol=1e-4, rtol=1e-4)
    assert kept == [3, 4, 5, 6, 7, 7, 7, 7, 7, 7, 7, 7]


@pytest.mark.parametrize("kind", ["zformer-window", "zformer-window-sinks", "zformer-window-sinks-fading",
                                  "zformer-window-unrotated-maps"])
def test_steady_decoding_steps_take_the_short_form_and_give_the_long_forms_logits(kind, monkeypatch):
    """Past the prompt, once the window holds only real tokens and every sink lies before it, each
    step runs `ops.windowed_decode_step` (grouped key/value heads read without repeating them); in
    fp64 its logits are those of one pass over the whole text, for left-padded rows too, and a step
    where some row still has padding in its window takes the general form."""
    from hf_zformer.modeling import attention

    model = converted(kind).double()
    sinks = model.config.attention_sinks
    model.config.attention_window = 8
    for layer in model.model.layers:
        layer.self_attn.window = 8
    calls = []
    short_form = attention.windowed_decode_step
    monkeypatch.setattr(attention, "windowed_decode_step", lambda *a, **k: calls.append(1) or short_form(*a, **k))
    ids, mask, _ = left_padded()
    more = torch.randint(5, 97, (3, 8), generator=torch.Generator().manual_seed(4))
    text, text_mask = torch.cat([ids, more], 1), torch.cat([mask, torch.ones_like(more)], 1)
    steady = []
    with torch.no_grad():
        full = model(input_ids=text, attention_mask=text_mask, position_ids=positions(text_mask)).logits
        cache = model.model.new_cache()
        steps = [model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), cache=cache).logits]
        for stop in range(10, 18):
            before = len(calls)
            steps.append(model(input_ids=text[:, stop - 1 : stop], attention_mask=text_mask[:, :stop],
                               position_ids=positions(text_mask)[:, stop - 1 : stop], cache=cache).logits)
            steady.append(len(calls) - before)
    real = text_mask.bool()
    torch.testing.assert_close(torch.cat(steps, 1)[real], full[real], atol=1e-10, rtol=1e-10)
    # window 8 (tokens i - 7 ... i): the 5-token row (tokens 4-8 real) has padding in the windows of
    # tokens 9 and 10; its second sink (token 5) is inside the window up to token 12
    first_steady = 4 if sinks else 2
    assert steady == [0] * first_steady + [len(model.model.layers)] * (8 - first_steady), steady


@pytest.mark.parametrize("rotary_maps", [True, False], ids=["rotated-maps", "unrotated-maps"])
def test_unrotated_feature_maps_make_the_model_the_same_at_every_position(rotary_maps):
    """Rotary attention sees only distances: with the maps on the unrotated projections, a text gives
    the same logits at positions 0... and 40... (to the rotary table's fp32 rounding); with the maps
    on the rotated ones it does not."""
    model = converted("zformer-window-sinks" if rotary_maps else "zformer-window-unrotated-maps").double()
    ids = torch.randint(5, 97, (2, 12))
    with torch.no_grad():
        first = model(input_ids=ids).logits
        later = model(input_ids=ids, position_ids=torch.arange(40, 52)[None]).logits
    difference = float((first - later).abs().max())
    assert difference > 1e-2 if rotary_maps else difference < 1e-4, difference


@pytest.mark.parametrize("kind", list(KINDS))
def test_no_peeking(kind):
    model = converted(kind)
    ids = torch.randint(5, 97, (2, 12))
    changed = ids.clone()
    changed[:, 7:] = torch.randint(5, 97, (2, 5))
    with torch.no_grad():
        base, logits = model(input_ids=ids).logits, model(input_ids=changed).logits
    torch.testing.assert_close(logits[:, :7], base[:, :7], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits[:, 7:], base[:, 7:])


@pytest.mark.parametrize("kind", list(KINDS))
def test_left_padded_batch_is_each_row_alone(kind):
    model = converted(kind)
    ids, mask, lengths = left_padded()
    with torch.no_grad():
        batch = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
        for row, length in enumerate(lengths):
            alone = model(input_ids=ids[row : row + 1, 9 - length :]).logits[0]
            torch.testing.assert_close(batch[row, 9 - length :], alone, atol=1e-4, rtol=1e-4)
    generated = generate(model, ids, mask, num_beams=2)
    for row, length in enumerate(lengths):
        alone = generate(model, ids[row : row + 1, 9 - length :], mask[row : row + 1, 9 - length :], num_beams=2)
        assert torch.equal(generated[row, 9:], alone[0, length:]), row


@pytest.mark.parametrize("kind", list(KINDS))
def test_cache_size_is_constant_for_linear_layers(kind):
    model = converted(kind)
    ids, mask, _ = left_padded()
    sizes = {}
    for new in (6, 60):
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             return_dict_in_generate=True, do_sample=False)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        assert cache.get_seq_length() == ids.shape[1] + new - 1
        sizes[new] = [sum(t.numel() for t in (layer.tensors() if hasattr(layer, "tensors") else
                                              [layer.keys, layer.values])) for layer in cache.layers]
    for kind_of_layer, short, long in zip(model.config.layer_attention_types(), sizes[6], sizes[60]):
        assert (long > short > 0) if kind_of_layer == "full" else (short == long > 0), (kind_of_layer, short, long)


def test_save_load_and_auto_class(tmp_path):
    model = converted("hybrid")
    model.save_pretrained(tmp_path / "saved")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    assert type(loaded) is ZformerLlamaForCausalLM
    ids = torch.randint(5, 97, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    reference = full_attention_copy(model)
    assert reference.config.layer_attention_types() == ["full"] * 3
    assert reference.model.layers[0].self_attn.q_proj.weight.data_ptr() != model.model.layers[0].self_attn.q_proj.weight.data_ptr()
    torch.testing.assert_close(reference.model.layers[0].self_attn.q_proj.weight, model.model.layers[0].self_attn.q_proj.weight)


def test_remote_code_generations_in_clean_process(tmp_path):
    ids, mask, _ = left_padded()
    models = {kind: converted(kind) for kind in ("full", "zformer-window", "fastformer", "zformer-identity",
                                                 "zformer-window-memory", "zformer-window-memory-cache-positions")}
    assert_same_generations_in_clean_process(
        tmp_path, "AutoModelForCausalLM", models, dict(input_ids=ids, attention_mask=mask), num_beams=2,
        max_new_tokens=8, min_new_tokens=8, suppress_tokens=[0, 1, 2],
    )


def test_hidden_states_and_tuples_follow_the_arguments_and_the_config():
    """`output_hidden_states` and `return_dict`, given or from the config, as every transformers
    model: the embeddings and each layer's output, the last after the final norm."""
    model = converted("hybrid")
    ids = torch.randint(5, 97, (2, 10))
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
        assert len(out.hidden_states) == LLAMA["num_hidden_layers"] + 1
        torch.testing.assert_close(out.hidden_states[0], model.model.embed_tokens(ids))
        base = model.model(input_ids=ids, output_hidden_states=True)
        torch.testing.assert_close(base.hidden_states[-1], base.last_hidden_state)
        last_hidden, cache = model.model(input_ids=ids, return_dict=False)
        torch.testing.assert_close(last_hidden, base.last_hidden_state)
        assert isinstance(cache, ZformerLlamaCache)
        model.config.output_hidden_states, model.config.return_dict = True, False
        logits, cache, hidden_states = model(input_ids=ids)
        assert isinstance(cache, ZformerLlamaCache)
        torch.testing.assert_close(logits, out.logits)
        for got, expected in zip(hidden_states, out.hidden_states, strict=True):
            torch.testing.assert_close(got, expected)
        assert model.model(input_ids=ids)[-1] is not None  # the base model's hidden states, from the config


def test_shift_labels_are_the_targets_of_the_logits():
    """Targets shifted before the call (Trainer under sequence or context parallelism) score
    logits[i] against shift_labels[i], whatever `labels` say."""
    model = converted("hybrid")
    ids = torch.randint(5, 97, (2, 10))
    shift_labels = torch.randint(0, 97, (2, 10))
    for labels in (ids, torch.zeros_like(ids), None):
        out = model(input_ids=ids, labels=labels, shift_labels=shift_labels)
        torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(out.logits.reshape(-1, 97),
                                                                               shift_labels.reshape(-1)))


@pytest.mark.parametrize("tie", [True, False])
def test_tensor_parallel_plan_shards_a_tied_head_with_its_embeddings(tie):
    model = convert_causal_lm("tiny", source=tiny_llama(tie_word_embeddings=tie), attention_type="zformer")
    plan = model.tp_plan
    assert ("lm_head" in plan) == ("model.embed_tokens" in plan) and "lm_head" in plan
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie


def test_training_step_moves_the_new_attention_parameters():
    model = converted("hybrid").train()
    ids = torch.randint(5, 97, (2, 10))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    gates = model.model.layers[0].self_attn
    assert gates.window_gate.grad is not None and gates.query_map.weight.grad.abs().sum() > 0
    assert model.model.layers[2].self_attn.transform.weight.grad.abs().sum() > 0


def test_identity_and_fastformer_layers_are_calibrated_to_the_softmax_size():
    from hf_zformer.conversion.convert_decoder import attention_calls

    source = tiny_llama()
    reference = convert_causal_lm("tiny", source=source)
    for kind in ("zformer-identity", "fastformer"):
        model = convert_causal_lm("tiny", source=source, **KINDS[kind])
        ids = torch.randint(0, 97, (1, 128), generator=torch.Generator().manual_seed(0))
        calls, expected = attention_calls(model, ids, None), attention_calls(reference, ids, None)
        with torch.no_grad():
            for i in calls:
                size = calls[i][1].square().mean().sqrt()
                target = expected[i][1].square().mean().sqrt()
                if i == 0:  # same input in both models at the first layer: the sizes match
                    torch.testing.assert_close(size, target, rtol=1e-3, atol=0)


@pytest.mark.parametrize("fields, message", [
    (dict(attention_type="xformer"), "attention_type='xformer' is not supported"),
    (dict(attention_type=["full", "zformer"]), "attention_type has 2 entries"),
    (dict(attention_type="zformer", zformer_feature_map="identity", attention_window=8), "only zformer layers with"),
    (dict(attention_type="fastformer", attention_window=8), "only zformer layers with"),
    (dict(attention_type="zformer", attention_window=-1), "attention_window=-1 must be a non-negative"),
    (dict(zformer_feature_map="cosine"), "zformer_feature_map='cosine' is not supported"),
    (dict(attention_type="zformer", attention_sinks=4), "attention_sinks=4 needs a softmax window"),
    (dict(attention_type="zformer", attention_window=8, attention_sinks=True), "attention_sinks=True must be"),
    (dict(attention_type="zformer", feature_map_horizon=512), "feature_map_horizon=512 needs a softmax window"),
    (dict(attention_type="zformer", rotary_feature_maps=False), "rotary_feature_maps=False needs a softmax window"),
    (dict(attention_type="zformer", attention_window=8, rotary_feature_maps="no"), "rotary_feature_maps='no' must be"),
    (dict(attention_type="zformer", attention_window=8, feature_map_horizon=-5),
     "feature_map_horizon=-5 must be a non-negative integer"),
    (dict(attention_type="zformer", attention_memory=8), "attention_memory=8 needs a softmax window"),
    (dict(attention_type="zformer", attention_window=8, attention_memory=-1), "attention_memory=-1 must be an integer"),
    (dict(attention_type="zformer", attention_window=8, attention_memory=4, attention_memory_chunk=0),
     "attention_memory_chunk=0 must be an integer, at least 1"),
    (dict(attention_type="zformer", attention_window=8, attention_memory=4, attention_memory_positions="rope"),
     "attention_memory_positions='rope': choose one of"),
    (dict(attention_type="zformer", attention_window=8, attention_memory_positions="cache"),
     "attention_memory_positions='cache' reads a recall memory's keys; attention_memory=0"),
])
def test_bad_configs_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        ZformerLlamaConfig(**LLAMA, **fields)


def test_convert_pretrained_and_script_from_a_folder(tmp_path):
    source = tiny_llama(tie_word_embeddings=True)
    source.save_pretrained(tmp_path / "llama")
    model = convert_pretrained(tmp_path / "llama", "zformer", tmp_path / "out", attention_window=4)
    assert type(model) is ZformerLlamaForCausalLM and model.config.layer_windows() == [4, 4, 4]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(5, 97, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    assert "text-generation" in (tmp_path / "out" / "README.md").read_text()
    with pytest.raises(ValueError, match="task='fill-mask'.*causal language model"):
        convert_pretrained(tmp_path / "llama", "zformer", task="fill-mask")
    with pytest.raises(ValueError, match="num_hidden_layers=2 cannot be set"):
        convert_pretrained(tmp_path / "llama", "zformer", num_hidden_layers=2)
    result = warm_scripts.run_python(
        [sys.executable, str(REPO_ROOT / "scripts" / "convert_checkpoint.py"), "--model_name_or_path",
         str(tmp_path / "llama"), "--attention_type", "zformer", "--task", "text-generation", "--config_overrides",
         "zformer_feature_map=hedgehog,attention_window=64|64|32", "--output_dir", str(tmp_path / "script")],
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    script_model = AutoModelForCausalLM.from_pretrained(tmp_path / "script").eval()
    assert script_model.config.layer_windows() == [64, 64, 32]
    # windows longer than the text: softmax weights only, the source's function
    with torch.no_grad():
        torch.testing.assert_close(script_model(input_ids=ids).logits, source(input_ids=ids).logits, atol=1e-5,
                                   rtol=1e-5)


def test_inputs_that_do_not_fit_are_named_with_their_shapes():
    """As the Zformer-family models: a 1-D input, an empty sequence, a mask of another shape, a
    cache of another batch and a fractional mask are ValueErrors naming the shapes (or the value)."""
    model = converted("zformer-window").eval()
    ids = torch.randint(3, 50, (2, 5))
    with torch.no_grad():
        for inputs, message in ((dict(input_ids=ids[0]), r"input_ids has shape \(5,\)"),
                                (dict(input_ids=ids[:, :0]), "an empty sequence"),
                                (dict(input_ids=ids, attention_mask=torch.ones(2, 4)),
                                 r"attention_mask has shape \(2, 4\), but input_ids has shape \(2, 5\)"),
                                (dict(input_ids=ids, attention_mask=torch.tensor([[1, 1, 1, 1, 0.5]] * 2)),
                                 "it holds 0.5")):
            with pytest.raises(ValueError, match=message):
                model(**inputs)
        from hf_zformer.modeling.modeling_zformer import CACHE_FIELD

        cache = getattr(model(input_ids=ids, use_cache=True), CACHE_FIELD)
        with pytest.raises(ValueError, match=r"the cache holds a batch of 2 sequences, but input_ids has shape \(3, 1\)"):
            model(input_ids=torch.ones(3, 1, dtype=torch.long), cache=cache, use_cache=True)
