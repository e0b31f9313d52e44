"""Every form of the sequence operations in `hf_zformer.modeling.ops` against the naive reference of
its family, in fp64, forward and backward (queries, keys, values, scores, the state and the scale)."""

import pytest
import torch

from hf_zformer.modeling import ops, policy

B, H, D = 3, 2, 4


def _mask(length, kind):
    """(B, length): None, or padding at the end of row 1, at the start of row 2 (left padding) and an
    all-padding row 0."""
    if kind == "none":
        return None
    mask = torch.ones(B, length, dtype=torch.long)
    mask[0] = 0
    mask[1, length - 2 :] = 0
    mask[2, :2] = 0
    return mask


def _leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_() for t in tensors]


def _grads(outputs, inputs, seed=7):
    """Gradients of a fixed random projection of `outputs` (tensors or None) with respect to `inputs`."""
    generator = torch.Generator().manual_seed(seed)
    total = sum((o * torch.randn(o.shape, generator=generator, dtype=o.dtype)).sum() for o in outputs if o is not None)
    present = [t for t in inputs if t is not None]
    return torch.autograd.grad(total, present, allow_unused=True)


def _assert_same(fast, reference, inputs_fast, inputs_reference):
    for got, want in zip(fast, reference):
        if want is None:
            assert got is None
            continue
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    for got, want in zip(_grads(fast, inputs_fast), _grads(reference, inputs_reference)):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def _linear_case(queries, keys, with_state, with_scale, seed=0, value_width=D):
    """Queries/keys of width D, values of `value_width` (wider with a feature map's [v, 1])."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, queries, D, generator=generator, dtype=torch.float64)
    k = torch.randn(B, H, keys, D, generator=generator, dtype=torch.float64)
    v = torch.randn(B, H, keys, value_width, generator=generator, dtype=torch.float64)
    state = torch.randn(B, H, D, value_width, generator=generator, dtype=torch.float64) if with_state else None
    scale = torch.tensor([0.3], dtype=torch.float64) if with_scale else None
    return q, k, v, state, scale


def _run_linear(function, q, k, v, mask, state, scale, **options):
    out, after = function(q, k, v, mask, state, scale=scale, **options)
    return [out, after]


@pytest.mark.parametrize("value_width", [D, D + 3])
@pytest.mark.parametrize("mask_kind", ["none", "padded"])
@pytest.mark.parametrize("with_scale", [False, True])
@pytest.mark.parametrize(
    "queries, keys, with_state, return_state, form",
    [
        (3, 3, False, False, "quadratic, scale on the scores"),
        (3, 6, False, False, "quadratic, scale on the queries (Nk > d)"),
        (9, 9, False, False, "linear order"),
        (3, 5, True, True, "linear order from a state"),
        (9, 9, False, True, "linear order, state returned"),
    ],
)
def test_bidirectional_linear_attention_equals_reference(queries, keys, with_state, return_state, form, with_scale,
                                                         mask_kind, value_width):
    q, k, v, state, scale = _linear_case(queries, keys, with_state, with_scale, value_width=value_width)
    mask = _mask(keys, mask_kind)
    fast_inputs, reference_inputs = _leaves(q, k, v, state, scale), _leaves(q, k, v, state, scale)
    fast = _run_linear(ops.linear_attention, *fast_inputs[:3], mask, *fast_inputs[3:], return_state=return_state)
    reference = _run_linear(ops.linear_attention_reference, *reference_inputs[:3], mask, *reference_inputs[3:],
                            return_state=return_state)
    _assert_same(fast, reference, fast_inputs, reference_inputs)


def test_stored_state_alone_is_attended_without_keys():
    """No new keys (a cross-attention's stored memory): q (state), scaled."""
    q, _, _, state, scale = _linear_case(4, 0, True, True)
    out, after = ops.linear_attention(q, None, None, state=state, scale=scale, return_state=True)
    expected, _ = ops.linear_attention_reference(q, q[:, :, :0], q[:, :, :0], state=state, scale=scale)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-12)
    assert after is state


@pytest.mark.parametrize("value_width", [D, D + 3])
@pytest.mark.parametrize("mask_kind", ["none", "padded"])
@pytest.mark.parametrize(
    "length, block, with_state, return_state, form",
    [
        (6, 64, False, False, "quadratic (one block, no state)"),
        (11, 4, False, False, "blocks"),
        (11, 4, True, True, "blocks from a state, state returned"),
        (6, 64, False, True, "one block through the state path"),
        (1, 64, True, True, "a decoding step"),
    ],
)
def test_causal_linear_attention_equals_reference(monkeypatch, length, block, with_state, return_state, form,
                                                  mask_kind, value_width):
    monkeypatch.setattr(policy, "_active", policy.active().replaced(zformer_causal_block=block))
    q, k, v, state, scale = _linear_case(length, length, with_state, True, value_width=value_width)
    mask = _mask(length, mask_kind) if length > 2 else None
    fast_inputs, reference_inputs = _leaves(q, k, v, state, scale), _leaves(q, k, v, state, scale)
    fast = _run_linear(ops.linear_attention, *fast_inputs[:3], mask, *fast_inputs[3:], causal=True,
                       return_state=return_state)
    reference = _run_linear(ops.linear_attention_reference, *reference_inputs[:3], mask, *reference_inputs[3:],
                            causal=True, return_state=return_state)
    _assert_same(fast, reference, fast_inputs, reference_inputs)


def test_hedgehog_features_and_normalize_are_their_equations():
    """phi(x) = [softmax(W x + b), softmax(-(W x + b))] entry by entry; `normalize` divides by the
    last column and leaves a row whose weights sum to zero (no real key) at zero, with finite gradients."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(B, H, 5, D, generator=generator, dtype=torch.float64)
    weight = torch.randn(H, D, D, generator=generator, dtype=torch.float64)
    bias = torch.randn(H, D, generator=generator, dtype=torch.float64)
    features = ops.hedgehog_features(x, weight, bias)
    for b in range(B):
        for h in range(H):
            for n in range(5):
                projected = weight[h] @ x[b, h, n] + bias[h]
                expected = torch.cat([torch.softmax(projected, 0), torch.softmax(-projected, 0)])
                torch.testing.assert_close(features[b, h, n], expected, atol=1e-14, rtol=1e-14)
    weighted = torch.randn(B, H, 5, D + 1, generator=generator, dtype=torch.float64).abs()
    weighted[0, 0, 2] = 0.0  # a query that saw no real key
    weighted.requires_grad_()
    out = ops.normalize(weighted)
    torch.testing.assert_close(out[1], weighted[1, ..., :D] / weighted[1, ..., D:], atol=1e-14, rtol=1e-14)
    assert out[0, 0, 2].abs().max() == 0
    (gradient,) = torch.autograd.grad(out.sum(), weighted)
    assert torch.isfinite(gradient).all() and gradient[0, 0, 2, D] == 0  # the sum's gradient: none, not NaN


def _pool_case(length, seed=0):
    generator = torch.Generator().manual_seed(seed)
    scores = 3 * torch.randn(B, H, length, 1, generator=generator, dtype=torch.float64)
    values = torch.randn(B, H, length, D, generator=generator, dtype=torch.float64)
    return scores, values


def _pool_state(seed=1, empty_row=True):
    """A state as prefix_pool leaves it; row 0 has seen nothing (the lowest float, a zero pooling)."""
    generator = torch.Generator().manual_seed(seed)
    lse = torch.randn(B, H, 1, 1, generator=generator, dtype=torch.float64)
    pooled = torch.randn(B, H, 1, D, generator=generator, dtype=torch.float64)
    if empty_row:
        lse[0], pooled[0] = torch.finfo(torch.float64).min, 0.0
    return lse, pooled


@pytest.mark.parametrize("mask_kind", ["none", "padded"])
def test_bidirectional_softmax_pool_equals_reference(mask_kind):
    scores, values = _pool_case(7)
    mask = _mask(7, mask_kind)
    fast_inputs, reference_inputs = _leaves(scores, values), _leaves(scores, values)
    fast = list(ops.softmax_pool(*fast_inputs, mask))
    reference = list(ops.softmax_pool_reference(*reference_inputs, mask))
    _assert_same(fast, reference, fast_inputs, reference_inputs)
    with pytest.raises(ValueError, match="causal"):
        ops.softmax_pool(scores, values, mask, _pool_state())


@pytest.mark.parametrize("mask_kind", ["none", "padded"])
@pytest.mark.parametrize(
    "length, quadratic_limit, with_state, return_state, form",
    [
        (7, 64, False, False, "quadratic"),
        (7, 4, False, False, "prefix sums"),
        (7, 64, False, True, "prefix sums, state returned"),
        (7, 64, True, True, "prefix sums from a state"),
        (1, 64, True, True, "a decoding step"),
    ],
)
def test_causal_softmax_pool_equals_reference(monkeypatch, length, quadratic_limit, with_state, return_state, form,
                                              mask_kind):
    monkeypatch.setattr(policy, "_active", policy.active().replaced(fastformer_causal_quadratic=quadratic_limit))
    scores, values = _pool_case(length)
    state = _pool_state() if with_state else None
    mask = _mask(length, mask_kind) if length > 2 else None
    fast_inputs = _leaves(scores, values, *(state or ()))
    reference_inputs = _leaves(scores, values, *(state or ()))
    fast_state = tuple(fast_inputs[2:]) or None
    reference_state = tuple(reference_inputs[2:]) or None
    pooled, after = ops.softmax_pool(*fast_inputs[:2], mask, fast_state, causal=True, return_state=return_state)
    expected, expected_after = ops.softmax_pool_reference(*reference_inputs[:2], mask, reference_state, causal=True,
                                                          return_state=return_state)
    fast = [pooled, *(after or (None, None))]
    reference = [expected, *(expected_after or (None, None))]
    if after is not None:  # "nothing seen yet" is the lowest float in both; compare where something was
        seen = expected_after[0] > torch.finfo(torch.float64).min / 2
        fast[1], reference[1] = torch.where(seen, after[0], 0.0), torch.where(seen, expected_after[0], 0.0)
    _assert_same(fast, reference, fast_inputs, reference_inputs)
