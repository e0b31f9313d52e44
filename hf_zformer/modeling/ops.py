"""The sequence operations of the linear attention types, as pure functions of tensors, each family
with one signature and a naive reference beside it (loops over positions, written for reading;
the tests compare every fast form against it in fp64, forward and backward).

- **Linear attention** (Zformer): `linear_attention(query, key, value, mask, state, *, causal,
  scale, return_state) -> (out, state)`, reference `linear_attention_reference`. Per head,
  out_i = scale * q_i (state + sum_j k_j^T v_j) over the real keys j that query i sees (all of them,
  or j <= i with `causal=True`); `state` (B, H, d_k, d_v) is that sum over earlier tokens (a
  decoder's cache, or a cross-attention's whole memory). Keys and values may differ in width (a
  feature map widens the keys; `[v, 1]` adds the normaliser's column to the values).
- **Hedgehog feature map** (Zformer with `zformer_feature_map="hedgehog"`): `hedgehog_features`,
  and `normalize` to turn `linear_attention` over phi(q), phi(k) and [v, 1] into normalised
  attention; `normalized_attention_weights` builds its weights explicitly (distillation, tests).
- **Softmax window + feature map** (causal Zformer with `attention_window`):
  `windowed_linear_attention`: softmax weights over the last W keys, Hedgehog weights over the
  older ones, one normalisation (LoLCATs-style).
- **Softmax pooling** (Fastformer): `softmax_pool(scores, values, mask, state, *, causal,
  return_state) -> (pooled, state)`, reference `softmax_pool_reference`. pooled_i = sum_j
  softmax_j(scores) values_j over the real positions j that i sees; `state` is (log-sum-exp of the
  scores so far (B, H, 1, 1), the pooling so far (B, H, 1, d)).

- **Direction pooling** (bidirectional Fastformer): `direction_pool(values, direction, mask, scale,
  gate)`, reference `direction_pool_reference`: `softmax_pool` with the scores scale values_j . u, so
  a fused kernel reads the values once and no (B, H, N, 1) scores are formed; a gate (B, H, d) pools
  the rows gate * values_j without forming them (the key pooling's q_g * k_i). Values (B, 1, N, D)
  are shared by H directions (B or 1, H, D): the folded form pools the layer's input once per head.

- **Column scaling** (Fastformer's W_r diag(k_g)): `column_scaled(weight, scales, dtype)`, (B, O, I)
  = weight diag(scales[b]); on CUDA one kernel whose backward reads the output's gradient once.
  `column_scaled_product(base, rows, weight, scales)`: base + (rows diag(scales[b])) weight^T, the
  batched product over that map, or one fused kernel that forms no map.

Softmax attention (full) runs through transformers' attention functions, with
`attention.einsum_attention_forward` as its reference.

**Backends.** Each operation has a torch form (below; every device and dtype, fp64 included) and,
where one exists, a fused Triton kernel, one module per family (`triton_linear_attention.py`,
`triton_pooling.py` and `triton_shared_pool.py` (direction pooling per head, or of shared rows
along every head's direction), `triton_prefix_pool.py` (causal softmax pooling), `triton_product.py`
(column scaling), forward and backward, their shared helpers in `triton_launch.py`), which runs on CUDA tensors in fp32/bf16/fp16 when triton
is installed; causal linear attention over more than one token runs flash-linear-attention's
chunked kernel where `fla` is installed (`pip install hf_zformer[gpu]`). Which form runs is the
execution policy's choice (`policy.py`: one table by operation, device type, dtype and width, with
every threshold this file reads); each function here asks it through a `*_path` function
(`linear_attention_path`, `softmax_pool_path`, `direction_pool_path`, `column_scaled_path`,
`column_scaled_product_path`), which `explain.py` asks too. The policy's backend, `auto` (the
default: every fast form where it applies), `torch` (plain torch everywhere: the reference to
compare with) or `triton` (the kernels wherever these apply, also on CPU tensors under
`TRITON_INTERPRET=1`, as the tests run them), also governs the device-specific fast forms outside
this file: the GPU's stacked query/key/value product (`blocks.project`), `blocks.Linear`'s
transposed product for a few rows and the tied-embedding gradient of
`modeling_zformer.tied_lookups`; `HF_ZFORMER_KERNELS` (read at import), `set_kernel_backend` or
`use_kernel_backend` chooses it. A call a kernel does not cover (a state, causal, fp64, an
unsupported head width) takes the torch form; the reason is logged once at debug level.
Inside `torch.compile` the kernels run as operators the compiler calls without tracing into them
(each family's `OPERATORS`); fla's kernel runs in eager calls only.

Each function picks its form by a rule stated in its docstring (the cheaper order on short inputs,
blocks for long causal inputs, a four-operation step while decoding). Sums over the sequence run in
fp32 with autocast off (fp64 stays fp64). This file ships to the Hugging Face Hub with every
checkpoint: torch and siblings only.
"""

import torch
from transformers.utils import logging

from .blocks import at_least_fp32, masked_softmax, no_autocast, per_head_product
from .policy import (  # noqa: F401  (the backend's controls are this module's public names too)
    KERNEL_BACKENDS,
    active,
    kernel_backend,
    set_kernel_backend,
    use_kernel_backend,
)
from .policy import INTERPRETED as TRITON_INTERPRETED
from .triton_launch import AVAILABLE as TRITON_AVAILABLE
from .triton_launch import FLOOR as KERNEL_FLOOR
from .triton_launch import RUNNABLE as TRITON_RUNNABLE
from .triton_launch import VERSION as TRITON_VERSION
from .triton_launch import shared_memory_limit, supported_width
from .triton_linear_attention import linear_attention_fits, linear_attention_kernel
from .triton_pooling import direction_pool_kernel
from .triton_prefix_pool import prefix_fits, prefix_pool_kernel
from .triton_product import column_scale_kernel, product_fits, scaled_product_kernel
from .triton_shared_pool import shared_fits, shared_pool_kernel

logger = logging.get_logger(__name__)

# ----------------------------------------------------------------------------------------------
# backends
# ----------------------------------------------------------------------------------------------

_reported: set[str] = set()


def _torch_form(reason: str) -> bool:
    if reason not in _reported:
        _reported.add(reason)
        logger.debug(f"hf_zformer kernels: the torch form runs ({reason})")
    return False


def interpreter_too_old() -> str:
    """Why the kernels cannot run here (`triton_launch.RUNNABLE` false): the interpreter's version, and the remedy."""
    version = ".".join(map(str, TRITON_VERSION))
    return (f"triton {version}'s interpreter (TRITON_INTERPRET=1) cannot run the kernels; from triton 3.7 on "
            "it can (pip install 'triton>=3.7')")


def _kernel_applies(operation: str, *tensors: torch.Tensor, width_ok=supported_width, fits=None) -> bool:
    """Whether `operation` runs its Triton kernel on these inputs: where the policy sends calls on
    their device to the kernels (`policy.Policy.kernels_wanted`), in its dtypes, with `width_ok` of
    each last dimension, and `fits(limit)` of the kernel's tiles against the GPU's shared memory
    (`triton_launch.shared_memory_limit`); `False` means the torch form, with the reason logged once at
    debug level. The tensors may be anything with a device, a dtype and a shape (`explain.py`)."""
    policy = active()
    device = tensors[0].device
    if not policy.kernels_wanted(device.type, operation):
        return False  # the torch forms are the device's own
    forced = policy.backend == "triton"
    if not TRITON_AVAILABLE:
        if forced:
            raise RuntimeError("HF_ZFORMER_KERNELS=triton: triton is not installed (pip install triton)")
        return _torch_form("triton is not installed")
    if device.type != "cuda" and not TRITON_INTERPRETED:
        raise RuntimeError(f"HF_ZFORMER_KERNELS=triton on a {device.type} tensor: the kernels need CUDA, or "
                           "TRITON_INTERPRET=1 set before the first import to run them on the CPU")
    if not TRITON_RUNNABLE:
        if forced:
            raise RuntimeError(f"HF_ZFORMER_KERNELS=triton: {interpreter_too_old()}")
        return _torch_form(interpreter_too_old())
    dtypes = policy.pool_kernel_dtypes if operation == "direction_pool" else policy.kernel_dtypes
    if any(t.dtype not in dtypes for t in tensors):
        return _torch_form(f"{operation} in {tensors[0].dtype}")
    if not all(width_ok(t.shape[-1]) for t in tensors):
        return _torch_form(f"{operation} with widths {sorted({t.shape[-1] for t in tensors})}")
    if fits is not None and not fits(shared_memory_limit(device)):
        return _torch_form(f"{operation} with widths {sorted({t.shape[-1] for t in tensors})}: no shared-memory "
                           f"bound of its kernel's tiles fits {device}")
    return True


_fla_chunk = None


def _fla_applies(*tensors: torch.Tensor) -> bool:
    """Whether causal linear attention runs flash-linear-attention's chunked kernel (`fla`, CUDA
    only, an optional install): on the policy's `fla_devices`, the conditions of `_kernel_applies`,
    and fla importable."""
    global _fla_chunk
    device_type = tensors[0].device.type
    if device_type != "cuda" or device_type not in active().fla_devices:
        return False
    if not _kernel_applies("causal linear_attention", *tensors):
        return False
    if torch.compiler.is_compiling():  # fla's launches are not operators the compiler can call
        return _torch_form("causal linear_attention inside torch.compile: fla's kernel runs in eager calls only")
    if _fla_chunk is None:
        try:
            from fla.ops.linear_attn import chunk_linear_attn
        except ImportError:
            _fla_chunk = False
        else:
            _fla_chunk = chunk_linear_attn
    return bool(_fla_chunk) or _torch_form("causal linear_attention: fla is not installed")


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


# ----------------------------------------------------------------------------------------------
# linear attention (Zformer)
# ----------------------------------------------------------------------------------------------


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
    if not has_state and not (causal or return_state) and _kernel_applies(
        "linear_attention", query, key, value,
        fits=lambda limit: linear_attention_fits(query.shape[-1], value.shape[-1], limit),
    ):
        return "triton"
    if causal and query.shape[2] > 1 and _fla_applies(query, key, value):
        return "fla"
    return "torch"


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
        short = queries <= active().zformer_causal_block if causal else quadratic_order_pays_off(queries, keys, dim)
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


# ----------------------------------------------------------------------------------------------
# Hedgehog feature map (Zformer with zformer_feature_map="hedgehog")
# ----------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------
# softmax pooling (Fastformer)
# ----------------------------------------------------------------------------------------------


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


def softmax_pool(scores, values, mask=None, state=None, *, causal=False, return_state=False):
    """Fastformer's sequence operation (see the module docstring). scores (B, H, N, 1), values
    (B, H, N, d), mask (B, N), 1/True at real tokens, or None; state (lse (B, H, 1, 1), pooled
    (B, H, 1, d)) of earlier tokens or None (causal only). Returns (pooled: (B, H, 1, d) pooled over
    all real tokens, or (B, H, N, d) with `causal`; the state including these tokens when
    `return_state`, else None). A causal position with no real token yet pools to zero.

    The form: bidirectional, one masked softmax; causal without a state, the Triton kernel where
    kernels apply (`prefix_pool_kernel`, one launch forward and one backward; its state only
    outside autograd); else up to the policy's `fastformer_causal_quadratic` tokens without a state (and none asked
    for) a softmax over the causal pattern (`causal_softmax_pool`); otherwise prefix sums from the
    state (`prefix_pool`, a four-operation update for one new token).
    """
    if not causal:
        if state is not None or return_state:
            raise ValueError("softmax_pool: a state belongs to the causal form (causal=True)")
        weights = masked_softmax(scores, None if mask is None else mask.bool()[:, None, :, None], dim=2)
        return weights.transpose(-1, -2) @ values, None
    if softmax_pool_path(scores, values, state is not None, causal=True, return_state=return_state) == "triton":
        pooled, lse = prefix_pool_kernel(scores, values, mask)
        if not return_state:
            return pooled, None
        last = lse[:, :, -1:, None]  # "nothing seen yet" in the torch form's spelling: the lowest float
        return pooled, (torch.where(last > KERNEL_FLOOR, last, torch.finfo(last.dtype).min), pooled[:, :, -1:])
    if state is None and not return_state and scores.shape[2] <= active().fastformer_causal_quadratic:
        return causal_softmax_pool(scores, values, mask), None
    if mask is not None:
        scores = scores.masked_fill(~mask.bool()[:, None, :, None], float("-inf"))
    pooled, after = prefix_pool(scores, values, state)
    return pooled, after if return_state else None


def softmax_pool_path(scores, values, has_state: bool = False, *, causal: bool = False,
                      return_state: bool = False) -> str:
    """The path `softmax_pool` takes: 'triton' (the causal kernel, `prefix_pool_kernel`, without a
    state in) or 'torch'."""
    if causal and not has_state and _prefix_kernel_applies(scores, values, return_state):
        return "triton"
    return "torch"


def _prefix_kernel_applies(scores, values, return_state: bool) -> bool:
    """Whether causal pooling without a state runs the Triton kernel (`prefix_pool_kernel`): where
    kernels apply, and not for a state that autograd must trace (the kernel's log-sum-exp carries
    no gradient; a prefill under autograd is rare)."""
    if return_state and torch.is_grad_enabled() and (scores.requires_grad or values.requires_grad):
        return False
    return _kernel_applies("prefix_pool", values, fits=lambda limit: prefix_fits(values.shape[-1], limit))


def direction_pool(values, direction=None, mask=None, scale: float = 1.0, gate=None):
    """Bidirectional softmax pooling whose scores are a projection of the values themselves:
    pooled = sum_j softmax_j(scale values_j . u) values_j over the real positions j. values (B, H,
    N, d), direction u (B or 1, H, d), or None for zero scores (the plain mean), mask (B, N), 1/True
    at real tokens, or None; `scale` a number (the kernel applies it to u itself: no operation of
    its own). Returns (B, H, 1, d) in fp32 (fp64 stays fp64); zero for a row with no real token.
    Fastformer's two poolings both take this form (w . q_i, and w . (q_g * k_i) = (w * q_g) . k_i).

    `gate` (B, H, d) or None: the rows pooled are gate * values_j. The pooling is computed as
    gate * (the pooling of values_j along gate * u), so the gated rows are never formed; in the
    kernel the two products are part of the launch (Fastformer's key pooling, gate = q_g).

    Values (B, 1, N, D) are one sequence shared by the H directions (B or 1, H, D): each head pools
    the whole rows along its own direction (Fastformer's folded form pools the layer's input this
    way); without a direction that is the plain mean, H = 1.

    The Triton kernel where the policy sends the call to it (`direction_pool_path`;
    `shared_pool_kernel` for shared values), the gate inside the launch unless the policy's
    `gate_in_kernel` is off; else `softmax_pool` over the scores (shared values: two batched products)."""
    shared = values.shape[1] == 1 and (direction is None or direction.shape[1] > 1)
    if not shared and _kernel_applies("direction_pool", values):
        if gate is None or active().gate_in_kernel:
            return direction_pool_kernel(values, direction, mask, scale, gate)[:, :, None]
        direction = None if direction is None else direction * gate
        return gate[:, :, None] * direction_pool_kernel(values, direction, mask, scale)[:, :, None]
    if gate is not None:  # the torch forms: the gate's two products
        direction = None if direction is None else direction * gate
    direction = _scaled(direction, scale)
    if shared:  # a view both ways (no copy in the backward)
        pooled = _shared_direction_pool(values.squeeze(1), direction, mask)
    else:
        with no_autocast(values.device.type):
            values = at_least_fp32(values)[0]
            pooled = softmax_pool(direction_scores(values, direction), values, mask)[0]
    return pooled if gate is None else gate[:, :, None] * pooled


def direction_pool_path(values, direction_heads: int | None) -> str:
    """The path `direction_pool` takes on values (B, H, N, d) along a direction of
    `direction_heads` heads (None: no direction, the mean): 'triton' or 'torch'. Shared rows
    (B, 1, N, D) take the copy `shared_rows` chooses, whose path this is when `values` is that copy."""
    if values.shape[1] == 1 and (direction_heads is None or direction_heads > 1):
        return "triton" if _shared_kernel_applies(values, direction_heads or 1) else "torch"
    return "triton" if _kernel_applies("direction_pool", values) else "torch"


def column_scaled(weight, scales, dtype: torch.dtype):
    """weight (O, I) with its columns scaled per sequence, (B, O, I) = weight diag(scales[b]) for
    scales (B, I), in `dtype` (Fastformer's W_r diag(k_g)). On CUDA one kernel (`column_scale_kernel`:
    each product in fp32, rounded once; the backward reads the output's gradient once for both
    gradients); else the weight and the scales cast to `dtype` and multiplied (five passes over
    (B, O, I) in the backward where the kernel makes one)."""
    if column_scaled_path(weight, scales) == "triton":
        return column_scale_kernel(weight, scales, dtype)
    return weight.to(dtype) * scales.to(dtype)[:, None, :]


def column_scaled_path(weight, scales) -> str:
    """The path `column_scaled` takes: 'triton' or 'torch'."""
    return "triton" if _kernel_applies("column_scale", weight, scales, width_ok=lambda width: width >= 1) else "torch"


def column_scaled_product(base, rows, weight, scales):
    """(B, N, O) = base + (rows diag(scales[b])) weight^T per sequence, in rows' dtype, for rows and
    base (B, N, I) and (B, N, O), weight (O, I) and scales (B, I) (Fastformer's r = q + W_r (k_g * v)).
    The torch form is one batched product whose accumulator starts from base, over the map
    `column_scaled(weight, scales)` (B, O, I); the fused kernel (`scaled_product_kernel`, an
    experimental one: 16-bit rows under `auto` on the device types of the policy's
    `experimental.fused_product`, none by default) scales the rows as it loads them and writes no
    map: a (B, O, I) write and read fewer, forward."""
    if column_scaled_product_path(base, rows, weight, scales) == "triton":
        return scaled_product_kernel(base, rows, weight, scales)
    return torch.baddbmm(base, rows, column_scaled(weight, scales, rows.dtype).transpose(1, 2))


def column_scaled_product_path(base, rows, weight, scales) -> str:
    """The path `column_scaled_product` takes: 'triton' (the fused kernel) or 'torch' (a batched
    product over the map `column_scaled` forms, whose own path is `column_scaled_path`)."""
    return "triton" if _product_kernel_applies(base, rows, weight, scales) else "torch"


def _product_kernel_applies(base, rows, weight, scales) -> bool:
    if not active().fused_product_wanted(rows.device.type, rows.dtype):
        return False
    return base.dtype == rows.dtype and _kernel_applies("scaled_product", rows, base, weight, scales,
                                                        width_ok=lambda width: width >= 1, fits=product_fits)


def _scaled(direction, scale: float):
    """direction * scale, where the torch forms apply the scale (one multiply of the small direction)."""
    return direction if direction is None or scale == 1 else direction * scale


def _shared_kernel_applies(values, heads: int) -> bool:
    """Whether `direction_pool` of shared rows runs `shared_pool_kernel` (`_shared_direction_pool`)."""
    policy = active()
    if values.dtype == torch.float32 and not (policy.shared_pool_fp32 or policy.backend == "triton"):
        return False
    return _kernel_applies("direction_pool", values, width_ok=lambda width: width >= 1,
                           fits=lambda limit: shared_fits(values.shape[-1], heads, limit))


def shared_rows(values, low_precision, heads: int):
    """Which copy of shared rows (B, N, D) `direction_pool` along `heads` directions should read:
    `low_precision` (the autocast copy, half the bytes) where the kernel takes it, else `values`
    itself, which the torch form sums without making an fp32 copy (on a CPU under bf16 autocast:
    1.3-1.45x faster forward for fastformer's folded form at 2,048 tokens, width 512)."""
    if low_precision is values or _shared_kernel_applies(low_precision, heads):
        return low_precision
    return values


def _shared_direction_pool(values, direction, mask):
    """`direction_pool` of values (B, N, D) shared by the directions (B or 1, H, D) -> (B, H, 1, D).
    The kernel takes 16-bit rows (its products in tf32, exact for them); fp32 rows, whose products
    the kernel would run exactly on CUDA cores, take the torch form's batched products unless the
    backend `triton` forces the kernel (the tests)."""
    if _shared_kernel_applies(values, 1 if direction is None else direction.shape[1]):
        return shared_pool_kernel(values, direction, mask)[:, :, None]
    with no_autocast(values.device.type):
        values = at_least_fp32(values)[0]
        if direction is None:
            scores = values.new_zeros(values.shape[0], 1, values.shape[1])
        else:
            scores = direction.to(values.dtype) @ values.transpose(1, 2)  # (B, H, N)
        weights = masked_softmax(scores, None if mask is None else mask.bool()[:, None, :])
        return (weights @ values)[:, :, None]


def direction_scores(values, direction):
    """values_j . u (B, H, N, 1) in the values' dtype, u (B or 1, H, d): a product and a sum over d,
    on the values' own strided layout (no copy); zeros without a direction (the plain mean). Each
    score is a d_h-term dot product, too small for BLAS: a `bmm` over the heads or one product with a
    block-diagonal (D, H) matrix took 1.6-1.8x as long, forward and backward, at B x N = 128 tokens,
    d_h = 64 on the CPU (docs/benchmarks.md, "Short inputs")."""
    if direction is None:
        return values.new_zeros(*values.shape[:-1], 1)
    return (values * direction.to(values.dtype)[:, :, None, :]).sum(-1, keepdim=True)


def direction_pool_reference(values, direction=None, mask=None, scale: float = 1.0, gate=None):
    """`direction_pool` computed naively, through `softmax_pool_reference` over the scores (shared
    values broadcast to every direction; gated values formed)."""
    direction = _scaled(direction, scale)
    if values.shape[1] == 1 and direction is not None:
        values = values.expand(-1, direction.shape[1], -1, -1)
    if gate is not None:
        values = values * gate[:, :, None, :]
    return softmax_pool_reference(direction_scores(values, direction), values, mask)[0]


def causal_softmax_pool(scores: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """`prefix_pool` without a state, in the quadratic form: output i is sum_{j<=i} softmax_j(scores)
    values_j over the real positions j <= i (mask (B, N), 1 at real tokens, or None), zero where
    there is none yet. scores (B, H, N, 1), values (B, H, N, d); returns (B, H, N, d). Each row's
    softmax takes its own max, so no position underflows against a later, larger score."""
    length = scores.shape[2]
    allowed = torch.ones(length, length, dtype=torch.bool, device=scores.device).tril_()  # j <= i
    if mask is not None:
        allowed = allowed & mask.bool()[:, None, None, :]  # (B, 1, N, N)
    # without padding every row holds its own position; with it, a row can have no real token yet
    weights = masked_softmax(scores.transpose(-1, -2), allowed, may_be_empty=mask is not None)  # (B, H, N, N)
    return weights @ values


def prefix_pool(scores, values, state=None):
    """Causal pooling by prefix sums: output i pools positions j <= i. scores (B, H, N, 1), -inf at
    padding; values (B, H, N, d); state = (log-sum-exp of the scores so far (B, H, 1, 1), the
    pooling so far (B, H, 1, d)) of the positions before these, or None. Returns (pooled (B, H, N,
    d), the state after them).

    A single new token (a decoding step) with a state takes four operations: its share of the
    softmax a = exp(s - lse'), lse' = logaddexp(lse, s), moves the pooling towards its value,
    pooled' = pooled + a (v - pooled) (`torch.lerp`). Per-call overhead dominates decoding
    (docs/benchmarks.md). A block of tokens takes prefix sums under a running max, which starts at
    the lowest finite float, not -inf: padding (-inf) then gets weight exp(-inf) = 0 and never
    makes a NaN, without a guard. A state is the same thing with max = lse, denominator 1 and
    numerator = pooled, and "nothing seen yet" is lse = the lowest float, pooled = 0. The state keeps
    the sequence axis (size 1)."""
    length = values.shape[2]
    floor = torch.finfo(scores.dtype).min
    if state is not None and length == 1:  # a decoding step
        old_lse, old_pooled = state
        lse = torch.logaddexp(old_lse, scores)  # (B, H, 1, 1); unchanged by padding (-inf)
        pooled = torch.lerp(old_pooled, values, torch.exp(scores - lse))  # the new token's share: 0 at padding
        return pooled, (lse, pooled)
    if state is None:  # nothing before: the prefix sums alone
        new_max = scores.amax(dim=2, keepdim=True).clamp_min(floor)
        weights = torch.exp(scores - new_max)  # (B, H, N, 1)
        den, num = weights.cumsum(dim=2), (weights * values).cumsum(dim=2)
    else:
        old_lse, old_pooled = state
        new_max = torch.maximum(old_lse, scores.amax(dim=2, keepdim=True))
        rescale = torch.exp(old_lse - new_max)  # the earlier tokens' total weight (0 if all were padding)
        weights = torch.exp(scores - new_max)  # (B, H, N, 1)
        den = weights.cumsum(dim=2) + rescale  # (B, H, N, 1)
        num = torch.addcmul((weights * values).cumsum(dim=2), old_pooled, rescale)  # (B, H, N, d)
    # A prefix with no real token yet (only padding) has den = 0 and pools to zero. Every other den
    # is positive (>= 1 from the running max's own token on), so clamping den to the tiniest float
    # changes nothing else: one operation where no gradient is needed. Under autograd the clamp would
    # give -num / den^2 = 0/0 = NaN gradients there; dividing by 1 instead keeps them zero.
    if num.requires_grad or den.requires_grad:
        pooled = num / torch.where(den > 0, den, 1.0)
    else:
        pooled = num / den.clamp_min(torch.finfo(den.dtype).tiny)
    # log(0) = -inf where only padding was seen: the floor again
    lse = (new_max + torch.log(den[:, :, -1:])).clamp_min(floor)
    return pooled, (lse, pooled[:, :, -1:])


def softmax_pool_reference(scores, values, mask=None, state=None, *, causal=False, return_state=False):
    """`softmax_pool` computed naively: for each position, a softmax over the scores it sees, the
    earlier tokens' state entering as one more score (its log-sum-exp) with its pooling as value."""
    batch, heads, length, dim = values.shape
    keep = torch.ones(batch, length, dtype=torch.bool) if mask is None else mask.bool().cpu()

    def pool(b, h, last):
        """The pooling of row (b, h) over the real positions up to `last` and the state."""
        terms = [(scores[b, h, j, 0], values[b, h, j]) for j in range(last + 1) if keep[b, j]]
        if state is not None:  # "nothing seen yet" (the lowest float) weighs nothing beside a real token
            terms.append((state[0][b, h, 0, 0], state[1][b, h, 0]))
        if not terms:
            return values.new_zeros(dim), values.new_tensor(torch.finfo(values.dtype).min)
        logits = torch.stack([s for s, _ in terms])
        return torch.softmax(logits, 0) @ torch.stack([v for _, v in terms]), torch.logsumexp(logits, 0)

    rows = range(length) if causal else [length - 1]
    pooled = values.new_zeros(batch, heads, len(rows), dim)
    lse = values.new_zeros(batch, heads, 1, 1)
    for b in range(batch):
        for h in range(heads):
            for row, last in enumerate(rows):
                pooled[b, h, row], total = pool(b, h, last)
            lse[b, h, 0, 0] = total
    return pooled, ((lse, pooled[:, :, -1:].clone()) if return_state else None)
