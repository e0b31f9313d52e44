"""Fused Triton kernels for sequence operations of `ops.py`, forward and backward.

- `linear_attention_kernel(query, key, value, mask, scale)`: Zformer's bidirectional
  `out_i = scale * q_i sum_j m_j k_j^T v_j`. With enough (sequence, head) pairs to fill the GPU
  (`fused`), one program per pair sums the state K^T V over the keys in fp32 and applies it to every
  query in the same launch (`_fused_forward`); the backward is one launch too (`_fused_backward`:
  G = Q^T dO, then dQ = scale dO (K^T V)^T, dK = scale m V G^T, dV = scale m K G, and <K^T V, G>
  for the scale's gradient). With fewer pairs (long inputs, small batches) the sums are split over
  slices of the sequence (`_outer_sum`, then the slices in order, `_sum_parts`) and the products
  over tiles of rows (`_state_product`).
- `direction_pool_kernel(values, direction, mask)`: Fastformer's bidirectional pooling
  `sum_j softmax_j(values_j . u) values_j` over the real positions by an online softmax (`_pool`:
  one program per slice of the policy's `pool_chunk` rows, the slices merged in order, `_merge_pools`; one per
  pair where the sequence fits one slice); the backward (`_pool_backward`) reads the values once more:
  dx_j = w_j g + w_j (g . x_j - g . pooled) u, du = sum_j w_j (g . x_j - g . pooled) x_j.
- `column_scale_kernel(weight, scales, dtype)`: Fastformer's W_r diag(k_g) per sequence, each
  product in fp32 rounded once (`_column_scale`); the backward reads the output's gradient once for
  the weight's gradient (summed over the batch in a fixed order) and the scales' (`_column_scale_backward`).
- `scaled_product_kernel(base, rows, weight, scales)`: Fastformer's r = q + (v diag(k_g)) W_r^T per
  sequence as one matrix product (`_scaled_product`): the rows scaled as they are loaded, the
  accumulator starting from q's tile, no (B, D, D) map written or read; its backward goes through
  the map (`_column_scale`, `_column_scale_backward`).
- `prefix_pool_kernel(scores, values, mask)`: Fastformer's causal pooling
  `p_i = sum_{j <= i} softmax_j(s) x_j`, one program per pair walking the sequence in tiles: each
  row's log-sum-exp under its own maximum, the tile's (i, j) weights as one matrix product, the
  tiles before carried as a log-sum-exp and a pooling (`_prefix_pool`); the backward walks the tiles
  in reverse with the later rows' sums carried the same way (`_prefix_pool_backward`). Every weight
  it forms is at most 1, so no score range overflows.

Inputs are read where they lie (the head views of the projections, any strides, bf16/fp16/fp32; a
mask of any dtype) and every sum over the sequence runs in fp32; outputs come back in the inputs'
dtype, laid out (B, N, H, d) so that merging the heads is a view. Sums run over fixed tiles and
slices in sequence order, and padding's rows add exact zeros, so outputs at real positions do not
change, bit for bit, when padding is appended.

Inside `torch.compile` and under Python dispatch modes each family's forward and backward run as
operators (`OPERATORS`, `torch.library.custom_op`, with fake implementations for tracing), so
compiled graphs and their CUDA graphs launch the same kernels as eager calls, and a mode that
counts operations sees each kernel family as one.

The functions here do no dispatch: `ops.py` decides when they run. This file ships to the Hugging
Face Hub with every checkpoint and imports where triton is not installed (`AVAILABLE` is then False
and nothing here may be called); with `TRITON_INTERPRET=1` the kernels run on the CPU (triton 3.7 or
later: `RUNNABLE`), which is how the tests check them without a GPU.
"""

import re
import types
from typing import Optional

import torch

from .policy import INTERPRETED, active

# The Triton interpreter (`INTERPRETED`) multiplies 16-bit tiles wrongly (numpy has no bf16
# product): it takes the fp32 product of the same tiles, as fp32 inputs do anyway.

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch forms of ops.py run instead
    triton = None

AVAILABLE = triton is not None

# the log-sum-exp of an online softmax before any real score (finite: no NaN)
FLOOR = -1.0e38


# triton's interpreter before 3.7 stops at a loop bound computed inside a kernel (it asks an integer
# of a one-element array), and every sequence loop here has one: interpreted, the kernels need 3.7.
INTERPRETER_MINIMUM = (3, 7)
VERSION = tuple(int(part) for part in re.findall(r"\d+", triton.__version__)[:2]) if AVAILABLE else None
RUNNABLE = AVAILABLE and not (INTERPRETED and VERSION < INTERPRETER_MINIMUM)

if AVAILABLE:
    # the running maximum of an online softmax before any real score (finite: no NaN); a constexpr,
    # the only kind of global a compiled kernel may read
    _FLOOR = tl.constexpr(FLOOR)

    @triton.jit
    def _kept(M, smb, smn, b, rows, length, HAS_MASK: tl.constexpr):
        """Which of `rows` are real tokens of sequence b (inside the length, mask != 0)."""
        keep = rows < length
        if HAS_MASK:
            keep = keep & (tl.load(M + b * smb + rows * smn, mask=keep, other=0) != 0)
        return keep

    @triton.jit
    def _rows(X, rows, keep, columns, width, sxn, sxd):
        """The tile X[rows, columns] (zero outside `keep` and the width) of one (sequence, head)."""
        return tl.load(X + rows[:, None] * sxn + columns[None, :] * sxd,
                       mask=keep[:, None] & (columns[None, :] < width), other=0.0)

    @triton.jit
    def _outer_rows(acc, X, Y, M, smb, smn, b, start, stop, length, sxn, sxd, syn, syd,
                    DX: tl.constexpr, DY: tl.constexpr, BX: tl.constexpr, BY: tl.constexpr,
                    BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, DOT_FP32: tl.constexpr):
        """acc (BX, BY) + sum over the real rows n in [start, stop) of x_n^T y_n, tile by tile in order."""
        rx, ry = tl.arange(0, BX), tl.arange(0, BY)
        for offset in range(start, stop, BLOCK_N):
            rows = offset + tl.arange(0, BLOCK_N)
            keep = _kept(M, smb, smn, b, rows, length, HAS_MASK)
            x = _rows(X, rows, keep, rx, DX, sxn, sxd)
            y = _rows(Y, rows, keep, ry, DY, syn, syd)
            if DOT_FP32:
                acc += tl.dot(tl.trans(x.to(tl.float32)), y.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(tl.trans(x), y)
        return acc

    @triton.jit
    def _product_rows(X, O, M, smb, smn, b, state, c, offset, length, sxn, sxd, son, sod,
                      DX: tl.constexpr, DY: tl.constexpr, BX: tl.constexpr, BY: tl.constexpr,
                      BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, DOT_FP32: tl.constexpr):
        """Writes the tile of rows from `offset`: o_n = c m_n x_n state (state (BX, BY) fp32)."""
        rx, ry = tl.arange(0, BX), tl.arange(0, BY)
        rows = offset + tl.arange(0, BLOCK_N)
        inside = rows < length
        x = _rows(X, rows, inside, rx, DX, sxn, sxd).to(tl.float32)
        if DOT_FP32:
            out = tl.dot(x, state, input_precision="ieee")
        else:  # 16-bit inputs are exact in tf32; the state is rounded to tf32 (2^-11), finer than the output
            out = tl.dot(x, state, input_precision="tf32")
        out = out * c
        if HAS_MASK:
            out = tl.where(_kept(M, smb, smn, b, rows, length, True)[:, None], out, 0.0)
        tl.store(O + rows[:, None] * son + ry[None, :] * sod, out.to(O.dtype.element_ty),
                 mask=inside[:, None] & (ry[None, :] < DY))

    @triton.jit
    def _scale_factor(C, HAS_SCALE: tl.constexpr):
        """The one-element scale at C, or 1."""
        c = 1.0
        if HAS_SCALE:
            c = tl.load(C)
        return c

    @triton.jit
    def _state_tile(S, bh, BX: tl.constexpr, BY: tl.constexpr, TRANSPOSE: tl.constexpr):
        """The (BX, BY) fp32 state of pair bh (stored (BY, BX) with TRANSPOSE, read transposed)."""
        rx, ry = tl.arange(0, BX), tl.arange(0, BY)
        if TRANSPOSE:
            return tl.load(S + bh * BX * BY + ry[None, :] * BX + rx[:, None])
        return tl.load(S + bh * BX * BY + rx[:, None] * BY + ry[None, :])

    @triton.jit
    def _fused_forward(Q, K, V, M, C, O, S, length_q, length_k,
                       sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son, sod, smb, smn,
                       heads: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                       BV: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr,
                       HAS_SCALE: tl.constexpr, DOT_FP32: tl.constexpr):
        """One (sequence, head): S = sum_j m_j k_j^T v_j (stored, padded to (BK, BV)), o_i = c q_i S."""
        bh = tl.program_id(0)
        b, h = bh // heads, bh % heads
        state = _outer_rows(tl.zeros((BK, BV), dtype=tl.float32), K + b * skb + h * skh, V + b * svb + h * svh,
                            M, smb, smn, b, 0, length_k, length_k, skn, skd, svn, svd,
                            DK, DV, BK, BV, BLOCK_N, HAS_MASK, DOT_FP32)
        rk, rv = tl.arange(0, BK), tl.arange(0, BV)
        tl.store(S + bh * BK * BV + rk[:, None] * BV + rv[None, :], state)
        c = _scale_factor(C, HAS_SCALE)
        for offset in range(0, length_q, BLOCK_N):
            _product_rows(Q + b * sqb + h * sqh, O + b * sob + h * soh, M, smb, smn, b, state, c, offset, length_q,
                          sqn, sqd, son, sod, DK, DV, BK, BV, BLOCK_N, False, DOT_FP32)

    @triton.jit
    def _fused_backward(Q, K, V, G, M, C, S, GQ, GK, GV, GS, length_q, length_k,
                        sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sgb, sgh, sgn, sgd,
                        s1b, s1h, s1n, s1d, s2b, s2h, s2n, s2d, s3b, s3h, s3n, s3d, smb, smn,
                        heads: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                        BV: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr,
                        HAS_SCALE: tl.constexpr, DOT_FP32: tl.constexpr):
        """One (sequence, head) of the backward: P = Q^T dO; <S, P> (the scale's gradient, before
        the sum over pairs); dQ = c dO S^T; dK = c m V P^T; dV = c m K P."""
        bh = tl.program_id(0)
        b, h = bh // heads, bh % heads
        products = _outer_rows(tl.zeros((BK, BV), dtype=tl.float32), Q + b * sqb + h * sqh, G + b * sgb + h * sgh,
                               M, smb, smn, b, 0, length_q, length_q, sqn, sqd, sgn, sgd,
                               DK, DV, BK, BV, BLOCK_N, False, DOT_FP32)
        state = _state_tile(S, bh, BK, BV, False)
        tl.store(GS + bh, tl.sum(tl.sum(products * state, axis=1), axis=0))
        c = _scale_factor(C, HAS_SCALE)
        for offset in range(0, length_q, BLOCK_N):
            _product_rows(G + b * sgb + h * sgh, GQ + b * s1b + h * s1h, M, smb, smn, b, tl.trans(state), c, offset,
                          length_q, sgn, sgd, s1n, s1d, DV, DK, BV, BK, BLOCK_N, False, DOT_FP32)
        for offset in range(0, length_k, BLOCK_N):
            _product_rows(V + b * svb + h * svh, GK + b * s2b + h * s2h, M, smb, smn, b, tl.trans(products), c,
                          offset, length_k, svn, svd, s2n, s2d, DV, DK, BV, BK, BLOCK_N, HAS_MASK, DOT_FP32)
            _product_rows(K + b * skb + h * skh, GV + b * s3b + h * s3h, M, smb, smn, b, products, c,
                          offset, length_k, skn, skd, s3n, s3d, DK, DV, BK, BV, BLOCK_N, HAS_MASK, DOT_FP32)

    @triton.jit
    def _outer_sum(X, Y, M, P, length, chunk, sxb, sxh, sxn, sxd, syb, syh, syn, syd, smb, smn,
                   heads: tl.constexpr, DX: tl.constexpr, DY: tl.constexpr, BX: tl.constexpr, BY: tl.constexpr,
                   BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, DOT_FP32: tl.constexpr):
        """P[bh, s] = sum over the real rows of slice s of x_n^T y_n, padded to (BX, BY)."""
        part, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // heads, bh % heads
        start = part * chunk
        acc = _outer_rows(tl.zeros((BX, BY), dtype=tl.float32), X + b * sxb + h * sxh, Y + b * syb + h * syh,
                          M, smb, smn, b, start, tl.minimum(start + chunk, length), length, sxn, sxd, syn, syd,
                          DX, DY, BX, BY, BLOCK_N, HAS_MASK, DOT_FP32)
        rx, ry = tl.arange(0, BX), tl.arange(0, BY)
        tl.store(P + (bh * tl.num_programs(0) + part) * BX * BY + rx[:, None] * BY + ry[None, :], acc)

    @triton.jit
    def _sum_parts(P, OUT, parts, SIZE: tl.constexpr, BLOCK: tl.constexpr):
        """OUT[bh] = sum over p of P[bh, p] (SIZE fp32 each), in order: trailing all-zero parts (the
        slices of appended padding) add exact zeros. Each program sums one block of BLOCK elements
        (a divisor of SIZE) of one (sequence, head) pair."""
        bh, block = tl.program_id(0), tl.program_id(1)
        r = block * BLOCK + tl.arange(0, BLOCK)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for part in range(0, parts):
            acc += tl.load(P + (bh * parts + part) * SIZE + r)
        tl.store(OUT + bh * SIZE + r, acc)

    @triton.jit
    def _state_product(X, S, O, M, C, length, sxb, sxh, sxn, sxd, sob, soh, son, sod, smb, smn,
                       heads: tl.constexpr, DX: tl.constexpr, DY: tl.constexpr, BX: tl.constexpr,
                       BY: tl.constexpr, BLOCK_N: tl.constexpr, TRANSPOSE: tl.constexpr, HAS_MASK: tl.constexpr,
                       HAS_SCALE: tl.constexpr, DOT_FP32: tl.constexpr):
        """One tile of rows: o_n = c m_n x_n S[bh] (S stored padded (BX, BY); with TRANSPOSE (BY, BX))."""
        block, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // heads, bh % heads
        state = _state_tile(S, bh, BX, BY, TRANSPOSE)
        c = _scale_factor(C, HAS_SCALE)
        _product_rows(X + b * sxb + h * sxh, O + b * sob + h * soh, M, smb, smn, b, state, c, block * BLOCK_N, length,
                      sxn, sxd, son, sod, DX, DY, BX, BY, BLOCK_N, HAS_MASK, DOT_FP32)

    @triton.jit
    def _pool(X, U, GATE, M, MAX, SUM, ACC, POOLED, LSE, length, chunk, scale, sxb, sxh, sxn, sxd, sub, suh,
              smb, smn, heads: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BLOCK_N: tl.constexpr,
              HAS_MASK: tl.constexpr, HAS_DIRECTION: tl.constexpr, HAS_GATE: tl.constexpr, FINAL: tl.constexpr):
        """An online softmax over the rows of slice s: the running max of the scores x_n . (scale u),
        the sum of exp(score - max) and of exp(score - max) x_n. FINAL (one slice: the whole
        sequence): the pooling and log-sum-exp themselves (+inf where no token is real), else the
        slice's three sums. HAS_GATE: the rows are gate * x_n (GATE (B H, D) fp32), read as x_n
        along gate * u, the pooling multiplied by the gate at the end."""
        part, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // heads, bh % heads
        rd = tl.arange(0, BD)
        if HAS_DIRECTION:
            u = tl.load(U + b * sub + h * suh + rd, mask=rd < D, other=0.0).to(tl.float32) * scale
            if HAS_GATE:
                u = u * tl.load(GATE + bh * D + rd, mask=rd < D, other=0.0)
        top = tl.full((1,), _FLOOR, tl.float32)
        total = tl.zeros((1,), dtype=tl.float32)
        acc = tl.zeros((BD,), dtype=tl.float32)
        start = part * chunk
        for offset in range(start, tl.minimum(start + chunk, length), BLOCK_N):
            rows = offset + tl.arange(0, BLOCK_N)
            keep = _kept(M, smb, smn, b, rows, length, HAS_MASK)
            x = _rows(X + b * sxb + h * sxh, rows, keep, rd, D, sxn, sxd).to(tl.float32)
            if HAS_DIRECTION:
                scores = tl.sum(x * u[None, :], axis=1)
            else:
                scores = tl.zeros((BLOCK_N,), dtype=tl.float32)
            scores = tl.where(keep, scores, float("-inf"))
            new_top = tl.maximum(top, tl.max(scores, axis=0))
            rescale = tl.exp(top - new_top)
            weights = tl.exp(scores - new_top)  # 0 at padding
            total = total * rescale + tl.sum(weights, axis=0)
            acc = acc * rescale + tl.sum(weights[:, None] * x, axis=0)
            top = new_top
        one = tl.arange(0, 1)
        if FINAL:
            _store_pool(POOLED, LSE, GATE, bh, top, total, acc, rd, D, HAS_GATE)
        else:
            index = bh * tl.num_programs(0) + part
            tl.store(MAX + index + one, top)
            tl.store(SUM + index + one, total)
            tl.store(ACC + index * BD + rd, acc)

    @triton.jit
    def _store_pool(POOLED, LSE, GATE, bh, top, total, acc, rd, D: tl.constexpr, HAS_GATE: tl.constexpr):
        """The pooling acc / total (times the gate) and log-sum-exp of pair bh; a row without a real
        token pools to 0 with lse = +inf (zero weight everywhere in the backward)."""
        empty = total == 0
        pooled = acc / tl.where(empty, 1.0, total)
        if HAS_GATE:
            pooled = pooled * tl.load(GATE + bh * D + rd, mask=rd < D, other=0.0)
        tl.store(POOLED + bh * D + rd, pooled, mask=rd < D)
        tl.store(LSE + bh + tl.arange(0, 1), tl.where(empty, float("inf"), top + tl.log(tl.where(empty, 1.0, total))))

    @triton.jit
    def _merge_pools(MAX, SUM, ACC, POOLED, LSE, GATE, parts, D: tl.constexpr, BD: tl.constexpr,
                     HAS_GATE: tl.constexpr):
        """The pooling and log-sum-exp of each (b, h) from its slices' online softmaxes, merged in
        order (trailing slices of padding change nothing, exactly); `_store_pool` writes them."""
        bh = tl.program_id(0)
        rd = tl.arange(0, BD)
        one = tl.arange(0, 1)
        top = tl.full((1,), _FLOOR, tl.float32)
        total = tl.zeros((1,), dtype=tl.float32)
        acc = tl.zeros((BD,), dtype=tl.float32)
        for part in range(0, parts):
            index = bh * parts + part
            part_top = tl.load(MAX + index + one)
            new_top = tl.maximum(top, part_top)
            old, new = tl.exp(top - new_top), tl.exp(part_top - new_top)
            total = total * old + tl.load(SUM + index + one) * new
            acc = acc * old + tl.load(ACC + index * BD + rd) * new
            top = new_top
        _store_pool(POOLED, LSE, GATE, bh, top, total, acc, rd, D, HAS_GATE)

    @triton.jit
    def _pool_backward(X, U, GATE, M, G, LSE, P, DX, DU, PP, length, chunk, scale,
                       sxb, sxh, sxn, sxd, sub, suh, smb, smn, sdb, sdh, sdn, sdd,
                       heads: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BLOCK_N: tl.constexpr,
                       HAS_MASK: tl.constexpr, HAS_DIRECTION: tl.constexpr, HAS_GATE: tl.constexpr):
        """dx_n = w_n g + t_n (scale u) and scale sum_n t_n x_n (the gradient of u) over slice s,
        t_n = w_n (g . x_n - g . pooled), w_n = exp(x_n . (scale u) - lse) (0 at padding); g . pooled
        from the forward's output P (B H, D). HAS_GATE: g is the output's gradient times the gate, u
        the direction times the gate (g . pooled is still the output's gradient . P), and the slice's
        share of the ungated pooling, sum_n w_n x_n, goes to PP for the gate's gradient."""
        part, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // heads, bh % heads
        rd = tl.arange(0, BD)
        g = tl.load(G + bh * D + rd, mask=rd < D, other=0.0)
        lse = tl.load(LSE + bh)
        g_pooled = tl.sum(g * tl.load(P + bh * D + rd, mask=rd < D, other=0.0))
        if HAS_GATE:
            gate = tl.load(GATE + bh * D + rd, mask=rd < D, other=0.0)
            g = g * gate
        if HAS_DIRECTION:
            u = tl.load(U + b * sub + h * suh + rd, mask=rd < D, other=0.0).to(tl.float32) * scale
            if HAS_GATE:
                u = u * gate
        du = tl.zeros((BD,), dtype=tl.float32)
        pooled = tl.zeros((BD,), dtype=tl.float32)
        start = part * chunk
        for offset in range(start, tl.minimum(start + chunk, length), BLOCK_N):
            rows = offset + tl.arange(0, BLOCK_N)
            inside = rows < length
            keep = _kept(M, smb, smn, b, rows, length, HAS_MASK)
            x = _rows(X + b * sxb + h * sxh, rows, keep, rd, D, sxn, sxd).to(tl.float32)
            if HAS_DIRECTION:
                scores = tl.sum(x * u[None, :], axis=1)
            else:
                scores = tl.zeros((BLOCK_N,), dtype=tl.float32)
            weights = tl.where(keep, tl.exp(scores - lse), 0.0)
            t = weights * (tl.sum(x * g[None, :], axis=1) - g_pooled)
            dx = weights[:, None] * g[None, :]
            if HAS_DIRECTION:
                dx += t[:, None] * u[None, :]
                du += tl.sum(t[:, None] * x, axis=0)
            if HAS_GATE:
                pooled += tl.sum(weights[:, None] * x, axis=0)
            tl.store(DX + b * sdb + h * sdh + rows[:, None] * sdn + rd[None, :] * sdd, dx.to(DX.dtype.element_ty),
                     mask=inside[:, None] & (rd[None, :] < D))
        index = bh * tl.num_programs(0) + part
        if HAS_DIRECTION:
            tl.store(DU + index * BD + rd, du * scale)
        if HAS_GATE:
            tl.store(PP + index * BD + rd, pooled)

    @triton.jit
    def _gate_grads(DU, PP, G, U, GATE, DGATE, DDIR, batch, parts, sub, suh, heads: tl.constexpr,
                    D: tl.constexpr, BD: tl.constexpr, BB: tl.constexpr, HAS_DIRECTION: tl.constexpr,
                    SHARED: tl.constexpr):
        """The gated pooling's small gradients for head h from the slices' sums (in order), BB
        sequences per (BB, BD) tile: the gate's, g * pooled + du * u, and the direction's, du * gate
        (summed over the batch where one direction (SHARED) serves every sequence); du is the
        gradient of the gated direction u * gate."""
        h = tl.program_id(0)
        rd, rb = tl.arange(0, BD), tl.arange(0, BB)
        shared = tl.zeros((BD,), dtype=tl.float32)
        for first in range(0, batch, BB):
            b = first + rb
            bh = b * heads + h
            cells = (b[:, None] < batch) & (rd[None, :] < D)
            row = bh[:, None] * D + rd[None, :]
            slices = (bh[:, None] * parts) * BD + rd[None, :]
            pooled = tl.zeros((BB, BD), dtype=tl.float32)
            du = tl.zeros((BB, BD), dtype=tl.float32)
            for part in range(0, parts):
                pooled += tl.load(PP + slices + part * BD, mask=cells, other=0.0)
                if HAS_DIRECTION:
                    du += tl.load(DU + slices + part * BD, mask=cells, other=0.0)
            grad_gate = tl.load(G + row, mask=cells, other=0.0) * pooled
            if HAS_DIRECTION:
                u = tl.load(U + b[:, None] * sub + h * suh + rd[None, :], mask=cells, other=0.0).to(tl.float32)
                grad_gate += du * u
                grad_direction = du * tl.load(GATE + row, mask=cells, other=0.0)
                if SHARED:
                    shared += tl.sum(grad_direction, axis=0)
                else:
                    tl.store(DDIR + row, grad_direction, mask=cells)
            tl.store(DGATE + row, grad_gate, mask=cells)
        if HAS_DIRECTION and SHARED:
            tl.store(DDIR + h * D + rd, shared, mask=rd < D)

    @triton.jit
    def _dot32(a, b, DOT_FP32: tl.constexpr):
        """a @ b of fp32 tiles: exactly (DOT_FP32: fp32 inputs, the interpreter), else in tf32 (rows
        read from 16-bit inputs are exact in it; the other operand is rounded to 2^-11)."""
        if DOT_FP32:
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b, input_precision="tf32")

    @triton.jit
    def _shared_tile(X, M, smb, smn, b, rows, length, rd, D, sxn, sxd, u, BLOCK_N: tl.constexpr,
                     BH: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DIRECTION: tl.constexpr,
                     DOT_FP32: tl.constexpr):
        """(which rows are real, the tile of rows in fp32, their scores x_n . u_h against every
        direction (BLOCK_N, BH), zero without directions)."""
        keep = _kept(M, smb, smn, b, rows, length, HAS_MASK)
        x = _rows(X, rows, keep, rd, D, sxn, sxd).to(tl.float32)
        if HAS_DIRECTION:
            scores = _dot32(x, tl.trans(u), DOT_FP32)
        else:
            scores = tl.zeros((BLOCK_N, BH), dtype=tl.float32)
        return keep, x, scores

    @triton.jit
    def _directions(U, b, sub, suh, rd, rh, columns, BH: tl.constexpr, BD: tl.constexpr,
                    HAS_DIRECTION: tl.constexpr):
        """The (BH, BD) fp32 directions of sequence b (zeros without directions: never read)."""
        if HAS_DIRECTION:
            return tl.load(U + b * sub + rh[:, None] * suh + rd[None, :], mask=columns, other=0.0).to(tl.float32)
        return tl.zeros((BH, BD), dtype=tl.float32)

    @triton.jit
    def _shared_pool(X, U, M, MAX, SUM, ACC, POOLED, LSE, length, chunk, sxb, sxn, sxd, sub, suh, smb, smn,
                     heads: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr,
                     BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DIRECTION: tl.constexpr,
                     FINAL: tl.constexpr, DOT_FP32: tl.constexpr):
        """`_pool` of one slice of one sequence along all `heads` directions at once: each tile of
        rows is read once, its scores against every direction are one matrix product and so is its
        share of every head's pooling. The slices' sums are stored per (b, h) as `_pool` stores
        them, so `_merge_pools` merges them."""
        part, b = tl.program_id(0), tl.program_id(1)
        rd, rh = tl.arange(0, BD), tl.arange(0, BH)
        real_heads = rh < heads
        pairs = b * heads + rh  # (b, h) rows of the per-pair outputs
        columns = real_heads[:, None] & (rd[None, :] < D)
        u = _directions(U, b, sub, suh, rd, rh, columns, BH, BD, HAS_DIRECTION)
        top = tl.full((BH,), _FLOOR, tl.float32)
        total = tl.zeros((BH,), dtype=tl.float32)
        acc = tl.zeros((BH, BD), dtype=tl.float32)
        start = part * chunk
        for offset in range(start, tl.minimum(start + chunk, length), BLOCK_N):
            rows = offset + tl.arange(0, BLOCK_N)
            keep, x, scores = _shared_tile(X + b * sxb, M, smb, smn, b, rows, length, rd, D, sxn, sxd, u,
                                           BLOCK_N, BH, HAS_MASK, HAS_DIRECTION, DOT_FP32)
            scores = tl.where(keep[:, None], scores, float("-inf"))
            new_top = tl.maximum(top, tl.max(scores, axis=0))
            rescale = tl.exp(top - new_top)
            weights = tl.exp(scores - new_top[None, :])  # (BLOCK_N, BH), 0 at padding
            total = total * rescale + tl.sum(weights, axis=0)
            acc = acc * rescale[:, None] + _dot32(tl.trans(weights), x, DOT_FP32)
            top = new_top
        if FINAL:
            empty = total == 0
            tl.store(POOLED + pairs[:, None] * D + rd[None, :], acc / tl.where(empty, 1.0, total)[:, None],
                     mask=columns)
            tl.store(LSE + pairs, tl.where(empty, float("inf"), top + tl.log(tl.where(empty, 1.0, total))),
                     mask=real_heads)
        else:
            index = pairs * tl.num_programs(0) + part
            tl.store(MAX + index, top, mask=real_heads)
            tl.store(SUM + index, total, mask=real_heads)
            tl.store(ACC + index[:, None] * BD + rd[None, :], acc, mask=real_heads[:, None])

    @triton.jit
    def _shared_pool_backward(X, U, M, G, LSE, P, DX, DU, length, chunk, sxb, sxn, sxd, sub, suh, smb, smn,
                              sdb, sdn, sdd, heads: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                              BH: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr,
                              HAS_DIRECTION: tl.constexpr, DOT_FP32: tl.constexpr):
        """`_pool_backward` of one slice along all directions: with w_nh = exp(x_n . u_h - lse_h) and
        t_nh = w_nh (g_h . x_n - g_h . pooled_h), dx_n = sum_h w_nh g_h + t_nh u_h (two matrix
        products per tile) and the slice's du_h = sum_n t_nh x_n; pooled_h from P (B H, D)."""
        part, b = tl.program_id(0), tl.program_id(1)
        rd, rh = tl.arange(0, BD), tl.arange(0, BH)
        real_heads = rh < heads
        pairs = b * heads + rh
        columns = real_heads[:, None] & (rd[None, :] < D)
        g = tl.load(G + pairs[:, None] * D + rd[None, :], mask=columns, other=0.0)
        lse = tl.load(LSE + pairs, mask=real_heads, other=float("inf"))  # no weight on padded heads
        g_pooled = tl.sum(g * tl.load(P + pairs[:, None] * D + rd[None, :], mask=columns, other=0.0), axis=1)
        u = _directions(U, b, sub, suh, rd, rh, columns, BH, BD, HAS_DIRECTION)
        du = tl.zeros((BH, BD), dtype=tl.float32)
        start = part * chunk
        for offset in range(start, tl.minimum(start + chunk, length), BLOCK_N):
            rows = offset + tl.arange(0, BLOCK_N)
            keep, x, scores = _shared_tile(X + b * sxb, M, smb, smn, b, rows, length, rd, D, sxn, sxd, u,
                                           BLOCK_N, BH, HAS_MASK, HAS_DIRECTION, DOT_FP32)
            weights = tl.where(keep[:, None], tl.exp(scores - lse[None, :]), 0.0)
            t = weights * (_dot32(x, tl.trans(g), DOT_FP32) - g_pooled[None, :])
            dx = _dot32(weights, g, DOT_FP32)
            if HAS_DIRECTION:
                dx += _dot32(t, u, DOT_FP32)
                du += _dot32(tl.trans(t), x, DOT_FP32)
            tl.store(DX + b * sdb + rows[:, None] * sdn + rd[None, :] * sdd, dx.to(DX.dtype.element_ty),
                     mask=(rows < length)[:, None] & (rd[None, :] < D))
        if HAS_DIRECTION:
            tl.store(DU + ((b * tl.num_programs(0) + part) * BH + rh[:, None]) * BD + rd[None, :], du)

    @triton.jit
    def _shared_pool_backward_paired(X, U, M, G, LSE, P, DX, DU, length, chunk, sxb, sxn, sxd, sub, suh, smb,
                                     smn, sdb, sdn, sdd, heads: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                                     BH: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr,
                                     DOT_FP32: tl.constexpr):
        """`_shared_pool_backward` with directions, for at most BH / 2 heads: the directions and the
        gradients interleave in one (BH, BD) tile, rows (u_0, g_0, u_1, g_1, ...), so that one
        product per tile gives both x_n . u_h and x_n . g_h, one gives dx_n = sum_h t_nh u_h + w_nh g_h,
        and one du (its odd rows, sum_n w_nh x_n, are dropped). Against a tile for u and one for g,
        each padded to the 16 rows a product needs, this holds one (BH, BD) tile fewer and runs three
        products per tile instead of five."""
        part, b = tl.program_id(0), tl.program_id(1)
        HALF: tl.constexpr = BH // 2
        rd, rh, rp = tl.arange(0, BD), tl.arange(0, BH), tl.arange(0, HALF)
        head, is_u = rh // 2, rh % 2 == 0
        rows_ok = (head < heads)[:, None] & (rd[None, :] < D)
        u = tl.load(U + b * sub + head[:, None] * suh + rd[None, :], mask=rows_ok & is_u[:, None], other=0.0)
        g = tl.load(G + (b * heads + head[:, None]) * D + rd[None, :], mask=rows_ok & ~is_u[:, None], other=0.0)
        paired = u.to(tl.float32) + g  # (BH, BD): u_h in row 2h, g_h in row 2h + 1
        real_heads = rp < heads
        lse = tl.load(LSE + b * heads + rp, mask=real_heads, other=float("inf"))  # no weight on padded heads
        by_head = (b * heads + rp[:, None]) * D + rd[None, :]  # (HALF, BD) rows of g and the pooling per head
        head_ok = real_heads[:, None] & (rd[None, :] < D)
        g_pooled = tl.sum(tl.load(G + by_head, mask=head_ok, other=0.0) * tl.load(P + by_head, mask=head_ok, other=0.0),
                          axis=1)
        du = tl.zeros((BH, BD), dtype=tl.float32)
        start = part * chunk
        for offset in range(start, tl.minimum(start + chunk, length), BLOCK_N):
            rows = offset + tl.arange(0, BLOCK_N)
            keep = _kept(M, smb, smn, b, rows, length, HAS_MASK)
            x = _rows(X + b * sxb, rows, keep, rd, D, sxn, sxd).to(tl.float32)
            scores, x_g = tl.split(tl.reshape(_dot32(x, tl.trans(paired), DOT_FP32), (BLOCK_N, HALF, 2)))
            weights = tl.where(keep[:, None], tl.exp(scores - lse[None, :]), 0.0)
            t = weights * (x_g - g_pooled[None, :])
            coefficients = tl.reshape(tl.join(t, weights), (BLOCK_N, BH))  # (t_0, w_0, t_1, w_1, ...)
            dx = _dot32(coefficients, paired, DOT_FP32)
            du += _dot32(tl.trans(coefficients), x, DOT_FP32)
            tl.store(DX + b * sdb + rows[:, None] * sdn + rd[None, :] * sdd, dx.to(DX.dtype.element_ty),
                     mask=(rows < length)[:, None] & (rd[None, :] < D))
        tl.store(DU + ((b * tl.num_programs(0) + part) * HALF + head[:, None]) * BD + rd[None, :], du,
                 mask=is_u[:, None])  # du_h, from row 2h

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
        carry_lse = tl.max(tl.full((BLOCK_N,), _FLOOR, tl.float32), axis=0)
        carry = tl.zeros((BD,), dtype=tl.float32)
        for offset in range(0, length, BLOCK_N):
            rows = offset + local
            inside = rows < length
            keep = _kept(M, smb, smn, b, rows, length, HAS_MASK)
            s = tl.load(S + b * ssb + h * ssh + rows * ssn, mask=keep, other=float("-inf")).to(tl.float32)
            x = _rows(X + b * sxb + h * sxh, rows, keep, rd, D, sxn, sxd).to(tl.float32)
            # the tile's log-sum-exp up to each row, each row under its own maximum (no underflow
            # against a later, larger score); -inf before the tile's first real row
            logits = tl.where(causal, s[None, :], float("-inf"))  # (i, j), j <= i
            top = tl.maximum(tl.max(logits, axis=1), _FLOOR)
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
            keep = _kept(M, smb, smn, b, rows, length, HAS_MASK)
            s = tl.load(S + b * ssb + h * ssh + rows * ssn, mask=keep, other=float("-inf")).to(tl.float32)
            x = _rows(X + b * sxb + h * sxh, rows, keep, rd, D, sxn, sxd).to(tl.float32)
            lse = tl.load(L + bh * length + rows, mask=inside, other=float("inf"))
            g = _rows(G + b * sgb + h * sgh, rows, inside, rd, D, sgn, sgd).to(tl.float32)
            p = _rows(P + b * spb + h * sph, rows, inside, rd, D, spn, 1)
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

    @triton.jit
    def _column_scale(W, K, OUT, rows, cols, BO: tl.constexpr, BI: tl.constexpr):
        """One (BO, BI) tile of sequence b's OUT[b] = W diag(K[b]), the product in fp32, rounded once
        to OUT's dtype (W (rows, cols) and K (B, cols) contiguous)."""
        ob, ib, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        ro, ri = ob * BO + tl.arange(0, BO), ib * BI + tl.arange(0, BI)
        inside = (ro[:, None] < rows) & (ri[None, :] < cols)
        tile = ro[:, None] * cols + ri[None, :]
        w = tl.load(W + tile, mask=inside, other=0.0).to(tl.float32)
        k = tl.load(K + b * cols + ri, mask=ri < cols, other=0.0).to(tl.float32)
        tl.store(OUT + b.to(tl.int64) * rows * cols + tile, (w * k[None, :]).to(OUT.dtype.element_ty), mask=inside)

    @triton.jit
    def _column_scale_backward(G, W, K, GW, GK, batch, rows, cols, sgb, sgo, sgi,
                               BO: tl.constexpr, BI: tl.constexpr, BB: tl.constexpr):
        """For one (BO, BI) tile, over the batch BB sequences at a time (their loads in flight
        together; the sum in a fixed order): dW = sum_b G[b] diag(K[b]), and this tile's share of dK[b] =
        sum_o G[b] * W (GK (row tiles, B, cols), summed over the tiles after)."""
        ob, ib = tl.program_id(0), tl.program_id(1)
        ro, ri, rb = ob * BO + tl.arange(0, BO), ib * BI + tl.arange(0, BI), tl.arange(0, BB)
        inside = (ro[:, None] < rows) & (ri[None, :] < cols)
        w = tl.load(W + ro[:, None] * cols + ri[None, :], mask=inside, other=0.0).to(tl.float32)
        grad_w = tl.zeros((BO, BI), dtype=tl.float32)
        tile_g = G + ro[:, None] * sgo + ri[None, :] * sgi
        for first in range(0, batch, BB):
            b = first + rb
            columns = (b[:, None] < batch) & (ri[None, :] < cols)  # (BB, BI)
            g = tl.load(tile_g[None, :, :] + b.to(tl.int64)[:, None, None] * sgb,  # 64-bit: B D^2 may pass 2^31
                        mask=(b[:, None, None] < batch) & inside[None, :, :], other=0.0).to(tl.float32)
            k = tl.load(K + b[:, None] * cols + ri[None, :], mask=columns, other=0.0).to(tl.float32)
            grad_w += tl.sum(g * k[:, None, :], axis=0)
            tl.store(GK + (ob * batch + b[:, None]) * cols + ri[None, :], tl.sum(g * w[None, :, :], axis=1),
                     mask=columns)
        tl.store(GW + ro[:, None] * cols + ri[None, :], grad_w, mask=inside)

    @triton.jit
    def _scaled_product(V, K, W, Q, OUT, length, outs, ins, svb, svn, svi, sqb, sqn, sqo,
                        BM: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr, EXACT: tl.constexpr):
        """One (BM, BO) tile of sequence b's OUT[b] = Q[b] + (V[b] diag(K[b])) W^T: the rows of V
        scaled by K on load and rounded once to V's dtype (as the product u = k_g * v would be), W
        read in its own dtype and rounded to V's, the product summed in fp32 from Q's tile (in
        fp32 on CUDA cores where EXACT: fp32 inputs, and the interpreter, whose 16-bit products are
        wrong), rounded once to OUT's dtype (W (outs, ins), K (B, ins) and OUT contiguous)."""
        tile, b = tl.program_id(0), tl.program_id(1).to(tl.int64)  # 64-bit: B N D may pass 2^31
        row_tiles = tl.cdiv(length, BM)
        rm, ro = (tile % row_tiles) * BM + tl.arange(0, BM), (tile // row_tiles) * BO + tl.arange(0, BO)
        rows, columns = rm < length, ro < outs
        acc = tl.load(Q + b * sqb + rm[:, None] * sqn + ro[None, :] * sqo, mask=rows[:, None] & columns[None, :],
                      other=0.0).to(tl.float32)
        for first in range(0, ins, BI):
            ri = first + tl.arange(0, BI)
            inner = ri < ins
            v = tl.load(V + b * svb + rm[:, None] * svn + ri[None, :] * svi, mask=rows[:, None] & inner[None, :],
                        other=0.0)
            k = tl.load(K + b * ins + ri, mask=inner, other=0.0).to(tl.float32)
            u = (v.to(tl.float32) * k[None, :]).to(V.dtype.element_ty)
            w = tl.load(W + ro[None, :] * ins + ri[:, None], mask=inner[:, None] & columns[None, :],
                        other=0.0).to(V.dtype.element_ty)  # (BI, BO): W^T's tile
            if EXACT:
                acc += tl.dot(u.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(u, w)
        tl.store(OUT + (b * length + rm[:, None]) * outs + ro[None, :], acc.to(OUT.dtype.element_ty),
                 mask=rows[:, None] & columns[None, :])

# Rows per tile, and rows per slice of a split sum over the sequence: a fixed slice (whatever the
# length) keeps every real row in the same tile and slice when padding is appended.
_BLOCK_N = 64
_CHUNK = 512
# Rows per tile of the causal pooling, whose (rows, rows) weights and exact fp32 products (on CUDA
# cores) weigh on registers: with 64-row tiles ptxas compiled both kernels for sm_90 to 32
# registers and 6.5-10 KB of spilled stack per thread; 32-row tiles (8 warps from 128-wide heads)
# need 64-147 registers and spill nothing up to 128-wide heads (`scripts/compile_kernels.py`).
# Heads 256 wide take `_PREFIX_WIDE_BLOCK_N` (`_prefix_rows`).
_PREFIX_BLOCK_N = 32
_PREFIX_WIDE_BLOCK_N = 16
# Elements per program of the sum over slices (`_sum_parts`): a whole (256, 128) state per program
# held 256 fp32 values per thread, and ptxas gave it 255 registers and spilled 200 bytes for sm_90.
_SUM_BLOCK = 2048


def _linear_rows(exact: bool) -> int:
    """Rows per tile of the linear-attention kernels: 16 where their products run exactly in fp32
    on CUDA cores (fp32 inputs), else `_BLOCK_N`. Compiled for sm_90 with 64-row tiles, the exact
    products spilled registers: 1.7 KB per thread in the fused backward at 64-wide heads, and the
    state product at 96- and 128-wide heads got 32 registers and 6.5-8 KB of stack; 16-row tiles
    spill nothing there (`scripts/compile_kernels.py`). The interpreter keeps 64-row tiles (its
    products are exact for every dtype), except where a test swaps this function."""
    return 16 if exact and not INTERPRETED else _BLOCK_N


def _prefix_rows(width: int) -> int:
    """Rows per tile of the causal pooling's kernels for heads `width` wide: `_PREFIX_BLOCK_N`, and
    `_PREFIX_WIDE_BLOCK_N` from 256-wide tiles. At 256 with 32 rows, three (32, 256) fp32 tiles
    and the gradient's held 128 values per thread at 8 warps: the backward spilled 440 bytes per
    thread for sm_90 with triton 3.9, and with triton 3.6 (torch 2.11's) got 32 registers and 4 KB
    of stack, bf16 and fp32 alike (`scripts/compile_kernels.py`)."""
    return _PREFIX_WIDE_BLOCK_N if _tile(width) >= 256 else _PREFIX_BLOCK_N


_multiprocessors: dict = {}


def fused(pairs: int, device: torch.device) -> bool:
    """Whether `pairs` (sequence, head) pairs fill the device with one program each: from the
    policy's `fused_min_pairs` pairs, or where unset the GPU's number of multiprocessors (the
    interpreter: always)."""
    least = active().fused_min_pairs
    if least is not None:
        return pairs >= least
    if device.type != "cuda":
        return True
    if device not in _multiprocessors:
        _multiprocessors[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return pairs >= _multiprocessors[device]


def supported_width(width: int) -> bool:
    """Head widths the kernels take: up to 256 (one tile per head)."""
    return 1 <= width <= 256


# Shared memory one program may ask for (the opt-in maximum of a block), by compute capability,
# where triton's driver does not say (NVIDIA's CUDA C++ Programming Guide, technical specifications).
SHARED_MEMORY_BY_CAPABILITY = {(8, 0): 166_912, (8, 6): 101_376, (8, 7): 166_912, (8, 9): 101_376, (9, 0): 232_448}
_shared_memory: dict = {}

# The most shared memory one program of a kernel family asks for, by the tile it holds (the product
# of its widths padded to powers of two): (largest tile, bytes) pairs, over what triton compiles
# for sm_80 and sm_90 from bf16 and fp32 inputs. `scripts/compile_kernels.py` prints the compiled
# numbers, and its slow test keeps them within these bounds. A family runs its kernels only where
# its bound fits the GPU (`shared_memory_limit`); larger tiles, or a GPU with less shared memory,
# take the torch forms. Linear attention's tile is d_k x d_v (a Hedgehog map's 2 d x (d + 1)).
LINEAR_ATTENTION_SHARED = ((4096, 98_304), (16_384, 131_072), (32_768, 212_992))
# the pooling across heads: heads x width (16 x 512 for 8 heads of a 512-wide layer)
SHARED_POOL_SHARED = ((4096, 98_304), (8192, 163_840))
# the causal (prefix) pooling: the head width
PREFIX_POOL_SHARED = ((64, 26_624), (256, 34_816))
# the scaled product: its fixed tiles, whatever the widths (`policy.Experimental.product_tiles`)
PRODUCT_SHARED = 115_200


@torch.compiler.assume_constant_result  # inside torch.compile: asked once while tracing, not a graph break
def shared_memory_limit(device: torch.device) -> int | None:
    """Bytes of shared memory one program may use on `device` (None where there is no limit: the
    interpreter)."""
    if INTERPRETED or device.type != "cuda":
        return None
    if device not in _shared_memory:
        if not torch.cuda.is_available():  # a GPU this machine lacks (`explain.py` asks): no limit known
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            limit = int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])
        except Exception:  # a driver without the query: the capability's limit, or the smallest known
            limit = SHARED_MEMORY_BY_CAPABILITY.get(torch.cuda.get_device_capability(index),
                                                    min(SHARED_MEMORY_BY_CAPABILITY.values()))
        _shared_memory[device] = limit
    return _shared_memory[device]


def _bound(bounds, tile: int) -> int | None:
    """The shared memory a family with `bounds` asks for at `tile`, or None past its largest tile."""
    return next((size for largest, size in bounds if tile <= largest), None)


def _fits(needed: int | None, limit: int | None) -> bool:
    return needed is not None and (limit is None or needed <= limit)


def linear_attention_shared(dk: int, dv: int) -> int | None:
    """The most shared memory `linear_attention_kernel`'s programs ask for with keys d_k and values
    d_v wide (`LINEAR_ATTENTION_SHARED`), or None where it takes no such widths."""
    if not (supported_width(dk) and supported_width(dv)):
        return None
    return _bound(LINEAR_ATTENTION_SHARED, _tile(dk) * _tile(dv))


def linear_attention_fits(dk: int, dv: int, limit: int | None) -> bool:
    """Whether `linear_attention_kernel` takes keys d_k and values d_v wide on a GPU whose programs
    may use `limit` bytes of shared memory (None: no limit)."""
    return _fits(linear_attention_shared(dk, dv), limit)


def prefix_shared(width: int) -> int | None:
    """The most shared memory `prefix_pool_kernel`'s programs ask for at heads `width` wide
    (`PREFIX_POOL_SHARED`), or None where it takes no such width."""
    return _bound(PREFIX_POOL_SHARED, _tile(width)) if supported_width(width) else None


def prefix_fits(width: int, limit: int | None) -> bool:
    """Whether `prefix_pool_kernel` takes heads `width` wide within `limit` bytes of shared memory."""
    return _fits(prefix_shared(width), limit)


def _tile(width: int) -> int:
    """A width padded to a tile: a power of two, at least 16 (the smallest matrix-product tile)."""
    return max(16, triton.next_power_of_2(width))


def _slices(length: int) -> tuple[int, int]:
    """(number of slices, rows per slice) of a split sum over the sequence."""
    return max(1, triton.cdiv(length, _CHUNK)), _CHUNK


def _heads_last(batch: int, heads: int, length: int, width: int, like: torch.Tensor) -> torch.Tensor:
    """An empty (B, H, N, width) tensor stored as (B, N, H, width): merging its heads is a view."""
    return torch.empty(batch, length, heads, width, dtype=like.dtype, device=like.device).transpose(1, 2)


def _mask_arguments(mask: torch.Tensor | None, x: torch.Tensor):
    """(mask pointer, its two strides, HAS_MASK): the (B, N) mask as it is (any dtype), or a dummy."""
    if mask is None:
        return x, 0, 0, False
    return mask, mask.stride(0), mask.stride(1), True


def _launch_options(*widths: int) -> dict:
    """Warps and pipeline stages of a launch: wide tiles (128 columns and up: 1,024 wide with 8
    heads, a feature map's 2 d) take 8 warps and two stages, or the staged tiles outgrow an H200's
    shared memory (237,568 bytes asked against 232,448 at three stages)."""
    if max(_tile(w) for w in widths) >= 128:
        return {"num_warps": 8, "num_stages": 2}
    return {"num_warps": 4, "num_stages": 3}


def _dot_fp32(*tensors: torch.Tensor) -> bool:
    return INTERPRETED or any(t.dtype == torch.float32 for t in tensors)


def _scale_pointer(scale: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return x if scale is None else scale.detach().float().reshape(1)


def outer_sum(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """sum_n m_n x_n^T y_n per head, split over slices: x (B, H, N, dx), y (B, H, N, dy) ->
    (B, H, bx, by) fp32, the (dx, dy) sums padded with zeros to tiles, as `state_product` takes them."""
    batch, heads, length, dx = x.shape
    dy = y.shape[-1]
    bx, by = _tile(dx), _tile(dy)
    parts, chunk = _slices(length)
    partial = torch.empty(batch * heads, parts, bx, by, dtype=torch.float32, device=x.device)
    mask_ptr, smb, smn, has_mask = _mask_arguments(mask, x)
    exact = _dot_fp32(x, y)
    _outer_sum[(parts, batch * heads)](
        x, y, mask_ptr, partial, length, chunk, *x.stride(), *y.stride(), smb, smn,
        heads=heads, DX=dx, DY=dy, BX=bx, BY=by, BLOCK_N=_linear_rows(exact), HAS_MASK=has_mask, DOT_FP32=exact,
        **_launch_options(dx, dy),
    )
    if parts == 1:
        return partial.view(batch, heads, bx, by)
    summed = torch.empty(batch, heads, bx, by, dtype=torch.float32, device=x.device)
    block = min(bx * by, _SUM_BLOCK)
    _sum_parts[(batch * heads, bx * by // block)](partial, summed, parts, SIZE=bx * by, BLOCK=block)
    return summed


def state_product(x: torch.Tensor, state: torch.Tensor, width: int, mask: torch.Tensor | None = None,
                  scale: torch.Tensor | None = None, *, transpose: bool = False) -> torch.Tensor:
    """c m_n x_n S per head over tiles of rows (S^T with `transpose`): x (B, H, N, dx), state padded
    as `outer_sum` returns it (stored (B, H, dy, dx) with `transpose`), `width` = dy, scale one
    element or None. Returns (B, H, N, dy) in x's dtype, stored heads-last."""
    batch, heads, length, dx = x.shape
    out = _heads_last(batch, heads, length, width, x)
    mask_ptr, smb, smn, has_mask = _mask_arguments(mask, x)
    exact = _dot_fp32(x)
    rows = _linear_rows(exact)
    options = _launch_options(dx, width)
    if exact and not INTERPRETED and _tile(dx) * _tile(width) >= 128 * 128:
        # a (128, 128) fp32 state or wider, multiplied on CUDA cores: with 8 warps ptxas gave the
        # Hedgehog map's 128 x 65 and 192 x 97 products 32 registers and 3.4-5.6 KB of stack per
        # thread; 16 warps spill nothing (`scripts/compile_kernels.py`)
        options["num_warps"] = 16
    _state_product[(triton.cdiv(length, rows), batch * heads)](
        x, state.contiguous(), out, mask_ptr, _scale_pointer(scale, x), length, *x.stride(), *out.stride(), smb, smn,
        heads=heads, DX=dx, DY=width, BX=_tile(dx), BY=_tile(width), BLOCK_N=rows, TRANSPOSE=transpose,
        HAS_MASK=has_mask, HAS_SCALE=scale is not None, DOT_FP32=exact, **options,
    )
    return out


def _launch_fused_forward(query, key, value, mask, scale):
    batch, heads, length_q, dk = query.shape
    length_k, dv = key.shape[2], value.shape[-1]
    bk, bv = _tile(dk), _tile(dv)
    out = _heads_last(batch, heads, length_q, dv, query)
    state = torch.empty(batch, heads, bk, bv, dtype=torch.float32, device=query.device)
    mask_ptr, smb, smn, has_mask = _mask_arguments(mask, query)
    exact = _dot_fp32(query, key, value)
    _fused_forward[(batch * heads,)](
        query, key, value, mask_ptr, _scale_pointer(scale, query), out, state, length_q, length_k,
        *query.stride(), *key.stride(), *value.stride(), *out.stride(), smb, smn,
        heads=heads, DK=dk, DV=dv, BK=bk, BV=bv, BLOCK_N=_linear_rows(exact), HAS_MASK=has_mask,
        HAS_SCALE=scale is not None, DOT_FP32=exact, **_launch_options(dk, dv),
    )
    return out, state


def _launch_fused_backward(query, key, value, mask, scale, state, grad):
    batch, heads, length_q, dk = query.shape
    length_k, dv = key.shape[2], value.shape[-1]
    grads = [_heads_last(batch, heads, t.shape[2], t.shape[-1], t) for t in (query, key, value)]
    scale_products = torch.empty(batch * heads, dtype=torch.float32, device=query.device)
    mask_ptr, smb, smn, has_mask = _mask_arguments(mask, query)
    exact = _dot_fp32(query, key, value, grad)
    _fused_backward[(batch * heads,)](
        query, key, value, grad, mask_ptr, _scale_pointer(scale, query), state, *grads, scale_products,
        length_q, length_k, *query.stride(), *key.stride(), *value.stride(), *grad.stride(),
        *grads[0].stride(), *grads[1].stride(), *grads[2].stride(), smb, smn,
        heads=heads, DK=dk, DV=dv, BK=_tile(dk), BV=_tile(dv), BLOCK_N=_linear_rows(exact), HAS_MASK=has_mask,
        HAS_SCALE=scale is not None, DOT_FP32=exact, **_launch_options(dk, dv),
    )
    return (*grads, scale_products.sum())


def _linear_attention_forward(query, key, value, mask, scale):
    """(out, the state K^T V over the real keys, fp32, padded to tiles)."""
    if fused(query.shape[0] * query.shape[1], query.device):
        return _launch_fused_forward(query, key, value, mask, scale)
    state = outer_sum(key, value, mask)
    return state_product(query, state, value.shape[-1], scale=scale), state


def _linear_attention_grads(query, key, value, mask, scale, state, grad):
    """(dQ, dK, dV, each in its input's dtype and stored heads-last, and <K^T V, Q^T dO>, the
    scale's gradient before its dtype) from the forward's inputs and state and the output's
    gradient: one launch where the forward took the fused plan and the tiles fit, else the split
    sums and products."""
    if grad.stride(-1) != 1:
        grad = grad.contiguous()
    if fused(query.shape[0] * query.shape[1], query.device) and _fused_backward_fits(query.shape[-1], value.shape[-1]):
        return _launch_fused_backward(query, key, value, mask, scale, state, grad)
    products = outer_sum(query, grad, None)  # Q^T dO, unscaled
    scale_products = (products * state).sum()
    if scale is not None:
        products = products * scale.detach().float()
    grad_query = state_product(grad, state, query.shape[-1], scale=scale, transpose=True)
    grad_key = state_product(value, products, key.shape[-1], mask, transpose=True)
    grad_value = state_product(key, products, value.shape[-1], mask)
    # a feature map's fp32 keys beside 16-bit values: each gradient in its own input's dtype
    return grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype), scale_products


def _fused_backward_fits(dk: int, dv: int) -> bool:
    """Whether one program can hold the fused backward's tiles (the state, Q^T dO and their
    transposes: 262,144 bytes of shared memory at 128 x 128, over an H200's 232,448). Wider heads
    (1,024 wide with 8 heads; a Hedgehog map's 2 d against d + 1) take the split backward, whose
    launches each hold one tile; the fused forward's state serves it as it is."""
    return _tile(dk) * _tile(dv) < 128 * 128


class _LinearAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, mask, scale):
        out, state = _linear_attention_forward(query, key, value, mask, scale)
        ctx.save_for_backward(query, key, value, mask, state, scale)
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, mask, state, scale = ctx.saved_tensors
        *grads, scale_products = _linear_attention_grads(query, key, value, mask, scale, state, grad)
        return *grads, None, _scale_grad(scale, scale_products, ctx.needs_input_grad[4])


def _scale_grad(scale, products, needed: bool):
    """The scale's gradient from <K^T V, Q^T dO>, or None where no gradient is asked."""
    return products.reshape(scale.shape).to(scale.dtype) if scale is not None and needed else None


def linear_attention_kernel(query, key, value, mask=None, scale=None) -> torch.Tensor:
    """Bidirectional `ops.linear_attention` without a state: out_i = scale * q_i sum_j m_j k_j^T v_j.
    query/key (B, H, Nq/Nk, d), value (B, H, Nk, e) (widths `supported_width`), mask (B, Nk) or None,
    scale a one-element tensor or None. Returns (B, H, Nq, e) in the queries' dtype."""
    if _as_operators():
        return OPERATORS.linear_attention(query, key, value, mask, scale)[0]
    if _needs_graph(query, key, value, scale):
        return _LinearAttention.apply(query, key, value, mask, scale)
    return _linear_attention_forward(query, key, value, mask, scale)[0]  # inference: no autograd node


# how many Python dispatch modes are active (private API, absent from some torch versions)
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)


def _as_operators() -> bool:
    """Whether a call runs as its operators (`OPERATORS`) rather than as an autograd function that
    launches the kernels itself: inside torch.compile, and under a Python dispatch mode (a counter
    of operations or memory traffic, `torch.utils.flop_counter`, fake tensors, selective activation
    checkpointing), which would not see the kernels' launches but sees an operator's inputs and
    outputs, and runs its fake implementation where tensors hold no data."""
    return torch.compiler.is_compiling() or _dispatch_modes() > 0


def _needs_graph(*tensors) -> bool:
    """Whether a call must record its backward (the host time of an autograd node is worth saving
    where launches, not the GPU, bound the time: inference on short inputs)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _direction_strides(direction):
    """(batch stride, head stride) of a direction (B or 1, H, d): one row is shared by the batch."""
    if direction is None:
        return 0, 0
    return (0 if direction.shape[0] == 1 else direction.stride(0)), direction.stride(1)


def _pool_slices(values) -> tuple[int, int]:
    """(slices, rows per slice) of a pooling, by the policy's `pool_chunk` (rows per program, or
    None for one program per pair where the pairs fill the GPU); one slice is the whole sequence."""
    batch, heads, length, _ = values.shape
    whole = 1, max(_BLOCK_N, triton.cdiv(length, _BLOCK_N) * _BLOCK_N)
    chunk = active().pool_chunk
    if chunk is None:
        return whole if fused(batch * heads, values.device) else _slices(length)
    if chunk <= 0 or chunk % _BLOCK_N:  # a slice ends inside a tile: rows counted twice
        raise ValueError(f"policy pool_chunk={chunk}: a positive multiple of {_BLOCK_N} rows, or None")
    return whole if length <= chunk else (triton.cdiv(length, chunk), chunk)


def _pool_forward(values, direction, mask, scale: float = 1.0, gate=None):
    """(pooled (B, H, d) fp32, log-sum-exp (B, H) fp32, +inf where a row has no real token), the
    scores x_n . u multiplied by `scale`; with a gate (B, H, d) fp32, the pooling of gate * x_n."""
    batch, heads, length, dim = values.shape
    parts, chunk = _pool_slices(values)
    pooled = torch.empty(batch, heads, dim, dtype=torch.float32, device=values.device)
    lse = torch.empty(batch, heads, dtype=torch.float32, device=values.device)
    shape = (batch * heads, parts)
    if parts == 1:
        top = total = acc = pooled  # unused: the kernel writes the pooling itself
    else:
        top, total = (torch.empty(shape, dtype=torch.float32, device=values.device) for _ in range(2))
        acc = torch.empty(*shape, _tile(dim), dtype=torch.float32, device=values.device)
    mask_ptr, smb, smn, has_mask = _mask_arguments(mask, values)
    gate_ptr = pooled if gate is None else gate
    _pool[(parts, batch * heads)](
        values, values if direction is None else direction, gate_ptr, mask_ptr, top, total, acc, pooled, lse,
        length, chunk, float(scale), *values.stride(), *_direction_strides(direction), smb, smn, heads=heads, D=dim,
        BD=_tile(dim), BLOCK_N=_BLOCK_N, HAS_MASK=has_mask, HAS_DIRECTION=direction is not None,
        HAS_GATE=gate is not None, FINAL=parts == 1,
    )
    if parts > 1:
        _merge_pools[(batch * heads,)](top, total, acc, pooled, lse, gate_ptr, parts, D=dim, BD=_tile(dim),
                                       HAS_GATE=gate is not None)
    return pooled, lse


def _direction_pool_grads(values, direction, mask, pooled, lse, grad, scale: float = 1.0, gate=None):
    """(dvalues stored heads-last in the values' dtype, du in the direction's dtype or None without
    a direction, the gate's gradient (B, H, d) fp32 or None without a gate) from the forward's
    inputs, output and log-sum-exp and the output's gradient."""
    batch, heads, length, dim = values.shape
    grad, pooled = grad.float().contiguous(), pooled.contiguous()  # (B, H, d): the kernel takes g . pooled
    parts, chunk = _pool_slices(values)
    grad_values = _heads_last(batch, heads, length, dim, values)
    partial = torch.empty(batch * heads, parts, _tile(dim), dtype=torch.float32, device=values.device)
    shares = partial if gate is None else torch.empty_like(partial)  # the gate's: the ungated pooling's
    mask_ptr, smb, smn, has_mask = _mask_arguments(mask, values)
    _pool_backward[(parts, batch * heads)](
        values, values if direction is None else direction, pooled if gate is None else gate, mask_ptr, grad, lse,
        pooled, grad_values, partial, shares, length, chunk, float(scale), *values.stride(),
        *_direction_strides(direction), smb, smn, *grad_values.stride(), heads=heads, D=dim, BD=_tile(dim),
        BLOCK_N=_BLOCK_N, HAS_MASK=has_mask, HAS_DIRECTION=direction is not None, HAS_GATE=gate is not None,
    )
    if gate is not None:
        return grad_values, *_gate_grads_of(partial, shares, grad, direction, gate, parts)
    if direction is None:
        return grad_values, None, None
    grad_direction = (partial[:, 0] if parts == 1 else partial.sum(1))[:, :dim].view(batch, heads, dim)
    if direction.shape[0] == 1 and batch > 1:
        grad_direction = grad_direction.sum(0, keepdim=True)
    return grad_values, grad_direction.to(direction.dtype), None


def _sequences_per_tile(batch: int, most: int) -> int:
    """Sequences one tile of a kernel walking the batch takes: the batch rounded up to a power of
    two, at most `most` (a power of two), at least 1."""
    return max(1, min(triton.next_power_of_2(batch), most))


# Tile of the column scaling (`column_scale_kernel`): 32 x 32 gives a 512-wide layer's weight 256
# programs, each walking the batch in its backward, `_SCALE_BATCH` sequences at a time (one at a
# time, ptxas kept one tile's load in flight: 40 loads one after another at batch 40).
_SCALE_BLOCK = 32
_SCALE_BATCH = 4


def _column_scale_forward(weight, scales, dtype: torch.dtype) -> torch.Tensor:
    """(B, O, I) = weight (O, I) diag(scales[b]) in `dtype`."""
    weight, scales = weight.contiguous(), scales.contiguous()
    (rows, cols), batch = weight.shape, scales.shape[0]
    out = torch.empty(batch, rows, cols, dtype=dtype, device=weight.device)
    grid = (triton.cdiv(rows, _SCALE_BLOCK), triton.cdiv(cols, _SCALE_BLOCK), batch)
    _column_scale[grid](weight, scales, out, rows, cols, BO=_SCALE_BLOCK, BI=_SCALE_BLOCK)
    return out


def _column_scale_grads(grad, weight, scales) -> tuple[torch.Tensor, torch.Tensor]:
    """(dweight, dscales) of `_column_scale_forward`, summed in fp32 and returned in the operands'
    dtypes, from the output's gradient (any strides)."""
    weight, scales = weight.contiguous(), scales.contiguous()
    (rows, cols), batch = weight.shape, scales.shape[0]
    tiles = triton.cdiv(rows, _SCALE_BLOCK)
    grad_weight = torch.empty(rows, cols, dtype=torch.float32, device=weight.device)
    shares = torch.empty(tiles, batch, cols, dtype=torch.float32, device=weight.device)
    _column_scale_backward[(tiles, triton.cdiv(cols, _SCALE_BLOCK))](
        grad, weight, scales, grad_weight, shares, batch, rows, cols, *grad.stride(), BO=_SCALE_BLOCK,
        BI=_SCALE_BLOCK, BB=_sequences_per_tile(batch, _SCALE_BATCH),
    )
    grad_scales = shares[0] if tiles == 1 else shares.sum(0)
    return grad_weight.to(weight.dtype), grad_scales.to(scales.dtype)


class _ColumnScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, scales, dtype):
        ctx.save_for_backward(weight, scales)
        return _column_scale_forward(weight, scales, dtype)

    @staticmethod
    def backward(ctx, grad):
        return *_column_scale_grads(grad, *ctx.saved_tensors), None


def column_scale_kernel(weight, scales, dtype: torch.dtype) -> torch.Tensor:
    """`ops.column_scaled`: (B, O, I) = weight (O, I) diag(scales[b]) for scales (B, I), each
    element's product in fp32 rounded once to `dtype`; the backward reads the output's gradient
    once for both gradients (the weight's summed over the batch in a fixed order)."""
    if _as_operators():
        return OPERATORS.column_scale(weight, scales, dtype)
    if _needs_graph(weight, scales):
        return _ColumnScale.apply(weight, scales, dtype)
    return _column_scale_forward(weight, scales, dtype)


# Tiles of the scaled product (`scaled_product_kernel`) where fp32 rows make the products exact on
# CUDA cores, (rows, outputs, inner width, warps, pipeline stages); 16-bit rows take the policy's
# `experimental.product_tiles` (tensor-core tiles; the interpreter too: its products are exact anyway).
_PRODUCT_EXACT_TILES = (64, 64, 16, 4, 2)


def _product_tiles(dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    return _PRODUCT_EXACT_TILES if dtype == torch.float32 and not INTERPRETED else active().experimental.product_tiles


def _scaled_product_forward(base, rows, weight, scales) -> torch.Tensor:
    """(B, N, O) = base + (rows diag(scales[b])) weight^T in rows' dtype, for rows and base of any strides."""
    weight, scales = weight.contiguous(), scales.contiguous()
    (batch, length, ins), outs = rows.shape, weight.shape[0]
    out = torch.empty(batch, length, outs, dtype=rows.dtype, device=rows.device)
    bm, bo, bi, warps, stages = _product_tiles(rows.dtype)
    grid = (triton.cdiv(length, bm) * triton.cdiv(outs, bo), batch)
    _scaled_product[grid](rows, scales, weight, base, out, length, outs, ins, *rows.stride(), *base.stride(),
                          BM=bm, BO=bo, BI=bi, EXACT=rows.dtype == torch.float32 or INTERPRETED,
                          num_warps=warps, num_stages=stages)
    return out


def _scaled_product_grads(grad, rows, weight, scales, column_scale=None, column_scale_grads=None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(drows, dweight, dscales) of `_scaled_product_forward` (base's gradient is `grad` itself),
    through the (B, O, I) map weight diag(scales[b]), formed again: drows = grad map, and the map's
    gradient grad^T rows to both of the column scaling's. The column scaling and its gradients run
    as `column_scale(weight, scales, dtype)` and `column_scale_grads(grad, weight, scales)`: by
    default the launching functions, the operators in the operator's backward."""
    scaled = (column_scale or _column_scale_forward)(weight, scales, grad.dtype)
    grad_scaled = torch.bmm(grad.transpose(1, 2), rows.to(grad.dtype))
    return torch.bmm(grad, scaled), *(column_scale_grads or _column_scale_grads)(grad_scaled, weight, scales)


class _ScaledProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, base, rows, weight, scales):
        ctx.save_for_backward(rows, weight, scales)
        return _scaled_product_forward(base, rows, weight, scales)

    @staticmethod
    def backward(ctx, grad):
        return grad, *_scaled_product_grads(grad, *ctx.saved_tensors)


def scaled_product_kernel(base, rows, weight, scales) -> torch.Tensor:
    """`ops.column_scaled_product`: (B, N, O) = base + (rows diag(scales[b])) weight^T for rows
    (B, N, I), weight (O, I) and scales (B, I), in one launch: the scaled rows rounded once to their
    dtype on load, the sum in fp32 from base's tile, no (B, O, I) map and no scaled copy of the rows
    written. The backward forms the map once (`_column_scale`) for the rows' gradient and reads its
    gradient once for the weight's and the scales' (`_column_scale_backward`)."""
    if _as_operators():
        return OPERATORS.scaled_product(base, rows, weight, scales)
    if _needs_graph(base, rows, weight, scales):
        return _ScaledProduct.apply(base, rows, weight, scales)
    return _scaled_product_forward(base, rows, weight, scales)


# Elements of one (sequences, head width) tile of `_gate_grads`: its programs, one per head, walk the
# batch a tile of sequences at a time, so that loads of many sequences are in flight at once (one
# sequence at a time, each program waited on about (slices / 4 + 1) loads per sequence in turn:
# ptxas unrolls the loop over slices by 4).
_GATE_TILE = 4096


def _gate_batch_rows(batch: int, width: int) -> int:
    """Sequences per tile of `_gate_grads`: up to `_GATE_TILE` elements."""
    return _sequences_per_tile(batch, _GATE_TILE // _tile(width))


def _gate_grads_of(partial, shares, grad, direction, gate, parts):
    """(du or None, dgate) of a gated pooling from the backward's sums per slice (`_gate_grads`)."""
    batch, heads, dim = gate.shape
    grad_gate = torch.empty_like(gate)
    grad_direction = None
    if direction is not None:
        grad_direction = torch.empty(direction.shape, dtype=torch.float32, device=gate.device)
    _gate_grads[(heads,)](
        partial, shares, grad, gate if direction is None else direction, gate, grad_gate,
        grad_gate if grad_direction is None else grad_direction, batch, parts, *_direction_strides(direction),
        heads=heads, D=dim, BD=_tile(dim), BB=_gate_batch_rows(batch, dim), HAS_DIRECTION=direction is not None,
        SHARED=direction is not None and direction.shape[0] == 1,
    )
    return (None if direction is None else grad_direction.to(direction.dtype)), grad_gate


class _DirectionPool(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, direction, mask, scale, gate):
        pooled, lse = _pool_forward(values, direction, mask, scale, gate)
        ctx.save_for_backward(values, direction, mask, pooled, lse, gate)
        ctx.scale = scale
        return pooled

    @staticmethod
    def backward(ctx, grad):
        values, direction, mask, pooled, lse, gate = ctx.saved_tensors
        grad_values, grad_direction, grad_gate = _direction_pool_grads(values, direction, mask, pooled, lse, grad,
                                                                       ctx.scale, gate)
        return grad_values, grad_direction, None, None, grad_gate


def direction_pool_kernel(values, direction=None, mask=None, scale: float = 1.0, gate=None) -> torch.Tensor:
    """Bidirectional `ops.direction_pool`: sum_j softmax_j(scale values_j . u) values_j over the real
    positions. values (B, H, N, d), direction u (B or 1, H, d) or None (the plain mean), mask (B, N)
    or None; the scale multiplies u inside the kernel. With a gate (B, H, d), the rows pooled are
    gate * values_j: the kernel reads values_j along gate * u and multiplies the pooling by the
    gate (no (B, H, N, d) product is formed). Returns (B, H, d) in fp32; zero for a row with no
    real token."""
    direction = None if direction is None else direction.contiguous()
    gate = None if gate is None else gate.float().contiguous()
    scale = float(scale)
    if _as_operators():
        return OPERATORS.direction_pool(values, direction, mask, scale, gate)[0]
    if _needs_graph(values, direction, gate):
        return _DirectionPool.apply(values, direction, mask, scale, gate)
    return _pool_forward(values, direction, mask, scale, gate)[0]  # inference: no autograd node


def shared_pool_shared(width: int, heads: int) -> int | None:
    """The most shared memory `shared_pool_kernel`'s programs ask for with `heads` directions over
    rows `width` wide (`SHARED_POOL_SHARED`), or None past its largest tile: a program holds
    (heads, width) tiles (the directions, the pooling, in the backward the gradients too), padded to
    powers of two, of at most 8,192 elements (16 heads at width 512); the backward's 16 x 1,024
    tiles outgrow an H200."""
    return _bound(SHARED_POOL_SHARED, _tile(heads) * _tile(width)) if width >= 1 else None


def product_fits(limit: int | None = None) -> bool:
    """Whether `scaled_product_kernel`'s tiles fit `limit` bytes of shared memory (None: no limit)."""
    return _fits(PRODUCT_SHARED, limit)


def shared_fits(width: int, heads: int, limit: int | None = None) -> bool:
    """Whether `shared_pool_kernel` takes `heads` directions over rows `width` wide within `limit`
    bytes of shared memory (None: no limit)."""
    return _fits(shared_pool_shared(width, heads), limit)


def _shared_block(width: int, backward: bool = False) -> int:
    """Rows per tile of the shared pooling: 16,384 elements of a (rows, width) tile (8,192 in the
    backward, which holds more tiles beside it), at least 16 (a matrix product's smallest tile): 32
    and 16 at width 512. A divisor of the policy's `pool_chunk` and of `_BLOCK_N`. At width 512 the backward's
    32-row tiles asked 196,608 bytes of shared memory (an A100 has 166,912) and ptxas spilled
    registers; 16 rows ask 163,840."""
    return max(16, min(_BLOCK_N, (8192 if backward else 16384) // _tile(width)))


def _shared_launch(values, direction, mask, backward: bool = False):
    """The launch arguments of the shared pooling's forward (or `backward`)."""
    batch, length, dim = values.shape
    heads = direction.shape[1]
    parts, chunk = _pool_slices(values[:, None])
    mask_ptr, smb, smn, has_mask = _mask_arguments(mask, values)
    sub = 0 if direction.shape[0] == 1 else direction.stride(0)
    constants = dict(heads=heads, D=dim, BD=_tile(dim), BH=_tile(heads), BLOCK_N=_shared_block(dim, backward), HAS_MASK=has_mask,
                     DOT_FP32=_dot_fp32(values), **_launch_options(dim))  # the rows' precision decides
    return parts, chunk, (mask_ptr,), (values.stride(0), values.stride(1), values.stride(2), sub, direction.stride(1),
                                       smb, smn), constants


def _shared_pool_forward(values, direction, mask, has_direction):
    """(pooled (B, H, D) fp32, log-sum-exp (B, H) fp32, +inf where a row has no real token)."""
    batch, length, dim = values.shape
    heads = direction.shape[1]
    parts, chunk, (mask_ptr,), strides, constants = _shared_launch(values, direction, mask)
    pooled = torch.empty(batch, heads, dim, dtype=torch.float32, device=values.device)
    lse = torch.empty(batch, heads, dtype=torch.float32, device=values.device)
    if parts == 1:
        top = total = acc = pooled  # unused: the kernel writes the pooling itself
    else:
        top, total = (torch.empty(batch * heads, parts, dtype=torch.float32, device=values.device) for _ in range(2))
        acc = torch.empty(batch * heads, parts, _tile(dim), dtype=torch.float32, device=values.device)
    _shared_pool[(parts, batch)](values, direction, mask_ptr, top, total, acc, pooled, lse, length, chunk, *strides,
                                 HAS_DIRECTION=has_direction, FINAL=parts == 1, **constants)
    if parts > 1:
        _merge_pools[(batch * heads,)](top, total, acc, pooled, lse, pooled, parts, D=dim, BD=_tile(dim),
                                       HAS_GATE=False)
    return pooled, lse


def _paired_backward(heads: int) -> bool:
    """Whether the shared pooling's backward with `heads` directions takes
    `_shared_pool_backward_paired`: where the policy's `paired_shared_backward` allows it and each
    direction and its gradient fit one tile's rows (up to 8 heads, whose directions alone are padded
    to the 16 rows of a matrix product's tile)."""
    return active().paired_shared_backward and _tile(2 * heads) == _tile(heads)


def _shared_pool_grads(values, direction, mask, pooled, lse, grad, has_direction: bool):
    """(dvalues, contiguous in the values' dtype, du in the direction's dtype or None without a
    direction) of the shared pooling, from the forward's inputs and results and the gradient."""
    batch, length, dim = values.shape
    heads = direction.shape[1]
    grad, pooled = grad.float().contiguous(), pooled.contiguous()  # (B, H, D): the kernels take g . pooled
    parts, chunk, (mask_ptr,), strides, constants = _shared_launch(values, direction, mask, backward=True)
    grad_values = torch.empty_like(values, memory_format=torch.contiguous_format)
    paired = has_direction and _paired_backward(heads)
    rows = _tile(heads) // 2 if paired else _tile(heads)
    partial = torch.empty(batch, parts, rows, _tile(dim), dtype=torch.float32, device=values.device)
    arguments = (values, direction, mask_ptr, grad, lse, pooled, grad_values, partial, length, chunk, *strides,
                 *grad_values.stride())
    if paired:
        _shared_pool_backward_paired[(parts, batch)](*arguments, **constants)
    else:
        _shared_pool_backward[(parts, batch)](*arguments, HAS_DIRECTION=has_direction, **constants)
    if not has_direction:
        return grad_values, None
    grad_direction = partial.sum(1)[:, :heads, :dim]
    if direction.shape[0] == 1:
        grad_direction = grad_direction.sum(0, keepdim=True)
    return grad_values, grad_direction.to(direction.dtype)


class _SharedPool(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, direction, mask, has_direction):
        pooled, lse = _shared_pool_forward(values, direction, mask, has_direction)
        ctx.has_direction = has_direction
        ctx.save_for_backward(values, direction, mask, pooled, lse)
        return pooled

    @staticmethod
    def backward(ctx, grad):
        return *_shared_pool_grads(*ctx.saved_tensors, grad, ctx.has_direction), None, None


def shared_pool_kernel(values, direction=None, mask=None) -> torch.Tensor:
    """Bidirectional `ops.direction_pool` of one sequence per batch row along several directions:
    pooled_h = sum_j softmax_j(values_j . u_h) values_j over the real positions. values (B, N, D),
    any strides; direction u (B or 1, H, D), or None for zero scores (the plain mean, H = 1); mask
    (B, N) or None. Returns (B, H, D) in fp32; zero for a row with no real token. One program per
    slice of `pool_chunk` rows reads each tile once for every head."""
    has_direction = direction is not None
    direction = values[:1, :1] if direction is None else direction.contiguous()  # a pointer never read
    if _as_operators():
        return OPERATORS.shared_pool(values, direction, mask, has_direction)[0]
    if _needs_graph(values, direction if has_direction else None):
        return _SharedPool.apply(values, direction, mask, has_direction)
    return _shared_pool_forward(values, direction, mask, has_direction)[0]


def _prefix_pool_forward(scores, values, mask):
    """(pooled (B, H, N, d) fp32, log-sum-exp (B, H, N) fp32, the floor before any real token)."""
    batch, heads, length, dim = values.shape
    pooled = torch.empty(batch, heads, length, dim, dtype=torch.float32, device=values.device)
    lse = torch.empty(batch, heads, length, dtype=torch.float32, device=values.device)
    mask_ptr, smb, smn, has_mask = _mask_arguments(mask, values)
    _prefix_pool[(batch * heads,)](
        scores, values, mask_ptr, pooled, lse, length, *scores.stride()[:3], *values.stride(), smb, smn,
        *pooled.stride()[:3], heads=heads, D=dim, BD=_tile(dim), BLOCK_N=_prefix_rows(dim), HAS_MASK=has_mask,
        **_launch_options(dim),
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
    mask_ptr, smb, smn, has_mask = _mask_arguments(mask, values)
    _prefix_pool_backward[(batch * heads,)](
        scores_in, values_in, mask_ptr, pooled, lse, grad, grad_values, grad_scores, length,
        *scores_in.stride()[:3], *values_in.stride(), smb, smn, *pooled.stride()[:3], *grad.stride(),
        heads=heads, D=dim, BD=_tile(dim), BLOCK_N=_prefix_rows(dim), HAS_MASK=has_mask, **_launch_options(dim),
    )
    return grad_scores.to(scores.dtype), grad_values.to(values.dtype)


class _PrefixPool(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, values, mask):
        pooled, lse = _prefix_pool_forward(scores, values, mask)
        ctx.save_for_backward(scores, values, mask, pooled, lse)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zeros filled for lse's gradient (as `_save_all`)
        return pooled, lse

    @staticmethod
    def backward(ctx, grad, _):
        return *_prefix_pool_grads(*ctx.saved_tensors, grad), None


def prefix_pool_kernel(scores, values, mask=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal `ops.softmax_pool` without a state: output i is sum_{j <= i} softmax_j(scores) values_j
    over the real positions j <= i, zero where there is none yet. scores (B, H, N, 1), values
    (B, H, N, d), mask (B, N) or None. Returns (pooled (B, H, N, d) fp32, log-sum-exp of the scores
    up to each position (B, H, N) fp32, `FLOOR` where there is no real token yet)."""
    if _as_operators():
        return OPERATORS.prefix_pool(scores, values, mask)
    if _needs_graph(scores, values):
        return _PrefixPool.apply(scores, values, mask)
    return _prefix_pool_forward(scores, values, mask)


# ----------------------------------------------------------------------------------------------
# torch.compile: each kernel family as an operator
# ----------------------------------------------------------------------------------------------
# Inside torch.compile the public functions above call operators (`torch.library.custom_op`) that
# the compiler does not trace into: the forward and the backward of each family are an operator
# each, running the same launches as an eager call, and a fake implementation of each tells the
# compiler its outputs' shapes, dtypes and strides. Compiled graphs (inductor's CUDA graphs of
# `mode="reduce-overhead"` included) then launch the kernels as they are. So do calls under a
# Python dispatch mode (`_as_operators`), which sees each operator whole. Other eager calls keep
# the autograd functions: an operator's dispatch costs about 10 us more host time per call, and
# eager calls on short inputs are bound by host time.

Tensor = torch.Tensor


def operator_namespace() -> str:
    """The namespace of this copy's operators (`torch.ops.<namespace>`), named after the module: the
    installed package and a checkpoint's copy of this file (`trust_remote_code`) register their own."""
    return re.sub(r"[^0-9A-Za-z_]", "_", __name__)


def _linear_attention_op(query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor],
                         scale: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    return _linear_attention_forward(query, key, value, mask, scale)


def _fake_linear_attention(query, key, value, mask, scale):
    batch, heads, length, dk = query.shape
    dv = value.shape[-1]
    state = query.new_empty(batch, heads, _tile(dk), _tile(dv), dtype=torch.float32)
    return _heads_last(batch, heads, length, dv, query), state


def _linear_attention_grads_op(query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor], scale: Optional[Tensor],
                               state: Tensor, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _linear_attention_grads(query, key, value, mask, scale, state, grad)


def _fake_linear_attention_grads(query, key, value, mask, scale, state, grad):
    grads = (_heads_last(*t.shape[:3], t.shape[3], t) for t in (query, key, value))
    return *grads, query.new_empty((), dtype=torch.float32)


def _direction_pool_op(values: Tensor, direction: Optional[Tensor], mask: Optional[Tensor],
                       scale: float = 1.0, gate: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    return _pool_forward(values, direction, mask, scale, gate)


def _direction_pool_grads_op(values: Tensor, direction: Optional[Tensor], mask: Optional[Tensor], gate: Optional[Tensor],
                             pooled: Tensor, lse: Tensor, grad: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    grad_values, grad_direction, grad_gate = _direction_pool_grads(values, direction, mask, pooled, lse, grad, scale,
                                                                   gate)
    return (grad_values, values.new_empty(0) if grad_direction is None else grad_direction.contiguous(),
            values.new_empty(0) if grad_gate is None else grad_gate)


def _fake_direction_pool_grads(values, direction, mask, gate, pooled, lse, grad, scale):
    return (_heads_last(*values.shape, values), _fake_direction_grad(values, direction),
            values.new_empty(0) if gate is None else torch.empty_like(gate))


def _fake_direction_grad(values, direction):
    """du as the kernels return it: (1 or B, H, d) as u is, or an empty tensor without u."""
    if direction is None:
        return values.new_empty(0)
    rows = 1 if direction.shape[0] == 1 else values.shape[0]
    return direction.new_empty(rows, *direction.shape[1:])


def _fake_pool(values, direction, mask, scale=1.0, gate=None):
    """(pooled (B, H, d), log-sum-exp (B, H)), fp32; the shared pooling's H is its directions'."""
    heads = values.shape[1] if values.dim() == 4 else direction.shape[1]
    return (values.new_empty(values.shape[0], heads, values.shape[-1], dtype=torch.float32),
            values.new_empty(values.shape[0], heads, dtype=torch.float32))


def _shared_pool_op(values: Tensor, direction: Tensor, mask: Optional[Tensor],
                    has_direction: bool) -> tuple[Tensor, Tensor]:
    return _shared_pool_forward(values, direction, mask, has_direction)


def _shared_pool_grads_op(values: Tensor, direction: Tensor, mask: Optional[Tensor], pooled: Tensor, lse: Tensor,
                          grad: Tensor, has_direction: bool) -> tuple[Tensor, Tensor]:
    grad_values, grad_direction = _shared_pool_grads(values, direction, mask, pooled, lse, grad, has_direction)
    return grad_values, values.new_empty(0) if grad_direction is None else grad_direction.contiguous()


def _fake_shared_pool_grads(values, direction, mask, pooled, lse, grad, has_direction):
    return (torch.empty_like(values, memory_format=torch.contiguous_format),
            _fake_direction_grad(values, direction if has_direction else None))


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


def _column_scale_op(weight: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    return _column_scale_forward(weight, scales, dtype)


def _fake_column_scale(weight, scales, dtype):
    return weight.new_empty(scales.shape[0], *weight.shape, dtype=dtype)


def _column_scale_grads_op(grad: Tensor, weight: Tensor, scales: Tensor) -> tuple[Tensor, Tensor]:
    return _column_scale_grads(grad, weight, scales)


def _fake_column_scale_grads(grad, weight, scales):
    return torch.empty_like(weight), torch.empty_like(scales)


def _scaled_product_op(base: Tensor, rows: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    return _scaled_product_forward(base, rows, weight, scales)


def _fake_scaled_product(base, rows, weight, scales):
    return rows.new_empty(*rows.shape[:2], weight.shape[0])


def _save_operands(ctx, inputs, output):
    """The column scaling's weight and scales, for its backward."""
    ctx.save_for_backward(*inputs[:2])


def _save_product_operands(ctx, inputs, output):
    """The scaled product's rows, weight and scales, for its backward."""
    ctx.save_for_backward(*inputs[1:])


def _column_scale_operator_backward(ctx, grad):
    return *OPERATORS.column_scale_grads(grad, *ctx.saved_tensors), None


def _scaled_product_operator_backward(ctx, grad):
    """`_scaled_product_grads` through operators a compiler or a counter sees one by one: the map's
    column scaling, the two batched products, and the scaling's gradients."""
    return grad, *_scaled_product_grads(grad, *ctx.saved_tensors, OPERATORS.column_scale, OPERATORS.column_scale_grads)


def _save_all(ctx, inputs, output):
    """Saves the tensor inputs (None included) and the outputs, and the flags and numbers (a
    scale) aside, in order; the last output
    (a state or a log-sum-exp) takes no gradient, and none is made for it: without
    `set_materialize_grads(False)` autograd would fill a tensor of zeros for it before every
    backward (one more kernel launch each on a GPU), which the backward never reads."""
    ctx.save_for_backward(*(x for x in inputs if not isinstance(x, (bool, float))), *output)
    ctx.mark_non_differentiable(output[-1])
    ctx.set_materialize_grads(False)
    ctx.flags = [x for x in inputs if isinstance(x, (bool, float))]


def _linear_attention_operator_backward(ctx, grad, _):
    query, key, value, mask, scale, _out, state = ctx.saved_tensors
    *grads, products = OPERATORS.linear_attention_grads(query, key, value, mask, scale, state, grad)
    return *grads, None, _scale_grad(scale, products, ctx.needs_input_grad[4])


def _direction_pool_operator_backward(ctx, grad, _):
    values, direction, mask, gate, pooled, lse = ctx.saved_tensors
    (scale,) = ctx.flags
    grad_values, grad_direction, grad_gate = OPERATORS.direction_pool_grads(values, direction, mask, gate, pooled, lse,
                                                                            grad, scale)
    return (grad_values, None if direction is None else grad_direction, None, None,
            None if gate is None else grad_gate)


def _shared_pool_operator_backward(ctx, grad, _):
    values, direction, mask, pooled, lse = ctx.saved_tensors
    (has_direction,) = ctx.flags
    grad_values, grad_direction = OPERATORS.shared_pool_grads(values, direction, mask, pooled, lse, grad, has_direction)
    return grad_values, grad_direction if has_direction else None, None, None


def _prefix_pool_operator_backward(ctx, grad, _):
    scores, values, mask, pooled, lse = ctx.saved_tensors
    return *OPERATORS.prefix_pool_grads(scores, values, mask, pooled, lse, grad), None


def _register_operators():
    """Each family's forward and gradient operators with their fake implementations, the forward's
    backward through the gradient operator; a namespace object of the operators by name."""
    families = (  # name, forward, its fake, backward, gradient operator, its fake
        ("linear_attention", _linear_attention_op, _fake_linear_attention, _linear_attention_operator_backward,
         _linear_attention_grads_op, _fake_linear_attention_grads),
        ("direction_pool", _direction_pool_op, _fake_pool, _direction_pool_operator_backward,
         _direction_pool_grads_op, _fake_direction_pool_grads),
        ("shared_pool", _shared_pool_op, lambda values, direction, mask, has: _fake_pool(values, direction, mask),
         _shared_pool_operator_backward, _shared_pool_grads_op, _fake_shared_pool_grads),
        ("prefix_pool", _prefix_pool_op, _fake_prefix_pool, _prefix_pool_operator_backward,
         _prefix_pool_grads_op, _fake_prefix_pool_grads),
    )
    operators = {}
    for name, forward, fake, backward, grads, fake_grads in families:
        operators[name] = _custom_op(name, forward, fake)
        operators[name].register_autograd(backward, setup_context=_save_all)
        operators[f"{name}_grads"] = _custom_op(f"{name}_grads", grads, fake_grads)
    operators["column_scale"] = _custom_op("column_scale", _column_scale_op, _fake_column_scale)
    operators["column_scale"].register_autograd(_column_scale_operator_backward, setup_context=_save_operands)
    operators["column_scale_grads"] = _custom_op("column_scale_grads", _column_scale_grads_op, _fake_column_scale_grads)
    operators["scaled_product"] = _custom_op("scaled_product", _scaled_product_op, _fake_scaled_product)
    operators["scaled_product"].register_autograd(_scaled_product_operator_backward,
                                                  setup_context=_save_product_operands)
    return types.SimpleNamespace(**operators)


def _custom_op(name: str, function, fake):
    """`function` as the operator `name` of this copy's namespace (with a numbered namespace where a
    torch that refuses to redefine an operator already holds that name: a module executed again)."""
    for attempt in range(100):
        namespace = operator_namespace() + (f"_{attempt}" if attempt else "")
        try:
            operator = torch.library.custom_op(f"{namespace}::{name}", function, mutates_args=())
        except RuntimeError:
            continue
        operator.register_fake(fake)
        return operator
    raise RuntimeError(f"hf_zformer: no free namespace for the operator {name} of {__name__}")


OPERATORS = _register_operators() if AVAILABLE else None
