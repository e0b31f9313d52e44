"""Zformer with a learned feature map (`zformer_feature_map="hedgehog"`): normalised linear attention
out_i = sum_j (phi(q_i) . phi(k_j)) v_j / sum_j (phi(q_i) . phi(k_j)). Every form (bidirectional,
cross, causal with and without the cache) against the explicit quadratic weights a_ij in fp64,
outputs and gradients; padding, causality, generation, saving and loading, and the converter."""

import pytest
import torch
from conftest import TINY, assert_same_generations_in_clean_process, random_batch, tiny_config
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoModelForSequenceClassification

import hf_zformer
from hf_zformer import ZformerCache
from hf_zformer.modeling.attention import ZformerAttention
from hf_zformer.modeling.ops import normalized_attention_weights

B, N, D, H = 3, 9, 32, 4
DH = D // H


def hedgehog_attention(**roles):
    """A ZformerAttention with the hedgehog map, random weights everywhere (feature maps included), fp64."""
    attention = ZformerAttention(tiny_config(zformer_feature_map="hedgehog"), layer_idx=0, **roles)
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in attention.parameters():
            parameter.normal_(std=0.3)
        for feature_map in (attention.query_map, attention.key_map):
            feature_map.weight.add_(torch.eye(DH))  # around the identity, as training leaves it
    return attention.double()


def _mask():
    mask = torch.ones(B, N, dtype=torch.long)
    mask[1, 6:] = 0  # right padding
    mask[2, :4] = 0  # left padding: the first queries of a causal row see no real key
    return mask


def _phi(x, feature_map):
    """phi(x) = [softmax(W x + b), softmax(-(W x + b))] written out per head (x (B, N, D) -> (B, H, N, 2d))."""
    heads = x.view(x.shape[0], x.shape[1], H, DH).transpose(1, 2)
    projected = torch.einsum("bhnd,hed->bhne", heads, feature_map.weight) + feature_map.bias[:, None, :]
    return torch.cat([torch.softmax(projected, -1), torch.softmax(-projected, -1)], -1)


def reference_output(attention, x, mask=None, memory=None, memory_mask=None):
    """W_o (a V) with the weights a_ij built explicitly (`normalized_attention_weights`)."""
    source, source_mask = (memory, memory_mask) if attention.is_cross else (x, mask)
    weights = normalized_attention_weights(_phi(attention.query(x), attention.query_map),
                                           _phi(attention.key(source), attention.key_map), source_mask,
                                           causal=attention.is_causal)
    value = attention.value(source).view(source.shape[0], source.shape[1], H, DH).transpose(1, 2)
    return attention.output((weights @ value).transpose(1, 2).reshape(x.shape[0], x.shape[1], D))


def _output_and_gradients(output, inputs, attention):
    loss = (output * torch.linspace(-1, 1, output.numel(), dtype=output.dtype).view_as(output)).sum()
    loss = loss + output.pow(2).sum()
    return output, torch.autograd.grad(loss, [*inputs, *attention.parameters()])


def _assert_same(first, second, atol=1e-10):
    torch.testing.assert_close(first[0], second[0], atol=atol, rtol=1e-10)
    for a, b in zip(first[1], second[1], strict=True):
        assert torch.isfinite(a).all() and torch.isfinite(b).all()
        torch.testing.assert_close(a, b, atol=atol, rtol=1e-9)


def test_weights_reference_is_the_equation():
    """normalized_attention_weights, loop by loop: a_ij over real (and, causal, earlier) keys, rows
    summing to 1, a row with no key all zero."""
    generator = torch.Generator().manual_seed(0)
    query, key = torch.rand(2, 1, 1, 5, 6, generator=generator, dtype=torch.float64).unbind(0)
    mask = torch.tensor([[0, 1, 1, 0, 1]])
    for causal in (False, True):
        weights = normalized_attention_weights(query, key, mask, causal=causal)[0, 0]
        for i in range(5):
            allowed = [j for j in range(5) if mask[0, j] and (j <= i or not causal)]
            scores = torch.zeros(5, dtype=torch.float64)
            for j in allowed:
                scores[j] = query[0, 0, i] @ key[0, 0, j]
            expected = scores / scores.sum() if allowed else scores
            torch.testing.assert_close(weights[i], expected)
    assert normalized_attention_weights(query, key, mask, causal=True)[0, 0, 0].abs().max() == 0


@pytest.mark.parametrize("role", ["bidirectional", "causal", "cross"])
@pytest.mark.parametrize("with_mask", [False, True])
def test_every_form_equals_the_quadratic_reference(role, with_mask):
    """Outputs and the gradients of every input and parameter equal the explicit a_ij reference's,
    in fp64, with right and left padding and (cross) an all-padding memory row."""
    attention = hedgehog_attention(is_causal=role == "causal", is_cross=role == "cross")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(B, N, D, generator=generator, dtype=torch.float64).requires_grad_()
    mask = _mask() if with_mask else None
    if role == "cross":
        memory = torch.randn(B, 7, D, generator=generator, dtype=torch.float64).requires_grad_()
        memory_mask = torch.ones(B, 7, dtype=torch.long)
        memory_mask[1, 3:] = 0
        memory_mask[2] = 0  # nothing to attend to: zero context, finite gradients
        memory_mask = memory_mask if with_mask else None
        got = attention(x, memory=memory, memory_mask=memory_mask)[0]
        expected = reference_output(attention, x, memory=memory, memory_mask=memory_mask)
        inputs = [x, memory]
    else:
        got, expected = attention(x, mask)[0], reference_output(attention, x, mask)
        inputs = [x]
    _assert_same(_output_and_gradients(got, inputs, attention), _output_and_gradients(expected, inputs, attention))



@pytest.mark.parametrize("with_mask", [False, True])
def test_output_and_weights_in_one_pass_equal_forward_and_attention_weights(with_mask):
    """`output_and_weights` (what distillation uses, features computed once) returns forward's output
    and `attention_weights`' weights, with the same gradients, in fp64; causal and cross modules
    are refused."""
    attention = hedgehog_attention()
    x = torch.randn(B, N, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64).requires_grad_()
    mask = _mask() if with_mask else None
    output, weights = attention.output_and_weights(x, mask)
    torch.testing.assert_close(weights, attention.attention_weights(x, mask), rtol=0, atol=0)
    _assert_same(_output_and_gradients(output, [x], attention), _output_and_gradients(attention(x, mask)[0], [x], attention))
    for role in ("is_causal", "is_cross"):
        with pytest.raises(ValueError, match="bidirectional self-attention only"):
            hedgehog_attention(**{role: True}).output_and_weights(x, mask)

def test_causal_blocks_equal_one_pass(monkeypatch):
    """Sequences longer than a block (prefix sums across blocks) give the reference too."""
    from hf_zformer.modeling.policy import use_policy

    attention = hedgehog_attention(is_causal=True)
    x = torch.randn(B, N, D, dtype=torch.float64, requires_grad=True)
    with use_policy(zformer_causal_block=4):
        _assert_same(_output_and_gradients(attention(x, _mask())[0], [x], attention),
                     _output_and_gradients(reference_output(attention, x, _mask()), [x], attention))


def test_cache_equals_no_cache_in_blocks_and_steps():
    """Through the cache, blocks after a state and single steps give the one-pass output, with left
    padding (the first row's first block is padding only); the state is [S | z] (B, H, 2d, d + 1):
    S = sum phi(k_j) v_j^T and z = sum phi(k_j) over the real tokens."""
    attention = hedgehog_attention(is_causal=True)
    x = torch.randn(B, N, D, dtype=torch.float64)
    mask = _mask()
    mask[0, :3] = 0
    one_pass, _ = attention(x, mask)
    for sizes in ((3, 1, 4, 1), (1,) * N, (N,)):
        cache, outputs, start = ZformerCache(["zformer"]), [], 0
        for size in sizes:
            outputs.append(attention(x[:, start : start + size], mask[:, : start + size], cache=cache)[0])
            start += size
        torch.testing.assert_close(torch.cat(outputs, 1), one_pass, atol=1e-10, rtol=1e-10)
    (state,) = cache.layers[0].tensors()
    assert state.shape == (B, H, 2 * DH, DH + 1) and cache.get_seq_length() == N
    with torch.no_grad():
        keys = _phi(attention.key(x), attention.key_map) * mask[:, None, :, None]
        values = attention.value(x).view(B, N, H, DH).transpose(1, 2)
    torch.testing.assert_close(state[..., :DH], keys.transpose(-1, -2) @ values)
    torch.testing.assert_close(state[..., DH], keys.sum(2))


@pytest.mark.parametrize("role", ["bidirectional", "causal", "cross"])
def test_padding_changes_nothing_and_queries_without_keys_are_zero(role):
    attention = hedgehog_attention(is_causal=role == "causal", is_cross=role == "cross")
    x = torch.randn(B, N, D, dtype=torch.float64)
    extra = torch.randn(B, 4, D, dtype=torch.float64)
    if role == "cross":
        memory, memory_mask = torch.randn(B, 5, D, dtype=torch.float64), torch.ones(B, 5, dtype=torch.long)
        base = attention(x, memory=memory, memory_mask=memory_mask)[0]
        padded = attention(x, memory=torch.cat([memory, extra], 1),
                           memory_mask=torch.cat([memory_mask, torch.zeros(B, 4, dtype=torch.long)], 1))[0]
        torch.testing.assert_close(padded, base, atol=1e-12, rtol=1e-12)
        return
    mask = _mask()
    base = attention(x, mask)[0]
    padded = attention(torch.cat([x, extra], 1), torch.cat([mask, torch.zeros(B, 4, dtype=torch.long)], 1))[0]
    real = mask.bool()
    torch.testing.assert_close(padded[:, :N][real], base[real], atol=1e-12, rtol=1e-12)
    if role == "causal":  # left padding: the first queries see no real key, context zero (W_o's bias remains)
        torch.testing.assert_close(base[2, :4], attention.output.bias.expand(4, D))
        assert torch.isfinite(base).all()


def test_causal_does_not_peek():
    attention = hedgehog_attention(is_causal=True)
    x = torch.randn(B, N, D, dtype=torch.float64)
    changed = x.clone()
    changed[:, 5:] = torch.randn(B, N - 5, D, dtype=torch.float64)
    base, other = attention(x)[0], attention(changed)[0]
    torch.testing.assert_close(other[:, :5], base[:, :5], atol=1e-12, rtol=1e-12)
    assert not torch.allclose(other[:, 5:], base[:, 5:])


def test_sums_stay_fp32_under_autocast():
    attention = hedgehog_attention().float().eval()
    x = torch.randn(1, 2048, D) * 4
    reference, _ = attention(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low, _ = attention(x)
    assert ((low.float() - reference).norm() / reference.norm()) < 0.05


def test_bad_value_is_refused_by_name():
    with pytest.raises(ValueError, match="zformer_feature_map='softmax' is not supported"):
        tiny_config(zformer_feature_map="softmax")
    config = tiny_config()
    config.zformer_feature_map = "relu"  # set after construction: refused when a model is built
    with pytest.raises(ValueError, match="zformer_feature_map='relu'"):
        hf_zformer.ZformerModel(config)
    # a map on a config without any zformer layer would change nothing: refused, naming the types
    with pytest.raises(ValueError, match="applies to zformer layers and this config has none .attention_type='full'"):
        tiny_config(attention_type="full", zformer_feature_map="hedgehog")
    with pytest.raises(ValueError, match="attention_type=\\['full', 'fastformer'\\]"):
        tiny_config(attention_type=["full", "fastformer"], zformer_feature_map="hedgehog")
    tiny_config(attention_type=["full", "zformer"], zformer_feature_map="hedgehog")  # one zformer layer is enough
    tiny_config(attention_type="full", decoder_attention_type="zformer", zformer_feature_map="hedgehog")


def test_identity_keeps_its_parameters_and_hedgehog_has_no_scale():
    """The default builds exactly the parameters it always had; hedgehog adds the two maps (identity
    at init) and has no scale s."""
    plain = {n for n, _ in ZformerAttention(tiny_config()).named_parameters()}
    assert plain == {f"{p}.{w}" for p in ("query", "key", "value", "output") for w in ("weight", "bias")} | {"log_scale"}
    config = tiny_config(zformer_feature_map="hedgehog")
    model = hf_zformer.ZformerModel(config)
    attention = model.encoder.layers[0].attention
    names = {n for n, _ in attention.named_parameters()}
    assert names == plain - {"log_scale"} | {f"{m}.{w}" for m in ("query_map", "key_map") for w in ("weight", "bias")}
    torch.testing.assert_close(attention.query_map.weight, torch.eye(DH).expand(H, DH, DH))
    assert attention.key_map.bias.abs().max() == 0


def seq2seq():
    config = AutoConfig.for_model("zformer", **{**TINY, "attention_type": "zformer", "decoder_attention_type": "zformer",
                                                "cross_attention_type": "zformer", "num_decoder_layers": 2,
                                                "zformer_feature_map": "hedgehog"})
    return _widened(AutoModelForSeq2SeqLM.from_config(config))


def causal_lm():
    config = AutoConfig.for_model("zformer", **{**TINY, "attention_type": "zformer", "zformer_feature_map": "hedgehog"})
    return _widened(AutoModelForCausalLM.from_config(config))


def _widened(model):
    """Wider weights than the default init (every output depends on the whole input), maps off the identity."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2:
                parameter.normal_(std=0.2)
            elif name.endswith("_map.weight"):
                parameter.add_(torch.randn_like(parameter) * 0.5)
    return model.eval()


def _generate(model, ids, mask, **kwargs):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8,
                          suppress_tokens=[0, 1, 2, 3, 4], no_repeat_ngram_size=2, **kwargs)


@pytest.mark.parametrize("kind", ["seq2seq", "causal-lm"])
def test_generation_with_cache_equals_without(kind):
    """Logits token by token through the cache equal one pass; greedy and beam search give the same
    tokens with and without the cache (the causal LM on a left-padded batch)."""
    ids, mask = random_batch([9, 5, 7], seed=1)
    if kind == "seq2seq":
        model = seq2seq()
        target = torch.randint(5, TINY["vocab_size"], (3, 8))
        full = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target, use_cache=False).logits
        encoder_outputs, state, steps = model.get_encoder()(input_ids=ids, attention_mask=mask), None, []
        for i in range(target.shape[1]):
            out = model(encoder_outputs=encoder_outputs, attention_mask=mask, decoder_input_ids=target[:, i : i + 1],
                        past_key_values=state, use_cache=True)
            state = out.past_key_values
            steps.append(out.logits)
        torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=1e-4)
    else:
        model = causal_lm()
        width = ids.shape[1]  # left padding: each row's tokens at the end
        lengths = mask.sum(1).tolist()
        ids = torch.stack([torch.roll(row, width - n) for row, n in zip(ids, lengths)])
        mask = torch.stack([torch.roll(row, width - n) for row, n in zip(mask, lengths)])
        full = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        out = model(input_ids=ids[:, :4], attention_mask=mask[:, :4], use_cache=True)
        cache, steps = out.past_key_values, [out.logits]
        for i in range(4, width):
            out = model(input_ids=ids[:, i : i + 1], attention_mask=mask[:, : i + 1], past_key_values=cache)
            steps.append(out.logits)
        real = mask.bool()
        torch.testing.assert_close(torch.cat(steps, 1)[real], full[real], atol=1e-4, rtol=1e-4)
    for kwargs in (dict(num_beams=1, do_sample=False), dict(num_beams=3, do_sample=False)):
        cached = _generate(model, ids, mask, use_cache=True, **kwargs)
        assert torch.equal(cached, _generate(model, ids, mask, use_cache=False, **kwargs)), kwargs
        assert len(set(cached[0, -8:].tolist())) > 1  # a real, varied continuation


def test_save_load_round_trip_and_remote_code(tmp_path):
    """A classifier reloads with identical outputs (from_pretrained); a seq2seq model with hedgehog
    encoder, decoder and cross-attention generates the same tokens through remote code, in a process
    without hf_zformer."""
    config = tiny_config(zformer_feature_map="hedgehog", num_labels=2)
    classifier = _widened(AutoModelForSequenceClassification.from_config(config))
    classifier.save_pretrained(tmp_path / "classifier")
    loaded, info = AutoModelForSequenceClassification.from_pretrained(tmp_path / "classifier",
                                                                       output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids, mask = random_batch([9, 5, 7], seed=1)
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(input_ids=ids, attention_mask=mask).logits,
                                   classifier(input_ids=ids, attention_mask=mask).logits, atol=0, rtol=0)
    assert loaded.config.zformer_feature_map == "hedgehog"
    assert_same_generations_in_clean_process(
        tmp_path, "AutoModelForSeq2SeqLM", {"hedgehog": seq2seq()}, dict(input_ids=ids, attention_mask=mask),
        num_beams=2, max_new_tokens=6, min_new_tokens=6, suppress_tokens=[0, 1, 2, 3, 4],
    )


# The converter: tiny random BERT sources (tests/test_convert.py's)


def test_convert_with_hedgehog_starts_at_identity_without_scale(tmp_path):
    from test_convert import make_source, right_padded_batch

    folder, source = make_source(tmp_path, "bert", "classification")
    model = hf_zformer.convert_pretrained(folder, "zformer", zformer_feature_map="hedgehog")
    assert model.config.zformer_feature_map == "hedgehog" and model.config.zformer_scale_init == 700.0  # not calibrated
    for layer, source_layer in zip(model.zformer.encoder.layers, source.bert.encoder.layer):
        assert layer.attention.log_scale is None
        for feature_map in (layer.attention.query_map, layer.attention.key_map):
            torch.testing.assert_close(feature_map.weight, torch.eye(DH).expand(H, DH, DH), atol=0, rtol=0)
        torch.testing.assert_close(layer.attention.key.weight, source_layer.attention.self.key.weight, atol=0, rtol=0)
    ids, mask = right_padded_batch(0, lengths=(7, 4))
    with torch.no_grad():
        batch = model(input_ids=ids, attention_mask=mask).logits
        alone = model(input_ids=ids[1:, :4], attention_mask=mask[1:, :4]).logits
    torch.testing.assert_close(batch[1:], alone, atol=1e-5, rtol=1e-5)


def test_distillation_fits_weights_and_outputs_and_reports_both(tmp_path):
    """With a feature map the layer-wise loss adds the attention-weight cross-entropy: both fall on
    held-out texts, the report and the model card carry both, and a zero weight leaves the outputs
    loss alone (the report still measures the cross-entropy)."""
    import copy

    from test_convert import _sentences, make_source
    from transformers import AutoTokenizer

    from hf_zformer.conversion.convert import distill_attention

    folder, _ = make_source(tmp_path, "bert", "classification")
    settings = dict(steps=25, batch_size=8, learning_rate=3e-3, eval_texts=16)
    distillation = hf_zformer.Distillation(_sentences(80), **settings)
    torch.manual_seed(0)
    model = hf_zformer.convert_pretrained(folder, ["zformer", "full"], tmp_path / "out", distillation=distillation,
                                          zformer_feature_map="hedgehog")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "attention_weight_loss: 1.0" in card and "held-out cross-entropy per layer" in card
    reference = hf_zformer.convert_pretrained(folder, "full")
    start = hf_zformer.convert_pretrained(folder, ["zformer", "full"], zformer_feature_map="hedgehog")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    report = distill_attention(copy.deepcopy(start), reference, tokenizer, distillation, progress=False)
    assert report["layers"] == [0] and report["attention_weight_loss"] == 1.0
    assert report["after"][0] < 0.8 * report["before"][0]
    assert report["weight_loss_after"][0] < report["weight_loss_before"][0]
    outputs_only = distill_attention(copy.deepcopy(start), reference, tokenizer,
                                     hf_zformer.Distillation(_sentences(80), attention_weight_loss=0.0, **settings),
                                     progress=False)
    assert outputs_only["weight_loss_before"] == report["weight_loss_before"]
    assert outputs_only["weight_loss_after"] != report["weight_loss_after"]
    assert model.zformer.encoder.layers[0].attention.query_map.weight.requires_grad
    # the training loss takes output and weights from one pass: its output errors are forward's
    from hf_zformer.conversion.distillation import encoder_attention_calls, layer_losses, relative_errors

    batch = tokenizer(distillation.texts[:8], padding=True, return_tensors="pt")
    with torch.no_grad():
        calls = encoder_attention_calls(reference, batch["input_ids"], batch["attention_mask"])
        errors, cross_entropies = layer_losses(model, reference, calls, [0], batch["attention_mask"])
        torch.testing.assert_close(errors, relative_errors(model, calls, [0], batch["attention_mask"]))
    assert len(cross_entropies) == 1 and cross_entropies[0] > 0
    with pytest.raises(ValueError, match="attention_weight_loss must be >= 0, got -1"):
        hf_zformer.Distillation(_sentences(40), attention_weight_loss=-1)
