"""Each attention class against a naive, loop-based reading of the equations in DESIGN.md."""

import math

import pytest
import torch
from conftest import CountedOps, tiny_config

from hf_zformer.modeling.attention import (
    FastformerAttention,
    einsum_attention_forward,
    FullAttention,
    XformerAttention,
    ZformerAttention,
)
from hf_zformer.modeling import ops, ops_linear_attention
from hf_zformer.modeling.policy import use_policy
from hf_zformer.modeling.cache_zformer import ZformerCache

B, N, D, H = 2, 11, 32, 4
DH = D // H


def _inputs(seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N, D, generator=generator)
    mask = torch.ones(B, N, dtype=torch.long)
    mask[1, 7:] = 0
    return x, mask


def _heads(t, h=H):
    return t.view(t.shape[0], h, t.shape[1] // h)


def _randomize(module, std=0.3):
    torch.manual_seed(1)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=std)
    return module


def test_full_sdpa_equals_einsum_reference():
    x, mask = _inputs()
    sdpa_config = tiny_config(attention_type="full")
    eager_config = tiny_config(attention_type="full")
    sdpa_config._attn_implementation = "sdpa"
    eager_config._attn_implementation = "eager"
    fused = _randomize(FullAttention(sdpa_config)).eval()
    reference = FullAttention(eager_config).eval()
    reference.load_state_dict(fused.state_dict())
    for causal in (False, True):
        fused.is_causal = reference.is_causal = causal
        out_fused, _ = fused(x, mask)
        out_ref, _ = reference(x, mask)
        real = mask.bool()
        torch.testing.assert_close(out_fused[real], out_ref[real], atol=1e-5, rtol=1e-5)


def test_einsum_reference_gives_padding_exactly_zero_weight():
    q, k, v = torch.randn(3, B, H, N, DH).unbind(0)
    key_mask = torch.ones(B, 1, 1, N, dtype=torch.bool)
    key_mask[1, ..., 7:] = False
    output, weights = einsum_attention_forward(torch.nn.Identity(), q, k, v, key_mask, scaling=DH**-0.5)
    # the transformer-with-einsum reference code filled masked scores with 1e-12, which let padding into the softmax
    assert weights[1, :, :, 7:].abs().max() == 0
    torch.testing.assert_close(weights.sum(-1), torch.ones(B, H, N))
    expected = torch.softmax(q[1] @ k[1, :, :7].transpose(-1, -2) * DH**-0.5, dim=-1) @ v[1, :, :7]
    torch.testing.assert_close(output[1].transpose(0, 1), expected)
    # a row with no real key attends to nothing: zero weights and a zero context, not NaN
    key_mask[0] = False
    q.requires_grad_()
    output, weights = einsum_attention_forward(torch.nn.Identity(), q, k, v, key_mask, scaling=DH**-0.5)
    assert weights[0].abs().max() == 0 and output[0].abs().max() == 0
    output.sum().backward()
    assert torch.isfinite(q.grad).all()


def test_full_causal_cache_equals_one_pass():
    x, _ = _inputs()
    attention = _randomize(FullAttention(tiny_config(attention_type="full"), is_causal=True, layer_idx=0)).eval()
    one_pass, _ = attention(x)
    cache, steps = ZformerCache(["full"]), []
    for i in range(N):
        steps.append(attention(x[:, i : i + 1], cache=cache)[0])
    torch.testing.assert_close(torch.cat(steps, 1), one_pass, atol=1e-5, rtol=1e-5)
    assert cache.get_seq_length() == N and cache.layers[0].keys.shape == (B, H, N, DH)


def test_zformer_matches_equation_and_causal_state():
    x, mask = _inputs()
    attention = _randomize(ZformerAttention(tiny_config(attention_type="zformer")))
    out = attention.context(x, mask)
    q = attention.query(x) / math.sqrt(DH)
    k = attention.key(x) * mask[..., None]
    v = attention.value(x)
    for b in range(B):
        for h in range(H):
            sl = slice(h * DH, (h + 1) * DH)
            expected = q[b, :, sl] @ (k[b, :, sl].T @ v[b, :, sl]) / attention.log_scale.exp()
            torch.testing.assert_close(out[b, :, sl], expected, atol=1e-4, rtol=1e-4)

    attention.is_causal, attention.layer_idx = True, 0
    causal = attention.context(x, mask)
    for i in range(N):
        for h in range(H):
            sl = slice(h * DH, (h + 1) * DH)
            expected = q[:, i, sl][:, None] @ (k[:, : i + 1, sl].transpose(1, 2) @ v[:, : i + 1, sl])
            torch.testing.assert_close(causal[:, i, sl], expected[:, 0] / attention.log_scale.exp(), atol=1e-4, rtol=1e-4)
    # token by token through the recurrent state (the cache) gives the same outputs; the state is the
    # sum of k^T v over the real tokens, of size (B, H, d, d)
    cache, steps = ZformerCache(["zformer"]), []
    for i in range(N):
        steps.append(attention.context(x[:, i : i + 1], mask[:, : i + 1], cache=cache))
    torch.testing.assert_close(torch.cat(steps, 1), causal, atol=1e-4, rtol=1e-4)
    k_heads, v_heads = (t.view(B, N, H, DH).transpose(1, 2) for t in (k, v))
    torch.testing.assert_close(cache.layers[0].state, k_heads.transpose(-1, -2) @ v_heads, atol=1e-4, rtol=1e-4)
    assert cache.get_seq_length() == N and cache.self_attention_numel() == B * H * DH * DH


def test_zformer_causal_blocks_cover_long_sequences(monkeypatch):
    x = torch.randn(1, 40, D)
    attention = _randomize(ZformerAttention(tiny_config(), is_causal=True))
    one_block, _ = attention(x)
    with use_policy(zformer_causal_block=7):
        many_blocks, _ = attention(x)
    torch.testing.assert_close(many_blocks, one_block, atol=1e-4, rtol=1e-4)


def _naive_pool(scores, values):
    weights = torch.softmax(scores, dim=0)
    return (weights[:, None] * values).sum(0)


@pytest.mark.parametrize("pooling", ["additive", "mean"])
@pytest.mark.parametrize("share_qv", [False, True])
def test_fastformer_matches_equation(pooling, share_qv):
    x, mask = _inputs()
    config = tiny_config(attention_type="fastformer", fastformer_pooling=pooling, fastformer_share_qv=share_qv)
    attention = _randomize(FastformerAttention(config))
    out = attention.context(x, mask)
    attention.is_causal = True
    causal = attention.context(x, mask)

    q_all, k_all = attention.query(x), attention.key(x)
    v_all = q_all if share_qv else attention.value(x)

    def score(values, weight):
        return values @ weight / math.sqrt(DH) if pooling == "additive" else values[:, 0] * 0

    for b in range(B):
        n = int(mask[b].sum())
        u_bidirectional, u_causal = torch.zeros(n, D), torch.zeros(n, D)
        for h in range(H):
            sl = slice(h * DH, (h + 1) * DH)
            q, k, v = q_all[b, :n, sl], k_all[b, :n, sl], v_all[b, :n, sl]
            w_q = attention.query_score[h] if pooling == "additive" else None
            w_k = attention.key_score[h] if pooling == "additive" else None
            # bidirectional: one global query and key for the whole sequence
            p = _naive_pool(score(q, w_q), q) * k
            u_bidirectional[:, sl] = _naive_pool(score(p, w_k), p) * v
            # causal: position i pools positions j <= i; p_j uses the global query of its own prefix
            p = torch.stack([_naive_pool(score(q[: j + 1], w_q), q[: j + 1]) * k[j] for j in range(n)])
            for i in range(n):
                u_causal[i, sl] = _naive_pool(score(p[: i + 1], w_k), p[: i + 1]) * v[i]
        for u, got in ((u_bidirectional, out), (u_causal, causal)):
            expected = attention.transform(u) + q_all[b, :n]
            torch.testing.assert_close(got[b, :n], expected, atol=1e-4, rtol=1e-4)


def test_fastformer_causal_state_is_constant_size_and_exact():
    x, mask = _inputs()
    attention = _randomize(FastformerAttention(tiny_config(attention_type="fastformer"), is_causal=True, layer_idx=0))
    full, _ = attention(x, mask)
    cache, steps = ZformerCache(["fastformer"]), []
    for i in range(N):
        steps.append(attention(x[:, i : i + 1], mask[:, : i + 1], cache=cache)[0])
    torch.testing.assert_close(torch.cat(steps, 1)[mask.bool()], full[mask.bool()], atol=1e-5, rtol=1e-5)
    sizes = [t.shape for t in cache.layers[0].tensors()]
    assert sizes == [(B, H, 1, 1), (B, H, 1, DH)] * 2 and cache.get_seq_length() == N  # (lse, pooling) per pooling
    layer = cache.layers[0]
    assert [t.shape for t in layer.query_pool] == [t.shape for t in layer.key_pool] == [(B, H, 1, 1), (B, H, 1, DH)]


@pytest.mark.parametrize("attention_type", ["zformer", "fastformer"])
def test_a_recurrent_cache_layer_only_stores(attention_type):
    """A fixed-size cache layer takes no keys/values (transformers' `update`), only the state its
    attention computed; storing replaces the state and counts the new tokens."""
    cache = ZformerCache([attention_type])
    with pytest.raises(TypeError, match="store"):
        cache.update(torch.zeros(B, H, 1, DH), torch.zeros(B, H, 1, DH), 0)
    layer = cache.layers[0]
    state = torch.ones(B, H, DH, DH)
    pools = (torch.zeros(B, H, 1, 1), torch.ones(B, H, 1, DH))
    layer.store(state, 3) if attention_type == "zformer" else layer.store(pools, pools, 3)
    layer.store(2 * state, 2) if attention_type == "zformer" else layer.store(pools, pools, 2)
    assert cache.get_seq_length() == 5
    if attention_type == "zformer":
        assert torch.equal(layer.state, 2 * state) and layer.tensors() == [layer.state]
    else:
        assert layer.query_pool is pools and layer.key_pool is pools


def test_fastformer_cache_takes_blocks_and_steps_alike():
    """Through the cache, blocks of new tokens (prefix sums from a state) and single steps (the
    four-operation update) give the no-cache output, with left padding: the first row starts with
    blocks of padding only, so a state can also hold nothing yet."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(B, N, D, generator=generator)
    mask = torch.ones(B, N, dtype=torch.long)
    mask[0, :5] = 0  # left padding longer than the first block
    attention = _randomize(FastformerAttention(tiny_config(attention_type="fastformer"), is_causal=True, layer_idx=0))
    full, _ = attention(x, mask)
    cache, outputs, start = ZformerCache(["fastformer"]), [], 0
    for size in (3, 1, 4, 1, 2):  # N = 11 tokens
        outputs.append(attention(x[:, start : start + size], mask[:, : start + size], cache=cache)[0])
        start += size
    torch.testing.assert_close(torch.cat(outputs, 1)[mask.bool()], full[mask.bool()], atol=1e-5, rtol=1e-5)
    assert all(torch.isfinite(t).all() for t in cache.layers[0].tensors())


def test_xformer_matches_equation():
    x, mask = _inputs()
    config = tiny_config(attention_type="xformer", xformer_alpha=2, xformer_beta=4, max_position_embeddings=16)
    attention = _randomize(XformerAttention(config))
    assert attention.sequence_projection.shape == (4, 16)  # ceil(16 / 4) compressed keys, no bias
    out = attention.context(x, mask)
    e = attention.sequence_projection[:, :N]
    dq = D // 2 // H
    for b in range(B):
        real = mask[b].bool()
        q = attention.query(x[b])  # (N, D/alpha)
        key = e[:, real] @ q[real]  # K = E Q' over real positions only
        value = e[:, real] @ x[b, real]  # V = E X
        for h in range(H):
            qs, vs = slice(h * dq, (h + 1) * dq), slice(h * DH, (h + 1) * DH)
            probs = torch.softmax(q[:, qs] @ key[:, qs].T / math.sqrt(dq), dim=-1)
            torch.testing.assert_close(out[b, real, vs], (probs @ value[:, vs])[real], atol=1e-4, rtol=1e-4)


def test_xformer_rejects_sequences_longer_than_its_projection():
    attention = XformerAttention(tiny_config(attention_type="xformer", max_position_embeddings=8))
    with pytest.raises(ValueError, match="max_position_embeddings=8"):
        attention(torch.randn(1, 9, D))


@pytest.mark.parametrize("cls", [ZformerAttention, FastformerAttention, XformerAttention])
def test_linear_attention_sums_stay_fp32_under_autocast(cls):
    # Large activations: a bf16 sum over 4096 positions loses most of its digits.
    x = torch.randn(1, 4096, D) * 4
    config = tiny_config(attention_type="zformer", max_position_embeddings=4096)
    attention = _randomize(cls(config), std=0.05).eval()
    reference, _ = attention(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low, _ = attention(x)
    error = (low.float() - reference).norm() / reference.norm()
    assert error < 0.05, error


# Folded forms. Bidirectional zformer/fastformer self-attention on long fp32 sequences takes a
# folded form (one (D, D) map per sequence, `_folded`), which also absorbs the layer's output
# projection when N > D (`_apply_folded`). It must compute the same function, gradients included,
# as the plain form, and stay exact with padding.


def _output_and_gradients(attention, inputs, *args, **kwargs):
    """The attention's output on `inputs[0]` and the gradients of a fixed loss (linear + square, so
    every output element matters) with respect to every input and parameter."""
    output, _ = attention(inputs[0], *args, **kwargs)
    loss = (output * torch.linspace(-1, 1, output.numel()).view_as(output)).sum() + output.pow(2).sum()
    return output, torch.autograd.grad(loss, [*inputs, *attention.parameters()])


def _assert_same_function(first, second):
    """Two `_output_and_gradients` results agree (fp64 tolerances), every gradient finite."""
    (first_out, first_grads), (second_out, second_grads) = first, second
    torch.testing.assert_close(first_out, second_out, atol=1e-10, rtol=1e-10)
    for first_grad, second_grad in zip(first_grads, second_grads, strict=True):
        assert torch.isfinite(first_grad).all() and torch.isfinite(second_grad).all()
        torch.testing.assert_close(first_grad, second_grad, atol=1e-9, rtol=1e-10)


def _folding(monkeypatch, enabled):
    import hf_zformer.modeling.attention as attention_module

    monkeypatch.setattr(attention_module, "use_folded_form", lambda hidden_states, pays_off, *layers, **_: enabled)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(attention_type="zformer"),
        dict(attention_type="fastformer"),
        dict(attention_type="fastformer", fastformer_pooling="mean"),
        dict(attention_type="fastformer", fastformer_share_qv=True),
    ],
)
@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("length, projected", [(13, False), (13, True), (40, True)])
def test_folded_attention_equals_plain_attention(monkeypatch, overrides, with_mask, length, projected):
    """length 40 folds the output projection into the per-sequence map (zformer from N > D = 32,
    fastformer from B N >= 2 D); 13 applies it after.
    In fp64, so that the two forms' different summation orders stay far below the tolerance."""
    config = tiny_config(hidden_size=D, num_attention_heads=H, max_position_embeddings=64, **overrides)
    attention = _randomize(ZformerAttention(config) if config.attention_type == "zformer" else FastformerAttention(config))
    if hasattr(attention, "log_scale"):
        torch.nn.init.constant_(attention.log_scale, 1.0)
    if not projected:
        attention.output = torch.nn.Identity()  # the folded map without an output projection to fold in
    attention.double()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, length, D, generator=generator, dtype=torch.float64).requires_grad_()
    mask = torch.ones(4, length, dtype=torch.long)
    mask[1, 7:] = 0
    mask[2, 2:] = 0
    mask[3] = 0  # all padding: both forms pool nothing (zero global query and key), finite gradients
    mask = mask if with_mask else None
    results = []
    for enabled in (True, False):
        _folding(monkeypatch, enabled)
        results.append(_output_and_gradients(attention, [x], mask))
    _assert_same_function(*results)
    folded_out = results[0][0]

    # padding invariance of the folded form: extra padding leaves real positions unchanged
    if with_mask:
        _folding(monkeypatch, True)
        padded_x = torch.cat([x, torch.randn(4, 5, D, generator=generator, dtype=torch.float64)], 1)
        padded_mask = torch.cat([mask, torch.zeros(4, 5, dtype=torch.long)], 1)
        padded, _ = attention(padded_x, padded_mask)
        real = mask.bool()
        torch.testing.assert_close(padded[:, :length][real], folded_out[real], atol=1e-10, rtol=1e-10)


def test_a_tensor_subclass_weight_keeps_the_layers_own_forward():
    """A weight swapped for a tensor subclass in place (as torchao's quantisation does, the module's
    class unchanged): the folded forms and stacked products must not read it as a plain matrix."""
    from hf_zformer.modeling.blocks import plain_linears

    class Marked(torch.Tensor):
        pass

    layer = torch.nn.Linear(4, 4)
    assert plain_linears(layer)
    layer.weight = torch.nn.Parameter(layer.weight.detach().as_subclass(Marked))
    assert type(layer.weight) is Marked and not plain_linears(layer)


def test_plain_linears_tells_every_layer_that_must_keep_its_own_forward():
    """What `plain_linears` admits (its products may run outside the layer's forward: stacked,
    folded): `nn.Linear` and the opt-in `FewRowsLinear`, which declares the same product; and each
    thing that makes a layer keep its own forward."""
    from hf_zformer.cpu_speedups import FewRowsLinear
    from hf_zformer.modeling.blocks import plain_linears

    def fresh():
        return torch.nn.Linear(4, 4)

    plain, unbiased, replaced, faster = fresh(), torch.nn.Linear(4, 4, bias=False), fresh(), FewRowsLinear(4, 4)
    weight = replaced.weight.detach().clone()
    del replaced.weight
    replaced.weight = weight  # a plain tensor attribute instead of the parameter
    assert plain_linears(plain, unbiased, replaced, faster) and plain_linears()

    class Wrapped(torch.nn.Linear):  # a subclass with a forward of its own (quantised, adapted)
        pass

    kept = [Wrapped(4, 4)]
    own_forward = fresh()
    own_forward.forward = lambda x: x  # as accelerate's offloading hooks do
    kept.append(own_forward)
    sharded = fresh()
    sharded.weight.ds_id = 0  # a DeepSpeed ZeRO-3 partition, gathered only in the layer's own forward
    kept.append(sharded)
    for layer in kept:
        assert not plain_linears(plain, layer), layer
    assert plain_linears(plain)


def test_folded_form_is_taken_for_long_fp32_sequences_outside_autocast():
    import hf_zformer.modeling.attention as attention_module

    long = torch.randn(1, 64, 32)
    assert attention_module.use_folded_form(long, pays_off=True)
    assert attention_module.use_folded_form(long.double(), pays_off=True)
    assert not attention_module.use_folded_form(long, pays_off=False)
    assert not attention_module.use_folded_form(long.bfloat16(), pays_off=True)
    # under autocast the plain form keeps its fp32 sequence sums (and on CUDA its fused kernels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not attention_module.use_folded_form(long, pays_off=True)
        # unless the type takes it under autocast on this device (its `folded_autocast`)
        assert attention_module.use_folded_form(long, pays_off=True, autocast_devices=("cpu",))
        assert not attention_module.use_folded_form(long, pays_off=True, autocast_devices=("cuda",))
        assert not attention_module.use_folded_form(long, pays_off=False, autocast_devices=("cpu",))


@pytest.mark.parametrize("attention_type", ["full", "zformer", "xformer", "fastformer"])
def test_output_is_the_projected_context_for_every_type(attention_type):
    """Every type owns its output projection: forward gives `output(context)`, folded or not."""
    from hf_zformer.modeling.attention import ATTENTION_CLASSES

    config = tiny_config(hidden_size=D, num_attention_heads=H, max_position_embeddings=64, attention_type=attention_type)
    attention = _randomize(ATTENTION_CLASSES[attention_type](config)).eval()
    x = torch.randn(2, 48, D)  # N > D: zformer/fastformer fold the projection in
    mask = torch.ones(2, 48, dtype=torch.long)
    mask[1, 30:] = 0
    with torch.no_grad():
        projected, _ = attention(x, mask)
        context = attention.context(x, mask)
    torch.testing.assert_close(projected, attention.output(context), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "attention_type, role, message",
    [("xformer", dict(is_causal=True), "XformerAttention cannot be causal"),
     ("xformer", dict(is_cross=True), "XformerAttention cannot be cross-attention"),
     ("fastformer", dict(is_cross=True), "FastformerAttention cannot be cross-attention"),
     ("full", dict(is_causal=True, is_cross=True), "is_causal=True and is_cross=True")],
)
def test_roles_a_type_cannot_play_raise(attention_type, role, message):
    from hf_zformer.modeling.attention import ATTENTION_CLASSES

    with pytest.raises(ValueError, match=message):
        ATTENTION_CLASSES[attention_type](tiny_config(attention_type=attention_type), **role)


@pytest.mark.parametrize("attention_type", ["full", "zformer", "xformer", "fastformer"])
def test_every_type_has_the_same_constructor_and_forward(attention_type):
    import inspect

    from hf_zformer.modeling.attention import ATTENTION_CLASSES, Attention

    cls = ATTENTION_CLASSES[attention_type]
    assert issubclass(cls, Attention)
    for method in ("__init__", "forward", "context"):
        assert list(inspect.signature(getattr(cls, method)).parameters) == list(
            inspect.signature(getattr(Attention, method)).parameters
        ), method


@pytest.mark.parametrize("attention_type", ["full", "zformer"])
def test_cross_attention_memory_is_computed_once_into_the_cache(attention_type):
    config = tiny_config(attention_type=attention_type)
    from hf_zformer.modeling.attention import ATTENTION_CLASSES

    attention = _randomize(ATTENTION_CLASSES[attention_type](config, is_cross=True, layer_idx=0)).eval()
    x, memory = torch.randn(B, 3, D), torch.randn(B, N, D)
    memory_mask = torch.ones(B, N, dtype=torch.long)
    memory_mask[1, 6:] = 0
    cache = ZformerCache(["full"], cross_attention=True)
    first, _ = attention(x, memory=memory, memory_mask=memory_mask, cache=cache)
    assert cache.has_memory(0)
    again, _ = attention(x, memory_mask=memory_mask, cache=cache)  # no memory: the cached projection
    torch.testing.assert_close(again, first)
    without_padding, _ = attention(x[1:], memory=memory[1:, :6])
    torch.testing.assert_close(first[1:], without_padding, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("is_cross, source_length", [(False, 5), (True, 7), (True, 12)])
@pytest.mark.parametrize("with_mask", [False, True])
def test_zformer_quadratic_order_equals_linear_order(monkeypatch, is_cross, source_length, with_mask):
    """Short inputs take (Q K^T) V instead of Q (K^T V): the same product in the cheaper order. In
    fp64 both orders agree (outputs and every gradient, the scale's included), padding and
    all-padding rows included, and extra padding leaves real positions unchanged. Up to d_h = 8 keys
    the scale multiplies the scores, above it the queries (a memory of 12 tokens): both are covered."""
    config = tiny_config(hidden_size=D, num_attention_heads=H, attention_type="zformer")
    attention = _randomize(ZformerAttention(config, is_cross=is_cross, layer_idx=0)).double()
    torch.nn.init.constant_(attention.log_scale, 1.0)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 5, D, generator=generator, dtype=torch.float64).requires_grad_()
    source = torch.randn(4, source_length, D, generator=generator, dtype=torch.float64).requires_grad_() if is_cross else x
    mask = torch.ones(4, source.shape[1], dtype=torch.long)
    mask[1, 3:] = 0
    mask[3] = 0
    mask = mask if with_mask else None
    kwargs = dict(memory=source, memory_mask=mask) if is_cross else dict(attention_mask=mask)
    results = []
    for quadratic in (True, False):
        monkeypatch.setattr(ops_linear_attention, "quadratic_order_pays_off", lambda nq, nk, d, q=quadratic: q)
        results.append(_output_and_gradients(attention, [x, source] if is_cross else [x], **kwargs))
    _assert_same_function(*results)
    quad_out = results[0][0]
    if with_mask:  # padding invariance of the quadratic order
        monkeypatch.setattr(ops_linear_attention, "quadratic_order_pays_off", lambda nq, nk, d: True)
        extra = torch.randn(4, 3, D, generator=generator, dtype=torch.float64)
        padded_mask = torch.cat([mask, torch.zeros(4, 3, dtype=torch.long)], 1)
        if is_cross:
            padded, _ = attention(x, memory=torch.cat([source, extra], 1), memory_mask=padded_mask)
            torch.testing.assert_close(padded, quad_out, atol=1e-10, rtol=1e-10)
        else:
            padded, _ = attention(torch.cat([x, extra], 1), padded_mask)
            torch.testing.assert_close(padded[:, :5][mask.bool()], quad_out[mask.bool()], atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize(
    "kind, limit_name, limits",
    [
        ("zformer", "zformer_causal_block", (9, 4)),  # one short pass under 9; three blocks of prefix sums under 4
        ("fastformer", "fastformer_causal_quadratic", (9, 8)),  # the quadratic pooling under 9; prefix sums under 8
    ],
)
def test_causal_short_form_equals_prefix_sums(with_mask, kind, limit_name, limits):
    """Without a cache, short causal inputs take a quadratic form: Zformer one masked `(Q K^T) V` on
    head batches (`ops.quadratic_linear_attention`) instead of the blocked prefix sums of `causal_linear_attention`,
    Fastformer a softmax over the causal pattern instead of prefix poolings. In fp64 both forms
    agree (outputs and every gradient), with padding at the end, padding before the first real
    token (those rows see nothing: zero) and an all-padding row; token-by-token decoding through
    the cache gives the same outputs."""
    config = tiny_config(hidden_size=D, num_attention_heads=H, attention_type=kind)
    attention_class = ZformerAttention if kind == "zformer" else FastformerAttention
    attention = _randomize(attention_class(config, is_causal=True, layer_idx=0)).double()
    if kind == "zformer":
        torch.nn.init.constant_(attention.log_scale, 1.0)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 9, D, generator=generator, dtype=torch.float64).requires_grad_()
    mask = torch.ones(4, 9, dtype=torch.long)
    mask[1, 6:] = 0
    mask[2, :3] = 0
    mask[3] = 0
    mask = mask if with_mask else None
    results = []
    for limit in limits:  # the 9 tokens take the quadratic form under the first limit, not under the second
        with use_policy(**{limit_name: limit}):
            results.append(_output_and_gradients(attention, [x], mask))
    _assert_same_function(*results)
    quad_out = results[0][0]
    if with_mask and kind == "fastformer":  # pooled state zero before the first real token: W_r's bias and q_i remain
        mixed = attention.output(attention.transform.bias + attention.query(x[2, :3]))
        torch.testing.assert_close(quad_out[2, :3], mixed, atol=1e-10, rtol=1e-10)
    for grad in (True, False):  # decoding under autograd and without it (generate's path)
        cache, steps = ZformerCache([kind]), []
        with torch.set_grad_enabled(grad):
            for i in range(9):
                steps.append(attention(x[:, i : i + 1], None if mask is None else mask[:, : i + 1], cache=cache)[0])
        torch.testing.assert_close(torch.cat(steps, 1), quad_out, atol=1e-10, rtol=1e-10)


def test_zformer_takes_the_cheaper_order():
    assert ops.quadratic_order_pays_off(31, 31, 32) and not ops.quadratic_order_pays_off(32, 32, 32)
    assert ops.quadratic_order_pays_off(1, 40, 32) and not ops.quadratic_order_pays_off(40, 40, 32)


# Stacked projections (`blocks.project`): on CUDA, plain Linear projections of one input run as one
# product against their stacked weights. The CPU keeps a product per layer; the tests stack there too.


@pytest.fixture
def stacking_on_cpu():
    with use_policy(stacked_projection=("cuda", "cpu")):
        yield


def test_project_stacks_plain_layers_into_one_product(stacking_on_cpu):
    from hf_zformer.modeling.blocks import project

    torch.manual_seed(0)
    layers = [torch.nn.Linear(D, D).double() for _ in range(3)]
    x = torch.randn(3, 16, D, dtype=torch.float64)  # 48 rows >= D: stacked
    outputs = project(x, *layers)
    assert len({t.untyped_storage().data_ptr() for t in outputs}) == 1  # slices of one product
    for layer, out in zip(layers, outputs):
        torch.testing.assert_close(out, layer(x), atol=1e-12, rtol=1e-12)
    few = project(x[:1, :4], *layers)  # 4 rows < D: a product per layer
    assert len({t.untyped_storage().data_ptr() for t in few}) == 3
    hooked = torch.nn.Linear(D, D).double()
    hooked.forward = lambda t: torch.nn.functional.linear(t, hooked.weight, hooked.bias)  # as accelerate's hooks do
    wrapped = project(x, layers[0], hooked)  # not plain: a product per layer
    assert len({t.untyped_storage().data_ptr() for t in wrapped}) == 2
    shift = torch.randn(D, dtype=torch.float64)  # a bias of the caller's: b_r joins b_q in fastformer
    bias = torch.cat([layers[0].bias + shift, layers[1].bias])
    shifted, plain = project(x, *layers[:2], bias=bias)
    torch.testing.assert_close(shifted, layers[0](x) + shift, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(plain, layers[1](x), atol=1e-12, rtol=1e-12)
    with pytest.raises(ValueError, match="stacks_projections"):  # one product per layer takes no such bias
        project(x[:1, :4], *layers[:2], bias=bias)


@pytest.mark.parametrize("attention_type, role", [
    ("full", "self"), ("full", "causal"), ("full", "cross"), ("zformer", "self"), ("zformer", "causal"),
    ("zformer", "cross"), ("fastformer", "self"), ("fastformer", "causal"),
])
def test_stacked_projections_compute_what_one_product_per_layer_does(monkeypatch, attention_type, role):
    """fp64, random weights and biases, padding: outputs and every gradient agree with the stacking
    off; length 40 >= D also takes fastformer's pooled context."""
    from hf_zformer.modeling.attention import ATTENTION_CLASSES

    config = tiny_config(hidden_size=D, num_attention_heads=H, max_position_embeddings=64, attention_type=attention_type)
    attention = _randomize(ATTENTION_CLASSES[attention_type](
        config, is_causal=role == "causal", is_cross=role == "cross", layer_idx=0)).double()
    _folding(monkeypatch, False)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 40, D, generator=generator, dtype=torch.float64).requires_grad_()
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 25:] = 0
    inputs = [x]
    kwargs = {}
    if role == "cross":
        memory = torch.randn(2, 36, D, generator=generator, dtype=torch.float64).requires_grad_()
        inputs.append(memory)
        kwargs = dict(memory=memory, memory_mask=mask[:, :36])
    results = []
    for devices in (("cuda", "cpu"), ("cuda",)):
        with use_policy(stacked_projection=devices):
            results.append(_output_and_gradients(attention, inputs, None if role == "cross" else mask, **kwargs))
    _assert_same_function(*results)


@pytest.mark.parametrize("attention_type", ["full", "zformer", "fastformer"])
@pytest.mark.parametrize("length", [8, 40, 80])
def test_a_replaced_forward_of_a_projection_is_honoured_by_every_form(monkeypatch, stacking_on_cpu, attention_type,
                                                                       length):
    """A layer whose `forward` is replaced on the instance (as accelerate's device hooks do) must be
    called for its every use: stacked products, fastformer's pooled output (length 40, the folded
    form off) and the fp32 folded forms (length 80) all step aside. Module hooks registered with
    `register_forward_hook` are not looked up (the shipped code reads no hook dictionaries of torch):
    they run wherever the layer's own forward runs."""
    from hf_zformer.modeling.attention import ATTENTION_CLASSES

    if length == 40:
        _folding(monkeypatch, False)
    config = tiny_config(hidden_size=D, num_attention_heads=H, max_position_embeddings=128, attention_type=attention_type)
    attention = _randomize(ATTENTION_CLASSES[attention_type](config))
    if length == 80 and attention_type != "full":
        assert attention._folded_output(torch.randn(2, length, D), None) is not None  # plain layers fold
    x = torch.randn(2, length, D, generator=torch.Generator().manual_seed(0), requires_grad=True)
    calls = []
    plain_forward = attention.value.forward
    attention.value.forward = lambda t: calls.append(t.shape) or torch.zeros_like(plain_forward(t))
    replaced, _ = attention(x)
    del attention.value.forward
    assert (2, length, D) in calls, "the replaced forward never saw every token"
    with torch.no_grad():
        attention.value.weight.zero_()
        attention.value.bias.zero_()
        silenced, _ = attention(x)
    torch.testing.assert_close(replaced, silenced, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention_type", ["zformer", "fastformer"])
def test_lora_adapters_on_the_projections_count_in_every_form(attention_type):
    """PEFT LoRA on `query` and `value`: the adapted module computes what a module with the merged
    weights does, on inputs past the width too (where the fp32 folded forms would read the base
    weights) and through fastformer's pooled context."""
    import copy

    peft = pytest.importorskip("peft")
    from hf_zformer.modeling.attention import ATTENTION_CLASSES

    config = tiny_config(hidden_size=D, num_attention_heads=H, max_position_embeddings=128, attention_type=attention_type)
    attention = _randomize(ATTENTION_CLASSES[attention_type](config)).double()
    adapted = peft.inject_adapter_in_model(
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"], init_lora_weights=False),
        copy.deepcopy(attention),
    )
    merged = copy.deepcopy(attention)
    with torch.no_grad():
        for name in ("query", "value"):
            getattr(merged, name).weight += getattr(adapted, name).get_delta_weight("default")
    for length in (12, 40, 80):
        x = torch.randn(2, length, D, generator=torch.Generator().manual_seed(length), dtype=torch.float64)
        expected, _ = merged(x)
        assert not torch.allclose(expected, attention(x)[0], atol=1e-3)
        torch.testing.assert_close(adapted(x)[0], expected, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("attention_type", ["zformer", "fastformer"])
def test_folded_form_under_autocast_reads_its_input_cast_once(attention_type):
    """A folded form under bf16 autocast (`folded_autocast_devices`, set on the module): the fp32 input
    is cast to bf16 once (one (B, N, D) bf16 copy in all: every product over the tokens reads it;
    fastformer's poolings sum in fp32), the output stays near fp32's, and so do the gradients."""
    config = tiny_config(hidden_size=D, num_attention_heads=H, max_position_embeddings=128, attention_type=attention_type)
    cls = ZformerAttention if attention_type == "zformer" else FastformerAttention
    attention = _randomize(cls(config), std=0.1)
    x = torch.randn(2, 80, D, generator=torch.Generator().manual_seed(0), requires_grad=True)
    reference, _ = attention(x)
    (reference_grad,) = torch.autograd.grad(reference.sum(), x)
    attention.folded_autocast_devices = ("cpu",)
    copies = CountedOps(lambda func, out: func is torch.ops.aten._to_copy.default and tuple(out.shape) == (2, 80, D)
                        and out.dtype == torch.bfloat16)  # bf16 copies of the input
    with torch.autocast("cpu", dtype=torch.bfloat16), copies:
        assert attention._folded_output(x, None) is not None  # the folded form is what runs
        low, _ = attention(x)
    assert copies.count == 2 and low.dtype == torch.bfloat16  # one cast per call above
    assert ((low.float() - reference).norm() / reference.norm()) < 0.02
    (low_grad,) = torch.autograd.grad(low.float().sum(), x)
    assert ((low_grad - reference_grad).norm() / reference_grad.norm()) < 0.03


@pytest.mark.parametrize("attention_type", ["zformer", "fastformer"])
def test_folded_forms_under_cpu_autocast_by_default(monkeypatch, attention_type):
    """By default zformer and fastformer take their folded forms under CPU bf16 autocast as in fp32
    (faster there, docs/benchmarks.md), not under fp16 autocast, and CUDA is not among the devices."""
    config = tiny_config(hidden_size=D, num_attention_heads=H, max_position_embeddings=128, attention_type=attention_type)
    cls = ZformerAttention if attention_type == "zformer" else FastformerAttention
    attention = _randomize(cls(config))
    x = torch.randn(2, 80, D)
    calls = []
    monkeypatch.setattr(cls, "_folded", lambda self, *args: calls.append(1) or torch.zeros_like(x))
    attention(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        attention(x)
    assert len(calls) == 2
    assert "cuda" not in attention.folded_autocast()
    with torch.autocast("cpu", dtype=torch.float16):  # fp16: a Gram sum over the tokens could overflow
        attention(x)
    assert len(calls) == 2


@pytest.mark.parametrize("output", ["plain", "set aside", "own forward"])
@pytest.mark.parametrize("with_mask", [False, True])
def test_fastformer_pooled_output_equals_the_plain_form(monkeypatch, stacking_on_cpu, output, with_mask):
    """From N >= D (40 tokens, width 32, the folded form off) bidirectional fastformer takes its pooled
    output, b_r moved into a plain W_o's bias, or, where W_o is set aside (as the benchmarks' level
    `attention` does) or given a forward of its own (as accelerate's hooks do), into the stacked
    projections' bias (taken off q's pooling). fp64, padding: the outputs and every gradient of the
    plain form (u_i = k_g * v_i, W_r u_i + b_r + q_i), and W_o's own forward sees every token."""
    import hf_zformer.modeling.attention as attention_module

    _folding(monkeypatch, False)
    config = tiny_config(hidden_size=D, num_attention_heads=H, max_position_embeddings=64, attention_type="fastformer")
    attention = _randomize(FastformerAttention(config)).double()
    if output == "set aside":
        attention.output = torch.nn.Identity()
    seen = []
    if output == "own forward":
        plain_forward = attention.output.forward
        attention.output.forward = lambda t: seen.append(t.shape) or plain_forward(t)
    x = torch.randn(2, 40, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64).requires_grad_()
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 23:] = 0
    mask = mask if with_mask else None
    taken = []
    pooled_output = FastformerAttention._pooled_output
    monkeypatch.setattr(FastformerAttention, "_pooled_output",
                        lambda self, *args: taken.append(1) or pooled_output(self, *args))
    pooled = _output_and_gradients(attention, [x], mask)
    assert taken == [1]
    monkeypatch.setattr(attention_module.FastformerAttention, "_takes_pooled_output", lambda *args: False)
    _assert_same_function(pooled, _output_and_gradients(attention, [x], mask))
    assert taken == [1] and seen == ([(2, 40, D)] * 2 if output == "own forward" else [])


@pytest.mark.parametrize("output", ["plain", "set aside"])
def test_fastformer_pooled_output_keeps_bf16_precision_with_a_large_transform_bias(monkeypatch, stacking_on_cpu,
                                                                                   output):
    """bf16 autocast, b_r five times larger than q and W_r u_i comparable to q: the pooled output is
    at least as close to the fp64 result as the plain form's u_i, W_r u_i + b_r + q_i (errors of the
    outputs less their mean over the tokens: b_r's constant part aside), with W_r's bias moved into
    the output projection's (no bf16 tensor carries it) and, W_o set aside, into the stacked
    projection's bias (q_i + b_r in bf16, as the plain form's r_i)."""
    import hf_zformer.modeling.attention as attention_module

    _folding(monkeypatch, False)
    config = tiny_config(hidden_size=64, num_attention_heads=4, max_position_embeddings=256, attention_type="fastformer")
    attention = _randomize(FastformerAttention(config), std=0.05)
    if output == "set aside":
        attention.output = torch.nn.Identity()
    with torch.no_grad():
        attention.transform.weight.normal_(std=1.0)
        attention.transform.bias.normal_(std=2.0)
    x = torch.randn(2, 128, 64, generator=torch.Generator().manual_seed(0))
    reference = attention.double()(x.double())[0]
    attention.float()

    def centred(t):
        return t - t.mean(1, keepdim=True)

    errors = {}
    for pooled in (True, False):
        if not pooled:
            monkeypatch.setattr(attention_module.FastformerAttention, "_takes_pooled_output", lambda *args: False)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low, _ = attention(x)
        errors[pooled] = ((centred(low.double()) - centred(reference)).norm() / centred(reference).norm()).item()
    assert errors[True] <= 1.1 * errors[False], errors
