"""Zformer's bidirectional linear attention as fused Triton kernels, forward and backward:
`linear_attention_kernel(query, key, value, mask, scale)`, `out_i = scale * q_i sum_j m_j k_j^T v_j`
(`ops.linear_attention`'s kernel form; its torch forms and reference are in `ops.py`).

With enough (sequence, head) pairs to fill the GPU (`triton_launch.fused`), one program per pair
sums the state K^T V over the keys in fp32 and applies it to every query in the same launch
(`_fused_forward`); the backward is one launch too (`_fused_backward`: G = Q^T dO, then
dQ = scale dO (K^T V)^T, dK = scale m V G^T, dV = scale m K G, and <K^T V, G> for the scale's
gradient). With fewer pairs (long inputs, small batches) the sums are split over slices of the
sequence (`_outer_sum`, then the slices in order, `_sum_parts`) and the products over tiles of
rows (`_state_product`). Inside torch.compile and under Python dispatch modes the forward and the
backward run as operators (`OPERATORS`).

This file ships to the Hugging Face Hub with every checkpoint and imports where triton is not
installed (`triton_launch.AVAILABLE` is then False and nothing here may be called)."""

import types
from typing import Optional

import torch

from .policy import INTERPRETED
from .triton_launch import (
    AVAILABLE,
    BLOCK_N,
    Tensor,
    as_operators,
    bound,
    dot_fp32,
    fits,
    fused,
    heads_last,
    kept,
    launch_options,
    load_tile,
    mask_arguments,
    needs_graph,
    register_family,
    slices,
    supported_width,
    tile,
    tl,
    triton,
)

if AVAILABLE:

    @triton.jit
    def _outer_rows(acc, X, Y, M, smb, smn, b, start, stop, length, sxn, sxd, syn, syd,
                    DX: tl.constexpr, DY: tl.constexpr, BX: tl.constexpr, BY: tl.constexpr,
                    BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, DOT_FP32: tl.constexpr):
        """acc (BX, BY) + sum over the real rows n in [start, stop) of x_n^T y_n, tile by tile in order."""
        rx, ry = tl.arange(0, BX), tl.arange(0, BY)
        for offset in range(start, stop, BLOCK_N):
            rows = offset + tl.arange(0, BLOCK_N)
            keep = kept(M, smb, smn, b, rows, length, HAS_MASK)
            x = load_tile(X, rows, keep, rx, DX, sxn, sxd)
            y = load_tile(Y, rows, keep, ry, DY, syn, syd)
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
        x = load_tile(X, rows, inside, rx, DX, sxn, sxd).to(tl.float32)
        if DOT_FP32:
            out = tl.dot(x, state, input_precision="ieee")
        else:  # 16-bit inputs are exact in tf32; the state is rounded to tf32 (2^-11), finer than the output
            out = tl.dot(x, state, input_precision="tf32")
        out = out * c
        if HAS_MASK:
            out = tl.where(kept(M, smb, smn, b, rows, length, True)[:, None], out, 0.0)
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


# Elements per program of the sum over slices (`_sum_parts`): a whole (256, 128) state per program
# held 256 fp32 values per thread, and ptxas gave it 255 registers and spilled 200 bytes for sm_90.
_SUM_BLOCK = 2048


def _linear_rows(exact: bool) -> int:
    """Rows per tile of the linear-attention kernels: 16 where their products run exactly in fp32
    on CUDA cores (fp32 inputs), else `BLOCK_N`. Compiled for sm_90 with 64-row tiles, the exact
    products spilled registers: 1.7 KB per thread in the fused backward at 64-wide heads, and the
    state product at 96- and 128-wide heads got 32 registers and 6.5-8 KB of stack; 16-row tiles
    spill nothing there (`scripts/compile_kernels.py`). The interpreter keeps 64-row tiles (its
    products are exact for every dtype), except where a test swaps this function."""
    return 16 if exact and not INTERPRETED else BLOCK_N

# The most shared memory one program of a kernel family asks for, by the tile it holds (the product
# of its widths padded to powers of two): (largest tile, bytes) pairs, over what triton compiles
# for sm_80 and sm_90 from bf16 and fp32 inputs. `scripts/compile_kernels.py` prints the compiled
# numbers, and its slow test keeps them within these bounds. A family runs its kernels only where
# its bound fits the GPU (`shared_memory_limit`); larger tiles, or a GPU with less shared memory,
# take the torch forms. Linear attention's tile is d_k x d_v (a Hedgehog map's 2 d x (d + 1)).
LINEAR_ATTENTION_SHARED = ((4096, 98_304), (16_384, 131_072), (32_768, 212_992))


def linear_attention_shared(dk: int, dv: int) -> int | None:
    """The most shared memory `linear_attention_kernel`'s programs ask for with keys d_k and values
    d_v wide (`LINEAR_ATTENTION_SHARED`), or None where it takes no such widths."""
    if not (supported_width(dk) and supported_width(dv)):
        return None
    return bound(LINEAR_ATTENTION_SHARED, tile(dk) * tile(dv))


def linear_attention_fits(dk: int, dv: int, limit: int | None) -> bool:
    """Whether `linear_attention_kernel` takes keys d_k and values d_v wide on a GPU whose programs
    may use `limit` bytes of shared memory (None: no limit)."""
    return fits(linear_attention_shared(dk, dv), limit)


def _scale_pointer(scale: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return x if scale is None else scale.detach().float().reshape(1)


def outer_sum(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """sum_n m_n x_n^T y_n per head, split over slices: x (B, H, N, dx), y (B, H, N, dy) ->
    (B, H, bx, by) fp32, the (dx, dy) sums padded with zeros to tiles, as `state_product` takes them."""
    batch, heads, length, dx = x.shape
    dy = y.shape[-1]
    bx, by = tile(dx), tile(dy)
    parts, chunk = slices(length)
    partial = torch.empty(batch * heads, parts, bx, by, dtype=torch.float32, device=x.device)
    mask_ptr, smb, smn, has_mask = mask_arguments(mask, x)
    exact = dot_fp32(x, y)
    _outer_sum[(parts, batch * heads)](
        x, y, mask_ptr, partial, length, chunk, *x.stride(), *y.stride(), smb, smn,
        heads=heads, DX=dx, DY=dy, BX=bx, BY=by, BLOCK_N=_linear_rows(exact), HAS_MASK=has_mask, DOT_FP32=exact,
        **launch_options(dx, dy),
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
    out = heads_last(batch, heads, length, width, x)
    mask_ptr, smb, smn, has_mask = mask_arguments(mask, x)
    exact = dot_fp32(x)
    rows = _linear_rows(exact)
    options = launch_options(dx, width)
    if exact and not INTERPRETED and tile(dx) * tile(width) >= 128 * 128:
        # a (128, 128) fp32 state or wider, multiplied on CUDA cores: with 8 warps ptxas gave the
        # Hedgehog map's 128 x 65 and 192 x 97 products 32 registers and 3.4-5.6 KB of stack per
        # thread; 16 warps spill nothing (`scripts/compile_kernels.py`)
        options["num_warps"] = 16
    _state_product[(triton.cdiv(length, rows), batch * heads)](
        x, state.contiguous(), out, mask_ptr, _scale_pointer(scale, x), length, *x.stride(), *out.stride(), smb, smn,
        heads=heads, DX=dx, DY=width, BX=tile(dx), BY=tile(width), BLOCK_N=rows, TRANSPOSE=transpose,
        HAS_MASK=has_mask, HAS_SCALE=scale is not None, DOT_FP32=exact, **options,
    )
    return out


def _launch_fused_forward(query, key, value, mask, scale):
    batch, heads, length_q, dk = query.shape
    length_k, dv = key.shape[2], value.shape[-1]
    bk, bv = tile(dk), tile(dv)
    out = heads_last(batch, heads, length_q, dv, query)
    state = torch.empty(batch, heads, bk, bv, dtype=torch.float32, device=query.device)
    mask_ptr, smb, smn, has_mask = mask_arguments(mask, query)
    exact = dot_fp32(query, key, value)
    _fused_forward[(batch * heads,)](
        query, key, value, mask_ptr, _scale_pointer(scale, query), out, state, length_q, length_k,
        *query.stride(), *key.stride(), *value.stride(), *out.stride(), smb, smn,
        heads=heads, DK=dk, DV=dv, BK=bk, BV=bv, BLOCK_N=_linear_rows(exact), HAS_MASK=has_mask,
        HAS_SCALE=scale is not None, DOT_FP32=exact, **launch_options(dk, dv),
    )
    return out, state


def _launch_fused_backward(query, key, value, mask, scale, state, grad):
    batch, heads, length_q, dk = query.shape
    length_k, dv = key.shape[2], value.shape[-1]
    grads = [heads_last(batch, heads, t.shape[2], t.shape[-1], t) for t in (query, key, value)]
    scale_products = torch.empty(batch * heads, dtype=torch.float32, device=query.device)
    mask_ptr, smb, smn, has_mask = mask_arguments(mask, query)
    exact = dot_fp32(query, key, value, grad)
    _fused_backward[(batch * heads,)](
        query, key, value, grad, mask_ptr, _scale_pointer(scale, query), state, *grads, scale_products,
        length_q, length_k, *query.stride(), *key.stride(), *value.stride(), *grad.stride(),
        *grads[0].stride(), *grads[1].stride(), *grads[2].stride(), smb, smn,
        heads=heads, DK=dk, DV=dv, BK=tile(dk), BV=tile(dv), BLOCK_N=_linear_rows(exact), HAS_MASK=has_mask,
        HAS_SCALE=scale is not None, DOT_FP32=exact, **launch_options(dk, dv),
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
    transposes: 262,144 bytes of shared memory at 128 x 128, over sm_90's 232,448). Wider heads
    (1,024 wide with 8 heads; a Hedgehog map's 2 d against d + 1) take the split backward, whose
    launches each hold one tile; the fused forward's state serves it as it is."""
    return tile(dk) * tile(dv) < 128 * 128


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
    if as_operators():
        return OPERATORS.linear_attention(query, key, value, mask, scale)[0]
    if needs_graph(query, key, value, scale):
        return _LinearAttention.apply(query, key, value, mask, scale)
    return _linear_attention_forward(query, key, value, mask, scale)[0]  # inference: no autograd node


def _linear_attention_op(query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor],
                         scale: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    return _linear_attention_forward(query, key, value, mask, scale)


def _fake_linear_attention(query, key, value, mask, scale):
    batch, heads, length, dk = query.shape
    dv = value.shape[-1]
    state = query.new_empty(batch, heads, tile(dk), tile(dv), dtype=torch.float32)
    return heads_last(batch, heads, length, dv, query), state


def _linear_attention_grads_op(query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor], scale: Optional[Tensor],
                               state: Tensor, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _linear_attention_grads(query, key, value, mask, scale, state, grad)


def _fake_linear_attention_grads(query, key, value, mask, scale, state, grad):
    grads = (heads_last(*t.shape[:3], t.shape[3], t) for t in (query, key, value))
    return *grads, query.new_empty((), dtype=torch.float32)


def _linear_attention_operator_backward(ctx, grad, _):
    query, key, value, mask, scale, _out, state = ctx.saved_tensors
    *grads, products = OPERATORS.linear_attention_grads(query, key, value, mask, scale, state, grad)
    return *grads, None, _scale_grad(scale, products, ctx.needs_input_grad[4])


def _register_operators():
    """This family's forward and gradient operators (`triton_launch.register_family`)."""
    operators = register_family(
        "linear_attention", _linear_attention_op, _fake_linear_attention,
        _linear_attention_operator_backward, _linear_attention_grads_op, _fake_linear_attention_grads,
    )
    return types.SimpleNamespace(**operators)


OPERATORS = _register_operators() if AVAILABLE else None
