"""Linear attention's torch forms (Zformer), each with the naive reference the tests compare it
with in fp64, forward and backward (`ops.py` gathers the names):

- `linear_attention(query, key, value, mask, state, *, causal, scale, return_state) -> (out,
  state)`, reference `linear_attention_reference`. Per head, out_i = scale * q_i (state + sum_j
  k_j^T v_j) over the real keys j that query i sees (all of them, or j <= i with `causal=True`);
  `state` (B, H, d_k, d_v) is that sum over earlier tokens (a decoder's cache, or a
  cross-attention's whole memory). Keys and values may differ in width (a feature map widens the
  keys; `[v, 1]` adds the normaliser's column to the values). Its path (`linear_attention_path`):
  the bidirectional kernel (`triton_linear_attention.py`), fla's chunked kernel for causal inputs,
  or the torch forms here, as the execution policy (`policy.py`) and `dispatch.py` decide.
- The Hedgehog feature map (`hedgehog_features`), with `normalize` to turn `linear_attention` over
  phi(q), phi(k) and [v, 1] into normalised attention; `normalized_attention_weights` builds its
  weights explicitly (distillation, tests).
- Softmax window + feature map (causal Zformer with `attention_window`):
  `windowed_linear_attention`, softmax weights over the last W keys and Hedgehog weights over the
  older ones in one normalisation (LoLCATs-style), and its decoding step `windowed_decode_step`.

Sums over the sequence run in fp32 with autocast off (fp64 stays fp64).

This file ships to the Hugging Face Hub with every checkpoint: torch and siblings only.
"""

import torch

from .blocks import at_least_fp32, no_autocast, per_head_product
from .dispatch import kernel_applies, torch_form
from .policy import active
from .triton_linear_attention import linear_attention_fits, linear_attention_kernel


_fla_chunk = None


def _fla_applies(*tensors: torch.Tensor) -> bool:
    """Whether causal linear attention runs flash-linear-attention's chunked kernel (`fla`, CUDA
    only, an optional install): on the policy's `fla_devices`, the conditions of `kernel_applies`,
    and fla importable."""
    global _fla_chunk
    device_type = tensors[0].device.type
    if device_type != "cuda" or device_type not in active().fla_devices:
        return False
    if not kernel_applies("causal linear_attention", *tensors):
        return False
    if torch.compiler.is_compiling():  # fla's launches are not operators the compiler can call
        return torch_form("causal linear_attention inside torch.compile: fla's kernel runs in eager calls only")
    if _fla_chunk is None:
        try:
            from fla.ops.linear_attn import chunk_linear_attn
        except ImportError:
            _fla_chunk = False
        else:
            _fla_chunk = chunk_linear_attn
    return bool(_fla_chunk) or torch_form("causal linear_attention: fla is not installed")


def _fla_causal_linear_attention(query, key, value, state, scale, return_state):
    """`linear_attention(..., causal=True)` through fla's `chunk_linear_attn` without its normaliser:
    on (B, N, H, d) views of ours, fp32 state in and out; the scale multiplies the output in fp32."""
    out, final = _fla_chunk(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scale=1.0,
        initial_state=None if state is None else state.float(), output_final_state=return_state, normalize=False,
    )
    out = at_least_fp32(out.transpose(1, 2))[0]
    if scale is not None:
        out = out * scale.to(out.dtype)
    return out, final


def quadratic_order_pays_off(query_length: int, key_length: int, head_dim: int) -> bool:
    """Whether `(Q K^T) V` (4 Nq Nk d_h FLOPs per head) costs less than `Q (K^T V)`
    (2 (Nq + Nk) d_h^2): short inputs, 2 Nq Nk < d_h (Nq + Nk), i.e. N < d_h for self-attention."""
    return 2 * query_length * key_length < head_dim * (query_length + key_length)


def linear_attention_path(query, key, value, has_state: bool = False, *, causal: bool = False,
                          return_state: bool = False) -> str:
    """The path `linear_attention` takes on these inputs (tensors, or anything with their device,
    dtype and shape): 'triton' (the bidirectional kernel: no state in or out), 'fla' (causal over
    more than one token where fla runs) or 'torch'."""
    if key is None:
        return "torch"
    if not has_state and not (causal or return_state) and kernel_applies(
        "linear_attention", query, key, value,
        fits=lambda limit: linear_attention_fits(query.shape[-1], value.shape[-1], limit),
    ):
        return "triton"
    if causal and query.shape[2] > 1 and _fla_applies(query, key, value):
        return "fla"
    return "torch"


def causal_form(queries: int, has_state: bool, return_state: bool = False) -> str:
    """The torch form causal `linear_attention` takes over `queries` new tokens: 'quadratic' (no
    state in or out, up to the policy's `zformer_causal_block` tokens: `(Q K^T) V` with the scores
    above the diagonal zeroed), 'step' (one token whose state is kept: q (state + k^T v)) or
    'blocks' (`causal_linear_attention`)."""
    if not has_state and not return_state and queries <= active().zformer_causal_block:
        return "quadratic"
    return "step" if queries == 1 and return_state else "blocks"


def linear_attention(query, key, value, mask=None, state=None, *, causal=False, scale=None, return_state=False):
    """Zformer's sequence operation (see the module docstring). query (B, H, Nq, d), key (B, H, Nk, d)
    and value (B, H, Nk, e) (Nk = Nq when causal) or both None (no new keys), mask (B, Nk), 1 at real
    keys, or None; state (B, H, d, e) or None (nothing before); scale a tensor of one element, or
    None for 1. Returns (out (B, H, Nq, e) in fp32 or fp64 (from the bidirectional kernel: in the
    queries' dtype), the state including these keys (B, H, d, e) when `return_state`, else None).

    The form, by a rule on the shapes: without a state (and none asked for), `(Q K^T) V` where it
    costs less (`quadratic_order_pays_off`; causal: up to the policy's `zformer_causal_block` tokens,
    with the scores above the diagonal zeroed); one new causal token with a state, q (state + k^T v);
    otherwise `Q (K^T V)`, causal in blocks (`causal_linear_attention`). The kernels where the policy
    sends the call to them (`linear_attention_path`).
    """
    if key is None:  # no new keys: attend to the state alone (a cross-attention's stored memory)
        with no_autocast(query.device.type):
            query = at_least_fp32(query)[0]
            query = query if scale is None else query * scale.to(query.dtype)
            return per_head_product(query, state), state if return_state else None
    path = linear_attention_path(query, key, value, state is not None, causal=causal, return_state=return_state)
    if path == "triton":
        return linear_attention_kernel(query, key, value, mask, scale), None
    if mask is not None:
        key = key * mask.to(key.dtype)[:, None, :, None]  # padding's keys are zero: no k^T v term
    if path == "fla":
        return _fla_causal_linear_attention(query, key, value, state, scale, return_state)
    queries, keys, dim = query.shape[2], key.shape[2], query.shape[3]
    if state is None and not return_state:
        short = causal_form(queries, False) == "quadratic" if causal else quadratic_order_pays_off(queries, keys, dim)
        if short:
            return quadratic_linear_attention(query, key, value, causal=causal, scale=scale), None
    with no_autocast(query.device.type):
        query, key, value = at_least_fp32(query, key, value)
        if scale is not None:
            query = query * scale.to(query.dtype)
        current = add_key_value_products(state, key, value) if (return_state or not causal) else None
        if not causal:
            return per_head_product(query, current), current if return_state else None
        if queries == 1 and current is not None:  # a decoding step: q (sum over all tokens so far)
            return per_head_product(query, current), current
        return causal_linear_attention(query, key, value, state), current


def quadratic_linear_attention(query, key, value, *, causal=False, scale=None):
    """`(Q K^T) V` (B, H, Nq, e), causal with the scores above the diagonal zeroed: the product in the
    cheaper order on short inputs, in fp32 on (B * H, N, d) head batches. `scale` multiplies the
    scores (B * H, Nq, Nk) where they are no larger than the queries (Nk <= d), else the queries:
    one pass over the smaller tensor, forward and backward (docs/benchmarks.md, "Short inputs")."""
    batch, heads, queries, dim = query.shape
    scale_scores = scale is not None and key.shape[2] <= dim
    with no_autocast(query.device.type):
        query, key, value = (t.reshape(batch * heads, *t.shape[2:]) for t in at_least_fp32(query, key, value))
        if scale is not None and not scale_scores:
            query = query * scale.to(query.dtype)
        scores = torch.bmm(query, key.transpose(1, 2))  # (B * H, Nq, Nk): no softmax
        if scale_scores:
            scores = scores * scale.to(scores.dtype)
        if causal and queries > 1:
            scores = scores.tril_()  # in place: the product's backward needs its inputs, not its output
        return torch.bmm(scores, value).view(batch, heads, queries, value.shape[-1])


def causal_linear_attention(query, key, value, past=None, decay=None) -> torch.Tensor:
    """out_i = q_i (past + sum_{j<=i} k_j^T v_j), in fp32, computed in blocks of the policy's
    `zformer_causal_block` tokens: quadratic inside a block, recurrent across blocks. query/key (B, H, N, d), value
    (B, H, N, e); past (B, H, d, e) (the sum over earlier tokens) or None. Returns (B, H, N, e).

    With `decay` (H,), per head a factor r in (0, 1]: out_i = q_i (r^i past + sum_{j<=i}
    r^(i-j) k_j^T v_j), every term fading by r per token of age (`past` as the first query sees it)."""
    length, block = query.shape[2], active().zformer_causal_block
    with no_autocast(query.device.type):
        query, key, value = at_least_fp32(query, key, value)
        log_decay = None if decay is None else torch.log(decay.to(query.dtype)).view(1, -1, 1, 1)
        state = past  # None: nothing before the first block (no product with a zero state)
        outputs = []
        for start in range(0, length, block):
            q = query[:, :, start : start + block]
            k = key[:, :, start : start + block]
            v = value[:, :, start : start + block]
            scores = q @ k.transpose(-1, -2)  # (B, H, b, b): no softmax, only causality
            if log_decay is not None:  # r^(a - c) for query a, key c <= a of the block
                steps = torch.arange(q.shape[2], device=q.device, dtype=q.dtype)
                scores = scores * torch.exp(log_decay * (steps[:, None] - steps[None, :]).clamp_min(0))
                if state is not None:
                    q = q * torch.exp(log_decay * steps[:, None])  # the state as query a sees it: r^a
            if q.shape[2] > 1:
                scores = scores.tril()
            outputs.append(scores @ v if state is None else per_head_product(q, state).add_(scores @ v))
            if start + block < length:
                if log_decay is not None:  # as the next block's first query sees them: r^(b - c), r^b
                    size = k.shape[2]
                    ages = size - torch.arange(size, device=k.device, dtype=k.dtype)
                    k = k * torch.exp(log_decay * ages[:, None])
                    state = None if state is None else state * torch.exp(log_decay * size)
                update = k.transpose(-1, -2) @ v
                state = update if state is None else state + update
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)


def add_key_value_products(past: torch.Tensor | None, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """past + sum_j k_j^T v_j per head, in fp32 (fp64 stays fp64): key (zero at padding) (B, H, N, d),
    value (B, H, N, e), past (B, H, d, e) or None (nothing before)."""
    batch, heads, length, dim = key.shape
    width = value.shape[-1]
    key, value = at_least_fp32(key, value)
    if past is None:
        past = key.new_zeros(batch, heads, dim, width)
    with no_autocast(key.device.type):
        # one batched product-and-add over (B * H) views (see `per_head_product`)
        return torch.baddbmm(
            past.reshape(batch * heads, dim, width), key.reshape(batch * heads, length, dim).transpose(1, 2),
            value.reshape(batch * heads, length, width),
        ).view(batch, heads, dim, width)


def linear_attention_reference(query, key, value, mask=None, state=None, *, causal=False, scale=None,
                               return_state=False):
    """`linear_attention` computed naively: for each query position, the sum of k_j^T v_j over the
    keys it sees, one key at a time, then the product with q_i."""
    batch, heads, queries, dim = query.shape
    keep = torch.ones(batch, key.shape[2], dtype=torch.bool) if mask is None else mask.bool().cpu()
    start = query.new_zeros(batch, heads, dim, value.shape[-1]) if state is None else state.to(query.dtype)
    out = query.new_zeros(batch, heads, queries, value.shape[-1])
    for b in range(batch):
        for h in range(heads):
            for i in range(queries):
                total = start[b, h]
                for j in range(key.shape[2] if not causal else i + 1):
                    if keep[b, j]:
                        total = total + torch.outer(key[b, h, j], value[b, h, j])
                out[b, h, i] = query[b, h, i] @ total * (1 if scale is None else scale.reshape(()))
    if not return_state:
        return out, None
    final = start.clone()
    for j in range(key.shape[2]):
        weight = keep[:, j].to(query.dtype).view(batch, 1, 1, 1).to(query.device)
        final = final + weight * key[:, :, j, :, None] * value[:, :, j, None, :]
    return out, final


def hedgehog_features(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Hedgehog's feature map (Zhang et al., ICLR 2024), per head h:
    phi(x) = [softmax(W_h x + b_h), softmax(-(W_h x + b_h))], each softmax over the d entries, so
    phi(x) has 2 d positive entries and phi(q) . phi(k) > 0 for any q, k. x (B, H, N, d), weight
    (H, d, d), bias (H, d). Returns (B, H, N, 2 d) in fp32 (fp64 stays fp64), autocast off."""
    with no_autocast(x.device.type):
        x = at_least_fp32(x)[0]
        # one product with [W; -W] gives [p, -p], one softmax over its two halves: 2 passes over the
        # (B, H, N, 2 d) features instead of 6 (bias, two softmaxes, negation, concatenation)
        weight, bias = weight.to(x.dtype), bias.to(x.dtype)
        both = torch.matmul(x, torch.cat([weight, -weight], 1).transpose(-1, -2))
        both = both + torch.cat([bias, -bias], -1)[:, None, :]
        return torch.softmax(both.unflatten(-1, (2, x.shape[-1])), dim=-1).flatten(-2)


def with_ones(value: torch.Tensor) -> torch.Tensor:
    """[v, 1] (B, H, N, d + 1): summed with weights, the last column is the sum of the weights."""
    return torch.cat([value, value.new_ones(*value.shape[:-1], 1)], dim=-1)


def normalize(weighted: torch.Tensor) -> torch.Tensor:
    """[sum_j w_ij v_j, sum_j w_ij] (B, H, N, d + 1) -> sum_j w_ij v_j / sum_j w_ij (B, H, N, d): the
    output of `linear_attention` over phi(q), phi(k) and `with_ones(v)` made normalised attention.
    The weights are never negative, so a zero sum means no key has weight (a query before any
    real token): the numerator is zero too, and dividing by 1 there keeps output and gradients zero."""
    numerator, denominator = weighted[..., :-1], weighted[..., -1:]
    return numerator / torch.where(denominator > 0, denominator, 1.0)


def normalized_attention_weights(query_features, key_features, mask=None, *, causal=False) -> torch.Tensor:
    """The weights a_ij = phi(q_i) . phi(k_j) / sum_j' phi(q_i) . phi(k_j') of normalised linear
    attention, built explicitly (quadratic): the reference the linear forms are tested against and
    the student's weights in attention distillation. query_features (B, H, Nq, F), key_features
    (B, H, Nk, F), mask (B, Nk), 1 at real keys, or None; `causal`: query i (the last Nq of Nk
    tokens) sees keys j <= i + Nk - Nq. A query with no real key gets zero weights. (B, H, Nq, Nk)."""
    scores = query_features @ key_features.transpose(-1, -2)  # (B, H, Nq, Nk), all > 0
    if mask is not None:
        scores = scores * mask.to(scores.dtype)[:, None, None, :]
    if causal:
        scores = scores.tril(scores.shape[-1] - scores.shape[-2])
    total = scores.sum(-1, keepdim=True)
    return scores / torch.where(total > 0, total, 1.0)


def windowed_linear_attention(query, key, value, query_features, key_features, key_mask, state, window: int,
                              softmax_share: torch.Tensor, scaling: float, return_state: bool = False,
                              sinks: tuple | None = None, position: int = 0, decay: torch.Tensor | None = None):
    """Normalised attention with softmax weights over the last `window` keys and feature-map weights
    over the older ones, per head (LoLCATs' sliding window + linear attention):

        w_ij = g exp(q_i . k_j * scaling - m_i)      for i - window < j <= i   (m_i: the row's max there)
        w_ij = (1 - g) phi(q_i) . phi(k_j)            for j <= i - window
        out_i = sum_j w_ij v_j / sum_j w_ij

    With `sinks` = (sink_key, sink_value (B, H, S, d), sink_index (B, S) long), S earlier tokens
    (StreamingLLM's attention sinks: the first tokens of a sequence) keep softmax weights
    g exp(q_i . k_s * scaling - m_i) for every later query, the max m_i taken over them too; a sink
    inside a query's window counts once, as a window key. sink_index is each sink's token index, -1
    for an empty slot, counted like `position`, the token index of key 0; key_features must be zero
    at the sinks (they never enter the feature-map part).

    With `decay` r (H,) in (0, 1], the feature-map weights fade with age beyond the window:
    w_ij = (1 - g) r^(i - window - j) phi(q_i) . phi(k_j), so that their total stays bounded however
    long the text (without it, it grows with the count of older tokens); `state` then holds the
    faded sum as the first query sees it.

    The N queries are the last N of the P + N keys (P <= window - 1 earlier tokens from the cache);
    `state` (B, H, F, d + 1) or None holds sum phi(k_j) [v_j, 1]^T over every token before those
    keys. query (B, H, N, d), key and value (B, H, P + N, d), query_features (B, H, N, F),
    key_features (B, H, K, F) of the first K keys (zero at padding; only the first
    P + N - window + 1 ever enter the feature-map part, so K may stop there), key_mask (B, P + N)
    1 at real keys or None,
    softmax_share g (H,) in (0, 1). The softmax part is computed in blocks of `window` queries, each
    against its 2 window - 1 keys: O(N window d) time and memory; the older keys through
    `linear_attention` on the keys shifted by `window` positions (zeros before the first).

    Returns (out (B, H, N, d) in fp32 or fp64, the state over every token older than the last
    `window - 1` keys when `return_state`, else None). A query with no real key gets zero."""
    batch, heads, queries, dim = query.shape
    past = key.shape[2] - queries
    if not 0 <= past < window:
        raise ValueError(f"windowed_linear_attention: {past} earlier keys for a window of {window}; at most "
                         f"{window - 1} (the cache keeps the last window - 1 tokens)")
    with no_autocast(query.device.type):
        query, key, value, query_features, key_features = at_least_fp32(
            query, key, value, query_features, key_features)
        if sinks is not None:
            sinks = (sinks[0].to(query.dtype), sinks[1].to(query.dtype), sinks[2])
        ones = with_ones(value)  # [v, 1] (B, H, P + N, d + 1)
        # feature-map part: query i sees key index <= past + i - window, shifted into a causal pattern
        older = past + queries - window  # keys that some query sees through the feature map
        if older > 0:
            shift = window - past
            shifted_keys = torch.nn.functional.pad(key_features[:, :, : queries - shift], (0, 0, shift, 0))
            shifted_values = torch.nn.functional.pad(ones, (0, 0, shift, 0))[:, :, :queries]
            if decay is None:
                linear, _ = linear_attention(query_features, shifted_keys, shifted_values, None, state, causal=True)
            else:  # a nonzero state means a full cache (P = window - 1): key j is then i - j' tokens old
                linear = causal_linear_attention(query_features, shifted_keys, shifted_values, state, decay)
        elif state is not None:
            linear = per_head_product(query_features, state)
        else:
            linear = None
        numerator, denominator = _window_softmax(query, key, value, key_mask, window, scaling, sinks, position)
        share = softmax_share.to(query.dtype).view(1, heads, 1, 1)
        numerator, denominator = share * numerator, share * denominator
        if linear is not None:
            numerator = numerator + (1 - share) * linear[..., :dim]
            denominator = denominator + (1 - share) * linear[..., dim:]
        out = numerator / torch.where(denominator > 0, denominator, 1.0)
        new_state = None
        if return_state:
            leaving = past + queries - (window - 1)  # keys no longer kept by the cache
            new_state = state
            if leaving > 0:
                leaving_features = key_features[:, :, :leaving]
                if decay is not None:  # as the next call's first query sees them: r^N state, r^(leaving-1-l) key l
                    log_decay = torch.log(decay.to(query.dtype))
                    ages = torch.arange(leaving - 1, -1, -1, device=query.device, dtype=query.dtype)
                    leaving_features = leaving_features * torch.exp(log_decay[:, None] * ages)[None, :, :, None]
                    state = None if state is None else state * torch.exp(log_decay * queries).view(1, heads, 1, 1)
                new_state = add_key_value_products(state, leaving_features, ones[:, :, :leaving])
            elif state is None:
                new_state = query.new_zeros(batch, heads, key_features.shape[-1], dim + 1)
    return out, new_state


def windowed_decode_step(query, window_key, window_value, query_features, state, softmax_share: torch.Tensor,
                         scaling: float) -> torch.Tensor:
    """`windowed_linear_attention` for one query in the steady state of decoding: its W keys (the
    last W - 1 tokens and its own) all real, the S attention sinks all before them, every older
    token in `state`. Nothing is masked then, so the softmax part is one product per key/value head
    over the sinks and the window, with the grouped query heads read as they are (no repeated keys):

        out = (g sum_j exp(q . k_j * scaling - m) v_j + (1 - g) phi(q) S_v) / (the same with 1, phi(q) S_1)

    query (B, H, 1, d), query_features (B, H, 1, F); window_key and window_value (B, H_kv, S + W, d):
    the S sinks first, then the window in token order, H_kv dividing H (query head h reads key/value
    head h // (H / H_kv)); state (B, H, F, d + 1) or None; softmax_share g (H,). The same weights
    as the general form, whose one-token call this replaces: a decoding step then costs a handful of
    operators per layer instead of the general form's masks, index ranges and concatenations.
    Returns out (B, H, 1, d) in fp32 (fp64 for fp64 inputs)."""
    batch, heads, _, dim = query.shape
    kv_heads = window_key.shape[1]
    with no_autocast(query.device.type):
        query, window_key, window_value, query_features = at_least_fp32(query, window_key, window_value, query_features)
        grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)  # (B, H_kv, G, d)
        scores = (grouped @ window_key.transpose(-1, -2)) * scaling  # (B, H_kv, G, S + W)
        weights = torch.exp(scores - scores.amax(-1, keepdim=True))
        share = softmax_share.to(query.dtype).view(1, heads, 1, 1)
        numerator = share * (weights @ window_value).view(batch, heads, 1, dim)
        denominator = share * weights.sum(-1, keepdim=True).view(batch, heads, 1, 1)
        if state is not None:
            linear = per_head_product(query_features, state)
            numerator = numerator + (1 - share) * linear[..., :dim]
            denominator = denominator + (1 - share) * linear[..., dim:]
        return numerator / denominator  # >= g > 0: the top-scoring key's weight is g


def _window_softmax(query, key, value, key_mask, window: int, scaling: float, sinks, position: int):
    """The softmax part of `windowed_linear_attention`, in blocks of `window` queries: per query the
    sum of exp(q . k * scaling - m) [v, 1] over its window's real keys and the sinks it sees, as
    (numerator (B, H, N, d), denominator (B, H, N, 1))."""
    batch, queries = query.shape[0], query.shape[2]
    past = key.shape[2] - queries
    numerators, denominators = [], []
    real = None if key_mask is None else key_mask.bool()
    for start in range(0, queries, window):
        stop = min(start + window, queries)
        first = max(0, past + start - window + 1)
        scores = (query[:, :, start:stop] @ key[:, :, first : past + stop].transpose(-1, -2)) * scaling
        rows = torch.arange(past + start, past + stop, device=query.device)[:, None]  # key index of each query
        columns = torch.arange(first, past + stop, device=query.device)[None, :]
        allowed = (columns <= rows) & (columns > rows - window)  # (b, k)
        if real is not None:
            allowed = allowed & real[:, None, None, first : past + stop]
        block_values = value[:, :, first : past + stop]
        if sinks is not None:  # the sinks this block's queries see outside their window
            sink_key, sink_value, sink_index = sinks
            scores = torch.cat([scores, (query[:, :, start:stop] @ sink_key.transpose(-1, -2)) * scaling], -1)
            seen = (sink_index[:, None, :] >= 0) & (sink_index[:, None, :] <= position + rows[None] - window)
            allowed = torch.cat([allowed.expand(batch, 1, -1, -1), seen[:, None]], -1)
            block_values = torch.cat([block_values, sink_value], 2)
        scores = scores.masked_fill(~allowed, float("-inf"))
        top = scores.amax(-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # a row with no real key
        weights = torch.exp(scores - top)  # 0 where not allowed
        numerators.append(weights @ block_values)
        denominators.append(weights.sum(-1, keepdim=True))
    return torch.cat(numerators, 2), torch.cat(denominators, 2)
