"""Fused Triton kernels for the bidirectional sequence operations of `ops.py`, forward and backward.

- `linear_attention_kernel(query, key, value, mask, scale)`: Zformer's bidirectional
  `out_i = scale * q_i sum_j m_j k_j^T v_j`, as two passes: the per-head state K^T V is summed over
  the sequence in fp32 (`_outer_sum`, one program per head and slice of 512 tokens, then the slices
  in order, `_sum_parts`), and applied to every query (`_state_product`). The backward is the same two kernels again:
  dQ = scale dO (K^T V)^T, G = scale Q^T dO, dK = m V G^T, dV = m K G, d scale = <K^T V, Q^T dO>.
- `direction_pool_kernel(values, direction, mask)`: Fastformer's bidirectional pooling
  `sum_j softmax_j(values_j . direction) values_j` over the real positions, with an online softmax
  per slice of the sequence (`_pool`), the slices merged in order (`_merge_pools`); the backward (`_pool_backward`) reads
  the values once more: dx_j = w_j g + w_j (g . x_j - g . pooled) u, du = sum_j w_j (g . x_j - g .
  pooled) x_j.

Inputs are read where they lie (the head views of the projections, any strides, bf16/fp16/fp32)
and every sum over the sequence runs in fp32; outputs come back in the inputs' dtype, laid out
(B, N, H, d) so that merging the heads is a view. Padding's keys and values contribute nothing, so
outputs at real positions are exactly invariant to extra padding.

The functions here do no dispatch: `ops.py` decides when they run. This file ships to the Hugging
Face Hub with every checkpoint and imports where triton is not installed (`AVAILABLE` is then False
and nothing here may be called); with `TRITON_INTERPRET=1` the kernels run on the CPU, which is how
the tests check them without a GPU.
"""

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch forms of ops.py run instead
    triton = None

AVAILABLE = triton is not None

# The Triton interpreter multiplies 16-bit tiles wrongly (numpy has no bf16 product): it takes the
# fp32 product of the same tiles, as fp32 inputs do anyway.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

if AVAILABLE:
    # the running maximum of an online softmax before any real score (finite: no NaN); a constexpr,
    # the only kind of global a compiled kernel may read
    _FLOOR = tl.constexpr(-1.0e38)

    @triton.jit
    def _outer_sum(X, Y, M, P, length, chunk,
                   sxb, sxh, sxn, sxd, syb, syh, syn, syd, smb,
                   heads: tl.constexpr, DX: tl.constexpr, DY: tl.constexpr, BX: tl.constexpr, BY: tl.constexpr,
                   BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, DOT_FP32: tl.constexpr):
        """P[bh, s] = sum over rows n of slice s of m_n x_n^T y_n (DX, DY) in fp32, stored padded to
        (BX, BY) with zeros."""
        part, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // heads, bh % heads
        rx, ry = tl.arange(0, BX), tl.arange(0, BY)
        acc = tl.zeros((BX, BY), dtype=tl.float32)
        start = part * chunk
        for offset in range(0, tl.minimum(chunk, length - start), BLOCK_N):
            rows = start + offset + tl.arange(0, BLOCK_N)
            keep = rows < length
            if HAS_MASK:
                keep = keep & (tl.load(M + b * smb + rows, mask=rows < length, other=0) != 0)
            x = tl.load(X + b * sxb + h * sxh + rows[:, None] * sxn + rx[None, :] * sxd,
                        mask=keep[:, None] & (rx[None, :] < DX), other=0.0)
            y = tl.load(Y + b * syb + h * syh + rows[:, None] * syn + ry[None, :] * syd,
                        mask=keep[:, None] & (ry[None, :] < DY), other=0.0)
            if DOT_FP32:
                acc += tl.dot(tl.trans(x.to(tl.float32)), y.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(tl.trans(x), y)
        parts = tl.num_programs(0)
        tl.store(P + (bh * parts + part) * BX * BY + rx[:, None] * BY + ry[None, :], acc)

    @triton.jit
    def _state_product(X, S, O, M, C, length,
                       sxb, sxh, sxn, sxd, sob, soh, son, sod, smb,
                       heads: tl.constexpr, DX: tl.constexpr, DY: tl.constexpr, BX: tl.constexpr,
                       BY: tl.constexpr, BLOCK_N: tl.constexpr, TRANSPOSE: tl.constexpr, HAS_MASK: tl.constexpr,
                       HAS_SCALE: tl.constexpr, DOT_FP32: tl.constexpr):
        """O rows = c m_n x_n S[bh]: x (DX wide), S fp32 stored padded (BX, BY) (with TRANSPOSE:
        (BY, BX)), O (DY wide)."""
        block, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // heads, bh % heads
        rx, ry = tl.arange(0, BX), tl.arange(0, BY)
        rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = rows < length
        if TRANSPOSE:
            state = tl.load(S + bh * BX * BY + ry[None, :] * BX + rx[:, None])
        else:
            state = tl.load(S + bh * BX * BY + rx[:, None] * BY + ry[None, :])
        x = tl.load(X + b * sxb + h * sxh + rows[:, None] * sxn + rx[None, :] * sxd,
                    mask=inside[:, None] & (rx[None, :] < DX), other=0.0)
        if DOT_FP32:
            out = tl.dot(x.to(tl.float32), state, input_precision="ieee")
        else:  # 16-bit inputs are exact in tf32; the state is rounded to tf32 (2^-11), finer than the output
            out = tl.dot(x.to(tl.float32), state, input_precision="tf32")
        if HAS_SCALE:
            out = out * tl.load(C)
        if HAS_MASK:
            keep = tl.load(M + b * smb + rows, mask=inside, other=0) != 0
            out = tl.where(keep[:, None], out, 0.0)
        tl.store(O + b * sob + h * soh + rows[:, None] * son + ry[None, :] * sod, out.to(O.dtype.element_ty),
                 mask=inside[:, None] & (ry[None, :] < DY))

    @triton.jit
    def _pool(X, U, M, MAX, SUM, ACC, length, chunk,
              sxb, sxh, sxn, sxd, sub, suh, smb,
              heads: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BLOCK_N: tl.constexpr,
              HAS_MASK: tl.constexpr, HAS_DIRECTION: tl.constexpr):
        """Over slice s of the sequence: the running max of the scores x_n . u, the sum of exp(score -
        max) and the sum of exp(score - max) x_n (an online softmax), per (b, h); D wide, padded to BD."""
        part, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // heads, bh % heads
        rd = tl.arange(0, BD)
        if HAS_DIRECTION:
            u = tl.load(U + b * sub + h * suh + rd, mask=rd < D, other=0.0).to(tl.float32)
        top = tl.full((1,), _FLOOR, tl.float32)
        total = tl.zeros((1,), dtype=tl.float32)
        acc = tl.zeros((BD,), dtype=tl.float32)
        start = part * chunk
        for offset in range(0, tl.minimum(chunk, length - start), BLOCK_N):
            rows = start + offset + tl.arange(0, BLOCK_N)
            keep = rows < length
            if HAS_MASK:
                keep = keep & (tl.load(M + b * smb + rows, mask=rows < length, other=0) != 0)
            x = tl.load(X + b * sxb + h * sxh + rows[:, None] * sxn + rd[None, :] * sxd, mask=keep[:, None],
                        other=0.0).to(tl.float32)
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
        index = bh * tl.num_programs(0) + part
        tl.store(MAX + index + tl.arange(0, 1), top)
        tl.store(SUM + index + tl.arange(0, 1), total)
        tl.store(ACC + index * BD + rd, acc)

    @triton.jit
    def _pool_backward(X, U, M, G, LSE, GP, DX, DU, length, chunk,
                       sxb, sxh, sxn, sxd, sub, suh, smb, sdb, sdh, sdn, sdd,
                       heads: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BLOCK_N: tl.constexpr,
                       HAS_MASK: tl.constexpr, HAS_DIRECTION: tl.constexpr):
        """dx_n = w_n g + t_n u and sum_n t_n x_n over slice s, t_n = w_n (g . x_n - g . pooled),
        w_n = exp(x_n . u - lse) (0 at padding)."""
        part, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // heads, bh % heads
        rd = tl.arange(0, BD)
        g = tl.load(G + bh * D + rd, mask=rd < D, other=0.0)
        lse = tl.load(LSE + bh)
        g_pooled = tl.load(GP + bh)
        if HAS_DIRECTION:
            u = tl.load(U + b * sub + h * suh + rd, mask=rd < D, other=0.0).to(tl.float32)
        du = tl.zeros((BD,), dtype=tl.float32)
        start = part * chunk
        for offset in range(0, tl.minimum(chunk, length - start), BLOCK_N):
            rows = start + offset + tl.arange(0, BLOCK_N)
            inside = rows < length
            keep = inside
            if HAS_MASK:
                keep = keep & (tl.load(M + b * smb + rows, mask=inside, other=0) != 0)
            x = tl.load(X + b * sxb + h * sxh + rows[:, None] * sxn + rd[None, :] * sxd, mask=keep[:, None],
                        other=0.0).to(tl.float32)
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
            tl.store(DX + b * sdb + h * sdh + rows[:, None] * sdn + rd[None, :] * sdd, dx.to(DX.dtype.element_ty),
                     mask=inside[:, None] & (rd[None, :] < D))
        if HAS_DIRECTION:
            tl.store(DU + (bh * tl.num_programs(0) + part) * BD + rd, du)


    @triton.jit
    def _sum_parts(P, OUT, parts, SIZE: tl.constexpr):
        """OUT[bh] = sum over p of P[bh, p] (SIZE fp32 each), in order: trailing all-zero parts (the
        slices of appended padding) add exact zeros."""
        bh = tl.program_id(0)
        r = tl.arange(0, SIZE)
        acc = tl.zeros((SIZE,), dtype=tl.float32)
        for part in range(0, parts):
            acc += tl.load(P + (bh * parts + part) * SIZE + r)
        tl.store(OUT + bh * SIZE + r, acc)

    @triton.jit
    def _merge_pools(MAX, SUM, ACC, POOLED, LSE, parts, D: tl.constexpr, BD: tl.constexpr):
        """The pooling and log-sum-exp of each (b, h) from its slices' online softmaxes, merged in
        order (trailing slices of padding change nothing, exactly); a row without a real token
        pools to 0 with lse = +inf (zero weight everywhere in the backward)."""
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
        empty = total == 0
        tl.store(POOLED + bh * D + rd, acc / tl.where(empty, 1.0, total), mask=rd < D)
        tl.store(LSE + bh + one, tl.where(empty, float("inf"), top + tl.log(tl.where(empty, 1.0, total))))


# Rows per tile, and rows per slice of a sum over the sequence: a fixed slice (whatever the length
# or batch) keeps every real row in the same tile and slice when padding is appended, so padding
# adds exact zeros and outputs at real positions do not change.
_BLOCK_N = 64
_CHUNK = 512


def supported_width(width: int) -> bool:
    """Head widths the kernels take: up to 256 (one tile per head)."""
    return 1 <= width <= 256


def _tile(width: int) -> int:
    """A width padded to a tile: a power of two, at least 16 (the smallest matrix-product tile)."""
    return max(16, triton.next_power_of_2(width))


def _slices(length: int) -> tuple[int, int]:
    """(number of slices, rows per slice) of a sum over the sequence."""
    return max(1, triton.cdiv(length, _CHUNK)), _CHUNK


def _strides(x: torch.Tensor) -> tuple[int, int, int, int]:
    return tuple(x.stride())


def _heads_last(batch: int, heads: int, length: int, width: int, like: torch.Tensor, dtype=None) -> torch.Tensor:
    """An empty (B, H, N, width) tensor stored as (B, N, H, width): merging its heads is a view."""
    return torch.empty(batch, length, heads, width, dtype=dtype or like.dtype, device=like.device).transpose(1, 2)


def _mask_arguments(mask: torch.Tensor | None, x: torch.Tensor):
    """(mask pointer, batch stride, HAS_MASK): the mask as int8 (B, N) contiguous, or a dummy."""
    if mask is None:
        return x, 0, False
    mask = mask.to(torch.int8).contiguous()
    return mask, mask.stride(0), True


def _dot_fp32(*tensors: torch.Tensor) -> bool:
    return INTERPRETED or any(t.dtype == torch.float32 for t in tensors)


def outer_sum(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """sum_n m_n x_n^T y_n per head: x (B, H, N, dx), y (B, H, N, dy) -> (B, H, bx, by) in fp32, the
    (dx, dy) sums padded with zeros to tiles (`_tile`), as `state_product` takes them."""
    batch, heads, length, dx = x.shape
    dy = y.shape[-1]
    bx, by = _tile(dx), _tile(dy)
    parts, chunk = _slices(length)
    partial = torch.empty(batch * heads, parts, bx, by, dtype=torch.float32, device=x.device)
    mask_ptr, smb, has_mask = _mask_arguments(mask, x)
    _outer_sum[(parts, batch * heads)](
        x, y, mask_ptr, partial, length, chunk, *_strides(x), *_strides(y), smb,
        heads=heads, DX=dx, DY=dy, BX=bx, BY=by, BLOCK_N=_BLOCK_N, HAS_MASK=has_mask, DOT_FP32=_dot_fp32(x, y),
    )
    if parts == 1:
        return partial.view(batch, heads, bx, by)
    summed = torch.empty(batch, heads, bx, by, dtype=torch.float32, device=x.device)
    _sum_parts[(batch * heads,)](partial, summed, parts, SIZE=bx * by)
    return summed


def state_product(x: torch.Tensor, state: torch.Tensor, width: int, mask: torch.Tensor | None = None,
                  scale: torch.Tensor | None = None, *, transpose: bool = False) -> torch.Tensor:
    """c m_n x_n S per head (S^T with `transpose`): x (B, H, N, dx), state (B, H, dx, dy) fp32 padded
    to tiles as `outer_sum` returns it (stored (B, H, dy, dx) with `transpose`), `width` = dy, scale
    one fp32 element or None. Returns (B, H, N, dy) in x's dtype, stored heads-last."""
    batch, heads, length, dx = x.shape
    dy = width
    out = _heads_last(batch, heads, length, dy, x)
    mask_ptr, smb, has_mask = _mask_arguments(mask, x)
    scale_ptr = x if scale is None else scale.detach().float().reshape(1)
    _state_product[(triton.cdiv(length, _BLOCK_N), batch * heads)](
        x, state.contiguous(), out, mask_ptr, scale_ptr, length, *_strides(x), *_strides(out), smb,
        heads=heads, DX=dx, DY=dy, BX=_tile(dx), BY=_tile(dy), BLOCK_N=_BLOCK_N, TRANSPOSE=transpose,
        HAS_MASK=has_mask,
        HAS_SCALE=scale is not None, DOT_FP32=_dot_fp32(x),
    )
    return out


class _LinearAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, mask, scale):
        state = outer_sum(key, value, mask)  # K^T V over the real keys, fp32
        ctx.save_for_backward(query, key, value, mask, state, scale)
        return state_product(query, state, value.shape[-1], scale=scale)

    @staticmethod
    def backward(ctx, grad):
        query, key, value, mask, state, scale = ctx.saved_tensors
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        products = outer_sum(query, grad, None)  # Q^T dO, unscaled
        grad_scale = None
        if scale is not None and ctx.needs_input_grad[4]:
            grad_scale = (products * state).sum().reshape(scale.shape).to(scale.dtype)
        if scale is not None:
            products = products * scale.detach().float()
        grad_query = state_product(grad, state, query.shape[-1], scale=scale, transpose=True)
        grad_key = state_product(value, products, key.shape[-1], mask, transpose=True)
        grad_value = state_product(key, products, value.shape[-1], mask)
        return grad_query, grad_key, grad_value, None, grad_scale


def linear_attention_kernel(query, key, value, mask=None, scale=None) -> torch.Tensor:
    """Bidirectional `ops.linear_attention` without a state: out_i = scale * q_i sum_j m_j k_j^T v_j.
    query/key (B, H, N, d), value (B, H, N, e) (widths `supported_width`), mask (B, N) or None,
    scale a one-element tensor or None. Returns (B, H, N, e) in the queries' dtype."""
    return _LinearAttention.apply(query, key, value, mask, scale)


def _direction_strides(direction):
    """(batch stride, head stride) of a direction (B or 1, H, d): one row is shared by the batch."""
    if direction is None:
        return 0, 0
    return (0 if direction.shape[0] == 1 else direction.stride(0)), direction.stride(1)


def _pool_forward(values, direction, mask):
    """(pooled (B, H, d) fp32, log-sum-exp (B, H) fp32, +inf where a row has no real token)."""
    batch, heads, length, dim = values.shape
    parts, chunk = _slices(length)
    shape = (batch * heads, parts)
    top, total = (torch.empty(shape, dtype=torch.float32, device=values.device) for _ in range(2))
    acc = torch.empty(*shape, _tile(dim), dtype=torch.float32, device=values.device)
    mask_ptr, smb, has_mask = _mask_arguments(mask, values)
    sub, suh = _direction_strides(direction)
    _pool[(parts, batch * heads)](
        values, values if direction is None else direction, mask_ptr, top, total, acc, length, chunk,
        *_strides(values), sub, suh, smb, heads=heads, D=dim, BD=_tile(dim), BLOCK_N=_BLOCK_N,
        HAS_MASK=has_mask, HAS_DIRECTION=direction is not None,
    )
    pooled = torch.empty(batch, heads, dim, dtype=torch.float32, device=values.device)
    lse = torch.empty(batch, heads, dtype=torch.float32, device=values.device)
    _merge_pools[(batch * heads,)](top, total, acc, pooled, lse, parts, D=dim, BD=_tile(dim))
    return pooled, lse


class _DirectionPool(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, direction, mask):
        pooled, lse = _pool_forward(values, direction, mask)
        ctx.save_for_backward(values, direction, mask, pooled, lse)
        return pooled

    @staticmethod
    def backward(ctx, grad):
        values, direction, mask, pooled, lse = ctx.saved_tensors
        batch, heads, length, dim = values.shape
        grad = grad.float().contiguous()
        grad_pooled = (grad * pooled).sum(-1).contiguous()  # g . pooled (B, H)
        parts, chunk = _slices(length)
        grad_values = _heads_last(batch, heads, length, dim, values)
        partial = torch.empty(batch * heads, parts, _tile(dim), dtype=torch.float32, device=values.device)
        mask_ptr, smb, has_mask = _mask_arguments(mask, values)
        sub, suh = _direction_strides(direction)
        _pool_backward[(parts, batch * heads)](
            values, values if direction is None else direction, mask_ptr, grad, lse.contiguous(), grad_pooled,
            grad_values, partial, length, chunk, *_strides(values), sub, suh, smb, *_strides(grad_values),
            heads=heads, D=dim, BD=_tile(dim), BLOCK_N=_BLOCK_N, HAS_MASK=has_mask,
            HAS_DIRECTION=direction is not None,
        )
        grad_direction = None
        if direction is not None and ctx.needs_input_grad[1]:
            grad_direction = partial.sum(1)[:, :dim].view(batch, heads, dim)  # a gradient: no exactness asked
            if direction.shape[0] == 1 and batch > 1:
                grad_direction = grad_direction.sum(0, keepdim=True)
            grad_direction = grad_direction.to(direction.dtype)
        return grad_values, grad_direction, None


def direction_pool_kernel(values, direction=None, mask=None) -> torch.Tensor:
    """Bidirectional `ops.direction_pool`: sum_j softmax_j(values_j . u) values_j over the real
    positions. values (B, H, N, d), direction u (B or 1, H, d) or None (the plain mean), mask (B, N)
    or None. Returns (B, H, d) in fp32; zero for a row with no real token."""
    return _DirectionPool.apply(values, None if direction is None else direction.contiguous(), mask)
