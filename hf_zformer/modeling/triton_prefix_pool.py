"""Fastformer's causal (prefix) pooling as fused Triton kernels: `prefix_pool_kernel(scores,
values, mask)`, `p_i = sum_{j <= i} softmax_j(s) x_j`, one program per pair walking the sequence
in tiles: each row's log-sum-exp under its own maximum, the tile's (i, j) weights as one matrix
product, the tiles before carried as a log-sum-exp and a pooling (`_prefix_pool`); the backward
walks the tiles in reverse with the later rows' sums carried the same way
(`_prefix_pool_backward`). Every weight it forms is at most 1, so no score range overflows.
`ops.softmax_pool` dispatches (its torch forms and reference are in `ops.py`). Operators:
`OPERATORS`.

This file ships to the Hugging Face Hub with every checkpoint and imports where triton is not
installed (`triton_launch.AVAILABLE` is then False and nothing here may be called)."""

import types
from typing import Optional

import torch

from .triton_launch import (
    AVAILABLE,
    FLOOR_CONSTANT,
    BLOCK_N,
    Tensor,
    as_operators,
    bound,
    fits,
    kept,
    launch_options,
    load_tile,
    mask_arguments,
    needs_graph,
    register_family,
    supported_width,
    tile,
    tl,
    triton,
)

if AVAILABLE:

    @triton.jit
    def _prefix_pool(S, X, M, P, L, length, ssb, ssh, ssn, sxb, sxh, sxn, sxd, smb, smn, spb, sph, spn,
                     heads: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BLOCK_N: tl.constexpr,
                     HAS_MASK: tl.constexpr):
        """Causal softmax pooling of one (sequence, head), tile by tile in order: lse_i, the
        log-sum-exp of the real scores s_j, j <= i (the floor before any), and
        p_i = sum_{j <= i} exp(s_j - lse_i) x_j, as the tile's (i, j) weights times its rows plus the
        pooling carried from the tiles before, exp(lse_carry - lse_i) p_carry. Every weight is at
        most 1."""
        bh = tl.program_id(0)
        b, h = bh // heads, bh % heads
        rd, local = tl.arange(0, BD), tl.arange(0, BLOCK_N)
        causal = local[:, None] >= local[None, :]
        last = local == BLOCK_N - 1
        carry_lse = tl.max(tl.full((BLOCK_N,), FLOOR_CONSTANT, tl.float32), axis=0)
        carry = tl.zeros((BD,), dtype=tl.float32)
        for offset in range(0, length, BLOCK_N):
            rows = offset + local
            inside = rows < length
            keep = kept(M, smb, smn, b, rows, length, HAS_MASK)
            s = tl.load(S + b * ssb + h * ssh + rows * ssn, mask=keep, other=float("-inf")).to(tl.float32)
            x = load_tile(X + b * sxb + h * sxh, rows, keep, rd, D, sxn, sxd).to(tl.float32)
            # the tile's log-sum-exp up to each row, each row under its own maximum (no underflow
            # against a later, larger score); -inf before the tile's first real row
            logits = tl.where(causal, s[None, :], float("-inf"))  # (i, j), j <= i
            top = tl.maximum(tl.max(logits, axis=1), FLOOR_CONSTANT)
            within = top + tl.log(tl.sum(tl.exp(logits - top[:, None]), axis=1))
            high = tl.maximum(within, carry_lse)
            lse = high + tl.log(tl.exp(within - high) + tl.exp(carry_lse - high))
            weights = tl.exp(logits - lse[:, None])
            pooled = tl.dot(weights, x, input_precision="ieee") + tl.exp(carry_lse - lse)[:, None] * carry[None, :]
            tl.store(P + b * spb + h * sph + rows[:, None] * spn + rd[None, :], pooled,
                     mask=inside[:, None] & (rd[None, :] < D))
            tl.store(L + bh * length + rows, lse, mask=inside)
            carry_lse = tl.sum(tl.where(last, lse, 0.0), axis=0)
            carry = tl.sum(tl.where(last[:, None], pooled, 0.0), axis=0)

    @triton.jit
    def _prefix_pool_backward(S, X, M, P, L, G, GX, GS, length, ssb, ssh, ssn, sxb, sxh, sxn, sxd, smb, smn,
                              spb, sph, spn, sgb, sgh, sgn, sgd, heads: tl.constexpr, D: tl.constexpr,
                              BD: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr):
        """The tiles in reverse: with a_ij = exp(s_j - lse_i) (j <= i), dx_j = sum_{i >= j} a_ij g_i
        and ds_j = x_j . dx_j - sum_{i >= j} a_ij (g_i . p_i). The later tiles enter through sums
        carried against the log-sum-exp at their first row (the smallest of theirs: lse never
        decreases), r = sum_i exp(ref - lse_i) g_i and c = sum_i exp(ref - lse_i) g_i . p_i, which a
        row j reaches with weight exp(s_j - ref) <= 1."""
        bh = tl.program_id(0)
        b, h = bh // heads, bh % heads
        rd, local = tl.arange(0, BD), tl.arange(0, BLOCK_N)
        causal = local[:, None] >= local[None, :]
        first = local == 0
        ref = tl.max(tl.full((BLOCK_N,), float("inf"), tl.float32), axis=0)  # nothing carried yet: weight 0
        carry_r = tl.zeros((BD,), dtype=tl.float32)
        carry_c = tl.sum(tl.zeros((BLOCK_N,), dtype=tl.float32), axis=0)
        tiles = tl.cdiv(length, BLOCK_N)
        for back in range(0, tiles):
            rows = (tiles - 1 - back) * BLOCK_N + local
            inside = rows < length
            keep = kept(M, smb, smn, b, rows, length, HAS_MASK)
            s = tl.load(S + b * ssb + h * ssh + rows * ssn, mask=keep, other=float("-inf")).to(tl.float32)
            x = load_tile(X + b * sxb + h * sxh, rows, keep, rd, D, sxn, sxd).to(tl.float32)
            lse = tl.load(L + bh * length + rows, mask=inside, other=float("inf"))
            g = load_tile(G + b * sgb + h * sgh, rows, inside, rd, D, sgn, sgd).to(tl.float32)
            p = load_tile(P + b * spb + h * sph, rows, inside, rd, D, spn, 1)
            gp = tl.sum(g * p, axis=1)
            weights = tl.exp(tl.where(causal, s[None, :] - lse[:, None], float("-inf")))  # (i, j), j <= i
            reach = tl.exp(s - ref)
            dx = tl.dot(tl.trans(weights), g, input_precision="ieee") + reach[:, None] * carry_r[None, :]
            dc = tl.sum(weights * gp[:, None], axis=0) + reach * carry_c
            ds = tl.sum(x * dx, axis=1) - dc
            tl.store(GX + b * sxb + h * sxh + rows[:, None] * sxn + rd[None, :] * sxd, dx,
                     mask=inside[:, None] & (rd[None, :] < D))
            tl.store(GS + b * ssb + h * ssh + rows * ssn, ds, mask=inside)
            new_ref = tl.sum(tl.where(first, lse, 0.0), axis=0)
            decay = tl.exp(new_ref - lse)
            moved = tl.exp(new_ref - ref)
            carry_r = tl.sum(decay[:, None] * g, axis=0) + moved * carry_r
            carry_c = tl.sum(decay * gp, axis=0) + moved * carry_c
            ref = new_ref


# Rows per tile of the causal pooling, whose (rows, rows) weights and exact fp32 products (on CUDA
# cores) weigh on registers: with 64-row tiles ptxas compiled both kernels for sm_90 to 32
# registers and 6.5-10 KB of spilled stack per thread; 32-row tiles (8 warps from 128-wide heads)
# need 64-147 registers and spill nothing up to 128-wide heads (`scripts/compile_kernels.py`).
# Heads 256 wide take `_PREFIX_WIDE_BLOCK_N` (`_prefix_rows`).
_PREFIX_BLOCK_N = 32
_PREFIX_WIDE_BLOCK_N = 16


def _prefix_rows(width: int) -> int:
    """Rows per tile of the causal pooling's kernels for heads `width` wide: `_PREFIX_BLOCK_N`, and
    `_PREFIX_WIDE_BLOCK_N` from 256-wide tiles. At 256 with 32 rows, three (32, 256) fp32 tiles
    and the gradient's held 128 values per thread at 8 warps: the backward spilled 440 bytes per
    thread for sm_90 with triton 3.9, and with triton 3.6 (torch 2.11's) got 32 registers and 4 KB
    of stack, bf16 and fp32 alike (`scripts/compile_kernels.py`)."""
    return _PREFIX_WIDE_BLOCK_N if tile(width) >= 256 else _PREFIX_BLOCK_N
# the causal (prefix) pooling: the head width
PREFIX_POOL_SHARED = ((64, 26_624), (256, 34_816))


def prefix_shared(width: int) -> int | None:
    """The most shared memory `prefix_pool_kernel`'s programs ask for at heads `width` wide
    (`PREFIX_POOL_SHARED`), or None where it takes no such width."""
    return bound(PREFIX_POOL_SHARED, tile(width)) if supported_width(width) else None


def prefix_fits(width: int, limit: int | None) -> bool:
    """Whether `prefix_pool_kernel` takes heads `width` wide within `limit` bytes of shared memory."""
    return fits(prefix_shared(width), limit)


def _prefix_pool_forward(scores, values, mask):
    """(pooled (B, H, N, d) fp32, log-sum-exp (B, H, N) fp32, the floor before any real token)."""
    batch, heads, length, dim = values.shape
    pooled = torch.empty(batch, heads, length, dim, dtype=torch.float32, device=values.device)
    lse = torch.empty(batch, heads, length, dtype=torch.float32, device=values.device)
    mask_ptr, smb, smn, has_mask = mask_arguments(mask, values)
    _prefix_pool[(batch * heads,)](
        scores, values, mask_ptr, pooled, lse, length, *scores.stride()[:3], *values.stride(), smb, smn,
        *pooled.stride()[:3], heads=heads, D=dim, BD=tile(dim), BLOCK_N=_prefix_rows(dim), HAS_MASK=has_mask,
        **launch_options(dim),
    )
    return pooled, lse


def _prefix_pool_grads(scores, values, mask, pooled, lse, grad):
    """(dscores, dvalues), contiguous in their inputs' dtypes, from the forward's inputs and results
    and the pooling's gradient."""
    batch, heads, length, dim = values.shape
    # contiguous inputs: the gradients, laid out alike, share their strides
    scores_in, values_in = scores.contiguous(), values.contiguous()
    grad_scores = torch.empty_like(scores_in, dtype=torch.float32)
    grad_values = torch.empty_like(values_in, dtype=torch.float32)
    mask_ptr, smb, smn, has_mask = mask_arguments(mask, values)
    _prefix_pool_backward[(batch * heads,)](
        scores_in, values_in, mask_ptr, pooled, lse, grad, grad_values, grad_scores, length,
        *scores_in.stride()[:3], *values_in.stride(), smb, smn, *pooled.stride()[:3], *grad.stride(),
        heads=heads, D=dim, BD=tile(dim), BLOCK_N=_prefix_rows(dim), HAS_MASK=has_mask, **launch_options(dim),
    )
    return grad_scores.to(scores.dtype), grad_values.to(values.dtype)


class _PrefixPool(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, values, mask):
        pooled, lse = _prefix_pool_forward(scores, values, mask)
        ctx.save_for_backward(scores, values, mask, pooled, lse)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zeros filled for lse's gradient (as `save_all`)
        return pooled, lse

    @staticmethod
    def backward(ctx, grad, _):
        return *_prefix_pool_grads(*ctx.saved_tensors, grad), None


def prefix_pool_kernel(scores, values, mask=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal `ops.softmax_pool` without a state: output i is sum_{j <= i} softmax_j(scores) values_j
    over the real positions j <= i, zero where there is none yet. scores (B, H, N, 1), values
    (B, H, N, d), mask (B, N) or None. Returns (pooled (B, H, N, d) fp32, log-sum-exp of the scores
    up to each position (B, H, N) fp32, `FLOOR` where there is no real token yet)."""
    if as_operators():
        return OPERATORS.prefix_pool(scores, values, mask)
    if needs_graph(scores, values):
        return _PrefixPool.apply(scores, values, mask)
    return _prefix_pool_forward(scores, values, mask)


def _prefix_pool_op(scores: Tensor, values: Tensor, mask: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    return _prefix_pool_forward(scores, values, mask)


def _fake_prefix_pool(scores, values, mask):
    return (values.new_empty(values.shape, dtype=torch.float32),
            values.new_empty(values.shape[:3], dtype=torch.float32))


def _prefix_pool_grads_op(scores: Tensor, values: Tensor, mask: Optional[Tensor], pooled: Tensor, lse: Tensor,
                          grad: Tensor) -> tuple[Tensor, Tensor]:
    return _prefix_pool_grads(scores, values, mask, pooled, lse, grad)


def _fake_prefix_pool_grads(scores, values, mask, pooled, lse, grad):
    return scores.new_empty(scores.shape), values.new_empty(values.shape)


def _prefix_pool_operator_backward(ctx, grad, _):
    scores, values, mask, pooled, lse = ctx.saved_tensors
    return *OPERATORS.prefix_pool_grads(scores, values, mask, pooled, lse, grad), None


def _register_operators():
    """This family's forward and gradient operators (`triton_launch.register_family`)."""
    operators = register_family(
        "prefix_pool", _prefix_pool_op, _fake_prefix_pool,
        _prefix_pool_operator_backward, _prefix_pool_grads_op, _fake_prefix_pool_grads,
    )
    return types.SimpleNamespace(**operators)


OPERATORS = _register_operators() if AVAILABLE else None
